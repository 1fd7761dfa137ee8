//! `bench reserve`'s HTTP load generator, in a process of its own so the CPU split is honest: the
//! parent keeps the service in-process and runs `cifpool-tools bench-client reserve …` (a hidden
//! subcommand of the same binary) for each measured run; the child drives the service over HTTP
//! (closed loop with `--clients`, or open loop at `--rate`), and prints its figures as one JSON line
//! on stdout. The API key comes in [`KEY_ENV`] (not on the command line, where `ps` would show it).
//!
//! The parent watches the child's CPU (`/proc/<pid>/stat`, then its reaped-children times), so a
//! phase's split is service (this process), load generator (the child) and Postgres. When this
//! process is not the tools binary (a test harness calling [`super::run_on`]) or `--load-in-process`
//! is given, the same loops run in-process, as before, and the split says so.
//!
//! Each run is a new process with its own connection pool: its clients connect at the start of the
//! run (before, the in-process client kept its idle connections from one level to the next).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, Subcommand};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::cpu::{CpuSplit, CpuWatch};
use super::report::Latency;
use super::reserve::{FixedRate, HOLDER, ServiceLevel};
use super::ticker;
use crate::load::{Schedule, Tally, fixed_rate};

/// The variable that carries the API key to the child.
pub const KEY_ENV: &str = "CIFPOOL_BENCH_API_KEY";
/// How long the parent waits for a child beyond its run's length (start-up, requests in flight).
const CHILD_GRACE: Duration = Duration::from_secs(120);

/// `cifpool-tools bench-client <target>` (hidden): a load generator run by a benchmark.
#[derive(Debug, Clone, Args, PartialEq)]
pub struct BenchClientArgs {
    /// What to drive.
    #[command(subcommand)]
    pub target: ClientTarget,
}

/// The load generators.
#[derive(Debug, Clone, Subcommand, PartialEq)]
pub enum ClientTarget {
    /// `POST /v1/cif` against a `bench reserve` service.
    Reserve(ReserveLoad),
}

/// One run of `bench reserve`'s load generator.
#[derive(Debug, Clone, Args, PartialEq)]
pub struct ReserveLoad {
    /// `POST` endpoint (`http://127.0.0.1:PORT/v1/cif`).
    #[arg(long)]
    pub url: String,
    /// Closed loop: this many clients, each sending its next request when the previous one answered.
    #[arg(long, conflicts_with = "rate", required_unless_present = "rate")]
    pub clients: Option<usize>,
    /// Open loop: requests per second on a fixed schedule, latency from each scheduled instant.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Seconds to run.
    #[arg(long)]
    pub duration: u64,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
    /// Closed loop only: a caller guessing keys. Every request carries a fresh random `cfp_` bearer
    /// token instead of the key, and a client sends its next guess as soon as one is refused.
    #[arg(long, requires = "clients")]
    pub guess_keys: bool,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

impl ReserveLoad {
    /// The command line that parses back into `self` (after `bench-client reserve`).
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec!["bench-client".into(), "reserve".into(), "--url".into(), self.url.clone()];
        if let Some(c) = self.clients {
            args.extend(["--clients".into(), c.to_string()]);
        }
        if let Some(r) = self.rate {
            args.extend(["--rate".into(), r.to_string()]);
        }
        args.extend(["--duration".into(), self.duration.to_string(), "--timeout".into(), self.timeout.to_string()]);
        if self.no_progress {
            args.push("--no-progress".into());
        }
        if self.guess_keys {
            args.push("--guess-keys".into());
        }
        args
    }
}

/// What the child prints: one JSON line.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "mode", rename_all = "lowercase")]
pub enum LoadResult {
    /// A closed-loop run.
    Closed(ServiceLevel),
    /// An open-loop run.
    Open(FixedRate),
}

/// Parses the child's stdout: its last line holding a JSON object.
pub fn parse_result(stdout: &str) -> anyhow::Result<LoadResult> {
    let line = stdout
        .lines()
        .map(str::trim)
        .rfind(|l| l.starts_with('{'))
        .with_context(|| format!("no JSON line in the load generator's output: {stdout:?}"))?;
    serde_json::from_str(line).with_context(|| format!("unexpected load generator output: {line}"))
}

