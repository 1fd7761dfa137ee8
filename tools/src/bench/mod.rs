//! `cifpool-tools bench <target>`: reproducible measurements, each written to `DIR/<target>.json` (figures,
//! parameters, machine) and summarised as a table on stdout.
//!
//! - [`reserve`]: `POST /v1/cif` against an in-process service at several concurrencies, beside the
//!   same one-statement claim run raw through `pgbench` (the headline: service / raw), and the latency
//!   at a fixed open-loop request rate; the HTTP load comes from a child process ([`loadgen`]).
//! - [`refill`]: codes/s of `refill()` (Feistel + `COPY` in batches) filling an empty pool, against a
//!   naive autocommit `INSERT` per code and one raw `COPY` of the same rows.
//! - [`soak`]: minutes of reservations (reserve + confirm) and queue traffic together, per-minute
//!   throughput and table sizes.
//! - [`admin`]: operators' reads (`/admin/queue`, `/metrics`, the console's queue and dead-letter
//!   pages) with millions of finished and waiting jobs, and the periodic work's CPU while idle.
//! - [`horizon`]: the same mixed load while another session holds a snapshot open: drain, reservation
//!   p99 and dead tuples per window, before, during and after the hold.
//! - [`queue`]: one HTTP batch of 500,000 jobs and its cancel, the drain of 200,000 jobs through the worker groups
//!   with no-op providers beside the same drain by Graphile Worker ([`graphile`]), and the OTP wait
//!   ([`otp`]) while a 500,000-job promo backlog drains.
//!
//! Everything runs on a scratch database, `cifpool_bench`, dropped and re-created at the start of each
//! run on the configured server (the embedded cluster unless `database.url` is set). The `run_*`
//! functions take connect options instead, so tests can point them at a database of their own.

pub mod admin;
pub mod claims;
pub mod cpu;
pub mod enqueue;
pub mod graphile;
pub mod horizon;
pub mod loadgen;
pub mod otp;
pub mod queue;
pub mod raw;
pub mod refill;
pub mod report;
pub mod reserve;
pub mod soak;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sqlx::postgres::PgConnectOptions;

use cifpool::config::Settings;
use cifpool::db::Database;
use cifpool::startup::{Application, RunningApp};

/// Name of the scratch database `run` creates on the configured server.
pub const BENCH_DATABASE: &str = "cifpool_bench";

/// What to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Target {
    /// HTTP reservations vs the raw SQL claim, and p99 at a fixed request rate.
    Reserve,
    /// Refill codes/s vs row-by-row INSERT and one raw COPY.
    Refill,
    /// Queue bulk enqueue, drain rate, OTP wait during a promo drain.
    Queue,
    /// Long mixed run: per-minute throughput, first vs last minute, table sizes.
    Soak,
    /// Mixed load while a snapshot is held open: drain, reservation p99, dead tuples per window.
    Horizon,
    /// Operators' reads with millions of jobs in the table, and the periodic work while idle.
    Admin,
}

impl Target {
    /// The name used on the command line and for the JSON file.
    pub fn name(self) -> &'static str {
        match self {
            Target::Reserve => "reserve",
            Target::Refill => "refill",
            Target::Queue => "queue",
            Target::Soak => "soak",
            Target::Horizon => "horizon",
            Target::Admin => "admin",
        }
    }
}

/// How the raw-SQL side of `reserve` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RawMode {
    /// `pgbench` when installed, else an in-process sqlx loop.
    #[default]
    Auto,
    /// `pgbench` or fail.
    Pgbench,
    /// In-process sqlx loop.
    Sqlx,
    /// Skip the raw-SQL comparison.
    None,
}

