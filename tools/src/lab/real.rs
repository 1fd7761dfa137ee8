//! `cifpool-tools lab`: the send-flow isolation experiment, scaled down, on the real queue — real worker groups, the real
//! claim SQL, a real Postgres, fake providers over HTTP with the scenario's latencies.
//!
//! Per cell (strategy × scenario): a fresh set of tables, a promo batch inserted first, OTPs injected
//! at a fixed rate from `otp_start` for `otp_window`, the groups run for `duration`, then the OTPs'
//! waits (`picked_at - created_at`) are read back from the jobs table.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use cifpool::auth::{Caller, Scope};
use cifpool::config::{ClassSettings, ProviderKind, ProviderSettings, QueueSettings};
use cifpool::db::Database;
use cifpool::internals::batch;
use cifpool::internals::enqueue;
use cifpool::internals::fake_provider::{FakeBehaviour, FakeProvider};
use cifpool::internals::intake;
use cifpool::internals::runtime::QueueRuntime;
use cifpool::internals::stats::QueueStats;
use cifpool::queue::NewJob;
use cifpool::queue::policy::Strategy;
use cifpool::supervise::Supervisor;

use crate::load::{Schedule, fixed_rate};

/// Provider conditions of a lab cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LabScenario {
    /// Push hangs (3000 ms), SMS healthy (300 ms).
    PushHang,
    /// Push healthy (50 ms), SMS slow (1500 ms).
    SmsSlow,
}

impl LabScenario {
    /// Both.
    pub const ALL: [LabScenario; 2] = [LabScenario::PushHang, LabScenario::SmsSlow];

    /// Kebab-case name.
    pub fn name(self) -> &'static str {
        match self {
            LabScenario::PushHang => "push-hang",
            LabScenario::SmsSlow => "sms-slow",
        }
    }
}

/// Parameters of the lab; each default is the flag's default (scaled down from the production
/// shape: 20 workers, 6 reserved, a 20,000-job promo batch, 10 OTP/s).
#[derive(Debug, Clone, clap::Args)]
pub struct LabOptions {
    /// Workers in all.
    #[arg(long, default_value_t = 20)]
    pub workers: usize,
    /// Workers reserved for OTP (bulkhead, floor-borrow).
    #[arg(long, default_value_t = 6)]
    pub reserved: usize,
    /// Promo jobs inserted before the run.
    #[arg(long, default_value_t = 20_000)]
    pub promo: usize,
    /// OTPs per second.
    #[arg(long, default_value_t = 10.0)]
    pub otp_rate: f64,
    /// Seconds after the start at which OTPs begin.
    #[arg(long, default_value_t = 3.0)]
    pub otp_start: f64,
    /// Seconds during which OTPs arrive.
    #[arg(long, default_value_t = 15.0)]
    pub otp_window: f64,
    /// Seconds the workers run per cell.
    #[arg(long, default_value_t = 25.0)]
    pub duration: f64,
    /// Push latency under push-hang, ms.
    #[arg(long, default_value_t = 3000)]
    pub push_hang_push_ms: u64,
    /// SMS latency under push-hang, ms.
    #[arg(long, default_value_t = 300)]
    pub push_hang_sms_ms: u64,
    /// Push latency under sms-slow, ms.
    #[arg(long, default_value_t = 50)]
    pub sms_slow_push_ms: u64,
    /// SMS latency under sms-slow, ms.
    #[arg(long, default_value_t = 1500)]
    pub sms_slow_sms_ms: u64,
}

impl Default for LabOptions {
    fn default() -> Self {
        crate::cli::parse_defaults()
    }
}

impl LabOptions {
    /// (push, SMS) latency of `scenario`.
    fn latencies(&self, scenario: LabScenario) -> (Duration, Duration) {
        let ms = Duration::from_millis;
        match scenario {
            LabScenario::PushHang => (ms(self.push_hang_push_ms), ms(self.push_hang_sms_ms)),
            LabScenario::SmsSlow => (ms(self.sms_slow_push_ms), ms(self.sms_slow_sms_ms)),
        }
    }

