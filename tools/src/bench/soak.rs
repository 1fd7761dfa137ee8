//! `cifpool-tools bench soak`: a long mixed run, to show what time does to throughput (bloat, vacuum,
//! growing history tables) rather than what a fresh table can do.
//!
//! Method: one service instance on the scratch database, everything on as in production (worker
//! groups, the pool's own refill and reclaim schedules, the queue sweep, the stats loop, autovacuum),
//! no-op providers. For the whole run, at once:
//! - **reservations**: `clients` closed-loop clients each `POST /v1/cif` then confirm that code, so
//!   `cif_codes` churns and `cif_issued` grows; the pool is refilled by the service itself (watermark
//!   50,000, batches of 10,000, checked every 5 s and after claims);
//! - **queue**: promo batches of 500 jobs over 100 tenants at a fixed rate (`queue_rate` jobs/s) plus
//!   10 OTP/s, drained by the worker groups.
//!
//! Reported per minute: confirmed reservations/s, queue jobs sent/s and the OTP wait p99; the headline
//! is the last full minute against the first. Table and index sizes (and dead tuples) are taken at the
//! start and the end.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

use super::enqueue::batch_body;
use super::report::{BenchReport, Latency, Machine, ms, table as text_table, thousands};
use super::{BenchArgs, bench_pool, db_now, use_noop_providers};
use crate::load::{Schedule, Tally, fixed_rate, post_json};
use cifpool::config::Settings;

/// Name of the soak's pool.
pub const POOL: &str = "soak";
/// Jobs per promo batch.
const BATCH: u64 = 500;
/// OTPs per second.
const OTP_RATE: f64 = 10.0;

/// Parameters of a `soak` run.
#[derive(Debug, Clone, Serialize)]
pub struct SoakOptions {
    /// Length of the run.
    pub minutes: f64,
    /// Closed-loop reservation clients.
    pub clients: usize,
    /// Promo jobs per second offered to the queue.
    pub queue_rate: f64,
    /// Draw progress bars.
    #[serde(skip)]
    pub progress: bool,
}

impl SoakOptions {
    /// From the command line.
    pub fn from_args(args: &BenchArgs) -> SoakOptions {
        SoakOptions {
            minutes: args.minutes,
            clients: args.concurrency.first().copied().unwrap_or(16),
            queue_rate: args.queue_rate,
            progress: !args.no_progress,
        }
    }
}

/// One minute of the run.
#[derive(Debug, Clone, Serialize)]
pub struct Minute {
    /// 0-based minute.
    pub minute: usize,
    /// Reservations confirmed per second.
    pub confirmed_per_s: f64,
    /// Queue jobs sent per second.
    pub sent_per_s: f64,
    /// OTP enqueue → claim.
    pub otp_wait: Option<Latency>,
}

/// Size of one table at a point in time.
#[derive(Debug, Clone, Serialize)]
pub struct TableSize {
    /// Table.
    pub table: String,
    /// Live rows (statistics estimate).
    pub live_rows: i64,
    /// Dead rows waiting for vacuum (statistics estimate).
    pub dead_rows: i64,
    /// Heap bytes.
    pub heap_bytes: i64,
    /// Bytes of all its indexes.
    pub index_bytes: i64,
    /// Autovacuum runs so far.
    pub autovacuum_count: i64,
}

/// Everything `bench soak` measured.
#[derive(Debug, Clone, Serialize)]
pub struct SoakResults {
    /// Seconds actually run.
    pub seconds: f64,
    /// Per-minute figures (full minutes only).
    pub minutes: Vec<Minute>,
    /// Last full minute / first, confirmed reservations.
    pub reservations_last_over_first: Option<f64>,
    /// Last full minute / first, queue jobs sent.
    pub queue_last_over_first: Option<f64>,
    /// Requests that did not succeed, by status.
    pub errors: BTreeMap<String, u64>,
    /// Table sizes at the start.
    pub tables_start: Vec<TableSize>,
    /// Table sizes at the end.
    pub tables_end: Vec<TableSize>,
}

