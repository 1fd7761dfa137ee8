//! `cifpool-tools bench horizon`: the service under a steady mixed load while another session holds a
//! snapshot open, the classic way a Postgres queue degrades: no dead row version younger than that
//! snapshot can be removed, so every claim, finish and reservation wades through more of them.
//!
//! Method: one service instance on the scratch database with everything on as in production (worker
//! groups, the pool's refill and reclaim schedules, the sweeps, autovacuum), no-op providers, and for
//! the whole run the soak's load ([`super::soak`]): `clients` closed-loop clients each reserve a code
//! and confirm it, promo batches of 500 jobs arrive at `queue_rate` jobs/s over 100 tenants, and 10
//! OTP/s. After `before` seconds a separate connection opens a `REPEATABLE READ` transaction, reads one
//! row (which takes its snapshot) and keeps it for `hold` seconds, then rolls back; the run goes on for
//! `after` seconds.
//!
//! Reported per window of `window` seconds: reservations confirmed/s and the reservation's
//! (`POST /v1/cif`) p99, promo jobs sent/s and the promo backlog at the window's end, the OTP wait p99,
//! the dead tuples of `notification_jobs` and `cif_codes`, and the oldest snapshot's age as the
//! service's own probe reads it. The summary compares the hold with the time before it (the first
//! window left out as warm-up) and says how long after the hold the service was back: the end of the
//! first window after it with a drain of at least 0.9× and a reservation p99 of at most 1.5× the values
//! before.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};
use tokio_util::sync::CancellationToken;

use super::claims::{GroupClaims, claim_totals, claims_between};
use super::report::{BenchReport, Latency, Machine, ms, table as text_table, thousands};
use super::soak::{feed, otps, reserve_and_confirm};
use super::{BenchArgs, db_now};
use cifpool::config::Settings;
use cifpool::internals::horizon;

/// Drain at least this share of the rate before the hold, for the service to count as back.
const BACK_DRAIN: f64 = 0.9;
/// Reservation p99 at most this multiple of the p99 before the hold, for the service to count as back.
const BACK_P99: f64 = 1.5;

/// Parameters of a `horizon` run.
#[derive(Debug, Clone, Serialize)]
pub struct HorizonOptions {
    /// Seconds of load before the snapshot is taken.
    pub before_s: f64,
    /// Seconds the snapshot is held.
    pub hold_s: f64,
    /// Seconds of load after it is let go.
    pub after_s: f64,
    /// Length of one reported window, seconds.
    pub window_s: f64,
    /// Closed-loop reservation clients.
    pub clients: usize,
    /// Promo jobs per second offered to the queue.
    pub queue_rate: f64,
    /// Draw progress bars.
    #[serde(skip)]
    pub progress: bool,
}

impl HorizonOptions {
    /// From the command line.
    pub fn from_args(args: &BenchArgs) -> HorizonOptions {
        HorizonOptions {
            before_s: args.before_secs,
            hold_s: args.hold_secs,
            after_s: args.after_secs,
            window_s: args.window_secs,
            clients: args.clients,
            queue_rate: args.queue_rate,
            progress: !args.no_progress,
        }
    }
}

/// Where a window lies against the hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Before the snapshot was taken.
    Before,
    /// While it was held (a window the hold starts or ends inside goes with the side that has most of it).
    Hold,
    /// After it was let go.
    After,
}

/// One window of the run.
#[derive(Debug, Clone, Serialize)]
pub struct Window {
    /// Seconds from the start of the run to the window's start.
    pub start_s: f64,
    /// Against the hold.
    pub phase: Phase,
    /// Reservations confirmed per second.
    pub confirmed_per_s: f64,
    /// `POST /v1/cif` latency of the reservations that finished in the window.
    pub reserve: Option<Latency>,
    /// Promo jobs sent per second.
    pub sent_per_s: f64,
    /// Promo jobs accepted and not yet finished at the window's end.
    pub backlog: i64,
    /// OTP enqueue → claim p99, ms.
    pub otp_wait_p99_ms: Option<f64>,
    /// Dead tuples of `notification_jobs` at the window's end (statistics).
    pub dead_jobs: i64,
    /// Dead tuples of `cif_codes` at the window's end (statistics).
    pub dead_codes: i64,
    /// The oldest snapshot's age at the window's end, seconds, as the service's horizon probe reads it.
    pub oldest_snapshot_s: f64,
    /// The claim statements of the worker group that spent the most time claiming in the window.
    pub claims: Option<GroupClaims>,
}

