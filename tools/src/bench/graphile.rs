//! The peer of `bench queue`'s drain: Graphile Worker 0.18 draining the same number of no-op jobs on
//! the same cluster, in its batched configuration (local queue of 500, batched completion, 24
//! concurrent jobs), so the report can give cifpool's drain rate as a ratio of a known queue's.
//!
//! The driver, `tools/peers/graphile/{package.json, package-lock.json, drain.mjs}`, is compiled into
//! the binary and written to `target/peers/graphile` (beside the binary's own directory), where
//! `npm ci` installs the pinned Graphile Worker once; a later run reuses the install while its
//! version and `package.json` match. A run then:
//! 1. re-creates the database [`DATABASE`] on the bench's server;
//! 2. `node drain.mjs prepare`: Graphile's migrations and one `add_jobs` call of N no-op jobs;
//! 3. `VACUUM ANALYZE` of its jobs table and a `CHECKPOINT`, as before cifpool's drain;
//! 4. `node drain.mjs drain`: one worker, timed by the driver from just before `run()` until its jobs
//!    table is empty (completions are batched, so a job's row outlives its run by a moment);
//! 5. drops the database.
//!
//! Without `node` or `npm`, or when the install fails, the peer is skipped with the reason in the
//! report; a failed run is reported the same way. Neither fails the bench.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::cpu::{CpuSplit, CpuWatch};
use super::libpq_env;

/// The Graphile Worker version `package.json` pins.
pub const PINNED_VERSION: &str = "0.18.0";
/// Jobs one worker runs at once.
pub const CONCURRENCY: u32 = 24;
/// Jobs the worker locks and fetches per query.
pub const LOCAL_QUEUE: u32 = 500;
/// The peer's scratch database, on the same server as the bench's.
pub const DATABASE: &str = "cifpool_bench_graphile";

const PACKAGE_JSON: &str = include_str!("../../peers/graphile/package.json");
const PACKAGE_LOCK: &str = include_str!("../../peers/graphile/package-lock.json");
const DRIVER: &str = include_str!("../../peers/graphile/drain.mjs");
/// `npm ci` downloads ~70 packages; on a slow registry that takes minutes, never this long.
const INSTALL_TIMEOUT: Duration = Duration::from_secs(600);

/// What the peer did, for the report.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PeerDrain {
    /// `graphile-worker`.
    pub peer: &'static str,
    /// How it was configured.
    pub settings: String,
    /// Its figures, or why there are none.
    #[serde(flatten)]
    pub outcome: PeerOutcome,
}

/// Whether the peer ran.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "status", rename_all = "lowercase")]
pub enum PeerOutcome {
    /// It drained the jobs.
    Ran(PeerRun),
    /// It could not be set up (`--no-peer`, no node or npm, the install failed).
    Skipped {
        /// Why.
        reason: String,
    },
    /// It was set up but its run failed.
    Failed {
        /// What failed.
        reason: String,
    },
}

/// The figures of a peer drain: `drain.mjs drain`'s output, plus the enqueue time and CPU.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PeerRun {
    /// Graphile Worker's installed version.
    pub graphile_worker: String,
    /// `node --version`.
    pub node: String,
    /// Jobs drained.
    pub jobs: u64,
    /// From just before the worker was started to an empty jobs table.
    pub seconds: f64,
    /// `jobs / seconds`.
    pub jobs_per_s: f64,
    /// The one `add_jobs` call of the preparation (not measured against ours: a different path).
    #[serde(default)]
    pub add_jobs_seconds: f64,
    /// Where the CPU went during the drain (`child` = the node process).
    #[serde(default)]
    pub cpu: Option<CpuSplit>,
}

impl PeerDrain {
    /// The peer's drain rate, when it ran.
    pub fn jobs_per_s(&self) -> Option<f64> {
        match &self.outcome {
            PeerOutcome::Ran(run) if run.jobs_per_s > 0.0 => Some(run.jobs_per_s),
            _ => None,
        }
    }
}

/// The oldest node Graphile Worker 0.18.0 declares it supports (`engines`); it runs on node 20 here,
/// but a figure taken below this should say so.
const NODE_ENGINE_MAJOR: u32 = 22;

