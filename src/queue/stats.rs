//! Queue depth per class: the gauges (age of the oldest waiting job is the main signal) and the
//! numbers intake backpressure predicts waits from. One instance at a time counts them into
//! `queue_class_stats` (counting reads every waiting job); every instance publishes them from there.

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock, RwLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::queue::analyze::{LastAnalyze, Misled, analyze_if_misled};
use crate::queue::runtime::QueueRuntime;
use crate::queue::status::JobStatus;

/// How often [`refresh_round`] runs: how old the numbers may get.
pub(crate) const STATS_INTERVAL: Duration = Duration::from_secs(2);

/// Window over which the drain rate is measured.
pub(crate) const DRAIN_WINDOW: Duration = Duration::from_secs(30);
/// Most recent finishes read to estimate the drain rate (bounds the refresh's cost).
pub(crate) const DRAIN_SAMPLE: i64 = 5_000;

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

/// One tenant's waiting jobs in a class.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct TenantLoad {
    /// Its jobs waiting to be claimed.
    pub pending: u64,
    /// Seconds since its longest-waiting due job became due.
    pub oldest_age_s: f64,
}

/// The tenants with waiting jobs in a class.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct ClassTenants {
    /// The tenants with the most waiting jobs (up to [`TENANTS_KEPT`]).
    pub tenants: BTreeMap<String, TenantLoad>,
    /// How many tenants have waiting jobs at all.
    pub active: u64,
}

/// Tenants per class whose load is kept (those with the most waiting jobs); the others are counted.
pub(crate) const TENANTS_KEPT: usize = 1_000;

/// The latest snapshot, refreshed by the maintenance loop.
#[derive(Debug, Default)]
pub struct QueueStats {
    classes: RwLock<BTreeMap<String, ClassStats>>,
    tenants: RwLock<BTreeMap<String, ClassTenants>>,
    last_analyze: LastAnalyze,
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

    /// Replaces one class's tenant loads (refresh, tests).
    pub(crate) fn set_tenants(&self, class: &str, tenants: ClassTenants) {
        self.tenants.write().expect("stats lock").insert(class.to_string(), tenants);
    }

    /// Predicted wait of `jobs` more jobs of `tenant` in `class` when the class is claimed in weighted
    /// turns among tenants: the tenant drains at its weight's part of the class's drain rate, so its
    /// wait is its own backlog over that part, and never less than its own longest wait. `None`
    /// before the first refresh, and when nothing of the class drains (a stalled class is judged as a
    /// whole).
    pub(crate) fn tenant_predicted_wait(
        &self,
        class: &str,
        tenant: &str,
        jobs: u64,
        weights: &BTreeMap<String, f64>,
    ) -> Option<Duration> {
        let s = self.get(class)?;
        if s.drain_per_s <= 0.0 {
            return None;
        }
        let all = self.tenants.read().expect("stats lock");
        let loads = all.get(class)?;
        let weight = |t: &str| weights.get(t).copied().unwrap_or(1.0);
        let own = loads.tenants.get(tenant).copied().unwrap_or_default();
        let listed = loads.tenants.len() as u64 - u64::from(loads.tenants.contains_key(tenant));
        let others: f64 = loads.tenants.keys().filter(|t| *t != tenant).map(|t| weight(t)).sum::<f64>()
            + loads.active.saturating_sub(listed + u64::from(own.pending > 0)) as f64;
        let share = s.drain_per_s * weight(tenant) / (others + weight(tenant));
        let by_rate = (own.pending + jobs) as f64 / share;
        Some(Duration::from_secs_f64(by_rate.max(own.oldest_age_s)))
    }

    /// Predicted wait of a job enqueued now: pending ahead / drain rate, and never less than the
    /// age of the oldest waiting job (which also covers a stalled queue with no drain at all).
    /// `None` before the first refresh.
    pub(crate) fn predicted_wait(&self, class: &str) -> Option<Duration> {
        let s = self.get(class)?;
        if s.pending == 0 {
            return Some(Duration::ZERO);
        }
        let by_rate = if s.drain_per_s > 0.0 { s.pending as f64 / s.drain_per_s } else { 0.0 };
        Some(Duration::from_secs_f64(by_rate.max(s.oldest_age_s)))
    }