/// One phase in a few numbers.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseSummary {
    /// Promo jobs sent per second, over the phase.
    pub sent_per_s: f64,
    /// The slowest window's sent/s.
    pub worst_sent_per_s: f64,
    /// Reservation p99 over the phase, ms.
    pub reserve_p99_ms: Option<f64>,
    /// The worst window's reservation p99, ms.
    pub worst_reserve_p99_ms: Option<f64>,
}

/// Everything `bench horizon` measured.
#[derive(Debug, Clone, Serialize)]
pub struct HorizonResults {
    /// Seconds actually run.
    pub seconds: f64,
    /// When the snapshot was taken and let go, seconds from the start.
    pub held_from_s: f64,
    /// When it was let go.
    pub held_until_s: f64,
    /// Every full window.
    pub windows: Vec<Window>,
    /// Before the hold (first window left out).
    pub before: PhaseSummary,
    /// During it.
    pub hold: PhaseSummary,
    /// After it.
    pub after: PhaseSummary,
    /// Sent/s during the hold over before (goal ≥ 0.8).
    pub drain_hold_over_before: Option<f64>,
    /// Reservation p99 during the hold over before (goal ≤ 2).
    pub p99_hold_over_before: Option<f64>,
    /// Seconds from the end of the hold to the end of the first window that was back (goal ≤ 60).
    pub back_after_s: Option<f64>,
    /// Requests that did not succeed, by label.
    pub errors: BTreeMap<String, u64>,
}