    /// How long the workers run per cell.
    pub fn run_time(&self) -> Duration {
        Duration::from_secs_f64(self.duration)
    }
}

/// One OTP's fate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LabOtp {
    /// Seconds after the cell started.
    pub created_s: f64,
    /// `picked_at - created_at`, if picked within the run.
    pub wait_s: Option<f64>,
}

/// One cell's outcome.
#[derive(Debug, Clone)]
pub struct LabCell {
    /// Strategy.
    pub strategy: Strategy,
    /// Scenario.
    pub scenario: LabScenario,
    /// Every OTP injected.
    pub otps: Vec<LabOtp>,
    /// Promo jobs sent within the run.
    pub promo_done: u64,
}

impl LabCell {
    /// OTPs injected.
    pub fn otp_total(&self) -> usize {
        self.otps.len()
    }

    /// Waits of the OTPs picked within the run, sorted.
    pub fn waits(&self) -> Vec<f64> {
        let mut w: Vec<f64> = self.otps.iter().filter_map(|o| o.wait_s).collect();
        w.sort_by(f64::total_cmp);
        w
    }

    /// Median wait of served OTPs.
    pub fn p50_s(&self) -> Option<f64> {
        crate::stats::percentile(&self.waits(), 0.5)
    }

    /// Longest wait of served OTPs.
    pub fn max_s(&self) -> Option<f64> {
        self.waits().last().copied()
    }

    /// The CSV row (`strategy,scenario,otp_total,otp_served,p50_s,max_s,promo_done`).
    pub fn csv_line(&self) -> String {
        let f = |v: Option<f64>| v.map(|x| format!("{x:.3}")).unwrap_or_default();
        format!(
            "{},{},{},{},{},{},{}",
            self.strategy.name(),
            self.scenario.name(),
            self.otp_total(),
            self.waits().len(),
            f(self.p50_s()),
            f(self.max_s()),
            self.promo_done
        )
    }
}

/// CSV header of `lab.csv`.
pub const CSV_HEADER: &str = "strategy,scenario,otp_total,otp_served,p50_s,max_s,promo_done";

async fn fake(latency: Duration) -> anyhow::Result<(Arc<FakeProvider>, String, CancellationToken)> {
    let fake = FakeProvider::new(FakeBehaviour { latency_ms: latency.as_millis() as u64, ..Default::default() });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let stop = CancellationToken::new();
    tokio::spawn(cifpool::internals::fake_provider::serve(fake.clone(), listener, stop.clone().cancelled_owned()));
    Ok((fake, url, stop))
}

/// Queue settings of a lab cell: an urgent `otp` and a bulk `promo` class, providers without limits
/// (the lab studies worker scheduling, not provider back-off), one job per claim.
fn lab_queue(opts: &LabOptions, strategy: Strategy, sms_url: &str, push_url: &str) -> QueueSettings {
    let class = |name: &str, priority: i16, provider: &str| ClassSettings {
        name: name.into(),
        priority,
        provider: provider.into(),
        max_attempts: 3,
        // The lab measures how long an OTP waits, so no deadline cuts the wait short.
        deadline: None,
        backoff_base: Duration::from_millis(100),
        backoff_cap: Duration::from_secs(1),
        target_wait: None,
        tenant_inflight_cap: 1_000_000,
        keep_personal_data: None,
    };
    let provider = |url: &str| ProviderSettings {
        kind: ProviderKind::Http,
        url: Some(url.into()),
        timeout: Duration::from_secs(20),
        max_concurrency: 100_000,
        min_concurrency: 1,
        max_rate_per_second: None,
        authorization: None,
        allow_noop: false,
    };
    QueueSettings {
        workers_enabled: true,
        strategy,
        workers: opts.workers,
        reserved: opts.reserved,
        urgent_classes: vec!["otp".into()],
        groups: Vec::new(),
        poll_interval: Duration::from_millis(50),
        claim_batch: 1,
        catch_up_batches: 1,
        durable_claims: false,
        lease: Duration::from_secs(60),
        sweep_schedule: "*/5 * * * * *".into(),
        overload: cifpool::config::OverloadMode::Reject,
        max_batch: usize::MAX,
        batch_body_limit_bytes: usize::MAX,
        max_concurrent_batches: 4,
        batch_min_bytes_per_second: 0,
        batch_timeout: Duration::from_secs(600),
        retention: Duration::from_secs(86_400),
        dead_letter_retention: None,
        tenant_weights: Default::default(),
        classes: vec![class("otp", 0, "sms"), class("promo", 2, "push")],
        providers: [("sms".to_string(), provider(sms_url)), ("push".to_string(), provider(push_url))]
            .into_iter()
            .collect(),
    }
}