    /// Publishes every class's numbers (gauges and this snapshot) from `queue_class_stats`, after
    /// computing them there first when they are stale and no other instance is computing them now.
    /// The instance that counted then analyzes the jobs table if the planner expects far fewer
    /// waiting jobs than it counted ([`crate::queue::analyze`]).
    pub async fn refresh(&self, db: &PgPool, rt: &QueueRuntime) -> Result<Refreshed, sqlx::Error> {
        let (refreshed, waiting) = compute(db, rt, false).await?;
        self.publish(db, rt).await?;
        analyze_if_misled(db, &self.last_analyze, &waiting).await;
        Ok(refreshed)
    }

    /// [`QueueStats::refresh`] that counts now whatever the stored numbers' age, after waiting for an
    /// instance that is counting at this moment (tests, and whoever needs numbers as of now). Returns
    /// what misled the planner when it analyzed the jobs table.
    pub async fn refresh_now(&self, db: &PgPool, rt: &QueueRuntime) -> Result<Option<Misled>, sqlx::Error> {
        let (_, waiting) = compute(db, rt, true).await?;
        self.publish(db, rt).await?;
        Ok(analyze_if_misled(db, &self.last_analyze, &waiting).await)
    }

    async fn publish(&self, db: &PgPool, rt: &QueueRuntime) -> Result<(), sqlx::Error> {
        let stored: Vec<StoredStats> = sqlx::query_as(
            "SELECT class, pending, extract(epoch FROM refreshed_at - oldest_due_at)::float8 AS oldest_age_s, \
                    drain_per_s, dead, extract(epoch FROM now() - oldest_dead_at)::float8 AS oldest_dead_age_s, \
                    tenants, active_tenants, extract(epoch FROM refreshed_at)::float8 AS counted_epoch \
             FROM queue_class_stats",
        )
        .fetch_all(db)
        .await?;
        for s in &stored {
            self.set_tenants(&s.class, s.tenant_loads());
        }
        for class in rt.classes.keys() {
            let stats = stored.iter().find(|s| &s.class == class).map_or(ClassStats::default(), |s| ClassStats {
                pending: s.pending.max(0) as u64,
                oldest_age_s: s.oldest_age_s.unwrap_or(0.0).max(0.0),
                drain_per_s: s.drain_per_s,
                dead: s.dead.max(0) as u64,
                oldest_dead_age_s: s.oldest_dead_age_s.unwrap_or(0.0).max(0.0),
            });
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

/// A row of `queue_class_stats`: waiting ages as of its count, the oldest dead letter's age now.
#[derive(sqlx::FromRow)]
struct StoredStats {
    class: String,
    pending: i64,
    oldest_age_s: Option<f64>,
    drain_per_s: f64,
    dead: i64,
    oldest_dead_age_s: Option<f64>,
    tenants: sqlx::types::Json<BTreeMap<String, (i64, Option<f64>)>>,
    active_tenants: i64,
    /// When the numbers were counted: waiting ages are as of then, not grown since (the job that was
    /// oldest then may have been sent since; a count at most a few seconds old shows it).
    counted_epoch: f64,
}

impl StoredStats {
    fn tenant_loads(&self) -> ClassTenants {
        let tenants = self
            .tenants
            .iter()
            .map(|(t, (pending, due_at))| {
                let oldest_age_s = due_at.map_or(0.0, |at| (self.counted_epoch - at).max(0.0));
                (t.clone(), TenantLoad { pending: (*pending).max(0) as u64, oldest_age_s })
            })
            .collect();
        ClassTenants { tenants, active: self.active_tenants.max(0) as u64 }
    }
}

/// Who computed the numbers a [`QueueStats::refresh`] published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refreshed {
    /// This instance counted them (they were stale, and it took the stats lock).
    Computed,
    /// Another instance's numbers, fresh enough or being recomputed right now.
    Shared,
}

/// Advisory-lock key of the stats computation ("cifq" in the high 32 bits).
pub const STATS_LOCK: i64 = 0x6369_6671 << 32 | 1;

/// Stored numbers younger than this are not recomputed: with every instance refreshing every
/// [`STATS_INTERVAL`], the deployment counts about twice per interval however many instances run.
pub const STATS_FRESH: Duration = Duration::from_secs(1);

/// Stored numbers are also fresh for this many times as long as counting them took: with a large
/// queue (counting a million waiting jobs takes a few hundred milliseconds) the deployment counts
/// less often, so counting never takes more than about a fortieth of one core, and the numbers are
/// then at most that much older.
pub const STATS_DUTY: f64 = 40.0;

/// Counts every class of `rt` into `queue_class_stats` when the stored numbers of one of them are
/// missing or older than [`STATS_FRESH`], unless another instance holds the stats lock (it is
/// counting them now). Counting reads every waiting job, which is why only one instance does it.
/// `force` counts whatever the stored numbers' age, waiting for the lock.
/// Returns, when it counted, the waiting jobs of each class that has any.
async fn compute(db: &PgPool, rt: &QueueRuntime, force: bool) -> Result<(Refreshed, Vec<(String, i64)>), sqlx::Error> {
    let classes: Vec<String> = rt.classes.keys().cloned().collect();
    let mut tx = db.begin().await?;
    if force {
        sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(STATS_LOCK).execute(&mut *tx).await?;
    } else {
        let locked: bool =
            sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1)").bind(STATS_LOCK).fetch_one(&mut *tx).await?;
        if !locked {
            return Ok((Refreshed::Shared, Vec::new()));
        }
        let fresh: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM queue_class_stats \
             WHERE class = ANY($1) \
               AND refreshed_at > now() - greatest($2::float8, $3::float8 * counting_s) * interval '1 second'",
        )
        .bind(&classes)
        .bind(STATS_FRESH.as_secs_f64())
        .bind(STATS_DUTY)
        .fetch_one(&mut *tx)
        .await?;
        if fresh as usize >= classes.len() {
            return Ok((Refreshed::Shared, Vec::new()));
        }
    }
    let counting = std::time::Instant::now();
    type Counted = (String, i64, Option<DateTime<Utc>>);
    /// A tenant's waiting jobs in one class: its name, how many, since when the oldest is due.
    type Load<'a> = (&'a str, i64, Option<DateTime<Utc>>);
    /// One row of [`WAITING_BY_TENANT`]: class, tenant, waiting, of which retrying, oldest due.
    type TenantRow = (String, String, i64, i64, Option<DateTime<Utc>>);
    let by_tenant: Vec<TenantRow> =
        sqlx::query_as(sqlx::AssertSqlSafe(WAITING_BY_TENANT.as_str())).fetch_all(&mut *tx).await?;
    let mut waiting: Vec<Counted> = Vec::new();
    let mut retrying_by_class: BTreeMap<&str, i64> = BTreeMap::new();
    let mut tenants: BTreeMap<&str, Vec<Load<'_>>> = BTreeMap::new();
    for (class, tenant, n, retrying, oldest) in &by_tenant {
        *retrying_by_class.entry(class.as_str()).or_default() += retrying;
        match waiting.iter_mut().find(|w| &w.0 == class) {
            Some(w) => {
                w.1 += n;
                w.2 = match (w.2, *oldest) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
            None => waiting.push((class.clone(), *n, *oldest)),
        }
        tenants.entry(class).or_default().push((tenant, *n, *oldest));
    }
    let dead: Vec<Counted> = sqlx::query_as(sqlx::AssertSqlSafe(DEAD_BY_CLASS.as_str())).fetch_all(&mut *tx).await?;
    let scheduled_by_class: BTreeMap<String, i64> = sqlx::query_as(sqlx::AssertSqlSafe(SCHEDULED_BY_CLASS.as_str()))
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .collect();
    let (mut pending, mut oldest_due_at, mut drain_per_s, mut dead_count, mut oldest_dead_at) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut retrying, mut scheduled) = (Vec::new(), Vec::new());
    let (mut tenant_loads, mut active_tenants) = (Vec::new(), Vec::new());
    for class in &classes {
        // The most recent finishes only, so the cost is bounded whatever the rate: under
        // DRAIN_SAMPLE finishes in the window, the rate is count / window; at or above it, the
        // rate is DRAIN_SAMPLE / the time those took (a full 30 s window at 27,000 jobs/s is
        // 800,000 index entries to count, every refresh). A discarded dead letter is a person's
        // clean-up, not the queue draining (its death was counted when it died).
        let (finished, span): (i64, f64) = sqlx::query_as(sqlx::AssertSqlSafe(DRAINED.as_str()))
            .bind(class)
            .bind(DRAIN_WINDOW.as_secs_f64())
            .bind(DRAIN_SAMPLE)
            .fetch_one(&mut *tx)
            .await?;
        drain_per_s.push(if finished >= DRAIN_SAMPLE && span > 0.0 {
            finished as f64 / span
        } else {
            finished as f64 / DRAIN_WINDOW.as_secs_f64()
        });
        let (n, oldest) = waiting.iter().find(|w| &w.0 == class).map_or((0, None), |w| (w.1, w.2));
        pending.push(n);
        retrying.push(retrying_by_class.get(class.as_str()).copied().unwrap_or(0));
        scheduled.push(scheduled_by_class.get(class).copied().unwrap_or(0));
        oldest_due_at.push(oldest);
        let (n, oldest) = dead.iter().find(|d| &d.0 == class).map_or((0, None), |d| (d.1, d.2));
        dead_count.push(n);
        oldest_dead_at.push(oldest);
        let mut loads = tenants.remove(class.as_str()).unwrap_or_default();
        active_tenants.push(loads.len() as i64);
        loads.sort_by_key(|(_, n, _)| std::cmp::Reverse(*n));
        loads.truncate(TENANTS_KEPT);
        let kept: BTreeMap<&str, (i64, Option<f64>)> = loads
            .into_iter()
            .map(|(t, n, oldest)| (t, (n, oldest.map(|at| at.timestamp_micros() as f64 / 1e6))))
            .collect();
        tenant_loads.push(serde_json::to_value(kept).expect("a map of numbers serialises"));
    }
    let counting_s = counting.elapsed().as_secs_f64();
    sqlx::query(
        "INSERT INTO queue_class_stats \
             (class, pending, oldest_due_at, drain_per_s, dead, oldest_dead_at, tenants, active_tenants, \
              retrying, scheduled, counting_s, refreshed_at) \
         SELECT c.*, $11, now() \
         FROM unnest($1::text[], $2::int8[], $3::timestamptz[], $4::float8[], $5::int8[], $6::timestamptz[], \
                     $7::jsonb[], $8::int8[], $9::int8[], $10::int8[]) AS c \
         ON CONFLICT (class) DO UPDATE SET pending = excluded.pending, oldest_due_at = excluded.oldest_due_at, \
             drain_per_s = excluded.drain_per_s, dead = excluded.dead, \
             oldest_dead_at = excluded.oldest_dead_at, tenants = excluded.tenants, \
             active_tenants = excluded.active_tenants, retrying = excluded.retrying, \
             scheduled = excluded.scheduled, counting_s = excluded.counting_s, refreshed_at = excluded.refreshed_at",
    )
    .bind(&classes)
    .bind(&pending)
    .bind(&oldest_due_at)
    .bind(&drain_per_s)
    .bind(&dead_count)
    .bind(&oldest_dead_at)
    .bind(&tenant_loads)
    .bind(&active_tenants)
    .bind(&retrying)
    .bind(&scheduled)
    .bind(counting_s)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((Refreshed::Computed, waiting.into_iter().map(|(class, n, _)| (class, n)).collect()))
}

