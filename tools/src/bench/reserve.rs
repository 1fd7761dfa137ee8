//! `cifpool-tools bench reserve`: reservations per second and latency of `POST /v1/cif` over HTTP, against
//! the same one-statement claim run raw on the same cluster (the headline figure is service / raw), and
//! the latency at a fixed open-loop request rate.
//!
//! Method:
//! - The service runs in-process (the real [`cifpool::startup::Application`], its configured database pool size and
//!   timeouts) on a bench pool (`bench`, the default `individual` format under prefix 7) whose own
//!   refill never triggers during a level; the queue workers are off; its per-key request limit
//!   (`security.requests_per_second_per_key`) is raised to a million a second ([`super::per_key_limit`]), so that the limit does not
//!   set the figure (it still runs on every request). The load generator is a reqwest
//!   client (keep-alive connection pool) with one tokio task per concurrent client, closed loop, in a
//!   child process of its own ([`super::loadgen`]), so the CPU split tells the service, the load
//!   generator and Postgres apart.
//! - The raw side runs [`cifpool::internals::reservations::reserve_sql`] through `pgbench -M prepared` at the same
//!   concurrency (`$n` binds turned into pgbench variables), or an in-process sqlx loop (one connection
//!   per client, same statement, prepared) when pgbench is missing.
//! - Before every measured phase, every code reserved by the previous phase is released and the table
//!   vacuumed, so each phase starts from the same pool; the pool is topped up (forced `refill()`) to
//!   1.5× what the phase could consume at the fastest rate seen so far.
//! - Fixed rate: requests are scheduled at fixed intervals regardless of responses (open loop), and
//!   latency is measured from each request's scheduled time, so a stall counts against every request
//!   it delays (no coordinated omission). Generator lag (timer granularity, ~1 ms) is included.
//! - Under guessing: the fixed-rate run again, while `--guessing-clients` more clients (in a load
//!   generator process of their own) send reservations as fast as they are answered, each under a
//!   fresh random `cfp_` key. All of them come from 127.0.0.1, as a guesser behind one address would.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::cpu::{CpuSplit, CpuWatch};
use super::loadgen::{LoadGenerator, Placement};
use super::raw::{RawMethod, pgbench_level, sqlx_level};
use super::report::{BenchReport, Latency, Machine, ms, table as text_table, thousands};
use super::{BenchArgs, RawMode, bench_pool, find_pgbench, scratch_dir};
use cifpool::cif::Pool;
use cifpool::config::Settings;
use cifpool::internals::refill::{RefillOptions, RefillOutcome, refill};

/// Name (customer type) of the bench pool.
pub const POOL: &str = "bench";
/// Holder recorded by both sides.
pub(crate) const HOLDER: &str = "bench";
/// Rate assumed before anything has been measured, reservations/s.
const INITIAL_RATE_GUESS: f64 = 4000.0;

/// Parameters of a `reserve` run.
#[derive(Debug, Clone, Serialize)]
pub struct ReserveOptions {
    /// Whole seconds per concurrency level, per side (pgbench's `-T` takes whole seconds).
    pub seconds: u64,
    /// Concurrency levels.
    pub concurrency: Vec<usize>,
    /// Open-loop rate for the fixed-rate run, req/s; 0 skips it.
    pub rate: f64,
    /// Concurrency of the authentication A/B (runs with and without key checks, alternating); 0
    /// skips it.
    pub auth_concurrency: usize,
    /// Clients guessing keys during a second fixed-rate run; 0 skips it.
    pub guessing_clients: usize,
    /// Raw-SQL side.
    pub raw: RawMode,
    /// Directory for pgbench's script and logs (a `pgbench/` scratch directory is made inside).
    pub scratch: PathBuf,
    /// Where the HTTP load generator runs.
    pub load: Placement,
    /// Draw progress bars.
    #[serde(skip)]
    pub progress: bool,
}

impl ReserveOptions {
    /// From the command line.
    pub fn from_args(args: &BenchArgs) -> ReserveOptions {
        ReserveOptions {
            seconds: (args.duration.round() as u64).max(1),
            concurrency: args.concurrency.clone(),
            rate: args.rate,
            auth_concurrency: args.auth_concurrency,
            guessing_clients: args.guessing_clients,
            raw: args.raw,
            scratch: args.out.clone(),
            load: Placement::choose(
                args.load_in_process,
                args.client_bin.as_deref(),
                std::env::current_exe().ok().as_deref(),
            ),
            progress: !args.no_progress,
        }
    }
}