/// Runs one cell on `db` (whose queue tables it empties first).
pub async fn run_cell(
    db: &PgPool,
    opts: &LabOptions,
    strategy: Strategy,
    scenario: LabScenario,
    bar: &ProgressBar,
) -> anyhow::Result<LabCell> {
    sqlx::query("TRUNCATE notification_jobs, notification_tenant_clock, provider_shares, provider_budgets")
        .execute(db)
        .await
        .context("emptying the queue tables")?;
    let (push_latency, sms_latency) = opts.latencies(scenario);
    let (_sms, sms_url, sms_stop) = fake(sms_latency).await?;
    let (_push, push_url, push_stop) = fake(push_latency).await?;
    // Jobs sealed as the service seals them, under a key of the lab's own.
    static MASTER: std::sync::LazyLock<cifpool::keys::MasterKey> =
        std::sync::LazyLock::new(cifpool::keys::MasterKey::generate);
    let seal = cifpool::internals::seal::Seal::new(&MASTER, "lab", true);
    let rt = QueueRuntime::new(lab_queue(opts, strategy, &sms_url, &push_url), seal);

    // The promo backlog goes in through the service's own batch intake, as `POST
    // /v1/notifications/batch` would put it.
    let promo = serde_json::json!({
        "class": "promo",
        "tenant": "lab",
        "jobs": (0..opts.promo)
            .map(|i| serde_json::json!({ "recipient": format!("device-{i}"), "payload": { "campaign": "lab" } }))
            .collect::<Vec<_>>(),
    });
    let lab = Caller { name: "lab".into(), scopes: [Scope::NotifySend].into_iter().collect(), tenants: None };
    let bytes = bytes::Bytes::from(serde_json::to_vec(&promo)?);
    let body: batch::ByteStream = Box::pin(futures_util::stream::once(async move { Ok(bytes) }));
    batch::submit(db, &rt, &QueueStats::default(), &lab, body)
        .await
        .map_err(|e| anyhow::anyhow!("inserting the promo batch: {e}"))?;

    let stop = CancellationToken::new();
    let started = Instant::now();
    let t0: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(db).await?;
    let mut tasks = Supervisor::new(Default::default(), stop.clone());
    cifpool::internals::worker::start_all(&rt, db, Duration::ZERO, &mut tasks);

    // OTPs at a fixed rate, each at its scheduled instant (no drift from insert latency).
    let injector = {
        let (db, rt) = (db.clone(), rt.clone());
        let schedule = Schedule {
            rate: opts.otp_rate,
            origin: tokio::time::Instant::from_std(started) + Duration::from_secs_f64(opts.otp_start),
            calls: Some((opts.otp_rate * opts.otp_window).round() as u64),
        };
        tokio::spawn(fixed_rate(schedule, stop.clone(), Arc::default(), move |i| {
            let (db, rt) = (db.clone(), rt.clone());
            async move {
                let job = NewJob {
                    class: "otp".into(),
                    tenant: "lab".into(),
                    recipient: format!("+8490{i:07}"),
                    payload: intake::payload_of(&serde_json::json!({ "code": "000000" })),
                    idempotency_key: None,
                    run_at: None,
                };
                enqueue::enqueue_one(&db, &rt, &job, Duration::ZERO).await.map(|_| ()).map_err(|e| {
                    tracing::warn!(error = %e, "lab: OTP insert failed");
                    "insert".to_string()
                })
            }
        }))
    };
    while started.elapsed() < opts.run_time() {
        bar.set_position(started.elapsed().as_secs());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let t_end: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(db).await?;
    stop.cancel();
    injector.abort();
    // Sends still in flight (a hanging push) are abandoned: the run is over.
    tasks.drain(Duration::ZERO).await;
    sms_stop.cancel();
    push_stop.cancel();

    let rows: Vec<(f64, Option<f64>)> = sqlx::query_as(
        "SELECT extract(epoch FROM created_at - $1)::float8, \
                CASE WHEN picked_at <= $2 THEN extract(epoch FROM picked_at - created_at)::float8 END \
         FROM notification_jobs WHERE class = 'otp' ORDER BY id",
    )
    .bind(t0)
    .bind(t_end)
    .fetch_all(db)
    .await?;
    let promo_done: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM notification_jobs WHERE class = 'promo' AND status = 'sent' AND finished_at <= $1",
    )
    .bind(t_end)
    .fetch_one(db)
    .await?;
    bar.finish();
    Ok(LabCell {
        strategy,
        scenario,
        otps: rows.into_iter().map(|(created_s, wait_s)| LabOtp { created_s, wait_s }).collect(),
        promo_done: promo_done as u64,
    })
}