/// Jobs waiting per class and tenant (all of them, and those waiting out a retry's backoff), and
/// since when the oldest of each is due.
static WAITING_BY_TENANT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT class, tenant, count(*), count(*) FILTER (WHERE status = {retrying}), \
                min(greatest(created_at, run_after)) FILTER (WHERE run_after <= now()) \
         FROM notification_jobs WHERE status IN ({waiting}) GROUP BY class, tenant",
        waiting = JobStatus::sql_list(&JobStatus::CLAIMABLE),
        retrying = JobStatus::Retrying.sql()
    )
});

/// Scheduled jobs per class (a literal state, as for the dead letters: the partial index applies).
static SCHEDULED_BY_CLASS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT class, count(*) FROM notification_jobs WHERE status = {} GROUP BY class",
        JobStatus::Scheduled.sql()
    )
});

/// Dead letters per class and the oldest one's death (a literal state, not a bind: a generic plan
/// could not prove the partial dead-letter index applies).
static DEAD_BY_CLASS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT class, count(*), min(finished_at) FROM notification_jobs WHERE status = {} GROUP BY class",
        JobStatus::Dead.sql()
    )
});

/// A class's most recent finishes (at most `$3` within `$2` seconds): how many and over how long.
static DRAINED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT count(*), coalesce(extract(epoch FROM now() - min(finished_at))::float8, 0) FROM ( \
            SELECT finished_at FROM notification_jobs \
            WHERE class = $1 AND finished_at > now() - $2::float8 * interval '1 second' \
              AND status <> {discarded} \
            ORDER BY finished_at DESC LIMIT $3) AS recent",
        discarded = JobStatus::Discarded.sql()
    )
});

/// Refreshes `stats` from the database (an outage only skips the refresh); run every [`STATS_INTERVAL`].
pub(crate) async fn refresh_round(db: PgPool, runtime: Arc<QueueRuntime>, stats: Arc<QueueStats>) {
    if let Err(e) = stats.refresh(&db, &runtime).await {
        tracing::debug!(error = %e, "queue stats: database unavailable");
    }
}

crate::statements::statements_of!(WAITING_BY_TENANT, SCHEDULED_BY_CLASS, DEAD_BY_CLASS, DRAINED);
