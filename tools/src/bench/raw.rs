//! The raw side of `bench reserve`: the service's one-statement claim run without the service, through
//! `pgbench -M prepared` (its binds turned into pgbench variables, so the server sees the same prepared
//! statement), or through an in-process sqlx loop when pgbench is missing.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::report::Latency;
use super::reserve::{HOLDER, RawLevel};
use super::{libpq_env, scratch_dir, ticker};
use cifpool::cif::Pool;

/// How the raw claim runs.
pub(crate) enum RawMethod {
    Pgbench(PathBuf),
    Sqlx,
}

impl RawMethod {
    /// The method's name in the report.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            RawMethod::Pgbench(_) => "pgbench",
            RawMethod::Sqlx => "sqlx",
        }
    }
}

/// The service's claim (audit row included) as a pgbench script: its binds become pgbench variables
/// (`-D`), so with `-M prepared` the server sees the same prepared statement with the same parameter
/// positions.
pub fn pgbench_script() -> String {
    let sql = cifpool::internals::reservations::reserve_sql()
        .replace("$1", ":lease")
        .replace("$2", ":pool_id")
        .replace("$3", ":holder")
        .replace("$4", ":actor")
        .replace("$5", ":request_id")
        .replace("$6", ":pool_name")
        .replace("$7", ":client_request_id")
        // The raw claim scans from the lowest counter, as one statement without the service's cursor.
        .replace("$8", "0");
    format!("{sql};\n")
}

/// The actor and request id the raw side's audit rows carry.
const RAW_ACTOR: &str = "bench-raw";

pub(crate) async fn pgbench_level(
    bin: &std::path::Path,
    connect: &PgConnectOptions,
    pool: &Pool,
    c: usize,
    secs: u64,
    dir: &std::path::Path,
    progress: bool,
) -> anyhow::Result<RawLevel> {
    let run_dir = scratch_dir(dir, &format!("c{c}"))?;
    let script = run_dir.join("claim.sql");
    std::fs::write(&script, pgbench_script())?;
    let bar = super::bar(progress, &format!("pgbench c={c}"), secs, "s");
    let done = Arc::new(AtomicU64::new(0));
    let (stop, tick) = ticker(bar, Instant::now(), done, secs * 1000);
    let lease = pool.settings.lease_ttl.as_secs();
    let output = tokio::process::Command::new(bin)
        .args(["-n", "-M", "prepared", "-l", "--log-prefix", "pgb"])
        .args(["-c", &c.to_string(), "-j", &c.min(2).to_string(), "-T", &secs.to_string()])
        .arg("-f")
        .arg(&script)
        .args(["-D", &format!("lease={lease}"), "-D", &format!("pool_id={}", pool.id)])
        .args(["-D", &format!("holder={HOLDER}"), "-D", &format!("actor={RAW_ACTOR}"), "-D", "request_id=raw"])
        .args(["-D", "client_request_id=raw"])
        .args(["-D", &format!("pool_name={}", pool.name())])
        .envs(libpq_env(connect))
        .current_dir(&run_dir)
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    let _ = stop.send(());
    let _ = tick.await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    anyhow::ensure!(output.status.success(), "pgbench failed ({}): {stdout}\n{stderr}", output.status);
    let parsed = parse_pgbench(&stdout).with_context(|| format!("unexpected pgbench output:\n{stdout}\n{stderr}"))?;
    let mut latencies = Vec::new();
    for entry in std::fs::read_dir(&run_dir)? {
        let path = entry?.path();
        if path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("pgb.")) {
            latencies.extend(parse_pgbench_log(&std::fs::read_to_string(&path)?));
        }
    }
    Ok(RawLevel {
        concurrency: c,
        method: "pgbench",
        seconds: secs as f64,
        transactions: parsed.transactions,
        claimed: 0,
        failed: parsed.failed,
        rate_per_s: parsed.tps,
        latency: Latency::from_micros(latencies),
        available_before: 0,
        cpu: None,
    })
}

/// What pgbench's summary says.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PgbenchSummary {
    /// `tps = … (without initial connection time)`.
    pub tps: f64,
    /// `number of transactions actually processed`.
    pub transactions: u64,
    /// `number of failed transactions` (PostgreSQL 15+; 0 before).
    pub failed: u64,
}