/// The service side of one level.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ServiceLevel {
    /// Concurrent clients.
    pub concurrency: usize,
    /// Wall time from the first request to the last response.
    pub seconds: f64,
    /// 201 responses.
    pub reservations: u64,
    /// Reservations per second.
    pub rate_per_s: f64,
    /// Latency of the 201 responses.
    pub latency: Option<Latency>,
    /// Non-201 responses by status (`"transport"` for connection errors).
    pub errors: BTreeMap<String, u64>,
    /// 201 responses completed in each second of the run (shows drift within a level).
    pub per_second: Vec<u64>,
    /// Available codes in the pool when the level started.
    pub available_before: u64,
    /// Where the CPU went during the level: `cifpool` the service (and the load generator when it ran
    /// in-process), `child` the load generator's process.
    pub cpu: Option<CpuSplit>,
}

/// The raw-SQL side of one level.
#[derive(Debug, Clone, Serialize)]
pub struct RawLevel {
    /// Concurrent clients.
    pub concurrency: usize,
    /// `pgbench` or `sqlx`.
    pub method: &'static str,
    /// Measured seconds.
    pub seconds: f64,
    /// Statements run.
    pub transactions: u64,
    /// Rows actually claimed (lower than `transactions` only if the pool ran empty).
    pub claimed: u64,
    /// Failed statements.
    pub failed: u64,
    /// Claims per second (pgbench: its tps without connection time).
    pub rate_per_s: f64,
    /// Per-statement latency (pgbench: from its per-transaction log).
    pub latency: Option<Latency>,
    /// Available codes in the pool when the level started.
    pub available_before: u64,
    /// Where the CPU went during the level.
    pub cpu: Option<CpuSplit>,
}

/// One concurrency level, both sides.
#[derive(Debug, Clone, Serialize)]
pub struct Level {
    /// Concurrent clients.
    pub concurrency: usize,
    /// Through HTTP.
    pub service: ServiceLevel,
    /// Raw SQL, when run.
    pub raw: Option<RawLevel>,
    /// service rate / raw rate.
    pub service_over_raw: Option<f64>,
}

/// The fixed-rate (open-loop) run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FixedRate {
    /// Requested rate, req/s.
    pub target_rate: f64,
    /// Requests scheduled.
    pub scheduled: u64,
    /// 201 responses.
    pub reservations: u64,
    /// Responses per second actually completed over the run.
    pub achieved_rate: f64,
    /// Latency of the 201 responses, from their scheduled send time.
    pub latency: Option<Latency>,
    /// Non-201 responses by status.
    pub errors: BTreeMap<String, u64>,
    /// Most requests in flight at once.
    pub max_in_flight: usize,
    /// Where the CPU went during the run (as for a level).
    #[serde(default)]
    pub cpu: Option<CpuSplit>,
}

/// What checking API keys costs: the same closed loop against the service with authentication and
/// against a second instance on the same database without it, alternating, back to back.
#[derive(Debug, Clone, Serialize)]
pub struct AuthOverhead {
    /// Clients.
    pub concurrency: usize,
    /// Reservations/s of each run with keys checked, in run order.
    pub with_auth_per_s: Vec<f64>,
    /// Reservations/s of each run without authentication, in run order.
    pub without_auth_per_s: Vec<f64>,
    /// `1 - mean(with) / mean(without)`: the share of throughput authentication costs.
    pub overhead: f64,
}

/// The fixed-rate run repeated while other clients guess keys.
#[derive(Debug, Clone, Serialize)]
pub struct UnderGuessing {
    /// Clients guessing.
    pub guessing_clients: usize,
    /// Guesses answered per second.
    pub guesses_per_s: f64,
    /// How the guesses were answered, by status.
    pub guess_answers: BTreeMap<String, u64>,
    /// The real callers' run meanwhile.
    pub fixed_rate: FixedRate,
}

/// Figures of a `reserve` run.
#[derive(Debug, Clone, Serialize)]
pub struct ReserveResults {
    /// Per concurrency level.
    pub levels: Vec<Level>,
    /// The authentication A/B, when run.
    pub auth: Option<AuthOverhead>,
    /// Open-loop latency at a fixed rate.
    pub fixed_rate: Option<FixedRate>,
    /// The same while other clients guess keys.
    pub under_guessing: Option<UnderGuessing>,
    /// The statement both sides run (`$1` limit = 1, `$2` lease seconds, `$3` pool id, `$4` holder).
    pub claim_sql: String,
}