/// A caveat for the report when the node that ran the peer is older than Graphile Worker declares.
pub fn engine_note(run: &PeerRun) -> Option<String> {
    let major: u32 = run.node.trim_start_matches('v').split('.').next()?.parse().ok()?;
    (major < NODE_ENGINE_MAJOR).then(|| {
        format!(
            "peer drain: graphile-worker {} declares node >= 22.18; it ran on node {} (npm warns, it works)",
            run.graphile_worker, run.node
        )
    })
}

/// What `drain.mjs prepare` prints.
#[derive(Debug, Deserialize)]
struct Prepared {
    added: u64,
    seconds: f64,
}

/// Where and whether to run the peer.
#[derive(Debug, Clone)]
pub struct PeerOptions {
    /// Run it at all (`--no-peer` turns it off).
    pub enabled: bool,
    /// The install directory.
    pub dir: PathBuf,
    /// Longest the drain may take.
    pub timeout: Duration,
}

/// `target/peers/graphile` when the binary runs from `target/<profile>/`, else `peers/graphile` beside
/// the binary's directory.
pub fn default_dir() -> PathBuf {
    let exe = std::env::current_exe().ok();
    let target = exe.as_deref().and_then(Path::parent).and_then(Path::parent);
    target.unwrap_or(Path::new("target")).join("peers").join("graphile")
}

/// The settings string of the report.
pub fn settings() -> String {
    format!(
        "graphile-worker {PINNED_VERSION}: concurrency {CONCURRENCY}, localQueue.size {LOCAL_QUEUE}, \
         completeJobBatchDelay 0, failJobBatchDelay 0, no-op task"
    )
}

/// Decides whether the peer can run: the node and npm found (on `PATH`), or why not.
pub fn plan(enabled: bool, node: Option<PathBuf>, npm: Option<PathBuf>) -> Result<(PathBuf, PathBuf), String> {
    if !enabled {
        return Err("--no-peer".into());
    }
    match (node, npm) {
        (Some(node), Some(npm)) => Ok((node, npm)),
        (None, None) => Err("node and npm not found on PATH".into()),
        (None, _) => Err("node not found on PATH".into()),
        (_, None) => Err("npm not found on PATH".into()),
    }
}

/// The last line of `stdout` that holds a JSON object, parsed: the driver prints its result last, and
/// anything printed before it (a library's notice) is ignored.
pub fn parse_output<T: DeserializeOwned>(stdout: &str) -> anyhow::Result<T> {
    let line = stdout
        .lines()
        .map(str::trim)
        .rfind(|l| l.starts_with('{'))
        .with_context(|| format!("no JSON line in the driver's output: {stdout:?}"))?;
    serde_json::from_str(line).with_context(|| format!("unexpected driver output: {line}"))
}

/// The version of Graphile Worker installed under `dir`, if any.
pub fn installed_version(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("node_modules/graphile-worker/package.json")).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json["version"].as_str().map(str::to_string)
}

/// Whether the install under `dir` can be reused: the pinned version, installed from this
/// `package.json`.
pub fn install_is_current(dir: &Path) -> bool {
    installed_version(dir).as_deref() == Some(PINNED_VERSION)
        && std::fs::read_to_string(dir.join("package.json")).is_ok_and(|p| p == PACKAGE_JSON)
}

/// Runs the peer on the server behind `connect` (`harness` is a pool on the bench database of that
/// server); never fails, the outcome says what happened.
pub async fn run(connect: &PgConnectOptions, harness: &PgPool, jobs: u64, opts: &PeerOptions) -> PeerDrain {
    let outcome = match plan(opts.enabled, find_on_path("node"), find_on_path("npm")) {
        Err(reason) => PeerOutcome::Skipped { reason },
        Ok((node, npm)) => match install(&npm, &opts.dir).await {
            Err(e) => PeerOutcome::Skipped { reason: format!("installing graphile-worker failed: {e:#}") },
            Ok(()) => match run_installed(&node, connect, harness, jobs, opts).await {
                Ok(run) => PeerOutcome::Ran(run),
                Err(e) => PeerOutcome::Failed { reason: format!("{e:#}") },
            },
        },
    };
    PeerDrain { peer: "graphile-worker", settings: settings(), outcome }
}