/// `cifpool bench …`
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// What to measure: reserve, refill, queue, soak, horizon, admin.
    #[arg(value_enum)]
    pub target: Target,
    /// Output directory; the run writes `<target>.json` into it.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// reserve: seconds per concurrency level (and for the fixed-rate run).
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// reserve: concurrency levels (comma-separated); soak: the first is its reservation clients.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub concurrency: Vec<usize>,
    /// reserve: open-loop request rate (req/s) for the fixed-rate latency run; 0 skips it.
    #[arg(long, default_value_t = 1000.0)]
    pub rate: f64,
    /// reserve: clients of the authentication A/B (with and without key checks, alternating, 4 runs of
    /// --duration); 0 skips it.
    #[arg(long, default_value_t = 16)]
    pub auth_concurrency: usize,
    /// reserve: clients guessing API keys (a fresh random bearer token per request, no pause) during a
    /// second fixed-rate run, to show what they do to real callers' latency; 0 skips it.
    #[arg(long, default_value_t = 64)]
    pub guessing_clients: usize,
    /// reserve: how to run the equivalent raw SQL claim.
    #[arg(long, value_enum, default_value_t = RawMode::Auto)]
    pub raw: RawMode,
    /// refill: codes to generate into the empty pool (batches of 10,000).
    #[arg(long, default_value_t = 1_000_000)]
    pub refill_codes: u64,
    /// refill: the bench pool's cipher (`ff1`, what a new pool gets, or `feistel`).
    #[arg(long, value_enum, default_value_t = cifpool::code::Cipher::Ff1)]
    pub refill_cipher: cifpool::code::Cipher,
    /// refill: rows of the naive autocommit-INSERT baseline (its rate is extrapolated).
    #[arg(long, default_value_t = 5_000)]
    pub naive_rows: u64,
    /// queue: jobs drained by the workers.
    #[arg(long, default_value_t = 200_000)]
    pub jobs: u64,
    /// queue: jobs in the one bulk-enqueue request.
    #[arg(long, default_value_t = 500_000)]
    pub enqueue_jobs: u64,
    /// queue: promo backlog drained while OTPs arrive.
    #[arg(long, default_value_t = 500_000)]
    pub promo_jobs: u64,
    /// queue: OTPs per second during the promo drain.
    #[arg(long, default_value_t = 10.0)]
    pub otp_rate: f64,
    /// queue: leave out the Graphile Worker peer drain (run otherwise when node and npm are on PATH;
    /// installed once under target/peers/graphile).
    #[arg(long)]
    pub no_peer: bool,
    /// queue, admin: tenants the jobs are spread over.
    #[arg(long, default_value_t = 100)]
    pub tenants: usize,
    /// reserve: run the HTTP load generator inside this process, as before it had a process of its own
    /// (the CPU split then counts it with the service).
    #[arg(long)]
    pub load_in_process: bool,
    /// reserve: the `cifpool-tools` binary to run the load generator with (default: this binary; a
    /// test harness names the real one).
    #[arg(long, hide = true)]
    pub client_bin: Option<PathBuf>,
    /// soak: length in minutes.
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// soak, horizon: promo jobs per second offered to the queue.
    #[arg(long, default_value_t = 2000.0)]
    pub queue_rate: f64,
    /// horizon: reservation clients (each reserves and confirms in a loop).
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// horizon: seconds of load before the snapshot is taken.
    #[arg(long, default_value_t = 60.0)]
    pub before_secs: f64,
    /// horizon: seconds the snapshot is held open.
    #[arg(long, default_value_t = 180.0)]
    pub hold_secs: f64,
    /// horizon: seconds of load after it is let go.
    #[arg(long, default_value_t = 120.0)]
    pub after_secs: f64,
    /// horizon: length of one reported window, seconds.
    #[arg(long, default_value_t = 10.0)]
    pub window_secs: f64,
    /// admin: sent jobs in the history.
    #[arg(long, default_value_t = 5_000_000)]
    pub finished_jobs: u64,
    /// admin: promo jobs waiting.
    #[arg(long, default_value_t = 1_000_000)]
    pub pending_jobs: u64,
    /// admin: dead letters.
    #[arg(long, default_value_t = 20_000)]
    pub dead_jobs: u64,
    /// admin: requests per endpoint.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// admin: seconds of the idle window (periodic work only).
    #[arg(long, default_value_t = 60.0)]
    pub idle_secs: f64,
    /// No progress bars.
    #[arg(long)]
    pub no_progress: bool,
}

