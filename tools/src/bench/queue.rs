//! `cifpool-tools bench queue`: the notification queue's intake and drain, end to end through the real
//! service (HTTP intake, the configured worker groups, claim SQL, fenced finishes) with no-op providers,
//! and the same drain by a peer, Graphile Worker.
//!
//! Method, on the scratch database, each phase starting from empty tables:
//! - **enqueue** ([`super::enqueue`]): one `POST /v1/notifications/batch` of N promo jobs to a service
//!   whose workers are off, timed to the `202`, and its cancel.
//! - **peer drain** ([`super::graphile`]): Graphile Worker drains the same number of no-op jobs as the
//!   drain below, batched, on a database of its own on the same server, just before ours (skipped
//!   with the reason when node or npm is missing, the install fails or `--no-peer`).
//! - **drain**: N jobs are enqueued the same way, the table is `VACUUM ANALYZE`d and a `CHECKPOINT`
//!   taken (before every phase: so a WAL-triggered one rarely lands inside it), then a second service
//!   instance with workers on is started; jobs/s = N / (last `finished_at` − the moment before that
//!   instance was built). Every job must end `sent` with exactly one result row and one attempt, or the
//!   run says so: the figure is only worth anything with leases, fencing and deadlines intact.
//! - **otp during promo** ([`super::otp`]): OTPs arrive at a fixed rate while a promo backlog drains.
//!
//! Every provider is replaced by the no-op provider whatever the configuration says (a benchmark must
//! never send to a real gateway), with its concurrency limit raised to the worker count (a no-op
//! provider has no capacity limit to respect).

use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::claims::{GroupClaims, claim_totals, claims_between};
use super::cpu::{CpuSplit, CpuWatch};
use super::enqueue::{EnqueueResult, batch_body, enqueue_phase, post_batch};
use super::graphile::{PeerDrain, PeerOptions, PeerOutcome};
use super::otp::{OtpResult, otp_phase};
use super::report::{BenchReport, Latency, Machine, ms, table as text_table, thousands};
use super::{BenchArgs, db_now, use_noop_providers};
use cifpool::config::Settings;
use cifpool::queue::policy::Strategy;

/// Parameters of a `queue` run.
#[derive(Debug, Clone, Serialize)]
pub struct QueueBenchOptions {
    /// Jobs in the bulk-enqueue phase.
    pub enqueue_jobs: u64,
    /// Jobs drained in the drain phase.
    pub drain_jobs: u64,
    /// Promo backlog in the OTP phase.
    pub promo_jobs: u64,
    /// OTPs per second during the promo drain.
    pub otp_rate: f64,
    /// Tenants the promo jobs are spread over (round robin).
    pub tenants: usize,
    /// Run the Graphile Worker peer before the drain.
    pub peer: bool,
    /// Where the peer is installed.
    #[serde(skip)]
    pub peer_dir: std::path::PathBuf,
    /// Draw progress bars.
    #[serde(skip)]
    pub progress: bool,
}

impl QueueBenchOptions {
    /// From the command line.
    pub fn from_args(args: &BenchArgs) -> QueueBenchOptions {
        QueueBenchOptions {
            enqueue_jobs: args.enqueue_jobs,
            drain_jobs: args.jobs,
            promo_jobs: args.promo_jobs,
            otp_rate: args.otp_rate,
            tenants: args.tenants.max(1),
            peer: !args.no_peer,
            peer_dir: super::graphile::default_dir(),
            progress: !args.no_progress,
        }
    }
}

/// The drain phase.
#[derive(Debug, Clone, Serialize)]
pub struct DrainResult {
    /// Jobs waiting when the workers started.
    pub jobs: u64,
    /// Jobs that ended `sent`.
    pub sent: u64,
    /// Result rows (exactly one per sent job, or the run is invalid).
    pub result_rows: u64,
    /// Attempts over all jobs (= jobs when nothing was retried or lost a lease).
    pub attempts: u64,
    /// From just before the worker instance was built to the last `finished_at`.
    pub seconds: f64,
    /// `sent / seconds`.
    pub jobs_per_s: f64,
    /// Peak jobs/s over a one-second window (sampled every 250 ms).
    pub peak_jobs_per_s: f64,
    /// Worker strategy and sizes of the instance that drained.
    pub workers: String,
    /// Jobs finished in each second from the start (shows stalls and warm-up).
    pub per_second: Vec<u64>,
    /// Where the CPU went during the drain (cifpool = the worker instance; the intake instance idles).
    pub cpu: Option<CpuSplit>,
    /// Each worker group's claim statements during the drain.
    pub claims: Vec<GroupClaims>,
}