/// Runs the benchmark on the scratch database behind `connect`.
pub async fn run(
    connect: &PgConnectOptions,
    settings: &Settings,
    opts: &ReserveOptions,
) -> anyhow::Result<BenchReport<ReserveResults>> {
    let harness = PgPoolOptions::new().max_connections(4).connect_with(connect.clone()).await?;
    let machine = Machine::probe(&harness).await?;
    let mut notes = Vec::new();

    let mut app_settings = settings.clone();
    app_settings.queue.workers_enabled = false;
    app_settings.pools = vec![bench_pool(POOL, "7", 10_000, 10)];
    let db_settings = app_settings.database.clone();
    let unauth_settings = app_settings.clone();
    let service = super::start_service(connect, app_settings).await?;
    let pool = service.state.cif.pools().get(POOL).cloned().context("bench pool missing")?;

    if let Placement::InProcess { reason } = &opts.load {
        notes.push(format!(
            "the HTTP load generator ran inside the service's process ({reason}): cifpool CPU includes it"
        ));
    }
    let raw_method = match opts.raw {
        RawMode::None => None,
        RawMode::Sqlx => Some(RawMethod::Sqlx),
        RawMode::Pgbench => Some(RawMethod::Pgbench(find_pgbench().context("--raw pgbench: pgbench not found")?)),
        RawMode::Auto => match find_pgbench() {
            Some(bin) => Some(RawMethod::Pgbench(bin)),
            None => {
                notes.push(
                    "pgbench not found (PATH, /usr/lib/postgresql/*/bin): the raw side is an in-process sqlx loop"
                        .into(),
                );
                Some(RawMethod::Sqlx)
            }
        },
    };
    let script_dir = match &raw_method {
        Some(RawMethod::Pgbench(_)) => Some(scratch_dir(&opts.scratch, ".pgbench")?),
        _ => None,
    };

    let result = async {
        let key = super::api_key(connect).await?;
        let load = LoadGenerator::new(opts.load.clone(), key, Duration::from_secs(30))?;
        let url = format!("{}/v1/cif", service.base_url);
        let secs = opts.seconds;
        let mut best_rate = INITIAL_RATE_GUESS;
        let mut levels = Vec::new();
        for &c in &opts.concurrency {
            let need = (best_rate * 1.5 * secs as f64 * 1.5) as u64 + 1000;
            let available_before = reset(&harness, &pool, need).await?;
            let mut service = load.closed(&url, c, secs, opts.progress).await?;
            service.available_before = available_before;
            best_rate = best_rate.max(service.rate_per_s);
            if !service.errors.is_empty() {
                notes.push(format!("service at c={c}: non-201 responses {:?}", service.errors));
            }
            let raw = match &raw_method {
                None => None,
                Some(method) => {
                    let need = (best_rate * 3.0 * secs as f64 * 1.5) as u64 + 1000;
                    let available_before = reset(&harness, &pool, need).await?;
                    let watch = CpuWatch::start();
                    let mut raw = match method {
                        RawMethod::Pgbench(bin) => {
                            let dir = script_dir.as_ref().expect("made with the method");
                            pgbench_level(bin, connect, &pool, c, secs, dir, opts.progress).await?
                        }
                        RawMethod::Sqlx => sqlx_level(connect, &pool, c, secs, opts.progress).await?,
                    };
                    raw.cpu = watch.finish().await;
                    raw.claimed = reserved_count(&harness, &pool).await?;
                    raw.available_before = available_before;
                    if raw.claimed < raw.transactions {
                        notes.push(format!(
                            "raw at c={c}: {} statements but {} claims: the pool ran empty",
                            raw.transactions, raw.claimed
                        ));
                    }
                    if raw.failed > 0 {
                        notes.push(format!("raw at c={c}: {} failed statements", raw.failed));
                    }
                    best_rate = best_rate.max(raw.rate_per_s);
                    Some(raw)
                }
            };
            let ratio = raw.as_ref().filter(|r| r.rate_per_s > 0.0).map(|r| service.rate_per_s / r.rate_per_s);
            levels.push(Level { concurrency: c, service, raw, service_over_raw: ratio });
        }
        let auth = if opts.auth_concurrency > 0 {
            let c = opts.auth_concurrency;
            let open = super::build_service(connect, unauth_settings.clone()).await?.without_authentication().spawn();
            let open_url = format!("{}/v1/cif", open.base_url);
            let (mut with, mut without) = (Vec::new(), Vec::new());
            for round in 0..4 {
                reset(&harness, &pool, (best_rate * 1.5 * secs as f64 * 1.5) as u64 + 1000).await?;
                let checked = round % 2 == 0;
                let target = if checked { &url } else { &open_url };
                let level = load.closed(target, c, secs, opts.progress).await?;
                if !level.errors.is_empty() {
                    notes.push(format!("auth A/B (checked: {checked}): non-201 responses {:?}", level.errors));
                }
                if checked { with.push(level.rate_per_s) } else { without.push(level.rate_per_s) }
            }
            super::stop_service(open).await;
            let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
            let overhead = 1.0 - mean(&with) / mean(&without);
            Some(AuthOverhead { concurrency: c, with_auth_per_s: with, without_auth_per_s: without, overhead })
        } else {
            None
        };
        let fixed_rate = if opts.rate > 0.0 {
            reset(&harness, &pool, (opts.rate * secs as f64 * 1.5) as u64 + 1000).await?;
            let fixed = load.open(&url, opts.rate, secs, opts.progress).await?;
            if !fixed.errors.is_empty() {
                notes.push(format!("fixed rate: non-201 responses {:?}", fixed.errors));
            }
            if fixed.achieved_rate < 0.95 * opts.rate {
                notes.push(format!(
                    "fixed rate: achieved {:.0}/s of {:.0}/s requested: the service is saturated at this rate",
                    fixed.achieved_rate, opts.rate
                ));
            }
            Some(fixed)
        } else {
            None
        };
        let under_guessing = if opts.rate > 0.0 && opts.guessing_clients > 0 {
            reset(&harness, &pool, (opts.rate * secs as f64 * 1.5) as u64 + 1000).await?;
            let (fixed, guesses) = tokio::join!(
                load.open(&url, opts.rate, secs, opts.progress),
                load.guessing(&url, opts.guessing_clients, secs)
            );
            let (fixed, guesses) = (fixed?, guesses?);
            if !fixed.errors.is_empty() {
                notes.push(format!("fixed rate under guessing: non-201 responses {:?}", fixed.errors));
            }
            let answered: u64 = guesses.errors.values().sum::<u64>() + guesses.reservations;
            if guesses.reservations > 0 {
                notes.push(format!("{} made-up keys were accepted", guesses.reservations));
            }
            Some(UnderGuessing {
                guessing_clients: opts.guessing_clients,
                guesses_per_s: answered as f64 / guesses.seconds,
                guess_answers: guesses.errors,
                fixed_rate: fixed,
            })
        } else {
            None
        };
        anyhow::Ok(ReserveResults {
            levels,
            auth,
            fixed_rate,
            under_guessing,
            claim_sql: cifpool::internals::reservations::reserve_sql().to_string(),
        })
    }
    .await;

    super::stop_service(service).await;
    harness.close().await;
    if let Some(dir) = script_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    let results = result?;
    notes.push(
        "each phase starts from the same pool: codes reserved by the previous phase are released and \
         cif_codes vacuumed first"
            .into(),
    );
    let parameters = serde_json::json!({
        "seconds_per_level": opts.seconds,
        "concurrency": opts.concurrency,
        "fixed_rate": opts.rate,
        "auth_concurrency": opts.auth_concurrency,
        "guessing_clients": opts.guessing_clients,
        "raw": opts.raw,
        "raw_method": raw_method.as_ref().map(RawMethod::name),
        "pool": { "name": POOL, "digits": 9, "check": "damm", "prefix": "7" },
        "service_requests_per_second_per_key": super::per_key_limit(settings),
        "service_database_max_connections": db_settings.max_connections,
        "service_database_acquire_timeout_ms": db_settings.acquire_timeout.as_millis() as u64,
        "client": match &opts.load {
            Placement::Process { .. } => "reqwest, keep-alive pool, one tokio task per client, in a child process (cifpool-tools bench-client reserve) per run",
            Placement::InProcess { .. } => "reqwest, keep-alive pool, one tokio task per client, in the same process as the service",
        },
        "load_generator": opts.load,
        "pgbench": "pgbench -n -M prepared -c C -j min(C,2) -T secs -f claim.sql -D lease=3600 -D pool_id=ID -D holder=bench -D actor=bench-raw -D request_id=raw -D pool_name=bench -D client_request_id=raw -l",
    });
    Ok(BenchReport { target: "reserve".into(), parameters, machine, results, notes })
}