/// One service instance with everything on as in production (worker groups, the [`POOL`] pool's refill
/// every 5 s above a watermark of 50,000, reclaim, sweeps, statistics), no-op providers; returns once the
/// first refill has filled the pool (or after 60 s), so the clock starts on a full pool.
pub(super) async fn start_as_in_production(
    connect: &PgConnectOptions,
    settings: &Settings,
    harness: &PgPool,
) -> anyhow::Result<cifpool::startup::RunningApp> {
    let mut app = settings.clone();
    use_noop_providers(&mut app);
    app.queue.workers_enabled = true;
    let mut pool = bench_pool(POOL, "8", 10_000, 10);
    pool.low_watermark = 50_000;
    pool.refill_schedule = "*/5 * * * * *".into();
    pool.reclaim_schedule = "*/30 * * * * *".into();
    pool.lease_ttl = Duration::from_secs(300);
    app.pools = vec![pool];
    let service = super::start_service(connect, app).await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while available(harness).await? < 50_000 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(service)
}

/// Runs the soak on the scratch database behind `connect`.
pub async fn run(
    connect: &PgConnectOptions,
    settings: &Settings,
    opts: &SoakOptions,
) -> anyhow::Result<BenchReport<SoakResults>> {
    let harness = PgPoolOptions::new().max_connections(2).connect_with(connect.clone()).await?;
    let machine = Machine::probe(&harness).await?;
    let service = start_as_in_production(connect, settings, &harness).await?;
    let tables_start = table_sizes(&harness).await?;
    let start = db_now(&harness).await?;
    let started = Instant::now();
    let length = Duration::from_secs_f64(opts.minutes * 60.0);
    let client = super::client(connect, Duration::from_secs(30)).await?;
    let errors = Arc::new(std::sync::Mutex::new(BTreeMap::<String, u64>::new()));
    let confirmed_at = Arc::new(std::sync::Mutex::new(Vec::<u32>::new()));
    let done = Arc::new(AtomicU64::new(0));

    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..opts.clients {
        let (client, base) = (client.clone(), service.base_url.clone());
        let (errors, confirmed_at, done) = (errors.clone(), confirmed_at.clone(), done.clone());
        tasks.spawn(async move {
            let mut seconds = Vec::new();
            while started.elapsed() < length {
                match reserve_and_confirm(&client, &base).await {
                    Ok(_) => {
                        seconds.push(started.elapsed().as_secs() as u32);
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        *errors.lock().expect("errors lock").entry(e).or_default() += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            confirmed_at.lock().expect("tally lock").extend(seconds);
        });
    }
    let stop = CancellationToken::new();
    let loads = [
        tokio::spawn(feed(client.clone(), service.base_url.clone(), opts.queue_rate, length, stop.clone())),
        tokio::spawn(otps(client.clone(), service.base_url.clone(), length, stop.clone())),
    ];

    let bar = super::bar(opts.progress, "soak", length.as_secs(), "s");
    while !tasks.is_empty() {
        tokio::select! {
            _ = tasks.join_next() => {}
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        bar.set_position(started.elapsed().as_secs().min(length.as_secs()));
        bar.set_message(format!("{} reservations confirmed", thousands(done.load(Ordering::Relaxed) as f64)));
    }
    stop.cancel();
    for load in loads {
        let tally = load.await?;
        let mut errors = errors.lock().expect("errors lock");
        for (label, n) in tally.errors {
            *errors.entry(label).or_default() += n;
        }
    }
    bar.finish();
    let seconds = started.elapsed().as_secs_f64();
    let tables_end = table_sizes(&harness).await?;
    super::stop_service(service).await;

    let full = (seconds / 60.0).floor() as usize;
    let mut per_minute = vec![0u64; full.max(1)];
    for s in confirmed_at.lock().expect("tally lock").iter() {
        if let Some(m) = per_minute.get_mut(*s as usize / 60) {
            *m += 1;
        }
    }
    let sent: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT floor(extract(epoch FROM finished_at - $1) / 60)::int4 AS m, count(*) FROM notification_jobs \
         WHERE status = 'sent' AND class = 'promo' AND finished_at >= $1 GROUP BY m",
    )
    .bind(start)
    .fetch_all(&harness)
    .await?;
    let otp: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT floor(extract(epoch FROM created_at - $1) / 60)::int4, \
                (extract(epoch FROM picked_at - created_at) * 1e6)::int8 \
         FROM notification_jobs WHERE class = 'otp' AND picked_at IS NOT NULL AND created_at >= $1",
    )
    .bind(start)
    .fetch_all(&harness)
    .await?;
    harness.close().await;
    let minutes: Vec<Minute> = (0..full)
        .map(|m| Minute {
            minute: m,
            confirmed_per_s: per_minute[m] as f64 / 60.0,
            sent_per_s: sent.iter().find(|s| s.0 as usize == m).map_or(0.0, |s| s.1 as f64 / 60.0),
            otp_wait: Latency::from_micros(
                otp.iter().filter(|o| o.0 as usize == m).map(|o| o.1.max(0) as u64).collect(),
            ),
        })
        .collect();
    let ratio = |f: fn(&Minute) -> f64| match (minutes.first(), minutes.last()) {
        (Some(a), Some(b)) if minutes.len() >= 2 && f(a) > 0.0 => Some(f(b) / f(a)),
        _ => None,
    };
    let results = SoakResults {
        seconds,
        reservations_last_over_first: ratio(|m| m.confirmed_per_s),
        queue_last_over_first: ratio(|m| m.sent_per_s),
        minutes,
        errors: std::mem::take(&mut *errors.lock().expect("errors lock")),
        tables_start,
        tables_end,
    };
    let mut notes =
        vec!["providers are the no-op provider (sent = accepted by the provider, nothing leaves the machine)".into()];
    if results.minutes.len() < 2 {
        notes.push("shorter than two full minutes: no first/last comparison".into());
    }
    let parameters = serde_json::json!({
        "minutes": opts.minutes,
        "reservation_clients": opts.clients,
        "queue_rate": opts.queue_rate,
        "promo_batch": BATCH,
        "otp_rate": OTP_RATE,
        "pool": { "name": POOL, "low_watermark": 50_000, "batch_size": 10_000, "refill_schedule": "*/5 * * * * *" },
        "workers": settings.queue.workers,
        "claim_batch": settings.queue.claim_batch,
        "retention_s": settings.queue.retention.as_secs(),
    });
    Ok(BenchReport { target: "soak".into(), parameters, machine, results, notes })
}

pub(super) async fn available(db: &PgPool) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM cif_codes WHERE state = 'available'").fetch_one(db).await?)
}

/// One reservation confirmed; returns how long the reservation (`POST /v1/cif`) took. The error is a
/// short label (status or "transport").
pub(super) async fn reserve_and_confirm(client: &reqwest::Client, base: &str) -> Result<Duration, String> {
    let asked = Instant::now();
    let resp = client
        .post(format!("{base}/v1/cif"))
        .header("content-type", "application/json")
        .header("x-holder", "soak")
        .body(format!(r#"{{"customer_type":"{POOL}"}}"#))
        .send()
        .await
        .map_err(|_| "reserve transport".to_string())?;
    if resp.status().as_u16() != 201 {
        return Err(format!("reserve {}", resp.status().as_u16()));
    }
    let body: serde_json::Value = resp.json().await.map_err(|_| "reserve body".to_string())?;
    let reserved_in = asked.elapsed();
    let (Some(cif), Some(token)) = (body["cif"].as_str(), body["reservation_token"].as_str()) else {
        return Err("reserve body".into());
    };
    let resp = client
        .post(format!("{base}/v1/cif/{cif}/confirm"))
        .header("content-type", "application/json")
        .body(format!(r#"{{"reservation_token":"{token}"}}"#))
        .send()
        .await
        .map_err(|_| "confirm transport".to_string())?;
    match resp.status().as_u16() {
        200 => Ok(reserved_in),
        other => Err(format!("confirm {other}")),
    }
}

/// Promo batches of [`BATCH`] at `rate` jobs/s for `length` (or until `stop`); a success is a 202.
pub(super) async fn feed(
    client: reqwest::Client,
    base: String,
    rate: f64,
    length: Duration,
    stop: CancellationToken,
) -> Tally {
    if rate <= 0.0 {
        return Tally::default();
    }
    let url = format!("{base}/v1/notifications/batch");
    let schedule = Schedule::for_duration(rate / BATCH as f64, length);
    fixed_rate(schedule, stop, Arc::default(), |n| {
        let body = batch_body("promo", BATCH, 100, &format!("s{n}"));
        let (client, url) = (client.clone(), url.clone());
        async move { post_json(&client, &url, body, 202, "batch ").await }
    })
    .await
}

/// OTPs at [`OTP_RATE`] for `length` (or until `stop`); a success is a 202.
pub(super) async fn otps(client: reqwest::Client, base: String, length: Duration, stop: CancellationToken) -> Tally {
    let url = format!("{base}/v1/notifications");
    fixed_rate(Schedule::for_duration(OTP_RATE, length), stop, Arc::default(), |i| {
        let body =
            format!(r#"{{"class":"otp","tenant":"bank","recipient":"+8491{i:07}","payload":{{"code":"123456"}}}}"#);
        let (client, url) = (client.clone(), url.clone());
        async move { post_json(&client, &url, body, 202, "otp ").await }
    })
    .await
}

async fn table_sizes(db: &PgPool) -> anyhow::Result<Vec<TableSize>> {
    sqlx::query("ANALYZE cif_codes, cif_issued, notification_jobs").execute(db).await?;
    let rows: Vec<(String, i64, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT relname::text, n_live_tup, n_dead_tup, pg_relation_size(relid), pg_indexes_size(relid), \
                autovacuum_count \
         FROM pg_stat_user_tables WHERE relname IN ('cif_codes', 'cif_issued', 'notification_jobs') \
         ORDER BY relname",
    )
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(table, live_rows, dead_rows, heap_bytes, index_bytes, autovacuum_count)| TableSize {
            table,
            live_rows,
            dead_rows,
            heap_bytes,
            index_bytes,
            autovacuum_count,
        })
        .collect())
}

/// The summary table of a report.
pub fn table(report: &BenchReport<SoakResults>) -> String {
    let r = &report.results;
    let rows: Vec<Vec<String>> = r
        .minutes
        .iter()
        .map(|m| {
            vec![
                (m.minute + 1).to_string(),
                thousands(m.confirmed_per_s),
                thousands(m.sent_per_s),
                m.otp_wait.as_ref().map_or("-".into(), |l| ms(l.p99_ms)),
            ]
        })
        .collect();
    let mut out = format!("soak: {:.0} s of reservations (reserve + confirm) and queue traffic\n", r.seconds);
    out.push_str(&text_table(&["minute", "confirmed/s", "queue sent/s", "OTP wait p99 ms"], &rows));
    let ratio = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.2}"));
    out.push_str(&format!(
        "\nlast minute / first: reservations {}, queue {} (goal: within 20 %)",
        ratio(r.reservations_last_over_first),
        ratio(r.queue_last_over_first)
    ));
    let mb = |b: i64| format!("{:.1}", b as f64 / 1_048_576.0);
    let sizes: Vec<Vec<String>> = r
        .tables_start
        .iter()
        .zip(&r.tables_end)
        .map(|(a, b)| {
            vec![
                a.table.clone(),
                format!("{} → {}", thousands(a.live_rows as f64), thousands(b.live_rows as f64)),
                thousands(b.dead_rows as f64),
                format!("{} → {}", mb(a.heap_bytes), mb(b.heap_bytes)),
                format!("{} → {}", mb(a.index_bytes), mb(b.index_bytes)),
                (b.autovacuum_count - a.autovacuum_count).to_string(),
            ]
        })
        .collect();
    out.push('\n');
    out.push_str(&text_table(&["table", "live rows", "dead at end", "heap MiB", "index MiB", "autovacuums"], &sizes));
    if !r.errors.is_empty() {
        out.push_str(&format!("\nerrors: {:?}", r.errors));
    }
    for note in &report.notes {
        out.push_str(&format!("\nnote: {note}"));
    }
    out
}
