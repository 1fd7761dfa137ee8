//! Inserting validated jobs: weighted-fair keys per tenant, one job, or a batch by `COPY` (no
//! idempotency keys) or by array binds (with keys, skipping those already used).

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Duration;

use sqlx::PgPool;

use crate::queue::intake::NewJob;
use crate::queue::runtime::QueueRuntime;
use crate::queue::status::JobStatus;

/// Rows per INSERT … SELECT FROM unnest statement of a batch.
const CHUNK: usize = 50_000;

/// The fair-share weight of `tenant` (`queue.tenant_weights`, default 1).
pub(crate) fn weight(rt: &QueueRuntime, tenant: &str) -> f64 {
    rt.settings.tenant_weights.get(tenant).copied().unwrap_or(1.0)
}

/// Reserves `count` fair keys for `tenant` at `priority`: the tenant's clock moves on by
/// `count / weight`, starting no earlier than the smallest key of the jobs that are due at that
/// priority, the front of the queue (so a tenant returning after a pause does not jump the whole queue
/// with stale credit). Jobs not due yet (a retry waiting out a long backoff) do not anchor it: a key
/// from before their wait would hand a new tenant the turns of everyone queued since. Returns the
/// first key and the step.
pub(crate) async fn reserve_fair_keys(
    tx: &mut sqlx::PgConnection,
    priority: i16,
    tenant: &str,
    count: usize,
    weight: f64,
) -> Result<(f64, f64), sqlx::Error> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "WITH vt AS (SELECT coalesce(min(fair_key), 0) AS v FROM notification_jobs \
                         WHERE priority = $1 AND status IN ({waiting}) AND run_after <= now()) \
             INSERT INTO notification_tenant_clock AS c (priority, tenant, last_key) \
             SELECT $1, $2, vt.v + $3 FROM vt \
             ON CONFLICT (priority, tenant) DO UPDATE \
                SET last_key = greatest(c.last_key, (SELECT v FROM vt)) + $3 \
             RETURNING last_key",
            waiting = JobStatus::sql_list(&JobStatus::CLAIMABLE)
        )
    });
    let step = 1.0 / weight;
    let end: f64 = sqlx::query_scalar(sqlx::AssertSqlSafe(SQL.as_str()))
        .bind(priority)
        .bind(tenant)
        .bind(step * count as f64)
        .fetch_one(&mut *tx)
        .await?;
    Ok((end - step * count as f64 + step, step))
}

/// Result of [`enqueue_one`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    /// Job id.
    pub id: i64,
    /// False when the idempotency key matched an existing job.
    pub created: bool,
}

/// The job an idempotency key already produced, if any.
pub async fn existing(db: &PgPool, tenant: &str, key: &str) -> Result<Option<i64>, sqlx::Error> {
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
    // No look-up first: callers that need one before admission do it ([`existing`]); a repeated key
    // loses the insert below and gets the existing job back.
    let mut tx = db.begin().await?;
    let due = due_now(delay, job.run_at, chrono::Utc::now());
    let fair_key = if due {
        reserve_fair_keys(&mut tx, class.priority, &job.tenant, 1, weight(rt, &job.tenant)).await?.0
    } else {
        0.0
    };
    let id: Option<i64> = sqlx::query_scalar(
        "INSERT INTO notification_jobs \
            (class, priority, tenant, fair_key, recipient, payload, max_attempts, run_after, deadline, idempotency_key, \
             status, traceparent) \
         VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, \
                 greatest(now() + $8::float8 * interval '1 second', coalesce($11, now())), \
                 clock_timestamp() + $9::float8 * interval '1 second', $10, $12, $13) \
         ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING id",
    )
    .bind(&job.class)
    .bind(class.priority)
    .bind(&job.tenant)
    .bind(fair_key)
    .bind(&job.recipient)
    .bind(job.payload.get())
    .bind(class.max_attempts as i32)
    .bind(delay.as_secs_f64())
    .bind(class.deadline.map(|d| d.as_secs_f64()))
    .bind(&job.idempotency_key)
    .bind(job.run_at)
    .bind(initial_status(due))
    .bind(crate::telemetry::traces::current_traceparent())
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

/// What [`enqueue_batch`] inserted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchInserted {
    /// Rows inserted per class.
    pub per_class: BTreeMap<String, u64>,
    /// The batch's id (`GET /v1/notifications/batches/{id}`).
    pub batch_id: i64,
}