/// Releases every reserved code of `pool`, vacuums, and tops the pool up to `need` available codes;
/// returns the available count.
async fn reset(db: &PgPool, pool: &Pool, need: u64) -> anyhow::Result<u64> {
    sqlx::query(
        "UPDATE cif_codes SET state = 'available', lease_token = NULL, lease_expires_at = NULL, holder = NULL, \
         reserved_at = NULL WHERE pool_id = $1 AND state = 'reserved'",
    )
    .bind(pool.id)
    .execute(db)
    .await
    .context("releasing the codes of the previous phase")?;
    let mut available = available(db, pool).await?;
    while available < need {
        let summary = refill(db, pool, RefillOptions { force: true, ..Default::default() })
            .await
            .context("pre-filling the bench pool")?;
        match summary.outcome {
            RefillOutcome::Busy => tokio::time::sleep(Duration::from_millis(50)).await,
            RefillOutcome::Exhausted => anyhow::bail!("the bench pool's domain is exhausted"),
            RefillOutcome::Refused => anyhow::bail!("the bench pool's stored format or key is not this run's"),
            _ => {}
        }
        available = self::available(db, pool).await?;
    }
    sqlx::raw_sql("VACUUM (ANALYZE) cif_codes").execute(db).await.context("vacuuming cif_codes")?;
    super::checkpoint(db).await;
    Ok(available)
}