impl BenchArgs {
    /// Defaults for `target`, as the command line gives them (parsed, so each default lives once, in
    /// its `#[arg]`).
    pub fn new(target: Target) -> BenchArgs {
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            args: BenchArgs,
        }
        <Only as clap::Parser>::try_parse_from(["bench", target.name()]).expect("every other flag has a default").args
    }

    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.duration > 0.0 && self.duration.is_finite(), "--duration must be positive");
        anyhow::ensure!(
            !self.concurrency.is_empty() && self.concurrency.iter().all(|&c| c >= 1),
            "--concurrency needs levels of at least 1"
        );
        anyhow::ensure!(self.rate >= 0.0 && self.rate.is_finite(), "--rate must be 0 (off) or positive");
        anyhow::ensure!(self.refill_codes >= 1, "--refill-codes must be at least 1");
        anyhow::ensure!(
            self.jobs >= 1 && self.enqueue_jobs >= 1 && self.promo_jobs >= 1,
            "--jobs, --enqueue-jobs and --promo-jobs must be at least 1"
        );
        anyhow::ensure!(self.otp_rate > 0.0 && self.otp_rate <= 10_000.0, "--otp-rate must be in (0, 10000]");
        anyhow::ensure!(self.tenants >= 1, "--tenants must be at least 1");
        anyhow::ensure!(self.minutes > 0.0 && self.minutes.is_finite(), "--minutes must be positive");
        anyhow::ensure!(self.queue_rate >= 0.0 && self.queue_rate.is_finite(), "--queue-rate must be 0 or positive");
        anyhow::ensure!(self.clients >= 1, "--clients must be at least 1");
        let phase = |s: f64| s.is_finite() && s >= 0.0;
        anyhow::ensure!(
            phase(self.before_secs) && phase(self.hold_secs) && phase(self.after_secs),
            "--before-secs, --hold-secs and --after-secs must be 0 or positive"
        );
        anyhow::ensure!(self.window_secs >= 1.0 && self.window_secs.is_finite(), "--window-secs must be at least 1");
        anyhow::ensure!(self.requests >= 1, "--requests must be at least 1");
        anyhow::ensure!(self.idle_secs >= 1.0 && self.idle_secs.is_finite(), "--idle-secs must be at least 1");
        Ok(())
    }
}

/// Runs `cifpool bench` with `args`: opens the configured server (starting the embedded cluster if
/// needed), re-creates the scratch database [`BENCH_DATABASE`], measures, writes `<out>/<target>.json`
/// and prints a table.
pub fn run(settings: &Settings, args: &BenchArgs) -> anyhow::Result<()> {
    args.validate()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the runtime")?;
    runtime.block_on(async {
        let database = Database::open(settings).await?;
        let opened = open_bench_database(&database).await;
        let result = match opened {
            Ok(connect) => run_on(&connect, settings, args).await,
            Err(e) => Err(e),
        };
        database.close().await;
        result.map(|_| ())
    })
}

/// Measures `args.target` on the (scratch) database behind `connect`, writes the JSON into `args.out`
/// and prints the table; returns the JSON's path. `settings` supplies the service configuration
/// (database pool size, timeouts); its pools are replaced by a bench pool.
pub async fn run_on(connect: &PgConnectOptions, settings: &Settings, args: &BenchArgs) -> anyhow::Result<PathBuf> {
    args.validate()?;
    let (path, table) = match args.target {
        Target::Reserve => {
            let report = reserve::run(connect, settings, &reserve::ReserveOptions::from_args(args)).await?;
            (report.write(&args.out)?, reserve::table(&report))
        }
        Target::Refill => {
            let report = refill::run(connect, &refill::RefillBenchOptions::from_args(args)).await?;
            (report.write(&args.out)?, refill::table(&report))
        }
        Target::Queue => {
            let report = queue::run(connect, settings, &queue::QueueBenchOptions::from_args(args)).await?;
            (report.write(&args.out)?, queue::table(&report))
        }
        Target::Soak => {
            let report = soak::run(connect, settings, &soak::SoakOptions::from_args(args)).await?;
            (report.write(&args.out)?, soak::table(&report))
        }
        Target::Horizon => {
            let report = horizon::run(connect, settings, &horizon::HorizonOptions::from_args(args)).await?;
            (report.write(&args.out)?, horizon::table(&report))
        }
        Target::Admin => {
            let report = admin::run(connect, settings, &admin::AdminOptions::from_args(args)).await?;
            (report.write(&args.out)?, admin::table(&report))
        }
    };
    println!("{table}");
    println!("wrote {}", path.display());
    Ok(path)
}

/// Drops and re-creates [`BENCH_DATABASE`] on the server `database` is connected to, migrates it and
/// returns its connect options.
pub async fn open_bench_database(database: &Database) -> anyhow::Result<PgConnectOptions> {
    database.recreate_scratch(BENCH_DATABASE).await
}