/// Inserts many validated jobs, already in memory, in one transaction, fair keys reserved once per
/// (priority, tenant), as one batch created by `created_by` (the lab's batches; HTTP batches stream
/// through [`crate::queue::batch`]). A batch without idempotency keys (bulk promo, the common case)
/// goes in by `COPY`; a batch with keys by array binds (`INSERT … SELECT FROM unnest … ON CONFLICT`),
/// skipping jobs whose key exists. Each job is due after `delay` or at its own `run_at`, the later.
pub async fn enqueue_batch(
    db: &PgPool,
    rt: &QueueRuntime,
    jobs: &[NewJob],
    delay: Duration,
    created_by: &str,
) -> Result<BatchInserted, sqlx::Error> {
    let mut tx = db.begin().await?;
    // A large batch is one transaction of several statements; give each the time it needs.
    sqlx::query("SET LOCAL statement_timeout = '60s'").execute(&mut *tx).await?;
    let mut tenants: Vec<String> = jobs.iter().map(|j| j.tenant.clone()).collect();
    tenants.sort_unstable();
    tenants.dedup();
    let batch = open_batch(&mut tx, created_by, &tenants).await?;
    let batch_id = batch.id;
    // The transaction's `now()`, which every row's `run_after` and `deadline` count from.
    let now: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT now()").fetch_one(&mut *tx).await?;
    let due: Vec<bool> = jobs.iter().map(|j| due_now(delay, j.run_at, now)).collect();
    // Fair keys for the jobs due now: a contiguous run per (priority, tenant), in request order.
    let mut groups: BTreeMap<(i16, &str), Vec<usize>> = BTreeMap::new();
    for (i, job) in jobs.iter().enumerate().filter(|(i, _)| due[*i]) {
        groups.entry((rt.classes[&job.class].settings.priority, job.tenant.as_str())).or_default().push(i);
    }
    let mut keys = vec![0.0f64; jobs.len()];
    for ((priority, tenant), members) in &groups {
        let (first, step) = reserve_fair_keys(&mut tx, *priority, tenant, members.len(), weight(rt, tenant)).await?;
        for (n, &i) in members.iter().enumerate() {
            keys[i] = first + step * n as f64;
        }
    }
    let rows = BatchRows { jobs, keys: &keys, due: &due, now, delay, batch_id };
    let inserted = if jobs.iter().all(|j| j.idempotency_key.is_none()) {
        copy_unkeyed(&mut tx, rt, rows).await?
    } else {
        insert_keyed(&mut tx, rt, rows).await?
    };
    close_batch(&mut tx, batch, inserted.values().sum()).await?;
    tx.commit().await?;
    Ok(BatchInserted { per_class: inserted, batch_id })
}

/// A batch whose row exists and whose jobs are being inserted in the same transaction.
pub(crate) struct OpenBatch {
    /// The batch's id (`notification_jobs.batch_id` of its jobs).
    pub id: i64,
    /// The job id sequence's value before the batch's jobs.
    before: i64,
}

/// Creates the row of a batch by `created_by` for `tenants` (sorted, distinct); its job id range and
/// count are filled by [`close_batch`] once its jobs are in.
pub(crate) async fn open_batch(
    tx: &mut sqlx::PgConnection,
    created_by: &str,
    tenants: &[String],
) -> Result<OpenBatch, sqlx::Error> {
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO notification_batches (created_by, first_job_id, last_job_id, jobs, tenants) \
         VALUES ($1, 0, 0, 0, $2) RETURNING id",
    )
    .bind(created_by)
    .bind(tenants)
    .fetch_one(&mut *tx)
    .await?;
    // Job ids come from a sequence (no cache): every id the batch's insert takes lies above the value
    // read now and at or below the one read after it, whatever other inserts interleave.
    let before = last_job_id(tx).await?;
    Ok(OpenBatch { id, before })
}