/// The child's side: runs `args` and prints the result on stdout.
pub fn run_child(args: &BenchClientArgs) -> anyhow::Result<()> {
    let ClientTarget::Reserve(load) = &args.target;
    let key = std::env::var(KEY_ENV).with_context(|| format!("{KEY_ENV} is not set"))?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the runtime")?;
    let result = runtime.block_on(async {
        let client = http_client(&key, Duration::from_secs(load.timeout))?;
        let progress = !load.no_progress;
        anyhow::Ok(match (load.clients, load.rate) {
            (Some(c), _) => {
                LoadResult::Closed(closed_loop(&client, &load.url, c, load.duration, load.guess_keys, progress).await)
            }
            (None, Some(rate)) => LoadResult::Open(open_loop(&client, &load.url, rate, load.duration, progress).await),
            (None, None) => anyhow::bail!("--clients or --rate"),
        })
    })?;
    println!("{}", serde_json::to_string(&result)?);
    Ok(())
}

/// Where the load generator of a `reserve` run lives.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Placement {
    /// A child process of this binary per run.
    Process {
        /// The `cifpool-tools` binary.
        bin: PathBuf,
    },
    /// Inside this process (its CPU counts with the service's).
    InProcess {
        /// Why.
        reason: String,
    },
}

impl Placement {
    /// `--load-in-process`, else `--client-bin`, else this binary when it is `cifpool-tools`.
    pub fn choose(in_process: bool, client_bin: Option<&Path>, current_exe: Option<&Path>) -> Placement {
        if in_process {
            return Placement::InProcess { reason: "--load-in-process".into() };
        }
        if let Some(bin) = client_bin {
            return Placement::Process { bin: bin.to_path_buf() };
        }
        match current_exe {
            Some(exe) if exe.file_stem().is_some_and(|s| s == "cifpool-tools") => {
                Placement::Process { bin: exe.to_path_buf() }
            }
            _ => Placement::InProcess {
                reason: "this binary is not named cifpool-tools (a test harness, or a renamed copy): --client-bin names the load generator's"
                    .into(),
            },
        }
    }
}

/// The parent's handle on the load generator of a run.
pub struct LoadGenerator {
    placement: Placement,
    key: String,
    timeout: Duration,
    /// The in-process client (also what [`Placement::InProcess`] runs with).
    client: reqwest::Client,
}

impl LoadGenerator {
    /// A generator at `placement` that authenticates with `key`; requests time out after `timeout`.
    pub fn new(placement: Placement, key: String, timeout: Duration) -> anyhow::Result<LoadGenerator> {
        let client = http_client(&key, timeout)?;
        Ok(LoadGenerator { placement, key, timeout, client })
    }

    /// `c` clients in a closed loop against `url` for `secs`; the level's CPU split filled in.
    pub async fn closed(&self, url: &str, c: usize, secs: u64, progress: bool) -> anyhow::Result<ServiceLevel> {
        self.closed_loop(self.load(url, Some(c), None, secs, progress)).await
    }

    /// `c` clients guessing keys against `url` for `secs` (see [`ReserveLoad::guess_keys`]); the
    /// answers they got are the level's `errors` by status.
    pub async fn guessing(&self, url: &str, c: usize, secs: u64) -> anyhow::Result<ServiceLevel> {
        self.closed_loop(ReserveLoad { guess_keys: true, ..self.load(url, Some(c), None, secs, false) }).await
    }

    async fn closed_loop(&self, load: ReserveLoad) -> anyhow::Result<ServiceLevel> {
        let (result, cpu) = self.run(load).await?;
        let LoadResult::Closed(mut level) = result else {
            anyhow::bail!("the load generator answered an open-loop run")
        };
        level.cpu = cpu;
        Ok(level)
    }

