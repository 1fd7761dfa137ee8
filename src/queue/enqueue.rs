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

/// Moves the clocks of tenants `$2` at priority `$1` on by their spans `$3` (`text[]`, `float8[]`,
/// aligned, tenants distinct), each from where the due front of the priority stands: the smallest key
/// of a due job no lower than `$4`, or `$5` when there is none. Returns each tenant's clock's new end
/// and the front. One look serves every tenant of a batch: the front is the same for all of them
/// (their own jobs are inserted after). The clocks are locked in byte order of the tenant, as
/// [`reserve_fair_keys`] promises.
static RESERVE_FAIR_KEYS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH vt AS (SELECT coalesce(min(fair_key), $5) AS v FROM notification_jobs \
                     WHERE priority = $1 AND status IN ({waiting}) AND run_after <= now() AND fair_key >= $4), \
              wanted AS (SELECT tenant, span FROM unnest($2::text[], $3::float8[]) AS w(tenant, span)) \
         INSERT INTO notification_tenant_clock AS c (priority, tenant, last_key) \
         SELECT $1, w.tenant, vt.v + w.span FROM wanted w, vt ORDER BY w.tenant COLLATE \"C\" \
         ON CONFLICT (priority, tenant) DO UPDATE \
            SET last_key = greatest(c.last_key, (SELECT v FROM vt)) \
                + (SELECT span FROM wanted WHERE wanted.tenant = excluded.tenant) \
         RETURNING tenant, last_key, (SELECT v FROM vt)",
        waiting = JobStatus::sql_list(&JobStatus::CLAIMABLE)
    )
});

/// Where the due front of each priority stood when this instance last reserved fair keys there, and
/// the highest key it has handed out there.
///
/// The front only moves on as jobs are claimed, so the next look for it starts where the last one
/// found it: the index seek skips the entries of every job claimed before, instead of reading past
/// them. Those entries are normally cleaned up quickly, but while a long transaction or a replication
/// slot holds the database's cleanup horizon back they stay, and a look from the start read every
/// one of them (measured: over a second per intake batch three minutes into a held snapshot). A due
/// retry whose key lies behind the front no longer anchors it; it is still claimed first.
///
/// A look that finds no due job (the queue keeps up) puts the front at the highest key this instance
/// has handed out at the priority: every job it keyed has been claimed or is not due, so a newcomer
/// starts where the queue's turns have got to, and the next look starts above the entries of all those
/// jobs. (Left at the last front found, every look while the queue kept up walked the entries of every
/// job claimed since the queue last had a backlog: under a held horizon ~3 ms a look, one look per
/// tenant of each batch, about as much of Postgres's CPU as the claims.)
#[derive(Debug, Default)]
pub struct DueFronts(std::sync::Mutex<std::collections::BTreeMap<i16, DueFront>>);

/// One priority's entry in [`DueFronts`].
#[derive(Debug, Default, Clone, Copy)]
struct DueFront {
    /// Where the last look found the front (0 before the first look: keys start there).
    front: f64,
    /// The highest key this instance has handed out at the priority.
    keyed_up_to: f64,
}

impl DueFronts {
    /// Where the next look for the front of `priority` starts, and the front it takes when it finds
    /// no due job.
    fn look(&self, priority: i16) -> (f64, f64) {
        let at = self.0.lock().expect("due fronts lock").get(&priority).copied().unwrap_or_default();
        (at.front, at.front.max(at.keyed_up_to))
    }

    /// Records that the front of `priority` stood at `front` and that keys up to `last_key` were
    /// handed out; neither moves back.
    fn advance(&self, priority: i16, front: f64, last_key: f64) {
        let mut fronts = self.0.lock().expect("due fronts lock");
        let at = fronts.entry(priority).or_default();
        at.front = at.front.max(front);
        at.keyed_up_to = at.keyed_up_to.max(last_key);
    }
}

/// One tenant's part of a [`reserve_fair_keys`]: `count` keys at its `weight`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeysWanted<'a> {
    /// The tenant whose clock moves.
    pub tenant: &'a str,
    /// How many keys it takes.
    pub count: usize,
    /// Its fair-share weight (a step of `1 / weight` between its keys).
    pub weight: f64,
}