/// A pool definition for benchmarks: the default `individual` format (9 digits + Damm) under its own
/// prefix and key id, schedules that do not fire during a bench, a watermark of 1 so the service's own
/// post-claim refill stays out of the measurement.
pub fn bench_pool(
    name: &str,
    prefix: &str,
    batch_size: u32,
    max_batches_per_run: u32,
) -> cifpool::config::PoolSettings {
    cifpool::config::PoolSettings {
        name: name.into(),
        prefix: prefix.into(),
        digits: 9,
        check: cifpool::code::CheckScheme::Damm,
        key_id: "bench".into(),
        cipher: None,
        low_watermark: 1,
        batch_size,
        max_batches_per_run,
        lease_ttl: Duration::from_secs(3600),
        // Midnight on February 29th: not during a bench. (February 30th never comes: configuration
        // refuses a schedule that never fires.)
        refill_schedule: "0 0 0 29 2 *".into(),
        reclaim_schedule: "0 0 0 29 2 *".into(),
        fence_margin: None,
    }
}

/// A bar over `len` units with a label, hidden when `show` is false (or stderr is not a terminal).
pub(crate) fn bar(show: bool, label: &str, len: u64, unit: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(
        Some(len),
        if show { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() },
    );
    let template = format!("{{prefix:>26}} [{{bar:30}}] {{pos}}/{{len}} {unit} {{elapsed}} {{msg}}");
    bar.set_style(ProgressStyle::with_template(&template).expect("static template").progress_chars("=> "));
    bar.set_prefix(label.to_string());
    bar
}

/// Drives a bar from `done` until the returned sender fires, showing the running rate.
pub(crate) fn ticker(
    bar: ProgressBar,
    started: std::time::Instant,
    done: std::sync::Arc<std::sync::atomic::AtomicU64>,
    total_ms: u64,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        loop {
            let elapsed = started.elapsed();
            bar.set_position((elapsed.as_millis() as u64).min(total_ms) / 1000);
            let n = done.load(std::sync::atomic::Ordering::Relaxed);
            let rate = n as f64 / elapsed.as_secs_f64();
            bar.set_message(format!("{} ok, {}/s", report::thousands(n as f64), report::thousands(rate)));
            tokio::select! {
                _ = &mut rx => break,
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
        bar.finish();
    });
    (tx, task)
}

/// Finds `pgbench` like the embedded module finds `initdb`: `PATH`, then the newest
/// `/usr/lib/postgresql/<version>/bin`.
pub fn find_pgbench() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("PATH")
        && let Some(found) = std::env::split_paths(&path).map(|d| d.join("pgbench")).find(|p| p.is_file())
    {
        return Some(found);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin").join("pgbench");
            bin.is_file().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

/// libpq environment (`PGHOST`, `PGPORT`, `PGUSER`, `PGDATABASE`) for `connect`. A password is not
/// recoverable from connect options: `PGPASSWORD` / `~/.pgpass` of the environment apply.
pub(crate) fn libpq_env(connect: &PgConnectOptions) -> Vec<(&'static str, String)> {
    let host = match connect.get_socket() {
        Some(dir) => dir.display().to_string(),
        None => connect.get_host().to_string(),
    };
    let mut env = vec![
        ("PGHOST", host),
        ("PGPORT", connect.get_port().to_string()),
        ("PGUSER", connect.get_username().to_string()),
    ];
    if let Some(db) = connect.get_database() {
        env.push(("PGDATABASE", db.to_string()));
    }
    env
}

/// Forces a checkpoint before a measured phase, so a WAL-triggered one (every `max_wal_size`, 1 GB by
/// default) is less likely to land inside it and make runs incomparable. Needs a superuser or
/// `pg_checkpoint`; without the right it does nothing and says so once in the log.
pub(crate) async fn checkpoint(db: &sqlx::PgPool) {
    if let Err(e) = sqlx::query("CHECKPOINT").execute(db).await {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| tracing::warn!(error = %e, "CHECKPOINT before a phase refused; phases may be hit by one"));
    }
}

/// The database server's clock now (phases are timed against `finished_at` and friends, which it set).
pub(crate) async fn db_now(db: &sqlx::PgPool) -> anyhow::Result<chrono::DateTime<chrono::Utc>> {
    Ok(sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(db).await?)
}