/// Parses pgbench's summary output.
pub fn parse_pgbench(stdout: &str) -> Option<PgbenchSummary> {
    let number_after = |line: &str, key: &str| -> Option<f64> {
        let rest = line.trim().strip_prefix(key)?;
        rest.trim_start_matches([' ', '=', ':']).split(|c: char| c.is_whitespace() || c == '/').next()?.parse().ok()
    };
    let mut tps = None;
    let mut transactions = None;
    let mut failed = 0;
    for line in stdout.lines() {
        if line.starts_with("tps") {
            // Prefer the figure without connection time; older versions print both.
            if tps.is_none() || line.contains("without") || line.contains("excluding") {
                tps = number_after(line, "tps").or(tps);
            }
        } else if let Some(n) = number_after(line, "number of transactions actually processed") {
            transactions = Some(n as u64);
        } else if let Some(n) = number_after(line, "number of failed transactions") {
            failed = n as u64;
        }
    }
    Some(PgbenchSummary { tps: tps?, transactions: transactions?, failed })
}

/// Latencies (µs) of a pgbench `-l` log: `client_id transaction_no time script_no time_epoch time_us`.
pub fn parse_pgbench_log(text: &str) -> Vec<u64> {
    text.lines().filter_map(|line| line.split_whitespace().nth(2)?.parse::<u64>().ok()).collect()
}

pub(crate) async fn sqlx_level(
    connect: &PgConnectOptions,
    pool: &Pool,
    c: usize,
    secs: u64,
    progress: bool,
) -> anyhow::Result<RawLevel> {
    let db = PgPoolOptions::new().max_connections(c as u32).connect_with(connect.clone()).await?;
    let mut conns = Vec::with_capacity(c);
    for _ in 0..c {
        conns.push(db.acquire().await?);
    }
    let bar = super::bar(progress, &format!("sqlx c={c}"), secs, "s");
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let (stop, tick) = ticker(bar, started, done.clone(), secs * 1000);
    let lease = pool.settings.lease_ttl.as_secs_f64();
    let pool_id = pool.id;
    let pool_name = pool.name().to_string();
    let mut tasks = tokio::task::JoinSet::new();
    for mut conn in conns {
        let (done, pool_name) = (done.clone(), pool_name.clone());
        tasks.spawn(async move {
            let (mut lat, mut failed, mut n) = (Vec::new(), 0u64, 0u64);
            while Instant::now() < deadline {
                let t0 = Instant::now();
                let res = sqlx::query(sqlx::AssertSqlSafe(cifpool::internals::reservations::reserve_sql()))
                    .bind(lease)
                    .bind(pool_id)
                    .bind(HOLDER)
                    .bind(RAW_ACTOR)
                    .bind("raw")
                    .bind(&pool_name)
                    .bind(None::<&str>)
                    .bind(0_i64)
                    .fetch_optional(&mut *conn)
                    .await;
                n += 1;
                match res {
                    Ok(_) => {
                        lat.push(t0.elapsed().as_micros() as u64);
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => failed += 1,
                }
            }
            (lat, failed, n)
        });
    }
    let (mut lat, mut failed, mut n) = (Vec::new(), 0, 0);
    while let Some(r) = tasks.join_next().await {
        if let Ok((l, f, k)) = r {
            lat.extend(l);
            failed += f;
            n += k;
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let _ = stop.send(());
    let _ = tick.await;
    db.close().await;
    Ok(RawLevel {
        concurrency: c,
        method: "sqlx",
        seconds,
        transactions: n,
        claimed: 0,
        failed,
        rate_per_s: (n - failed) as f64 / seconds,
        latency: Latency::from_micros(lat),
        available_before: 0,
        cpu: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pgbench_15_output() {
        let out = "transaction type: claim.sql\nscaling factor: 1\nquery mode: prepared\nnumber of clients: 16\n\
                   number of threads: 2\nmaximum number of tries: 1\nduration: 5 s\n\
                   number of transactions actually processed: 51234\nnumber of failed transactions: 0 (0.000%)\n\
                   latency average = 1.561 ms\ninitial connection time = 12.345 ms\n\
                   tps = 10246.800000 (without initial connection time)\n";
        let s = parse_pgbench(out).unwrap();
        assert_eq!(s, PgbenchSummary { tps: 10246.8, transactions: 51234, failed: 0 });
        let old = "number of transactions actually processed: 10/10\ntps = 5.0 (including connections establishing)\n\
                   tps = 6.0 (excluding connections establishing)\n";
        let s = parse_pgbench(old).unwrap();
        assert_eq!(s.transactions, 10);
        assert_eq!(s.tps, 6.0);
    }

    #[test]
    fn parses_pgbench_log() {
        assert_eq!(
            parse_pgbench_log("0 1 1234 0 1700000000 123\n0 2 failed 0 1700000000 456\n1 1 99 0 1 2\n"),
            [1234, 99]
        );
    }

    #[test]
    fn script_has_no_positional_binds() {
        let s = pgbench_script();
        assert!(!s.contains('$'), "{s}");
        assert!(s.contains(":pool_id") && s.contains(":lease::float8") && s.trim_end().ends_with(';'));
    }
}