/// Runs the held-snapshot bench on the scratch database behind `connect`.
pub async fn run(
    connect: &PgConnectOptions,
    settings: &Settings,
    opts: &HorizonOptions,
) -> anyhow::Result<BenchReport<HorizonResults>> {
    // The reads after the run scan every job of it: no statement timeout for them.
    let untimed = connect.clone().options([("statement_timeout", "0")]);
    let harness = PgPoolOptions::new().max_connections(2).connect_with(untimed).await?;
    let machine = Machine::probe(&harness).await?;
    let service = super::soak::start_as_in_production(connect, settings, &harness).await?;

    let start = db_now(&harness).await?;
    let started = Instant::now();
    let length = Duration::from_secs_f64(opts.before_s + opts.hold_s + opts.after_s);
    let client = super::client(connect, Duration::from_secs(30)).await?;
    let errors = Arc::new(Mutex::new(BTreeMap::<String, u64>::new()));
    // (seconds from the start when the reservation was confirmed, its reserve latency in µs)
    let reservations = Arc::new(Mutex::new(Vec::<(f64, u64)>::new()));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..opts.clients {
        let (client, base) = (client.clone(), service.base_url.clone());
        let (errors, reservations) = (errors.clone(), reservations.clone());
        clients.spawn(async move {
            let mut mine = Vec::new();
            while started.elapsed() < length {
                match reserve_and_confirm(&client, &base).await {
                    Ok(took) => mine.push((started.elapsed().as_secs_f64(), took.as_micros() as u64)),
                    Err(e) => {
                        *errors.lock().expect("errors lock").entry(e).or_default() += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
            reservations.lock().expect("reservations lock").extend(mine);
        });
    }
    let stop = CancellationToken::new();
    let loads = [
        tokio::spawn(feed(client.clone(), service.base_url.clone(), opts.queue_rate, length, stop.clone())),
        tokio::spawn(otps(client.clone(), service.base_url.clone(), length, stop.clone())),
    ];
    let holder = tokio::spawn(hold_snapshot(
        connect.clone(),
        started + Duration::from_secs_f64(opts.before_s),
        Duration::from_secs_f64(opts.hold_s),
        started,
    ));

    let bar = super::bar(opts.progress, "horizon", length.as_secs(), "s");
    let window = Duration::from_secs_f64(opts.window_s);
    let mut samples = Vec::new();
    // The claims' own histograms at each window's edge (the first just as the windows start).
    let mut claim_readings = vec![claim_totals()];
    let mut next = started + window;
    while !clients.is_empty() || Instant::now() < started + length {
        tokio::select! {
            _ = clients.join_next(), if !clients.is_empty() => {}
            _ = tokio::time::sleep_until(next.into()) => {
                samples.push(sample(&harness).await?);
                claim_readings.push(claim_totals());
                next += window;
            }
        }
        bar.set_position(started.elapsed().as_secs().min(length.as_secs()));
    }
    stop.cancel();
    for load in loads {
        let tally = load.await?;
        let mut errors = errors.lock().expect("errors lock");
        for (label, n) in tally.errors {
            *errors.entry(label).or_default() += n;
        }
    }
    let (held_from_s, held_until_s) = holder.await??;
    bar.finish();
    let seconds = started.elapsed().as_secs_f64();
    super::stop_service(service).await;

    let full = ((seconds / opts.window_s).floor() as usize).min(samples.len());
    let per_window = queue_per_window(&harness, start, opts.window_s, full).await?;
    harness.close().await;
    let reservations = std::mem::take(&mut *reservations.lock().expect("reservations lock"));
    let windows: Vec<Window> = (0..full)
        .map(|w| {
            let (from, to) = (w as f64 * opts.window_s, (w + 1) as f64 * opts.window_s);
            // A window the hold starts or ends inside goes with the side that has most of it.
            let middle = (from + to) / 2.0;
            let phase = if middle < held_from_s {
                Phase::Before
            } else if middle >= held_until_s {
                Phase::After
            } else {
                Phase::Hold
            };
            let mine: Vec<u64> = reservations.iter().filter(|r| r.0 >= from && r.0 < to).map(|r| r.1).collect();
            let queue = per_window.get(&(w as i32)).cloned().unwrap_or_default();
            // The group that spent the most time claiming in the window: the one draining promo.
            let busiest = claims_between(&claim_readings[w], &claim_readings[w + 1], window)
                .into_iter()
                .max_by(|a, b| a.loops_busy.total_cmp(&b.loops_busy));
            Window {
                start_s: from,
                phase,
                confirmed_per_s: mine.len() as f64 / opts.window_s,
                reserve: Latency::from_micros(mine),
                sent_per_s: queue.sent as f64 / opts.window_s,
                backlog: queue.backlog,
                otp_wait_p99_ms: queue.otp_wait_p99_ms,
                dead_jobs: samples[w].dead_jobs,
                dead_codes: samples[w].dead_codes,
                oldest_snapshot_s: samples[w].oldest_snapshot_s,
                claims: busiest,
            }
        })
        .collect();
    let summary = |phase: Phase, skip: usize| {
        let ws: Vec<&Window> = windows.iter().filter(|w| w.phase == phase).skip(skip).collect();
        let (from, to) = match (ws.first(), ws.last()) {
            (Some(a), Some(b)) => (a.start_s, b.start_s + opts.window_s),
            _ => (0.0, 0.0),
        };
        let all: Vec<u64> = reservations.iter().filter(|r| r.0 >= from && r.0 < to).map(|r| r.1).collect();
        PhaseSummary {
            sent_per_s: if ws.is_empty() {
                0.0
            } else {
                ws.iter().map(|w| w.sent_per_s).sum::<f64>() / ws.len() as f64
            },
            worst_sent_per_s: ws.iter().map(|w| w.sent_per_s).fold(f64::INFINITY, f64::min).min(f64::MAX),
            reserve_p99_ms: Latency::from_micros(all).map(|l| l.p99_ms),
            worst_reserve_p99_ms: ws.iter().filter_map(|w| w.reserve.as_ref().map(|l| l.p99_ms)).reduce(f64::max),
        }
    };
    let (before, hold, after) = (summary(Phase::Before, 1), summary(Phase::Hold, 0), summary(Phase::After, 0));
    let over = |a: f64, b: f64| (b > 0.0).then(|| a / b);
    let back_after_s = windows
        .iter()
        .filter(|w| w.phase == Phase::After)
        .find(|w| {
            w.sent_per_s >= BACK_DRAIN * before.sent_per_s
                && match (w.reserve.as_ref(), before.reserve_p99_ms) {
                    (Some(l), Some(p)) => l.p99_ms <= BACK_P99 * p,
                    _ => false,
                }
        })
        .map(|w| w.start_s + opts.window_s - held_until_s);
    let results = HorizonResults {
        seconds,
        held_from_s,
        held_until_s,
        drain_hold_over_before: over(hold.sent_per_s, before.sent_per_s),
        p99_hold_over_before: hold.reserve_p99_ms.zip(before.reserve_p99_ms).and_then(|(h, b)| over(h, b)),
        back_after_s,
        windows,
        before,
        hold,
        after,
        errors: std::mem::take(&mut *errors.lock().expect("errors lock")),
    };
    let notes = vec![
        "providers are the no-op provider (sent = accepted by the provider, nothing leaves the machine)".into(),
        format!(
            "back: the first window after the hold with sent/s ≥ {BACK_DRAIN}× and reservation p99 ≤ {BACK_P99}× \
             the values before it"
        ),
    ];
    let parameters = serde_json::json!({
        "before_s": opts.before_s,
        "hold_s": opts.hold_s,
        "after_s": opts.after_s,
        "window_s": opts.window_s,
        "reservation_clients": opts.clients,
        "queue_rate": opts.queue_rate,
        "holder": "REPEATABLE READ transaction on its own connection, one read, then idle until rolled back",
        "workers": settings.queue.workers,
        "claim_batch": settings.queue.claim_batch,
    });
    Ok(BenchReport { target: "horizon".into(), parameters, machine, results, notes })
}

/// Waits until `at`, takes a snapshot in a `REPEATABLE READ` transaction, keeps it for `hold` and rolls
/// back; returns when it was taken and let go, seconds from `started`.
async fn hold_snapshot(
    connect: PgConnectOptions,
    at: Instant,
    hold: Duration,
    started: Instant,
) -> anyhow::Result<(f64, f64)> {
    let mut conn = PgConnection::connect_with(&connect).await?;
    tokio::time::sleep_until(at.into()).await;
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ").execute(&mut conn).await?;
    // A repeatable-read transaction takes its snapshot at its first statement, not at BEGIN.
    sqlx::query("SELECT count(*) FROM cif_pools").execute(&mut conn).await?;
    let from = started.elapsed().as_secs_f64();
    tokio::time::sleep(hold).await;
    sqlx::query("ROLLBACK").execute(&mut conn).await?;
    let until = started.elapsed().as_secs_f64();
    conn.close().await?;
    Ok((from, until))
}

/// What the database looks like at the end of a window.
struct Sample {
    dead_jobs: i64,
    dead_codes: i64,
    oldest_snapshot_s: f64,
}

async fn sample(db: &PgPool) -> anyhow::Result<Sample> {
    let (dead_jobs, dead_codes): (i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(n_dead_tup) FILTER (WHERE relname = 'notification_jobs'), 0)::int8, \
                coalesce(sum(n_dead_tup) FILTER (WHERE relname = 'cif_codes'), 0)::int8 \
         FROM pg_stat_user_tables WHERE relname IN ('notification_jobs', 'cif_codes')",
    )
    .fetch_one(db)
    .await?;
    let horizon = horizon::read(db).await?;
    Ok(Sample { dead_jobs, dead_codes, oldest_snapshot_s: horizon.oldest_snapshot_age_s })
}

/// The queue's side of one window, read from the jobs table after the run.
#[derive(Debug, Clone, Default)]
struct QueueWindow {
    sent: i64,
    backlog: i64,
    otp_wait_p99_ms: Option<f64>,
}

async fn queue_per_window(
    db: &PgPool,
    start: chrono::DateTime<chrono::Utc>,
    window_s: f64,
    windows: usize,
) -> anyhow::Result<BTreeMap<i32, QueueWindow>> {
    let mut out: BTreeMap<i32, QueueWindow> = BTreeMap::new();
    let sent: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT floor(extract(epoch FROM finished_at - $1) / $2)::int4 AS w, count(*) FROM notification_jobs \
         WHERE status = 'sent' AND class = 'promo' AND finished_at >= $1 GROUP BY w",
    )
    .bind(start)
    .bind(window_s)
    .fetch_all(db)
    .await?;
    for (w, n) in sent {
        out.entry(w).or_default().sent = n;
    }
    // Backlog at a window's end: promo jobs created by then less those finished by then (every job of
    // the run is created after `start`, on a fresh table).
    let flows: Vec<(i32, i64, i64)> = sqlx::query_as(
        "SELECT w, count(*) FILTER (WHERE what = 'created'), count(*) FILTER (WHERE what = 'finished') \
         FROM (SELECT floor(extract(epoch FROM created_at - $1) / $2)::int4 AS w, 'created' AS what \
                 FROM notification_jobs WHERE class = 'promo' \
               UNION ALL \
               SELECT floor(extract(epoch FROM finished_at - $1) / $2)::int4, 'finished' \
                 FROM notification_jobs WHERE class = 'promo' AND finished_at IS NOT NULL) AS f \
         GROUP BY w ORDER BY w",
    )
    .bind(start)
    .bind(window_s)
    .fetch_all(db)
    .await?;
    let mut backlog = 0;
    for w in 0..windows as i32 {
        for (_, created, finished) in flows.iter().filter(|f| f.0 == w) {
            backlog += created - finished;
        }
        out.entry(w).or_default().backlog = backlog;
    }
    let otp: Vec<(i32, f64)> = sqlx::query_as(
        "SELECT floor(extract(epoch FROM created_at - $1) / $2)::int4 AS w, \
                percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM picked_at - created_at) * 1000) \
         FROM notification_jobs WHERE class = 'otp' AND picked_at IS NOT NULL AND created_at >= $1 GROUP BY w",
    )
    .bind(start)
    .bind(window_s)
    .fetch_all(db)
    .await?;
    for (w, p99) in otp {
        out.entry(w).or_default().otp_wait_p99_ms = Some(p99);
    }
    Ok(out)
}

/// The summary table of a report.
pub fn table(report: &BenchReport<HorizonResults>) -> String {
    let r = &report.results;
    let opt_ms = |x: Option<f64>| x.map_or("-".into(), ms);
    let rows: Vec<Vec<String>> = r
        .windows
        .iter()
        .map(|w| {
            vec![
                format!("{:.0}", w.start_s),
                format!("{:?}", w.phase).to_lowercase(),
                thousands(w.confirmed_per_s),
                opt_ms(w.reserve.as_ref().map(|l| l.p99_ms)),
                thousands(w.sent_per_s),
                thousands(w.backlog as f64),
                opt_ms(w.otp_wait_p99_ms),
                thousands(w.dead_jobs as f64),
                thousands(w.dead_codes as f64),
                format!("{:.0}", w.oldest_snapshot_s),
                w.claims.as_ref().map_or("-".into(), |c| format!("{:.1}", c.mean_ms)),
                w.claims.as_ref().map_or("-".into(), |c| format!("{:.0}", c.loops_busy * 100.0)),
                w.claims.as_ref().map_or("-".into(), |c| thousands(c.from_floors as f64)),
            ]
        })
        .collect();
    let mut out = format!(
        "horizon: {:.0} s of mixed load, a snapshot held from {:.0} s to {:.0} s\n",
        r.seconds, r.held_from_s, r.held_until_s
    );
    out.push_str(&text_table(
        &[
            "from s",
            "phase",
            "confirmed/s",
            "reserve p99 ms",
            "promo sent/s",
            "backlog",
            "OTP wait p99 ms",
            "dead jobs",
            "dead codes",
            "snapshot age s",
            "claim ms",
            "claiming %",
            "from floors",
        ],
        &rows,
    ));
    out.push_str(
        "\nclaim ms, claiming %, from floors: the mean claim statement of the worker group that claimed longest \
         in the window, the share of the window its claim loops spent inside one, and how many of its claims \
         started at the group's floors",
    );
    let ratio = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.2}"));
    let phase = |name: &str, p: &PhaseSummary| {
        vec![
            name.to_string(),
            thousands(p.sent_per_s),
            thousands(p.worst_sent_per_s),
            opt_ms(p.reserve_p99_ms),
            opt_ms(p.worst_reserve_p99_ms),
        ]
    };
    out.push('\n');
    out.push_str(&text_table(
        &["phase", "promo sent/s", "worst window", "reserve p99 ms", "worst window"],
        &[phase("before", &r.before), phase("hold", &r.hold), phase("after", &r.after)],
    ));
    out.push_str(&format!(
        "\nduring the hold / before: drain {} (goal ≥ 0.8), reservation p99 {} (goal ≤ 2); back {} after the hold \
         ended (goal ≤ 60 s)",
        ratio(r.drain_hold_over_before),
        ratio(r.p99_hold_over_before),
        r.back_after_s.map_or("never in the run".into(), |s| format!("{s:.0} s"))
    ));
    if !r.errors.is_empty() {
        out.push_str(&format!("\nerrors: {:?}", r.errors));
    }
    for note in &report.notes {
        out.push_str(&format!("\nnote: {note}"));
    }
    out
}