async fn available(db: &PgPool, pool: &Pool) -> anyhow::Result<u64> {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM cif_codes WHERE pool_id = $1 AND state = 'available'")
        .bind(pool.id)
        .fetch_one(db)
        .await?;
    Ok(n as u64)
}

async fn reserved_count(db: &PgPool, pool: &Pool) -> anyhow::Result<u64> {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM cif_codes WHERE pool_id = $1 AND state = 'reserved'")
        .bind(pool.id)
        .fetch_one(db)
        .await?;
    Ok(n as u64)
}

/// The summary table of a report.
pub fn table(report: &BenchReport<ReserveResults>) -> String {
    let mut rows = Vec::new();
    let lat = |l: &Option<Latency>, f: fn(&Latency) -> f64| l.as_ref().map_or("-".into(), |l| ms(f(l)));
    for level in &report.results.levels {
        let raw = level.raw.as_ref();
        rows.push(vec![
            level.concurrency.to_string(),
            thousands(level.service.rate_per_s),
            lat(&level.service.latency, |l| l.p50_ms),
            lat(&level.service.latency, |l| l.p99_ms),
            raw.map_or("-".into(), |r| thousands(r.rate_per_s)),
            raw.map_or("-".into(), |r| lat(&r.latency, |l| l.p50_ms)),
            raw.map_or("-".into(), |r| lat(&r.latency, |l| l.p99_ms)),
            level.service_over_raw.map_or("-".into(), |x| format!("{x:.2}")),
        ]);
    }
    let mut out =
        format!("reserve: POST /v1/cif vs raw claim ({}), {} s per level\n", raw_name(report), seconds(report));
    let fixed_cpu = report.results.fixed_rate.as_ref().and_then(|f| Some((f.target_rate, f.cpu?)));
    let cpu_rows: Vec<(String, CpuSplit)> = report
        .results
        .levels
        .iter()
        .flat_map(|l| {
            let service = l.service.cpu.map(|cpu| (format!("service c={}", l.concurrency), cpu));
            let raw = l.raw.as_ref().and_then(|r| r.cpu).map(|cpu| (format!("raw c={}", l.concurrency), cpu));
            service.into_iter().chain(raw)
        })
        .chain(fixed_cpu.map(|(rate, cpu)| (format!("service {} req/s", thousands(rate)), cpu)))
        .collect();
    out.push_str(&text_table(
        &["clients", "service/s", "p50 ms", "p99 ms", "raw/s", "raw p50", "raw p99", "service/raw"],
        &rows,
    ));
    if let Some(a) = &report.results.auth {
        let runs = |v: &[f64]| v.iter().map(|x| thousands(*x)).collect::<Vec<_>>().join(", ");
        out.push_str(&format!(
            "\nauthentication at c={}: with keys {} /s, without {} /s: costs {:.1} % of throughput\n",
            a.concurrency,
            runs(&a.with_auth_per_s),
            runs(&a.without_auth_per_s),
            a.overhead * 100.0
        ));
    }
    let fixed_line = |f: &FixedRate| {
        let l = f.latency.as_ref();
        format!(
            "achieved {}/s, p50 {} ms, p99 {} ms, max {} ms",
            thousands(f.achieved_rate),
            l.map_or("-".into(), |l| ms(l.p50_ms)),
            l.map_or("-".into(), |l| ms(l.p99_ms)),
            l.map_or("-".into(), |l| ms(l.max_ms)),
        )
    };
    if let Some(f) = &report.results.fixed_rate {
        out.push_str(&format!(
            "\nfixed rate {} req/s (open loop, from scheduled time): {}",
            thousands(f.target_rate),
            fixed_line(f)
        ));
    }
    if let Some(g) = &report.results.under_guessing {
        let answers = g.guess_answers.iter().map(|(status, n)| format!("{status}: {n}")).collect::<Vec<_>>();
        out.push_str(&format!(
            "\nthe same while {} clients guess keys ({}/s answered: {}): {}",
            g.guessing_clients,
            thousands(g.guesses_per_s),
            answers.join(", "),
            fixed_line(&g.fixed_rate)
        ));
    }
    if !cpu_rows.is_empty() {
        let split = match report.parameters["load_generator"]["kind"].as_str() {
            Some("process") => "service = the service's process, load gen = the HTTP load generator's process",
            _ => "service = the service's process, with the HTTP load generator in it",
        };
        out.push_str(&format!("\nwhere the CPU went (cores busy on average; {split}):\n"));
        out.push_str(&super::cpu::table("service", "load gen", &cpu_rows));
        out.push_str(&cpu_per_reservation(&report.results.levels));
    }
    for note in &report.notes {
        out.push_str(&format!("\nnote: {note}"));
    }
    out
}