/// Reserves fair keys for each of `wanted` (distinct tenants) at `priority`, in one statement: each
/// tenant's clock moves on by `count / weight`, starting no earlier than the smallest key of the jobs
/// that are due at that priority, the front of the queue (so a tenant returning after a pause does not
/// jump the whole queue with stale credit). Jobs not due yet (a retry waiting out a long backoff) do
/// not anchor it: a key from before their wait would hand a new tenant the turns of everyone queued
/// since. With no due job the front is the highest key this instance has handed out there
/// ([`DueFronts`]). Returns each tenant's first key and step, in the order of `wanted`.
///
/// The clocks are locked in byte order of the tenant names (Rust's `str` order), whatever the order of
/// `wanted`: two intakes with tenants in common cannot deadlock.
pub async fn reserve_fair_keys(
    tx: &mut sqlx::PgConnection,
    fronts: &DueFronts,
    priority: i16,
    wanted: &[KeysWanted<'_>],
) -> Result<Vec<(f64, f64)>, sqlx::Error> {
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let tenants: Vec<&str> = wanted.iter().map(|w| w.tenant).collect();
    let spans: Vec<f64> = wanted.iter().map(|w| w.count as f64 / w.weight).collect();
    let (from, if_none) = fronts.look(priority);
    let rows: Vec<(String, f64, f64)> = sqlx::query_as(sqlx::AssertSqlSafe(RESERVE_FAIR_KEYS.as_str()))
        .bind(priority)
        .bind(&tenants)
        .bind(&spans)
        .bind(from)
        .bind(if_none)
        .fetch_all(&mut *tx)
        .await?;
    let ends: std::collections::HashMap<&str, f64> = rows.iter().map(|(t, end, _)| (t.as_str(), *end)).collect();
    let mut keys = Vec::with_capacity(wanted.len());
    for (w, span) in wanted.iter().zip(&spans) {
        let end = *ends.get(w.tenant).ok_or(sqlx::Error::RowNotFound)?;
        let step = 1.0 / w.weight;
        keys.push((end - span + step, step));
    }
    if let Some((_, _, front)) = rows.first() {
        let last_key = rows.iter().map(|r| r.1).fold(f64::NEG_INFINITY, f64::max);
        fronts.advance(priority, *front, last_key);
    }
    Ok(keys)
}

/// Indexes into a caller's list of key runs (a batch's staging groups, a stager's due jobs), grouped by
/// priority, then by tenant in byte order: what [`reserve_keys_of_runs`] reserves for.
pub(crate) type RunsByPriority<'a> = std::collections::BTreeMap<i16, std::collections::BTreeMap<&'a str, Vec<usize>>>;

/// Reserves the fair keys of `runs` key runs (run `i` takes `keys_in(i)` keys), grouped in `grouped`,
/// with one [`reserve_fair_keys`] per priority. Returns each run's first key and step; one tenant's
/// runs follow each other in the order listed. A run in no group gets `(0.0, 0.0)`.
pub(crate) async fn reserve_keys_of_runs(
    tx: &mut sqlx::PgConnection,
    rt: &QueueRuntime,
    runs: usize,
    grouped: &RunsByPriority<'_>,
    keys_in: impl Fn(usize) -> u64,
) -> Result<Vec<(f64, f64)>, sqlx::Error> {
    let mut keys = vec![(0.0, 0.0); runs];
    for (&priority, tenants) in grouped {
        let wanted: Vec<KeysWanted> = tenants
            .iter()
            .map(|(tenant, members)| KeysWanted {
                tenant,
                count: members.iter().map(|&i| keys_in(i)).sum::<u64>() as usize,
                weight: weight(rt, tenant),
            })
            .collect();
        let reserved = reserve_fair_keys(tx, &rt.due_fronts, priority, &wanted).await?;
        for (members, (first, step)) in tenants.values().zip(reserved) {
            let mut offset = 0u64;
            for &i in members {
                keys[i] = (first + step * offset as f64, step);
                offset += keys_in(i);
            }
        }
    }
    Ok(keys)
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
        let wanted = KeysWanted { tenant: &job.tenant, count: 1, weight: weight(rt, &job.tenant) };
        reserve_fair_keys(&mut tx, &rt.due_fronts, class.priority, &[wanted]).await?[0].0
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
