//! The batch in the database, in one transaction: a temporary staging table takes the rows by `COPY`
//! while the body is still arriving; once the whole batch is known to be valid and admitted, fair keys
//! are reserved per (priority, tenant) with the final counts and one `INSERT … SELECT` moves the rows
//! into `notification_jobs`. Reserving only then keeps each tenant clock locked for the insert alone,
//! never for a client's upload, and in one sorted order (no deadlock between two batches).

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row as _};

use crate::queue::batch::parse::Parsed;
use crate::queue::enqueue::{RunsByPriority, reserve_keys_of_runs};
use crate::queue::runtime::QueueRuntime;
use crate::queue::status::JobStatus;

/// The staging table of the request's transaction, dropped with it (commit or rollback). Columns left
/// NULL (class, tenant, due; `run_at` with `run_at_default`) take the batch's default, read after the
/// jobs; `grp` and `nth` place the row for its fair key (see [`super::rows`]).
pub(crate) const CREATE_STAGE: &str = "CREATE TEMP TABLE batch_stage ( \
        grp int4 NOT NULL, nth int8 NOT NULL, \
        class text, priority int2, max_attempts int4, deadline_s float8, \
        tenant text, run_at timestamptz, run_at_default bool NOT NULL, due bool, \
        recipient text NOT NULL, payload jsonb, sealed bytea, idempotency_key text \
    ) ON COMMIT DROP";

/// Begins the batch's work on `tx`: its statement timeout and the staging table.
pub async fn open(tx: &mut PgConnection) -> Result<(), sqlx::Error> {
    // The final insert of a large batch is one long statement.
    sqlx::query("SET LOCAL statement_timeout = '60s'").execute(&mut *tx).await?;
    sqlx::query(CREATE_STAGE).execute(&mut *tx).await?;
    Ok(())
}

/// Copies one chunk of staging rows. A statement per chunk: between chunks the connection waits for
/// the body without a statement running, so a slow client meets the request deadline, not a
/// statement timeout.
pub(crate) async fn copy_chunk(tx: &mut PgConnection, chunk: String) -> Result<(), sqlx::Error> {
    let mut copy = tx.copy_in_raw("COPY batch_stage FROM STDIN").await?;
    copy.send(chunk.into_bytes()).await?;
    copy.finish().await?;
    Ok(())
}

/// What [`insert`] stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Rows inserted per class (jobs whose key was used before are not).
    pub per_class: BTreeMap<String, u64>,
    /// The batch's id.
    pub batch_id: i64,
}

/// `INSERT … SELECT` from the staging table. One seq scan of a temporary table (never a synchronized
/// scan) reads it in the order it was copied, so ids follow the request's order as they did with COPY.
static INSERT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, \
             run_after, deadline, idempotency_key, batch_id, status, traceparent, keep_personal_data, sealed, sealed_with) \
         SELECT coalesce(s.class, $1), coalesce(s.priority, $2), coalesce(s.tenant, $3), \
                ($4::float8[])[s.grp] + ($5::float8[])[s.grp] * s.nth, \
                s.recipient, s.payload, coalesce(s.max_attempts, $6), \
                greatest($7::timestamptz + $8::float8 * interval '1 second', \
                         coalesce(CASE WHEN s.run_at_default THEN $9::timestamptz ELSE s.run_at END, $7)), \
                $7 + (CASE WHEN s.class IS NULL THEN $10::float8 ELSE s.deadline_s END) * interval '1 second', \
                s.idempotency_key, $11, \
                CASE WHEN $8 = 0 AND coalesce(s.due, $12) THEN {pending} ELSE {scheduled} END, $13, \
                ($15::float8[])[array_position($14::text[], coalesce(s.class, $1))] * interval '1 second', \
                s.sealed, CASE WHEN s.sealed IS NOT NULL THEN $16 END \
         FROM batch_stage s",
        pending = JobStatus::Pending.sql(),
        scheduled = JobStatus::Scheduled.sql(),
    )
});

/// The keyed form: rows whose (tenant, key) exists, or came earlier in the batch, are skipped.
static INSERT_KEYED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH ins AS ({} ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING \
                      RETURNING class) \
         SELECT class, count(*) FROM ins GROUP BY class",
        INSERT.as_str()
    )
});

