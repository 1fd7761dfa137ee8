//! `cifpool-tools bench queue`: the notification queue's intake and drain, end to end through the real
//! service (HTTP intake, the configured worker groups, claim SQL, fenced finishes) with no-op providers.
//!
//! Method, three phases on the scratch database, each starting from empty tables:
//! - **enqueue**: one `POST /v1/notifications/batch` of N promo jobs (spread over T tenants) to a
//!   service whose workers are off; the time from sending the body (prebuilt, ~32 bytes a job) to the
//!   `202`, so parsing, validation, fair keys and the inserts all count.
//! - **drain**: N jobs are enqueued the same way, the table is `VACUUM ANALYZE`d and a `CHECKPOINT`
//!   taken (before every phase: so a WAL-triggered one rarely lands inside it), then a second service
//!   instance with workers on is started; jobs/s = N / (last `finished_at` − the moment before that
//!   instance was built). Every job must end `sent` with exactly one result row and one attempt, or the
//!   run says so: the figure is only worth anything with leases, fencing and deadlines intact.
//! - **otp during promo**: a promo batch is enqueued, the worker instance starts under `floor-borrow`
//!   and, while the promo backlog drains, OTPs arrive one `POST /v1/notifications` at a time at a fixed
//!   rate (open loop). The OTP wait is `picked_at − created_at` (queue time) and `sent_at −
//!   created_at` (to the provider's acceptance), from the database's own clock.
//!
//! Every provider is replaced by the no-op provider whatever the configuration says (a benchmark must
//! never send to a real gateway), with its concurrency limit raised to the worker count (a no-op
//! provider has no capacity limit to respect).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

use super::cpu::{CpuSplit, CpuWatch};
use super::report::{BenchReport, Latency, Machine, ms, table as text_table, thousands};
use super::{BenchArgs, db_now, use_noop_providers};
use crate::load::{Schedule, Tally, fixed_rate, post_json};
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
            progress: !args.no_progress,
        }
    }
}

/// The bulk-enqueue phase.
#[derive(Debug, Clone, Serialize)]
pub struct EnqueueResult {
    /// Jobs in the one batch request.
    pub jobs: u64,
    /// Jobs the service reported accepted.
    pub accepted: u64,
    /// Request body size.
    pub body_bytes: usize,
    /// From sending the request to the response.
    pub seconds: f64,
    /// `accepted / seconds`.
    pub jobs_per_s: f64,
    /// Jobs `POST /v1/notifications/batches/{id}/cancel` then canceled (all of them: no worker runs).
    pub canceled: u64,
    /// From sending the cancel to its answer.
    pub cancel_seconds: f64,
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
}

/// The OTP-during-promo phase.
#[derive(Debug, Clone, Serialize)]
pub struct OtpResult {
    /// Promo backlog at the start.
    pub promo_jobs: u64,
    /// Promo jobs sent by the end.
    pub promo_sent: u64,
    /// From just before the worker instance was built to the last promo `finished_at`.
    pub promo_seconds: f64,
    /// OTPs requested per second.
    pub otp_rate: f64,
    /// OTPs accepted (HTTP 202).
    pub otp_enqueued: u64,
    /// OTPs sent.
    pub otp_sent: u64,
    /// OTPs that expired unsent (deadline 15 s).
    pub otp_expired: u64,
    /// Non-202 responses to OTP requests, by status.
    pub otp_errors: BTreeMap<String, u64>,
    /// Enqueue → claimed.
    pub otp_wait: Option<Latency>,
    /// Enqueue → accepted by the provider.
    pub otp_to_sent: Option<Latency>,
}