/// Writes the driver into `dir` and, unless [`install_is_current`], runs `npm ci` there.
async fn install(npm: &Path, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // The driver is rewritten every run (it is not part of the install), so it always matches the binary.
    std::fs::write(dir.join("drain.mjs"), DRIVER)?;
    if install_is_current(dir) {
        return Ok(());
    }
    std::fs::write(dir.join("package.json"), PACKAGE_JSON)?;
    std::fs::write(dir.join("package-lock.json"), PACKAGE_LOCK)?;
    tracing::warn!(dir = %dir.display(), "installing graphile-worker {PINNED_VERSION} for the queue bench's peer (once)");
    let child = tokio::process::Command::new(npm)
        .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
        .current_dir(dir)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(INSTALL_TIMEOUT, child)
        .await
        .map_err(|_| anyhow::anyhow!("npm ci took over {INSTALL_TIMEOUT:?}"))?
        .with_context(|| format!("running {}", npm.display()))?;
    anyhow::ensure!(output.status.success(), "npm ci: {}: {}", output.status, tail(&output.stderr, 5));
    anyhow::ensure!(
        install_is_current(dir),
        "npm ci succeeded but graphile-worker {PINNED_VERSION} is not in {}",
        dir.display()
    );
    Ok(())
}

async fn run_installed(
    node: &Path,
    connect: &PgConnectOptions,
    harness: &PgPool,
    jobs: u64,
    opts: &PeerOptions,
) -> anyhow::Result<PeerRun> {
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")))
        .execute(harness)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {DATABASE}")))
        .execute(harness)
        .await
        .context("creating the peer's database")?;
    let peer_connect = connect.clone().database(DATABASE);
    let result = async {
        let prepared: Prepared = parse_output(&driver(node, &opts.dir, &peer_connect, "prepare", jobs, &[]).await?.0)
            .context("drain.mjs prepare")?;
        anyhow::ensure!(prepared.added == jobs, "add_jobs added {} of {jobs} jobs", prepared.added);
        let db = PgPoolOptions::new().max_connections(1).connect_with(peer_connect.clone()).await?;
        sqlx::query("VACUUM ANALYZE graphile_worker._private_jobs").execute(&db).await?;
        super::checkpoint(&db).await;
        db.close().await;
        let timeout_ms = opts.timeout.as_millis().to_string();
        let extra = ["--concurrency", &CONCURRENCY.to_string(), "--local-queue", &LOCAL_QUEUE.to_string()];
        let (stdout, cpu) = driver(
            node,
            &opts.dir,
            &peer_connect,
            "drain",
            jobs,
            &[&extra[..], &["--timeout-ms", &timeout_ms]].concat(),
        )
        .await?;
        let mut run: PeerRun = parse_output(&stdout).context("drain.mjs drain")?;
        run.add_jobs_seconds = prepared.seconds;
        run.cpu = cpu;
        anyhow::Ok(run)
    }
    .await;
    let dropped = sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")))
        .execute(harness)
        .await;
    if let Err(e) = dropped {
        tracing::warn!(error = %e, "dropping the peer's database");
    }
    result
}

/// Runs `node drain.mjs <command> --jobs N <extra>` in `dir` against `connect`; returns its stdout and
/// the CPU split from its `ready` line (printed just before the timed part, so node's start-up and
/// Graphile's import stay out of it) to its exit. Its stderr is passed through (Graphile's warnings).
async fn driver(
    node: &Path,
    dir: &Path,
    connect: &PgConnectOptions,
    command: &str,
    jobs: u64,
    extra: &[&str],
) -> anyhow::Result<(String, Option<CpuSplit>)> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt};
    let mut child = tokio::process::Command::new(node)
        .arg("drain.mjs")
        .arg(command)
        .args(["--jobs", &jobs.to_string()])
        .args(extra)
        .envs(libpq_env(connect))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", node.display()))?;
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().context("the driver's stdout")?);
    let mut text = String::new();
    let mut watch = None;
    loop {
        let mut line = String::new();
        if stdout.read_line(&mut line).await? == 0 {
            break;
        }
        if line.trim() == "ready" {
            watch = Some(CpuWatch::with_child(child.id()));
            break;
        }
        text.push_str(&line);
    }
    stdout.read_to_string(&mut text).await?;
    let output = child.wait_with_output().await?;
    let cpu = match watch {
        Some(w) => w.finish().await,
        None => None,
    };
    anyhow::ensure!(output.status.success(), "drain.mjs {command}: {}: {}", output.status, tail(&output.stderr, 8));
    Ok((text, cpu))
}