/// Everything `bench queue` measured.
#[derive(Debug, Clone, Serialize)]
pub struct QueueResults {
    /// Bulk enqueue.
    pub enqueue: EnqueueResult,
    /// Drain.
    pub drain: DrainResult,
    /// The same drain by Graphile Worker, run just before ours.
    pub drain_peer: PeerDrain,
    /// Our drain rate / the peer's, when it ran.
    pub cifpool_over_peer: Option<f64>,
    /// Postgres CPU per job of our drain, microseconds (Postgres's cores during the drain / its rate).
    pub postgres_us_per_job: Option<f64>,
    /// The same for the peer's drain, when it ran.
    pub peer_postgres_us_per_job: Option<f64>,
    /// OTP latency while promo drains.
    pub otp_during_promo: OtpResult,
}

/// Runs the three phases on the scratch database behind `connect`.
pub async fn run(
    connect: &PgConnectOptions,
    settings: &Settings,
    opts: &QueueBenchOptions,
) -> anyhow::Result<BenchReport<QueueResults>> {
    let harness = PgPoolOptions::new().max_connections(2).connect_with(connect.clone()).await?;
    let machine = Machine::probe(&harness).await?;
    let mut notes = Vec::new();

    let mut base = settings.clone();
    base.pools = Vec::new();
    use_noop_providers(&mut base);
    // Whole batches in one request, whatever the configured ceiling.
    base.queue.max_batch =
        base.queue.max_batch.max(opts.enqueue_jobs.max(opts.drain_jobs).max(opts.promo_jobs) as usize);
    let mut intake_settings = base.clone();
    intake_settings.queue.workers_enabled = false;
    let mut worker_settings = base.clone();
    worker_settings.queue.workers_enabled = true;
    let mut otp_settings = worker_settings.clone();
    otp_settings.queue.strategy = Strategy::FloorBorrow;
    otp_settings.queue.groups.clear();

    let intake = super::start_service(connect, intake_settings).await?;
    let client = super::client(connect, Duration::from_secs(600)).await?;
    let result = async {
        clear(&harness).await?;
        let enqueue = enqueue_phase(&client, &intake.base_url, &harness, opts).await?;
        if enqueue.accepted != opts.enqueue_jobs {
            notes.push(format!("enqueue: {} of {} jobs accepted", enqueue.accepted, opts.enqueue_jobs));
        }

        let bar = super::bar(opts.progress, "graphile-worker drain", 1, "run");
        let peer_opts =
            PeerOptions { enabled: opts.peer, dir: opts.peer_dir.clone(), timeout: drain_cap(opts.drain_jobs) };
        let drain_peer = super::graphile::run(connect, &harness, opts.drain_jobs, &peer_opts).await;
        bar.inc(1);
        bar.finish();
        match &drain_peer.outcome {
            PeerOutcome::Ran(run) => notes.extend(super::graphile::engine_note(run)),
            PeerOutcome::Skipped { reason } => notes.push(format!("peer drain skipped: {reason}")),
            PeerOutcome::Failed { reason } => notes.push(format!("peer drain failed: {reason}")),
        }

        clear(&harness).await?;
        let drain = drain_phase(&client, &intake.base_url, &harness, connect, &worker_settings, opts).await?;
        if drain.sent != drain.jobs || drain.result_rows != drain.sent || drain.attempts != drain.jobs {
            notes.push(format!(
                "drain: {} jobs, {} sent, {} result rows, {} attempts: not a clean drain",
                drain.jobs, drain.sent, drain.result_rows, drain.attempts
            ));
        }

        clear(&harness).await?;
        let otp = otp_phase(&client, &intake.base_url, &harness, connect, &otp_settings, opts).await?;
        if otp.otp_sent + otp.otp_expired < otp.otp_enqueued {
            notes.push(format!(
                "otp: {} enqueued but only {} finished",
                otp.otp_enqueued,
                otp.otp_sent + otp.otp_expired
            ));
        }
        if otp.promo_sent < otp.promo_jobs {
            notes.push(format!("otp: the promo backlog was not drained ({} of {})", otp.promo_sent, otp.promo_jobs));
        }
        let cifpool_over_peer = drain_peer.jobs_per_s().map(|peer| drain.jobs_per_s / peer);
        let postgres_us_per_job = drain.cpu.and_then(|c| super::cpu::micros_each(c.postgres_cores, drain.jobs_per_s));
        let peer_postgres_us_per_job = match &drain_peer.outcome {
            PeerOutcome::Ran(run) => run.cpu.and_then(|c| super::cpu::micros_each(c.postgres_cores, run.jobs_per_s)),
            _ => None,
        };
        anyhow::Ok(QueueResults {
            enqueue,
            drain,
            drain_peer,
            cifpool_over_peer,
            postgres_us_per_job,
            peer_postgres_us_per_job,
            otp_during_promo: otp,
        })
    }
    .await;
    super::stop_service(intake).await;
    harness.close().await;
    let results = result?;
    notes.push("providers are the no-op provider (sent = accepted by the provider, nothing leaves the machine)".into());
    let q = &worker_settings.queue;
    let parameters = serde_json::json!({
        "enqueue_jobs": opts.enqueue_jobs,
        "drain_jobs": opts.drain_jobs,
        "promo_jobs": opts.promo_jobs,
        "otp_rate": opts.otp_rate,
        "tenants": opts.tenants,
        "strategy": q.strategy,
        "workers": q.workers,
        "reserved": q.reserved,
        "claim_batch": q.claim_batch,
        "database_max_connections": settings.database.max_connections,
        "personal_data": if settings.security.seal_personal_data {
            "sealed at intake (XChaCha20-Poly1305), opened after the claim"
        } else {
            "stored in clear (security.seal_personal_data = false)"
        },
        "client": "reqwest in the same process as both service instances",
        "peer": if opts.peer { super::graphile::settings() } else { "off (--no-peer)".into() },
        "peer_order": "the peer drains on its own database just before cifpool's drain phase",
    });
    Ok(BenchReport { target: "queue".into(), parameters, machine, results, notes })
}