    /// `rate` requests/s in an open loop against `url` for `secs`; the run's CPU split filled in.
    pub async fn open(&self, url: &str, rate: f64, secs: u64, progress: bool) -> anyhow::Result<FixedRate> {
        let load = self.load(url, None, Some(rate), secs, progress);
        let (result, cpu) = self.run(load).await?;
        let LoadResult::Open(mut fixed) = result else {
            anyhow::bail!("the load generator answered a closed-loop run")
        };
        fixed.cpu = cpu;
        Ok(fixed)
    }

    fn load(&self, url: &str, clients: Option<usize>, rate: Option<f64>, secs: u64, progress: bool) -> ReserveLoad {
        ReserveLoad {
            url: url.to_string(),
            clients,
            rate,
            duration: secs,
            timeout: self.timeout.as_secs().max(1),
            no_progress: !progress,
            guess_keys: false,
        }
    }

    async fn run(&self, load: ReserveLoad) -> anyhow::Result<(LoadResult, Option<CpuSplit>)> {
        let bin = match &self.placement {
            Placement::InProcess { .. } => {
                let watch = CpuWatch::start();
                let progress = !load.no_progress;
                let result = match (load.clients, load.rate) {
                    (Some(c), _) => LoadResult::Closed(
                        closed_loop(&self.client, &load.url, c, load.duration, load.guess_keys, progress).await,
                    ),
                    (None, rate) => LoadResult::Open(
                        open_loop(&self.client, &load.url, rate.unwrap_or(1.0), load.duration, progress).await,
                    ),
                };
                return Ok((result, watch.finish().await));
            }
            Placement::Process { bin } => bin,
        };
        let child = tokio::process::Command::new(bin)
            .args(load.to_args())
            .env(KEY_ENV, &self.key)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting the load generator {}", bin.display()))?;
        let watch = CpuWatch::with_child(child.id());
        let limit = Duration::from_secs(load.duration) + self.timeout + CHILD_GRACE;
        let output = tokio::time::timeout(limit, child.wait_with_output())
            .await
            .map_err(|_| anyhow::anyhow!("the load generator did not finish within {limit:?}"))??;
        let cpu = watch.finish().await;
        let stdout = String::from_utf8_lossy(&output.stdout);
        anyhow::ensure!(output.status.success(), "the load generator failed ({}): {stdout}", output.status);
        Ok((parse_result(&stdout)?, cpu))
    }
}

/// The HTTP client of a load generator: keep-alive, no Nagle, the API key on every request.
pub(crate) fn http_client(key: &str, timeout: Duration) -> anyhow::Result<reqwest::Client> {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::AUTHORIZATION, format!("Bearer {key}").parse()?);
    Ok(reqwest::Client::builder()
        .default_headers(headers)
        .tcp_nodelay(true)
        .pool_max_idle_per_host(usize::MAX)
        .timeout(timeout)
        .build()?)
}

const BODY: &str = r#"{"customer_type":"bench"}"#;

/// Sends one reservation; with `guess`, under a made-up key instead of the client's own.
async fn send(client: &reqwest::Client, url: &str, guess: bool) -> Result<(), String> {
    let mut request = client.post(url).header("content-type", "application/json").header("x-holder", HOLDER).body(BODY);
    if guess {
        // A request's own header wins over the client's default one.
        request = request.bearer_auth(cifpool::internals::api_key::generate_secret());
    }
    match request.send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            // Read the body so the connection goes back to the pool.
            let _ = resp.bytes().await;
            if status == 201 { Ok(()) } else { Err(status.to_string()) }
        }
        Err(_) => Err("transport".into()),
    }
}