/// Records the job id range and the number of jobs `batch` inserted (what batch status and cancel read).
pub(crate) async fn close_batch(tx: &mut sqlx::PgConnection, batch: OpenBatch, jobs: u64) -> Result<(), sqlx::Error> {
    let after = last_job_id(&mut *tx).await?;
    sqlx::query("UPDATE notification_batches SET first_job_id = $2, last_job_id = $3, jobs = $4 WHERE id = $1")
        .bind(batch.id)
        .bind(batch.before + 1)
        .bind(after)
        .bind(jobs as i64)
        .execute(tx)
        .await?;
    Ok(())
}

/// The job id sequence's last value (0 before any job).
async fn last_job_id(tx: &mut sqlx::PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('notification_jobs', 'id')::regclass), 0)",
    )
    .fetch_one(tx)
    .await
}

/// A batch's rows as [`enqueue_batch`] prepared them, for the insert paths.
#[derive(Clone, Copy)]
struct BatchRows<'a> {
    jobs: &'a [NewJob],
    /// Each job's fair key (unused for a job not due now).
    keys: &'a [f64],
    /// Whether each job is due now (`pending`) or later (`scheduled`).
    due: &'a [bool],
    /// The transaction's `now()`.
    now: chrono::DateTime<chrono::Utc>,
    /// Intake's deferral of the whole batch.
    delay: Duration,
    batch_id: i64,
}

/// The keyed path of [`enqueue_batch`]: array binds, conflicts on the idempotency key skipped.
async fn insert_keyed(
    tx: &mut sqlx::PgConnection,
    rt: &QueueRuntime,
    rows: BatchRows<'_>,
) -> Result<BTreeMap<String, u64>, sqlx::Error> {
    let BatchRows { jobs, keys, due, delay, batch_id, .. } = rows;
    let traceparent = crate::telemetry::traces::current_traceparent();
    let mut inserted: BTreeMap<String, u64> = BTreeMap::new();
    for (chunk_no, chunk) in jobs.chunks(CHUNK).enumerate() {
        let offset = chunk_no * CHUNK;
        let mut class = Vec::with_capacity(chunk.len());
        let mut priority = Vec::with_capacity(chunk.len());
        let mut tenant = Vec::with_capacity(chunk.len());
        let mut fair = Vec::with_capacity(chunk.len());
        let mut recipient = Vec::with_capacity(chunk.len());
        let mut payload = Vec::with_capacity(chunk.len());
        let mut attempts = Vec::with_capacity(chunk.len());
        let mut deadline = Vec::with_capacity(chunk.len());
        let mut key = Vec::with_capacity(chunk.len());
        let mut run_at = Vec::with_capacity(chunk.len());
        let mut status = Vec::with_capacity(chunk.len());
        for (i, job) in chunk.iter().enumerate() {
            let c = &rt.classes[&job.class].settings;
            class.push(job.class.as_str());
            priority.push(c.priority);
            tenant.push(job.tenant.as_str());
            fair.push(keys[offset + i]);
            recipient.push(job.recipient.as_str());
            payload.push(job.payload.get());
            attempts.push(c.max_attempts as i32);
            deadline.push(c.deadline.map(|d| d.as_secs_f64()));
            key.push(job.idempotency_key.as_deref());
            run_at.push(job.run_at);
            status.push(initial_status(due[offset + i]));
        }
        let counts: Vec<(String, i64)> = sqlx::query_as(
            "WITH ins AS (INSERT INTO notification_jobs \
                (class, priority, tenant, fair_key, recipient, payload, max_attempts, run_after, deadline, \
                 idempotency_key, batch_id, status, traceparent) \
             SELECT c, p, t, f, r, pl::jsonb, a, \
                    greatest(now() + $10::float8 * interval '1 second', coalesce(ra, now())), \
                    clock_timestamp() + d * interval '1 second', k, $12, s, $14 \
             FROM unnest($1::text[], $2::int2[], $3::text[], $4::float8[], $5::text[], $6::text[], $7::int4[], \
                         $8::float8[], $9::text[], $11::timestamptz[], $13::text[]) \
                  AS u(c, p, t, f, r, pl, a, d, k, ra, s) \
             ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING class) \
             SELECT class, count(*) FROM ins GROUP BY class",
        )
        .bind(&class)
        .bind(&priority)
        .bind(&tenant)
        .bind(&fair)
        .bind(&recipient)
        .bind(&payload)
        .bind(&attempts)
        .bind(&deadline)
        .bind(&key)
        .bind(delay.as_secs_f64())
        .bind(&run_at)
        .bind(batch_id)
        .bind(&status)
        .bind(&traceparent)
        .fetch_all(&mut *tx)
        .await?;
        for (class, n) in counts {
            *inserted.entry(class).or_default() += n as u64;
        }
    }
    Ok(inserted)
}

