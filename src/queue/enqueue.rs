//! Inserting validated jobs: weighted-fair keys per tenant (shared with batches and the stager) and
//! one job. Batches stream in through [`crate::queue::batch`].

use std::sync::LazyLock;
use std::time::Duration;

use sqlx::PgPool;

use crate::queue::job::NewJob;
use crate::queue::runtime::QueueRuntime;
use crate::queue::status::JobStatus;

/// The fair-share weight of `tenant` (`queue.tenant_weights`, default 1).
pub(crate) fn weight(rt: &QueueRuntime, tenant: &str) -> f64 {
    rt.settings.tenant_weights.get(tenant).copied().unwrap_or(1.0)
}

/// Moves a tenant's clock past `$3` keys from where the due front of priority `$1` stands, for tenant
/// `$2`, looking for the front no lower than `$4`; returns the clock's new end and the front found.
static RESERVE_FAIR_KEYS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH vt AS (SELECT coalesce(min(fair_key), $4) AS v FROM notification_jobs \
                     WHERE priority = $1 AND status IN ({waiting}) AND run_after <= now() AND fair_key >= $4) \
         INSERT INTO notification_tenant_clock AS c (priority, tenant, last_key) \
         SELECT $1, $2, vt.v + $3 FROM vt \
         ON CONFLICT (priority, tenant) DO UPDATE \
            SET last_key = greatest(c.last_key, (SELECT v FROM vt)) + $3 \
         RETURNING last_key, (SELECT v FROM vt)",
        waiting = JobStatus::sql_list(&JobStatus::CLAIMABLE)
    )
});

/// Where the due front of each priority stood when this instance last reserved fair keys there.
///
/// The front only moves on as jobs are claimed, so the next look for it starts where the last one
/// found it: the index seek skips the entries of every job claimed before, instead of reading past
/// them. Those entries are normally cleaned up quickly, but while a long transaction or a replication
/// slot holds the database's cleanup horizon back they stay, and a look from the start read every
/// one of them (measured: over a second per intake batch three minutes into a held snapshot). A due
/// retry whose key lies behind the front no longer anchors it; it is still claimed first.
#[derive(Debug, Default)]
pub struct DueFronts(std::sync::Mutex<std::collections::BTreeMap<i16, f64>>);

impl DueFronts {
    /// Where to start looking for the front of `priority` (0 before the first look: keys start there).
    fn floor(&self, priority: i16) -> f64 {
        self.0.lock().expect("due fronts lock").get(&priority).copied().unwrap_or(0.0)
    }

    /// Records that the front of `priority` stood at `front`; it never moves back.
    fn advance(&self, priority: i16, front: f64) {
        let mut fronts = self.0.lock().expect("due fronts lock");
        let at = fronts.entry(priority).or_insert(front);
        *at = at.max(front);
    }
}

/// Reserves `count` fair keys for `tenant` at `priority`: the tenant's clock moves on by
/// `count / weight`, starting no earlier than the smallest key of the jobs that are due at that
/// priority, the front of the queue (so a tenant returning after a pause does not jump the whole queue
/// with stale credit). Jobs not due yet (a retry waiting out a long backoff) do not anchor it: a key
/// from before their wait would hand a new tenant the turns of everyone queued since. With an empty
/// queue the front stays where it was last seen ([`DueFronts`]). Returns the first key and the step.
pub async fn reserve_fair_keys(
    tx: &mut sqlx::PgConnection,
    fronts: &DueFronts,
    priority: i16,
    tenant: &str,
    count: usize,
    weight: f64,
) -> Result<(f64, f64), sqlx::Error> {
    let step = 1.0 / weight;
    let (end, front): (f64, f64) = sqlx::query_as(sqlx::AssertSqlSafe(RESERVE_FAIR_KEYS.as_str()))
        .bind(priority)
        .bind(tenant)
        .bind(step * count as f64)
        .bind(fronts.floor(priority))
        .fetch_one(&mut *tx)
        .await?;
    fronts.advance(priority, front);
    Ok((end - step * count as f64 + step, step))
}

/// Result of [`enqueue_one`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    /// The job's id (also the provider's idempotency key).
    pub id: i64,
    /// False when the idempotency key matched an existing job.
    pub created: bool,
}

/// The job an idempotency key already produced, if any.
pub(crate) async fn existing(db: &PgPool, tenant: &str, key: &str) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM notification_jobs WHERE tenant = $1 AND idempotency_key = $2")
        .bind(tenant)
        .bind(key)
        .fetch_optional(db)
        .await
}

/// Whether a job enqueued now is due at once; one due later goes in `scheduled`, with no fair key
/// (the stager gives it one when it comes due).
fn due_now(delay: Duration, run_at: Option<chrono::DateTime<chrono::Utc>>, now: chrono::DateTime<chrono::Utc>) -> bool {
    delay.is_zero() && run_at.is_none_or(|t| t <= now)
}

/// The status column value of a job due at once or not.
fn initial_status(due: bool) -> &'static str {
    if due { JobStatus::Pending.as_str() } else { JobStatus::Scheduled.as_str() }
}

/// Inserts one job (validated by the caller), `delay` after now.
pub async fn enqueue_one(
    db: &PgPool,
    rt: &QueueRuntime,
    job: &NewJob,
    delay: Duration,
) -> Result<Enqueued, sqlx::Error> {
    let class = &rt.classes[&job.class].settings;
    // Sealed before the transaction: no lock is held while it encrypts.
    let stored = rt.seal.store(&job.recipient, job.payload.get());
    // No look-up first: callers that need one before admission do it ([`existing`]); a repeated key
    // loses the insert below and gets the existing job back.
    let mut tx = db.begin().await?;
    let due = due_now(delay, job.run_at, chrono::Utc::now());
    let fair_key = if due {
        reserve_fair_keys(&mut tx, &rt.due_fronts, class.priority, &job.tenant, 1, weight(rt, &job.tenant)).await?.0
    } else {
        0.0
    };
    let id: Option<i64> = sqlx::query_scalar(
        "INSERT INTO notification_jobs \
            (class, priority, tenant, fair_key, recipient, payload, max_attempts, run_after, deadline, idempotency_key, \
             status, traceparent, keep_personal_data, sealed, sealed_with) \
         VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, \
                 greatest(now() + $8::float8 * interval '1 second', coalesce($11, now())), \
                 clock_timestamp() + $9::float8 * interval '1 second', $10, $12, $13, \
                 $14::float8 * interval '1 second', $15, $16) \
         ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING id",
    )
    .bind(&job.class)
    .bind(class.priority)
    .bind(&job.tenant)
    .bind(fair_key)
    .bind(stored.recipient())
    .bind(stored.payload())
    .bind(class.max_attempts as i32)
    .bind(delay.as_secs_f64())
    .bind(class.deadline.map(|d| d.as_secs_f64()))
    .bind(&job.idempotency_key)
    .bind(job.run_at)
    .bind(initial_status(due))
    .bind(crate::telemetry::traces::current_traceparent())
    .bind(crate::queue::privacy::keep_seconds(class))
    .bind(stored.sealed())
    .bind(stored.sealed().map(|_| rt.seal.key_id()))
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    match id {
        Some(id) => Ok(Enqueued { id, created: true }),
        // The key exists (an earlier request, or a concurrent one that won): return that job.
        None => {
            let key = job.idempotency_key.as_deref().unwrap_or_default();
            let id = existing(db, &job.tenant, key).await?.ok_or(sqlx::Error::RowNotFound)?;
            Ok(Enqueued { id, created: false })
        }
    }
}

crate::statements::statements_of!(RESERVE_FAIR_KEYS);