/// `c` clients, each sending its next request when the previous one answered, for `secs` (guessing
/// keys with `guess`).
pub(crate) async fn closed_loop(
    client: &reqwest::Client,
    url: &str,
    c: usize,
    secs: u64,
    guess: bool,
    progress: bool,
) -> ServiceLevel {
    let bar = super::bar(progress, &format!("service c={c}"), secs, "s");
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let (stop, tick) = ticker(bar, started, done.clone(), secs * 1000);
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..c {
        let (client, url, done) = (client.clone(), url.to_string(), done.clone());
        tasks.spawn(async move {
            let mut tally = Tally::default();
            loop {
                let t0 = Instant::now();
                if t0 >= deadline {
                    break;
                }
                let outcome = send(&client, &url, guess).await;
                let end = Instant::now();
                if outcome.is_ok() {
                    done.fetch_add(1, Ordering::Relaxed);
                } else if !guess {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                tally.record(outcome, end - t0, end - started);
            }
            tally
        });
    }
    let mut all = Tally::default();
    while let Some(t) = tasks.join_next().await {
        if let Ok(t) = t {
            all.merge(t);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let _ = stop.send(());
    let _ = tick.await;
    let reservations = all.ok();
    ServiceLevel {
        concurrency: c,
        seconds,
        reservations,
        rate_per_s: reservations as f64 / seconds,
        latency: Latency::from_micros(all.latencies_us),
        errors: all.errors,
        per_second: all.per_second,
        available_before: 0,
        cpu: None,
    }
}

/// Requests at `rate`/s on a fixed schedule for `secs` (open loop: latency from each scheduled instant).
pub(crate) async fn open_loop(client: &reqwest::Client, url: &str, rate: f64, secs: u64, progress: bool) -> FixedRate {
    let bar = super::bar(progress, &format!("service {rate:.0} req/s"), secs, "s");
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let (stop, tick) = ticker(bar, started, done.clone(), secs * 1000);
    let schedule = Schedule::for_duration(rate, Duration::from_secs(secs));
    let scheduled = schedule.calls.unwrap_or_default();
    let all = fixed_rate(schedule, CancellationToken::new(), done, |_| {
        let (client, url) = (client.clone(), url.to_string());
        async move { send(&client, &url, false).await }
    })
    .await;
    let seconds = started.elapsed().as_secs_f64();
    let _ = stop.send(());
    let _ = tick.await;
    let reservations = all.ok();
    FixedRate {
        target_rate: rate,
        scheduled,
        reservations,
        achieved_rate: reservations as f64 / seconds,
        latency: Latency::from_micros(all.latencies_us),
        errors: all.errors,
        max_in_flight: all.max_in_flight,
        cpu: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_childs_result_round_trips_through_its_json_line() {
        let level = ServiceLevel {
            concurrency: 16,
            seconds: 2.001,
            reservations: 6000,
            rate_per_s: 2998.5,
            latency: Latency::from_micros(vec![900, 1200, 5000]),
            errors: [("503".to_string(), 2)].into(),
            per_second: vec![2990, 3010],
            available_before: 0,
            cpu: None,
        };
        let fixed = FixedRate {
            target_rate: 1000.0,
            scheduled: 2000,
            reservations: 1999,
            achieved_rate: 999.0,
            latency: Latency::from_micros(vec![1500]),
            errors: Default::default(),
            max_in_flight: 4,
            cpu: None,
        };
        for result in [LoadResult::Closed(level), LoadResult::Open(fixed)] {
            let stdout = format!("{}\n", serde_json::to_string(&result).unwrap());
            assert_eq!(parse_result(&stdout).unwrap(), result);
        }
        assert!(parse_result("").is_err());
        assert!(parse_result("{\"mode\":\"closed\"}\n").is_err(), "a result has its figures");
    }

    #[test]
    fn the_load_generator_runs_in_this_binary_unless_told_or_unable() {
        let tools = Path::new("/work/target/release/cifpool-tools");
        let harness = Path::new("/work/target/debug/deps/cifpool_tools-0123");
        assert_eq!(Placement::choose(false, None, Some(tools)), Placement::Process { bin: tools.into() });
        assert!(matches!(Placement::choose(true, None, Some(tools)), Placement::InProcess { .. }));
        assert!(matches!(Placement::choose(false, None, Some(harness)), Placement::InProcess { .. }));
        assert!(matches!(Placement::choose(false, None, None), Placement::InProcess { .. }));
        assert_eq!(Placement::choose(false, Some(tools), Some(harness)), Placement::Process { bin: tools.into() });
    }
}