/// Empties the queue tables.
async fn clear(db: &PgPool) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE notification_jobs, notification_tenant_clock")
        .execute(db)
        .await
        .context("emptying the queue tables")?;
    Ok(())
}

/// Jobs not finished yet (waiting or being sent).
pub(crate) async fn unfinished(db: &PgPool, class: &str) -> anyhow::Result<u64> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM notification_jobs \
         WHERE class = $1 AND status IN ('scheduled', 'pending', 'failed-retrying', 'sending')",
    )
    .bind(class)
    .fetch_one(db)
    .await?;
    Ok(n as u64)
}

/// Enqueues `n` promo jobs (workers off) and prepares the table as a long-lived queue would be.
pub(crate) async fn fill(
    client: &reqwest::Client,
    base: &str,
    db: &PgPool,
    n: u64,
    tenants: usize,
) -> anyhow::Result<()> {
    let (_, accepted, _) = post_batch(client, base, batch_body("promo", n, tenants, "d")).await?;
    anyhow::ensure!(accepted == n, "only {accepted} of {n} jobs accepted");
    sqlx::query("VACUUM ANALYZE notification_jobs").execute(db).await?;
    super::checkpoint(db).await;
    Ok(())
}

async fn drain_phase(
    client: &reqwest::Client,
    base: &str,
    db: &PgPool,
    connect: &PgConnectOptions,
    settings: &Settings,
    opts: &QueueBenchOptions,
) -> anyhow::Result<DrainResult> {
    let n = opts.drain_jobs;
    fill(client, base, db, n, opts.tenants).await?;
    let bar = super::bar(opts.progress, "drain", n, "jobs");
    let start = db_now(db).await?;
    let cpu_watch = CpuWatch::start();
    let claims_before = (claim_totals(), Instant::now());
    let workers = super::start_service(connect, settings.clone()).await?;
    let peak = watch(db, "promo", n, &bar, drain_cap(n)).await;
    let claims = claims_between(&claims_before.0, &claim_totals(), claims_before.1.elapsed());
    let cpu = cpu_watch.finish().await;
    super::stop_service(workers).await;
    bar.finish();
    let peak = peak?;
    let (sent, result_rows, attempts, last): (i64, i64, i64, Option<chrono::DateTime<chrono::Utc>>) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'sent'), \
                (SELECT count(*) FROM notification_results), \
                coalesce(sum(attempts), 0)::int8, max(finished_at) \
         FROM notification_jobs",
    )
    .fetch_one(db)
    .await?;
    let seconds = last.map_or(f64::NAN, |l| (l - start).as_seconds_f64());
    let buckets: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT floor(extract(epoch FROM finished_at - $1))::int4 AS s, count(*) FROM notification_jobs \
         WHERE finished_at IS NOT NULL GROUP BY s ORDER BY s",
    )
    .bind(start)
    .fetch_all(db)
    .await?;
    let mut per_second = vec![0u64; buckets.last().map_or(0, |b| b.0.max(0) as usize + 1)];
    for (s, n) in buckets {
        per_second[s.max(0) as usize] += n as u64;
    }
    let q = &settings.queue;
    Ok(DrainResult {
        jobs: n,
        sent: sent as u64,
        result_rows: result_rows as u64,
        attempts: attempts as u64,
        seconds,
        jobs_per_s: sent as f64 / seconds,
        peak_jobs_per_s: peak,
        workers: format!(
            "{:?}, {} workers ({} reserved), claim batch {}",
            q.strategy, q.workers, q.reserved, q.claim_batch
        ),
        per_second,
        cpu,
        claims,
    })
}

