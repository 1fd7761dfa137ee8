//! Queue depth per class: the gauges (age of the oldest waiting job is the main signal) and the
//! numbers intake backpressure predicts waits from.

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock, RwLock};
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::queue::runtime::QueueRuntime;
use crate::queue::status::JobStatus;

/// How often [`refresh_loop`] re-reads the numbers.
pub const STATS_INTERVAL: Duration = Duration::from_secs(2);

/// Window over which the drain rate is measured.
pub const DRAIN_WINDOW: Duration = Duration::from_secs(30);
/// Most recent finishes read to estimate the drain rate (bounds the refresh's cost).
pub const DRAIN_SAMPLE: i64 = 5_000;

/// One class's numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ClassStats {
    /// Jobs waiting to be claimed (pending or retrying; scheduled ones are not waiting yet).
    pub pending: u64,
    /// Seconds since the longest-waiting due job became due (was enqueued, or its `run_at` or retry
    /// time came): how far behind the class is, whatever the job's own history.
    pub oldest_age_s: f64,
    /// Jobs finished per second over the last [`DRAIN_WINDOW`].
    pub drain_per_s: f64,
    /// Dead-lettered jobs.
    pub dead: u64,
    /// Seconds since the oldest dead letter died (0 with none): dead letters wait for a person.
    pub oldest_dead_age_s: f64,
}

/// The latest snapshot, refreshed by the maintenance loop.
#[derive(Debug, Default)]
pub struct QueueStats {
    classes: RwLock<BTreeMap<String, ClassStats>>,
}

impl QueueStats {
    /// Snapshot of one class.
    pub fn get(&self, class: &str) -> Option<ClassStats> {
        self.classes.read().expect("stats lock").get(class).copied()
    }

    /// Replaces one class's numbers (refresh, tests).
    pub fn set(&self, class: &str, stats: ClassStats) {
        self.classes.write().expect("stats lock").insert(class.to_string(), stats);
    }

    /// Predicted wait of a job enqueued now: pending ahead / drain rate, and never less than the
    /// age of the oldest waiting job (which also covers a stalled queue with no drain at all).
    /// `None` before the first refresh.
    pub fn predicted_wait(&self, class: &str) -> Option<Duration> {
        let s = self.get(class)?;
        if s.pending == 0 {
            return Some(Duration::ZERO);
        }
        let by_rate = if s.drain_per_s > 0.0 { s.pending as f64 / s.drain_per_s } else { 0.0 };
        Some(Duration::from_secs_f64(by_rate.max(s.oldest_age_s)))
    }

    /// Reads every class's numbers from the database and publishes the gauges.
    pub async fn refresh(&self, db: &PgPool, rt: &QueueRuntime) -> Result<(), sqlx::Error> {
        static WAITING: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT class, count(*), \
                        coalesce(extract(epoch FROM now() - min(greatest(created_at, run_after)) FILTER (WHERE run_after <= now()))::float8, 0) \
                 FROM notification_jobs WHERE status IN ({waiting}) GROUP BY class",
                waiting = JobStatus::sql_list(&JobStatus::CLAIMABLE)
            )
        });
        let waiting: Vec<(String, i64, f64)> =
            sqlx::query_as(sqlx::AssertSqlSafe(WAITING.as_str())).fetch_all(db).await?;
        // A literal, not a bind: a generic plan could not prove the partial dead-letter index applies.
        static DEAD: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT class, count(*), \
                        coalesce(extract(epoch FROM now() - min(finished_at))::float8, 0) \
                 FROM notification_jobs WHERE status = {} GROUP BY class",
                JobStatus::Dead.sql()
            )
        });
        let dead: Vec<(String, i64, f64)> = sqlx::query_as(sqlx::AssertSqlSafe(DEAD.as_str())).fetch_all(db).await?;
        for class in rt.classes.keys() {
            // The most recent finishes only, so the cost is bounded whatever the rate: under
            // DRAIN_SAMPLE finishes in the window, the rate is count / window; at or above it, the
            // rate is DRAIN_SAMPLE / the time those took (a full 30 s window at 27,000 jobs/s is
            // 800,000 index entries to count, every refresh).
            let (finished, span): (i64, f64) = sqlx::query_as(
                "SELECT count(*), coalesce(extract(epoch FROM now() - min(finished_at))::float8, 0) FROM ( \
                    SELECT finished_at FROM notification_jobs \
                    WHERE class = $1 AND finished_at > now() - $2::float8 * interval '1 second' \
                    ORDER BY finished_at DESC LIMIT $3) AS recent",
            )
            .bind(class)
            .bind(DRAIN_WINDOW.as_secs_f64())
            .bind(DRAIN_SAMPLE)
            .fetch_one(db)
            .await?;
            let drain_per_s = if finished >= DRAIN_SAMPLE && span > 0.0 {
                finished as f64 / span
            } else {
                finished as f64 / DRAIN_WINDOW.as_secs_f64()
            };
            let (pending, oldest) =
                waiting.iter().find(|w| &w.0 == class).map(|w| (w.1 as u64, w.2.max(0.0))).unwrap_or((0, 0.0));
            let stats = ClassStats {
                pending,
                oldest_age_s: oldest,
                drain_per_s,
                dead: dead.iter().find(|d| &d.0 == class).map_or(0, |d| d.1 as u64),
                oldest_dead_age_s: dead.iter().find(|d| &d.0 == class).map_or(0.0, |d| d.2.max(0.0)),
            };
            let label = class.clone();
            metrics::gauge!("cifpool_queue_pending", "class" => label.clone()).set(stats.pending as f64);
            metrics::gauge!("cifpool_queue_oldest_pending_age_seconds", "class" => label.clone())
                .set(stats.oldest_age_s);
            metrics::gauge!("cifpool_queue_drain_per_second", "class" => label.clone()).set(stats.drain_per_s);
            metrics::gauge!("cifpool_queue_dead", "class" => label.clone()).set(stats.dead as f64);
            metrics::gauge!("cifpool_queue_dead_oldest_age_seconds", "class" => label).set(stats.oldest_dead_age_s);
            self.set(class, stats);
        }
        Ok(())
    }
}

/// Refreshes `stats` every [`STATS_INTERVAL`] until `stop` (a database outage only skips refreshes).
pub async fn refresh_loop(db: PgPool, runtime: Arc<QueueRuntime>, stats: Arc<QueueStats>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(STATS_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! { _ = stop.cancelled() => return, _ = tick.tick() => {} }
        if let Err(e) = stats.refresh(&db, &runtime).await {
            tracing::debug!(error = %e, "queue stats: database unavailable");
        }
    }
}