/// The last `n` lines of a process's output, for an error message.
fn tail(bytes: &[u8], n: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// `name` in a directory of `PATH`.
fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peer_is_skipped_without_node_or_npm_or_when_turned_off() {
        let (node, npm) = (Some(PathBuf::from("/bin/node")), Some(PathBuf::from("/bin/npm")));
        assert_eq!(plan(true, node.clone(), npm.clone()), Ok((node.clone().unwrap(), npm.clone().unwrap())));
        assert_eq!(plan(false, node.clone(), npm.clone()), Err("--no-peer".into()));
        assert_eq!(plan(true, None, npm.clone()), Err("node not found on PATH".into()));
        assert_eq!(plan(true, node, None), Err("npm not found on PATH".into()));
        assert_eq!(plan(true, None, None), Err("node and npm not found on PATH".into()));
    }

    #[test]
    fn the_driver_output_is_its_last_json_line() {
        let stdout = "(node:1) ExperimentalWarning: something\n\
            {\"command\":\"drain\",\"graphile_worker\":\"0.18.0\",\"node\":\"v20.20.2\",\"jobs\":20000,\
             \"ran\":20000,\"seconds\":0.8,\"jobs_per_s\":25000,\"concurrency\":24,\"local_queue\":500}\n\n";
        let run: PeerRun = parse_output(stdout).unwrap();
        assert_eq!((run.jobs, run.jobs_per_s, run.graphile_worker.as_str()), (20_000, 25_000.0, "0.18.0"));
        assert_eq!((run.add_jobs_seconds, run.cpu), (0.0, None), "filled in by the Rust side");
        let prepared: Prepared = parse_output("{\"command\":\"prepare\",\"added\":5,\"seconds\":0.25}").unwrap();
        assert_eq!((prepared.added, prepared.seconds), (5, 0.25));
        assert!(parse_output::<PeerRun>("npm ERR! something\n").is_err());
        assert!(parse_output::<PeerRun>("{\"jobs\": 3}").is_err(), "fields missing");
    }

    #[test]
    fn a_skipped_or_failed_peer_has_no_rate_and_says_why_in_json() {
        let skipped = PeerDrain {
            peer: "graphile-worker",
            settings: settings(),
            outcome: PeerOutcome::Skipped { reason: "npm not found on PATH".into() },
        };
        assert_eq!(skipped.jobs_per_s(), None);
        let json = serde_json::to_value(&skipped).unwrap();
        assert_eq!(
            (json["status"].as_str(), json["reason"].as_str()),
            (Some("skipped"), Some("npm not found on PATH"))
        );
        let ran: PeerRun =
            parse_output(r#"{"graphile_worker":"0.18.0","node":"v20","jobs":4,"seconds":2,"jobs_per_s":2}"#).unwrap();
        assert!(engine_note(&ran).is_some_and(|n| n.contains("node v20")));
        assert_eq!(engine_note(&PeerRun { node: "v22.18.0".into(), ..ran.clone() }), None);
        let ran = PeerDrain { outcome: PeerOutcome::Ran(ran), ..skipped };
        assert_eq!(ran.jobs_per_s(), Some(2.0));
        assert_eq!(serde_json::to_value(&ran).unwrap()["status"], "ran");
    }

    #[test]
    fn an_install_is_reused_only_at_the_pinned_version_and_package_json() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!install_is_current(dir.path()));
        let module = dir.path().join("node_modules/graphile-worker");
        std::fs::create_dir_all(&module).unwrap();
        std::fs::write(module.join("package.json"), r#"{"name":"graphile-worker","version":"0.16.6"}"#).unwrap();
        std::fs::write(dir.path().join("package.json"), PACKAGE_JSON).unwrap();
        assert_eq!(installed_version(dir.path()).as_deref(), Some("0.16.6"));
        assert!(!install_is_current(dir.path()), "another version");
        std::fs::write(module.join("package.json"), format!(r#"{{"version":"{PINNED_VERSION}"}}"#)).unwrap();
        assert!(install_is_current(dir.path()));
        assert!(PACKAGE_JSON.contains(&format!("\"graphile-worker\": \"{PINNED_VERSION}\"")), "pin and constant agree");
    }
}