/// Runs every requested cell, one after another, with a progress bar each.
pub async fn run_all(
    db: &PgPool,
    opts: &LabOptions,
    strategies: &[Strategy],
    scenarios: &[LabScenario],
    progress: bool,
) -> anyhow::Result<Vec<LabCell>> {
    let mut cells = Vec::new();
    for &scenario in scenarios {
        for &strategy in strategies {
            let bar = if progress { ProgressBar::new(opts.run_time().as_secs()) } else { ProgressBar::hidden() };
            bar.set_style(
                ProgressStyle::with_template("{prefix:>28} [{bar:30}] {pos:>2}/{len}s").expect("static template"),
            );
            bar.set_prefix(format!("{} / {}", strategy.name(), scenario.name()));
            cells.push(run_cell(db, opts, strategy, scenario, &bar).await?);
        }
    }
    Ok(cells)
}

/// Writes `lab.csv` and `lab.md` into `dir`.
pub fn write_tables(dir: &Path, cells: &[LabCell]) -> anyhow::Result<(PathBuf, PathBuf)> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let csv = dir.join("lab.csv");
    let mut text = format!("{CSV_HEADER}\n");
    for c in cells {
        text.push_str(&c.csv_line());
        text.push('\n');
    }
    std::fs::write(&csv, text)?;
    let md = dir.join("lab.md");
    let mut table = String::from(
        "| strategy | scenario | OTP total | OTP served | p50 wait (s) | max wait (s) | promo done |\n|---|---|---:|---:|---:|---:|---:|\n",
    );
    for c in cells {
        let f = |v: Option<f64>| v.map(|x| format!("{x:.3}")).unwrap_or_else(|| "—".into());
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            c.strategy.name(),
            c.scenario.name(),
            c.otp_total(),
            c.waits().len(),
            f(c.p50_s()),
            f(c.max_s()),
            c.promo_done
        ));
    }
    std::fs::write(&md, table)?;
    Ok((csv, md))
}

/// Name of the lab's scratch database (dropped and recreated at every run).
pub const LAB_DATABASE: &str = "cifpool_lab";

/// Opens the configured server (embedded by default) and a freshly created, migrated scratch
/// database on it, so the lab never touches the service's own tables.
pub async fn open_lab_database(settings: &cifpool::config::Settings) -> anyhow::Result<(Database, PgPool)> {
    let database = Database::open(settings).await?;
    let connect = database.recreate_scratch(LAB_DATABASE).await?;
    let db = sqlx::postgres::PgPoolOptions::new().max_connections(40).connect_with(connect).await?;
    Ok((database, db))
}