/// Bytes of COPY text sent per message.
const COPY_CHUNK: usize = 4 << 20;

/// The `COPY` path of [`enqueue_batch`], for jobs without idempotency keys (nothing can conflict).
/// `run_after` and `deadline` are computed from the transaction's `now()`, the value the column
/// default would give, so a deadline counts from the start of the batch, never later.
async fn copy_unkeyed(
    tx: &mut sqlx::PgConnection,
    rt: &QueueRuntime,
    rows: BatchRows<'_>,
) -> Result<BTreeMap<String, u64>, sqlx::Error> {
    use std::fmt::Write as _;
    let BatchRows { jobs, keys, due, now, delay, batch_id } = rows;
    let at = |after: Duration| {
        let t = now + chrono::Duration::from_std(after).unwrap_or(chrono::Duration::MAX);
        t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
    };
    let default_run_after = at(delay);
    let mut inserted: BTreeMap<&str, u64> = BTreeMap::new();
    let mut copy = tx
        .copy_in_raw(
            "COPY notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, \
             run_after, deadline, batch_id, status, traceparent) FROM STDIN",
        )
        .await?;
    // One trace context for the whole batch: the request's (`\\N`, NULL, without traces).
    let traceparent = crate::telemetry::traces::current_traceparent()
        .map_or_else(|| "\\N".to_string(), |t| copy_escape(&t).into_owned());
    let mut text = String::with_capacity(COPY_CHUNK + 4096);
    for ((job, key), due) in jobs.iter().zip(keys).zip(due) {
        let class = &rt.classes[&job.class].settings;
        let deadline = class.deadline.map_or_else(|| "\\N".to_string(), at);
        // A scheduled job is due at its `run_at` unless intake deferred the batch past it.
        let scheduled = job.run_at.and_then(|t| (t - now).to_std().ok()).filter(|d| *d > delay);
        let run_after = scheduled.map_or_else(|| default_run_after.clone(), at);
        let _ = write!(text, "{}\t{}\t", copy_escape(&job.class), class.priority);
        let _ = write!(text, "{}\t{key}\t{}\t", copy_escape(&job.tenant), copy_escape(&job.recipient));
        let _ = write!(text, "{}\t{}\t", copy_escape(job.payload.get()), class.max_attempts);
        let _ = writeln!(text, "{run_after}\t{deadline}\t{batch_id}\t{}\t{traceparent}", initial_status(*due));
        *inserted.entry(job.class.as_str()).or_default() += 1;
        if text.len() >= COPY_CHUNK {
            copy.send(text.as_bytes()).await?;
            text.clear();
        }
    }
    if !text.is_empty() {
        copy.send(text.as_bytes()).await?;
    }
    copy.finish().await?;
    Ok(inserted.into_iter().map(|(class, n)| (class.to_string(), n)).collect())
}

/// Escapes a value for COPY's text format (backslash, tab, newline, carriage return).
pub(crate) fn copy_escape(value: &str) -> std::borrow::Cow<'_, str> {
    if !value.contains(['\\', '\t', '\n', '\r']) {
        return std::borrow::Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 8);
    for ch in value.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::copy_escape;

    #[test]
    fn copy_escape_doubles_backslashes_and_escapes_separators() {
        assert_eq!(copy_escape("plain"), "plain");
        assert_eq!(copy_escape(r#"{"a":"x\"y"}"#), r#"{"a":"x\\"y"}"#);
        assert_eq!(copy_escape("a\tb\nc\rd"), "a\\tb\\nc\\rd");
    }
}