/// Everything `bench queue` measured.
#[derive(Debug, Clone, Serialize)]
pub struct QueueResults {
    /// Bulk enqueue.
    pub enqueue: EnqueueResult,
    /// Drain.
    pub drain: DrainResult,
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
        anyhow::Ok(QueueResults { enqueue, drain, otp_during_promo: otp })
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
        "client": "reqwest in the same process as both service instances",
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

/// A batch request body: `n` jobs of `class`, tenants `t000…` round robin.
pub fn batch_body(class: &str, n: u64, tenants: usize, tag: &str) -> Vec<u8> {
    let mut s = String::with_capacity(n as usize * 80 + 64);
    write!(s, r#"{{"class":"{class}","jobs":["#).expect("write to a String");
    for i in 0..n {
        if i > 0 {
            s.push(',');
        }
        write!(
            s,
            r#"{{"tenant":"t{:03}","recipient":"device-{tag}-{i}","payload":{{"title":"Sale","n":{i}}}}}"#,
            i % tenants as u64
        )
        .expect("write to a String");
    }
    s.push_str("]}");
    s.into_bytes()
}

/// Posts one batch; returns (elapsed, accepted).
/// Posts a batch; returns the time to the answer, the jobs accepted and the batch id.
async fn post_batch(client: &reqwest::Client, base: &str, body: Vec<u8>) -> anyhow::Result<(Duration, u64, i64)> {
    let started = Instant::now();
    let resp = client
        .post(format!("{base}/v1/notifications/batch"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .context("posting the batch")?;
    let status = resp.status();
    let text = resp.text().await?;
    let elapsed = started.elapsed();
    anyhow::ensure!(status.as_u16() == 202, "batch refused: {status} {text}");
    let body: serde_json::Value = serde_json::from_str(&text)?;
    Ok((elapsed, body["accepted"].as_u64().unwrap_or(0), body["batch_id"].as_i64().unwrap_or(0)))
}

/// Cancels batch `id`; returns the time to the answer and the jobs canceled.
async fn cancel_batch(client: &reqwest::Client, base: &str, id: i64) -> anyhow::Result<(Duration, u64)> {
    let started = Instant::now();
    let resp = client
        .post(format!("{base}/v1/notifications/batches/{id}/cancel"))
        .send()
        .await
        .context("canceling the batch")?;
    let status = resp.status();
    let text = resp.text().await?;
    let elapsed = started.elapsed();
    anyhow::ensure!(status.as_u16() == 200, "batch cancel refused: {status} {text}");
    let body: serde_json::Value = serde_json::from_str(&text)?;
    Ok((elapsed, body["canceled"].as_u64().unwrap_or(0)))
}

async fn enqueue_phase(
    client: &reqwest::Client,
    base: &str,
    db: &PgPool,
    opts: &QueueBenchOptions,
) -> anyhow::Result<EnqueueResult> {
    let body = batch_body("promo", opts.enqueue_jobs, opts.tenants, "e");
    super::checkpoint(db).await;
    let body_bytes = body.len();
    let bar = super::bar(opts.progress, "enqueue (one batch)", 1, "request");
    let (elapsed, accepted, batch_id) = post_batch(client, base, body).await?;
    bar.inc(1);
    bar.finish();
    super::checkpoint(db).await;
    let (cancel_elapsed, canceled) = cancel_batch(client, base, batch_id).await?;
    Ok(EnqueueResult {
        jobs: opts.enqueue_jobs,
        accepted,
        body_bytes,
        seconds: elapsed.as_secs_f64(),
        jobs_per_s: accepted as f64 / elapsed.as_secs_f64(),
        canceled,
        cancel_seconds: cancel_elapsed.as_secs_f64(),
    })
}

/// Jobs not finished yet (waiting or being sent).
async fn unfinished(db: &PgPool, class: &str) -> anyhow::Result<u64> {
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
async fn fill(client: &reqwest::Client, base: &str, db: &PgPool, n: u64, tenants: usize) -> anyhow::Result<()> {
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
    let workers = super::start_service(connect, settings.clone()).await?;
    let peak = watch(db, "promo", n, &bar, Duration::from_secs(60).max(Duration::from_millis(n))).await;
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
    })
}

/// Polls until no `class` job is unfinished (or `cap` passes), advancing `bar`; returns the peak
/// one-second rate seen. The poll counts result rows (a narrow table, ~10 ms per 100,000) twice a
/// second and only checks `class` precisely once that count has reached `total`: the precise count
/// reads the jobs table itself, and polling it often would steal measurable CPU from the drain.
async fn watch(
    db: &PgPool,
    class: &str,
    total: u64,
    bar: &indicatif::ProgressBar,
    cap: Duration,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut history: Vec<(Instant, u64)> = Vec::new();
    let mut peak = 0.0f64;
    loop {
        let results: i64 = sqlx::query_scalar("SELECT count(*) FROM notification_results").fetch_one(db).await?;
        let done = results as u64;
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

async fn otp_phase(
    client: &reqwest::Client,
    base: &str,
    db: &PgPool,
    connect: &PgConnectOptions,
    settings: &Settings,
    opts: &QueueBenchOptions,
) -> anyhow::Result<OtpResult> {
    let n = opts.promo_jobs;
    fill(client, base, db, n, opts.tenants).await?;
    let bar = super::bar(opts.progress, "promo drain + OTPs", n, "jobs");
    let started = Instant::now();
    let start = db_now(db).await?;
    let workers = super::start_service(connect, settings.clone()).await?;
    let stop_otp = CancellationToken::new();
    let otps = tokio::spawn(otp_load(client.clone(), base.to_string(), opts.otp_rate, stop_otp.clone()));
    // At least 10 s of OTPs even if promo drains sooner, so the percentiles rest on ~100 samples.
    let drained = watch(db, "promo", n, &bar, Duration::from_secs(600).max(Duration::from_millis(n))).await;
    let min_end = started + Duration::from_secs(10);
    tokio::time::sleep_until(min_end.into()).await;
    stop_otp.cancel();
    let otp_tally = otps.await.context("OTP load task")?;
    let (otp_enqueued, otp_errors) = (otp_tally.ok(), otp_tally.errors);
    // The last OTPs need a moment to be sent.
    let finish_by = Instant::now() + Duration::from_secs(20);
    while unfinished(db, "otp").await? > 0 && Instant::now() < finish_by {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    super::stop_service(workers).await;
    bar.finish();
    drained?;
    let (promo_sent, promo_last): (i64, Option<chrono::DateTime<chrono::Utc>>) = sqlx::query_as(
        "SELECT count(*), max(finished_at) FROM notification_jobs WHERE class = 'promo' AND status = 'sent'",
    )
    .fetch_one(db)
    .await?;
    let promo_seconds = promo_last.map_or(f64::NAN, |l| (l - start).as_seconds_f64());
    let rows: Vec<(String, Option<i64>, Option<i64>)> = sqlx::query_as(
        "SELECT j.status, \
                (extract(epoch FROM j.picked_at - j.created_at) * 1e6)::int8, \
                (extract(epoch FROM r.sent_at - j.created_at) * 1e6)::int8 \
         FROM notification_jobs j LEFT JOIN notification_results r ON r.job_id = j.id \
         WHERE j.class = 'otp'",
    )
    .fetch_all(db)
    .await?;
    let micros = |v: Option<i64>| v.map(|x| x.max(0) as u64);
    Ok(OtpResult {
        promo_jobs: n,
        promo_sent: promo_sent as u64,
        promo_seconds,
        otp_rate: opts.otp_rate,
        otp_enqueued,
        otp_sent: rows.iter().filter(|r| r.0 == "sent").count() as u64,
        otp_expired: rows.iter().filter(|r| r.0 == "expired").count() as u64,
        otp_errors,
        otp_wait: Latency::from_micros(rows.iter().filter_map(|r| micros(r.1)).collect()),
        otp_to_sent: Latency::from_micros(rows.iter().filter_map(|r| micros(r.2)).collect()),
    })
}

/// Posts one OTP every `1/rate` s (open loop: a slow answer does not delay the next) until `stop`;
/// a success is a 202.
async fn otp_load(client: reqwest::Client, base: String, rate: f64, stop: CancellationToken) -> Tally {
    let url = format!("{base}/v1/notifications");
    let schedule = Schedule { rate: rate.max(0.01), origin: tokio::time::Instant::now(), calls: None };
    fixed_rate(schedule, stop, Arc::default(), |i| {
        let body = format!(
            r#"{{"class":"otp","tenant":"bank","recipient":"+8490{i:07}","payload":{{"code":"{:06}"}}}}"#,
            i % 1_000_000
        );
        let (client, url) = (client.clone(), url.clone());
        async move { post_json(&client, &url, body, 202, "").await }
    })
    .await
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
    for note in &report.notes {
        out.push_str(&format!("\nnote: {note}"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_body_is_valid_json_with_round_robin_tenants() {
        let body = batch_body("promo", 5, 2, "x");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["class"], "promo");
        let jobs = v["jobs"].as_array().unwrap();
        assert_eq!(jobs.len(), 5);
        assert_eq!(jobs[0]["tenant"], "t000");
        assert_eq!(jobs[3]["tenant"], "t001");
        assert_eq!(jobs[4]["recipient"], "device-x-4");
    }
}