/// CPU per reservation at each level, the service's side (the service and its Postgres, then the
/// load generator) beside the raw claim's (its Postgres, then pgbench): on shared cores the clients'
/// CPU is taken from the side they drive, so the ratio alone does not say which side does less work.
fn cpu_per_reservation(levels: &[Level]) -> String {
    let micros =
        |cores: f64, rate: f64| super::cpu::micros_each(cores, rate).map_or("-".into(), |us| format!("{us:.0}"));
    let mut out = String::new();
    for level in levels {
        let (Some(service), Some(raw)) = (level.service.cpu, level.raw.as_ref()) else { continue };
        let Some(raw_cpu) = raw.cpu else { continue };
        let rate = level.service.rate_per_s;
        out.push_str(&format!(
            "\nCPU µs per reservation at c={}: service + its postgres {}, load gen {}; raw claim's postgres {}, pgbench {}",
            level.concurrency,
            micros(service.cifpool_cores + service.postgres_cores, rate),
            micros(service.child_cores, rate),
            micros(raw_cpu.postgres_cores, raw.rate_per_s),
            micros(raw_cpu.pgbench_cores, raw.rate_per_s),
        ));
    }
    out
}

fn raw_name(report: &BenchReport<ReserveResults>) -> String {
    report.parameters["raw_method"].as_str().unwrap_or("none").to_string()
}

fn seconds(report: &BenchReport<ReserveResults>) -> u64 {
    report.parameters["seconds_per_level"].as_u64().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(own: f64, child: f64, postgres: f64, pgbench: f64) -> CpuSplit {
        CpuSplit {
            seconds: 10.0,
            cifpool_cores: own,
            child_cores: child,
            postgres_cores: postgres,
            pgbench_cores: pgbench,
            cores: 2,
        }
    }

    #[test]
    fn cpu_per_reservation_divides_each_side_by_its_own_rate() {
        let service = ServiceLevel {
            concurrency: 16,
            seconds: 10.0,
            reservations: 40_000,
            rate_per_s: 4_000.0,
            latency: None,
            errors: BTreeMap::new(),
            per_second: vec![],
            available_before: 0,
            cpu: Some(split(0.48, 0.28, 0.72, 0.0)),
        };
        let raw = RawLevel {
            concurrency: 16,
            method: "pgbench",
            seconds: 10.0,
            transactions: 32_000,
            claimed: 32_000,
            failed: 0,
            rate_per_s: 3_200.0,
            latency: None,
            available_before: 0,
            cpu: Some(split(0.01, 0.0, 1.6, 0.08)),
        };
        let level = Level { concurrency: 16, service, raw: Some(raw), service_over_raw: Some(1.25) };
        assert_eq!(
            cpu_per_reservation(&[level]),
            "\nCPU µs per reservation at c=16: service + its postgres 300, load gen 70; raw claim's postgres 500, pgbench 25"
        );
    }
}