/// Moves the staged, checked and admitted batch into `notification_jobs` as one batch created by
/// `created_by`, each job due `delay` after now or at its own `run_at`, the later; the jobs keep
/// `traceparent`, the request's trace.
pub async fn insert(
    tx: &mut PgConnection,
    rt: &QueueRuntime,
    parsed: &Parsed,
    delay: Duration,
    created_by: &str,
    traceparent: Option<String>,
) -> Result<Stored, sqlx::Error> {
    let defaults = &parsed.verdict.defaults;
    let batch = open_batch(tx, created_by, &parsed.verdict.tenants).await?;
    let batch_id = batch.id;
    // Deadlines and `run_after` count from now, when the batch is stored, not from the start of the
    // upload (the transaction's `now()`).
    let at: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(&mut *tx).await?;
    let default_class = rt.classes.get(&defaults.class).map(|c| &c.settings);
    let default_due = defaults.run_at.is_none_or(|t| t <= at);
    let (firsts, steps) =
        fair_keys(tx, rt, parsed, delay, default_class.map_or(0, |c| c.priority), default_due).await?;
    let sql = if parsed.keyed { INSERT_KEYED.as_str() } else { INSERT.as_str() };
    // The classes that keep a finished job's personal data, and for how many seconds (see
    // `crate::queue::privacy`); every other class's jobs are erased as they finish.
    let (keeping_classes, keeping_for): (Vec<&str>, Vec<f64>) = rt
        .classes
        .values()
        .filter_map(|c| Some((c.settings.name.as_str(), crate::queue::privacy::keep_seconds(&c.settings)?)))
        .unzip();
    let query = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&defaults.class)
        .bind(default_class.map_or(0, |c| c.priority))
        .bind(&defaults.tenant)
        .bind(&firsts)
        .bind(&steps)
        .bind(default_class.map_or(0, |c| c.max_attempts as i32))
        .bind(at)
        .bind(delay.as_secs_f64())
        .bind(defaults.run_at)
        .bind(default_class.and_then(|c| c.deadline).map(|d| d.as_secs_f64()))
        .bind(batch_id)
        .bind(default_due)
        .bind(traceparent)
        .bind(&keeping_classes)
        .bind(&keeping_for)
        .bind(rt.seal.key_id());
    let per_class: BTreeMap<String, u64> = if parsed.keyed {
        let rows = query.fetch_all(&mut *tx).await?;
        rows.iter().map(|r| (r.get::<String, _>(0), r.get::<i64, _>(1) as u64)).collect()
    } else {
        // Nothing can conflict: every job is inserted.
        query.execute(&mut *tx).await?;
        parsed.verdict.per_class.clone()
    };
    close_batch(tx, batch, per_class.values().sum()).await?;
    Ok(Stored { per_class, batch_id })
}

/// Reserves the fair keys of the batch's due jobs, per (priority, tenant) in sorted order, each
/// clock moved on by the group's final count; returns, per staging group, its first key and step (0 for
/// a group not due: its jobs wait as `scheduled` and get keys when they come due). Staging groups that
/// end in one (priority, tenant), the one a default named and the one its jobs named, follow each
/// other in order of first appearance.
async fn fair_keys(
    tx: &mut PgConnection,
    rt: &QueueRuntime,
    parsed: &Parsed,
    delay: Duration,
    default_priority: i16,
    default_due: bool,
) -> Result<(Vec<f64>, Vec<f64>), sqlx::Error> {
    let groups = &parsed.groups;
    if !delay.is_zero() {
        return Ok((vec![0.0; groups.len()], vec![0.0; groups.len()]));
    }
    let default_tenant = &parsed.verdict.defaults.tenant;
    let mut grouped = RunsByPriority::new();
    for (i, group) in groups.iter().enumerate().filter(|(_, g)| g.due.unwrap_or(default_due)) {
        let tenant = group.tenant.as_deref().unwrap_or(default_tenant);
        grouped.entry(group.priority.unwrap_or(default_priority)).or_default().entry(tenant).or_default().push(i);
    }
    let keys = reserve_keys_of_runs(tx, rt, groups.len(), &grouped, |i| groups[i].rows).await?;
    Ok(keys.into_iter().unzip())
}

/// A batch whose row exists and whose jobs are being inserted in the same transaction.
struct OpenBatch {
    /// The batch's id (`notification_jobs.batch_id` of its jobs).
    id: i64,
    /// The job id sequence's value before the batch's jobs.
    before: i64,
}

/// Creates the row of a batch by `created_by` for `tenants` (sorted, distinct); its job id range and
/// count are filled by [`close_batch`] once its jobs are in.
async fn open_batch(
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
async fn close_batch(tx: &mut sqlx::PgConnection, batch: OpenBatch, jobs: u64) -> Result<(), sqlx::Error> {
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

crate::statements::statements_of!(INSERT, INSERT_KEYED);