/// Replaces every provider of `settings` with the no-op provider (a benchmark must never send to a real
/// gateway), its concurrency limit raised to the worker count: a no-op provider has no capacity to
/// protect, and the figures should measure the queue, not a configured gateway limit.
pub(crate) fn use_noop_providers(settings: &mut Settings) {
    let workers = settings.queue.workers as u32;
    for provider in settings.queue.providers.values_mut() {
        provider.kind = cifpool::config::ProviderKind::Noop;
        provider.allow_noop = true;
        provider.url = None;
        provider.authorization = None;
        provider.max_concurrency = provider.max_concurrency.max(workers);
    }
}

/// The real service started in-process on the bench database (its own connection pool, a throw-away
/// master key shared by every service of this process: the scratch database is re-created by every
/// run), listening on an ephemeral port.
pub(crate) async fn start_service(connect: &PgConnectOptions, settings: Settings) -> anyhow::Result<RunningApp> {
    Ok(build_service(connect, settings).await?.spawn())
}

/// The per-key request limit of the services the benches start, far above any rate measured.
const PER_KEY_LIMIT: u32 = 1_000_000;

/// The per-key request limit a bench's service runs with: the configured one raised to
/// [`PER_KEY_LIMIT`], or none where none is configured (0).
pub(crate) fn per_key_limit(settings: &Settings) -> u32 {
    match settings.security.requests_per_second_per_key {
        0 => 0,
        configured => configured.max(PER_KEY_LIMIT),
    }
}

/// [`start_service`] before it is spawned, for runs that adjust it first.
pub(crate) async fn build_service(connect: &PgConnectOptions, mut settings: Settings) -> anyhow::Result<Application> {
    static MASTER: std::sync::OnceLock<cifpool::keys::MasterKey> = std::sync::OnceLock::new();
    settings.server.listen = "127.0.0.1:0".parse().expect("static address");
    // Every client of a run sends the one key of `client`, and on a fast machine a run's clients
    // together outran the default per-key limit (5,000 requests a second): the limit, not the path
    // measured, set the figures. The limiter still runs on every request.
    settings.security.requests_per_second_per_key = per_key_limit(&settings);
    let db = Database::external(&settings.database, connect.clone());
    Application::build_with(settings, db, MASTER.get_or_init(cifpool::keys::MasterKey::generate))
        .await
        .context("starting the service under test")
}

/// An HTTP client for the services of a run: keep-alive, no Nagle, and an API key with every scope
/// (created in the scratch database) sent with each request.
pub(crate) async fn client(connect: &PgConnectOptions, timeout: Duration) -> anyhow::Result<reqwest::Client> {
    loadgen::http_client(&api_key(connect).await?, timeout)
}

/// A new API key with every scope, in the scratch database behind `connect`.
pub(crate) async fn api_key(connect: &PgConnectOptions) -> anyhow::Result<String> {
    let db = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with(connect.clone()).await?;
    let new = cifpool::internals::api_key::NewKey {
        name: format!("bench-{}", chrono::Utc::now().timestamp_micros()),
        scopes: cifpool::auth::Scope::ALL.iter().map(|s| s.as_str().to_string()).collect(),
        tenants: None,
    };
    let created = cifpool::internals::api_key::create(&db, &cifpool::audit::Actor::system(), &new).await;
    db.close().await;
    Ok(created?.key)
}

/// Stops a service of [`start_service`] (graceful shutdown, as on SIGTERM) and waits until it has.
pub(crate) async fn stop_service(service: RunningApp) {
    if let Err(e) = service.stop().await {
        tracing::warn!(error = %e, "bench service stopped with an error");
    }
}

/// A private scratch directory under `dir` (for pgbench scripts and logs).
pub(crate) fn scratch_dir(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    if path.exists() {
        std::fs::remove_dir_all(&path).with_context(|| format!("clearing {}", path.display()))?;
    }
    std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
    // Absolute: pgbench and the peer's node run their scripts from other working directories.
    std::path::absolute(&path).with_context(|| format!("resolving {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bench_raises_the_per_key_limit_and_keeps_none_as_none() {
        let mut settings = Settings::load_with_env(None, Vec::new()).expect("the shipped defaults load");
        assert_eq!(per_key_limit(&settings), PER_KEY_LIMIT);
        settings.security.requests_per_second_per_key = 0;
        assert_eq!(per_key_limit(&settings), 0);
        settings.security.requests_per_second_per_key = 2 * PER_KEY_LIMIT;
        assert_eq!(per_key_limit(&settings), 2 * PER_KEY_LIMIT);
    }
}