/// Longest a drain of `n` jobs may take (ours and the peer's): a minute, or 1 ms a job.
fn drain_cap(n: u64) -> Duration {
    Duration::from_secs(60).max(Duration::from_millis(n))
}

/// Polls until no `class` job is unfinished (or `cap` passes), advancing `bar`; returns the peak
/// one-second rate seen.
///
/// Progress is the `cifpool_queue_sent_total` counter of this process's metrics recorder, which the
/// in-process services share: reading it costs the database nothing, as the peer's driver counts its
/// runs in its own process. (Counting result rows twice a second read the whole jobs table each time,
/// ~86 ms at 200,000 jobs: 2.2 s of the ~15 s of Postgres CPU of the drain it measured.) Once
/// the counter reaches `total`, the jobs table itself is checked for anything left unfinished.
pub(crate) async fn watch(
    db: &PgPool,
    class: &str,
    total: u64,
    bar: &indicatif::ProgressBar,
    cap: Duration,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let baseline = sent_counter(class);
    let mut history: Vec<(Instant, u64)> = Vec::new();
    let mut peak = 0.0f64;
    loop {
        let done = sent_counter(class).saturating_sub(baseline);
        let now = Instant::now();
        bar.set_position(done.min(total));
        history.push((now, done));
        if let Some(&(t, d)) = history.iter().rev().find(|(t, _)| now.duration_since(*t) >= Duration::from_secs(1)) {
            peak = peak.max(done.saturating_sub(d) as f64 / now.duration_since(t).as_secs_f64());
        }
        if done >= total && unfinished(db, class).await? == 0 {
            return Ok(peak);
        }
        anyhow::ensure!(started.elapsed() < cap, "{class}: jobs still unfinished after {cap:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Jobs of `class` the services of this process have marked sent so far (the process-wide
/// `cifpool_queue_sent_total{class}`; 0 before the first).
fn sent_counter(class: &str) -> u64 {
    let rendered = cifpool::telemetry::metrics_handle().render();
    let series = format!("cifpool_queue_sent_total{{class=\"{class}\"}} ");
    rendered
        .lines()
        .find_map(|line| line.strip_prefix(&series))
        .and_then(|value| value.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// The summary table of a report.
pub fn table(report: &BenchReport<QueueResults>) -> String {
    let r = &report.results;
    let lat =
        |l: &Option<Latency>| l.as_ref().map_or(("-".to_string(), "-".to_string()), |l| (ms(l.p50_ms), ms(l.p99_ms)));
    let (wait50, wait99) = lat(&r.otp_during_promo.otp_wait);
    let (sent50, sent99) = lat(&r.otp_during_promo.otp_to_sent);
    let rows = vec![
        vec![
            "bulk enqueue (one HTTP batch)".into(),
            thousands(r.enqueue.accepted as f64),
            format!("{:.2}", r.enqueue.seconds),
            thousands(r.enqueue.jobs_per_s),
            "≤ 4 s for 500,000".into(),
        ],
        vec![
            "cancel that batch".into(),
            thousands(r.enqueue.canceled as f64),
            format!("{:.2}", r.enqueue.cancel_seconds),
            thousands(r.enqueue.canceled as f64 / r.enqueue.cancel_seconds),
            "≤ 10 s for 500,000".into(),
        ],
        vec![
            "drain, no-op provider".into(),
            thousands(r.drain.sent as f64),
            format!("{:.2}", r.drain.seconds),
            thousands(r.drain.jobs_per_s),
            "≥ 35,000 jobs/s".into(),
        ],
        peer_row(&r.drain_peer),
        vec![
            "promo drain with OTPs arriving".into(),
            thousands(r.otp_during_promo.promo_sent as f64),
            format!("{:.2}", r.otp_during_promo.promo_seconds),
            thousands(r.otp_during_promo.promo_sent as f64 / r.otp_during_promo.promo_seconds),
            String::new(),
        ],
    ];
    let mut out = String::from("queue: intake and drain through the service, no-op providers\n");
    out.push_str(&text_table(&["phase", "jobs", "seconds", "jobs/s", "goal"], &rows));
    let o = &r.otp_during_promo;
    out.push_str(&format!(
        "\nOTP at {}/s during the promo drain: {} sent, {} expired; wait p50 {wait50} ms, p99 {wait99} ms \
         (goal ≤ 1,000 ms); to sent p50 {sent50} ms, p99 {sent99} ms",
        o.otp_rate, o.otp_sent, o.otp_expired
    ));
    out.push_str(&format!(
        "\ndrain workers: {}; peak {}/s; CPU during the drain: {}",
        r.drain.workers,
        thousands(r.drain.peak_jobs_per_s),
        r.drain.cpu.map_or("-".into(), |c| format!(
            "cifpool {:.2} cores, postgres {:.2} cores of {}",
            c.cifpool_cores, c.postgres_cores, c.cores
        )),
    ));
    for c in &r.drain.claims {
        out.push_str(&format!(
            "\nclaims of group {} during the drain: {} statements, {:.1} ms and {:.0} jobs each; its claim loops \
             were inside a claim {:.0} % of the time; {} claims started at the group's floors",
            c.group,
            thousands(c.statements as f64),
            c.mean_ms,
            c.jobs_per_statement,
            c.loops_busy * 100.0,
            thousands(c.from_floors as f64)
        ));
    }
    out.push_str(&format!(
        "\ncifpool / graphile-worker drain: {} ({})",
        r.cifpool_over_peer.map_or("-".into(), |x| format!("{x:.2}")),
        r.drain_peer.settings
    ));
    if let PeerOutcome::Ran(run) = &r.drain_peer.outcome
        && let Some(c) = run.cpu
    {
        out.push_str(&format!(
            "; CPU during its drain: node {:.2} cores, postgres {:.2} cores",
            c.child_cores, c.postgres_cores
        ));
    }
    if let Some(ours) = r.postgres_us_per_job {
        out.push_str(&format!("\nPostgres CPU per drained job: cifpool {ours:.1} µs"));
        if let Some(peer) = r.peer_postgres_us_per_job {
            out.push_str(&format!(", {} {peer:.1} µs ({:.2}×, goal ≤ 1.0)", r.drain_peer.peer, ours / peer));
        }
    }
    for note in &report.notes {
        out.push_str(&format!("\nnote: {note}"));
    }
    out
}

/// The peer's row of the table: its figures, or why there are none.
fn peer_row(peer: &PeerDrain) -> Vec<String> {
    let label = format!("drain, {} (peer)", peer.peer);
    match &peer.outcome {
        PeerOutcome::Ran(run) => vec![
            label,
            thousands(run.jobs as f64),
            format!("{:.2}", run.seconds),
            thousands(run.jobs_per_s),
            String::new(),
        ],
        PeerOutcome::Skipped { .. } => vec![label, "-".into(), "-".into(), "-".into(), "skipped (see note)".into()],
        PeerOutcome::Failed { .. } => vec![label, "-".into(), "-".into(), "-".into(), "failed (see note)".into()],
    }
}
