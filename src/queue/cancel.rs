//! Taking jobs out of the queue before they are sent: one job, or every unsent job of a batch, and what a
//! batch holds now. A job that a worker has already claimed cannot be canceled: the cancel and the claim
//! meet on the job's row lock, so exactly one of them wins.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use tokio_util::task::TaskTracker;

use crate::audit::{Actor, Columns, action, audited, insert_from};
use crate::queue::status::JobStatus;
use crate::queue::store::{self, JobView};

/// Job ids per statement of a batch cancel: bounded, so no statement is one huge transaction and the
/// rows it holds are released soon.
const CANCEL_CHUNK: i64 = 20_000;

/// What canceling one job did.
#[derive(Debug, Clone, PartialEq)]
pub enum Canceled {
    /// It was waiting (pending, scheduled or retrying) and is canceled now.
    Now(JobView),
    /// It was canceled before (a repeated cancel).
    Already(JobView),
    /// It is being sent or is finished: too late.
    TooLate(JobView),
    /// No such job.
    NotFound,
}

static CANCEL_ONE: LazyLock<String> = LazyLock::new(|| {
    let cancel = format!(
        "UPDATE notification_jobs SET status = {canceled}, finished_at = clock_timestamp(), \
                last_error = 'canceled by ' || $2, {erase} \
         WHERE id = $1 AND status IN ({waiting}) RETURNING id, tenant, class",
        canceled = JobStatus::Canceled.sql(),
        erase = crate::queue::privacy::ERASE_ON_FINISH,
        waiting = JobStatus::sql_list(&JobStatus::CANCELABLE)
    );
    let columns = Columns {
        actor: "$2",
        request_id: "$3",
        client_request_id: "$4",
        detail: "jsonb_build_object('job', id, 'tenant', tenant, 'class', class)",
        ..Columns::default()
    };
    audited(&cancel, &insert_from(action::JOB_CANCELED, &columns, "done"), "id")
});

/// Cancels job `id` if it is still waiting, with its audit row.
pub(crate) async fn cancel_job(db: &PgPool, id: i64, actor: &Actor) -> Result<Canceled, sqlx::Error> {
    let done: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(CANCEL_ONE.as_str()))
        .bind(id)
        .bind(&actor.name)
        .bind(&actor.request_id)
        .bind(&actor.client_request_id)
        .fetch_optional(db)
        .await?;
    let Some(view) = store::get_job(db, id).await? else { return Ok(Canceled::NotFound) };
    Ok(match (done, view.status.as_str()) {
        (Some(_), _) => Canceled::Now(view),
        (None, "canceled") => Canceled::Already(view),
        (None, _) => Canceled::TooLate(view),
    })
}

/// A batch as its insert recorded it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Batch {
    /// The batch's id.
    pub id: i64,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// The key (actor) that enqueued it.
    pub created_by: String,
    /// Every job id of the batch lies in `first_job_id ..= last_job_id`.
    pub first_job_id: i64,
    /// See `first_job_id`.
    pub last_job_id: i64,
    /// Jobs inserted (duplicates skipped).
    pub jobs: i64,
    /// The tenants of its jobs.
    pub tenants: Vec<String>,
}

/// The batch `id`, if it exists.
pub async fn batch(db: &PgPool, id: i64) -> Result<Option<Batch>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, created_at, created_by, first_job_id, last_job_id, jobs, tenants FROM notification_batches \
         WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(db)
    .await
}

/// Where a batch's jobs stand.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchView {
    /// The batch's id.
    pub id: i64,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// The key that enqueued it.
    pub created_by: String,
    /// Jobs it holds.
    pub jobs: i64,
    /// Jobs per status; only statuses with jobs appear.
    pub by_status: BTreeMap<String, i64>,
}

/// Counts a batch's jobs by status (through the primary key, over the batch's id range).
pub(crate) async fn batch_view(db: &PgPool, batch: &Batch) -> Result<BatchView, sqlx::Error> {
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT status, count(*) \
         FROM notification_jobs WHERE id BETWEEN $1 AND $2 AND batch_id = $3 GROUP BY 1",
    )
    .bind(batch.first_job_id)
    .bind(batch.last_job_id)
    .bind(batch.id)
    .fetch_all(db)
    .await?;
    Ok(BatchView {
        id: batch.id,
        created_at: batch.created_at,
        created_by: batch.created_by.clone(),
        jobs: batch.jobs,
        by_status: rows.into_iter().collect(),
    })
}

static CANCEL_CHUNK_SQL: LazyLock<String> = LazyLock::new(|| {
    // A plain UPDATE over an id range, not a locking pick: a row a claim statement is taking right now
    // is waited for (a few milliseconds; claimers skip the rows this holds, so they never wait on it),
    // then re-checked, so a job claimed meanwhile stays claimed. Without the pick's row-lock records
    // and sort, a chunk writes a fifth fewer WAL records and took about half the time.
    let cancel = format!(
        "UPDATE notification_jobs SET status = {canceled}, finished_at = clock_timestamp(), \
                last_error = 'canceled with batch ' || $3::int8::text || ' by ' || $4, {erase} \
         WHERE id BETWEEN $1 AND $2 AND batch_id = $3 AND status IN ({waiting}) RETURNING id",
        canceled = JobStatus::Canceled.sql(),
        erase = crate::queue::privacy::ERASE_ON_FINISH,
        waiting = JobStatus::sql_list(&JobStatus::CANCELABLE)
    );
    let columns = Columns {
        actor: "$4",
        request_id: "$5",
        client_request_id: "$6",
        detail: "jsonb_build_object('batch', $3::int8, 'canceled', count(*))",
        ..Columns::default()
    };
    audited(&cancel, &insert_from(action::BATCH_CANCELED, &columns, "done HAVING count(*) > 0"), "count(*)")
});

/// Cancels every job of `batch` that is still waiting, one statement per [`CANCEL_CHUNK`] ids of its
/// range; each statement that cancels anything records a `batch.canceled` row with its count. A job
/// being sent (or already finished) is left as it is: too late for it. Returns how many were canceled.
pub async fn cancel_batch(db: &PgPool, batch: &Batch, actor: &Actor) -> Result<u64, sqlx::Error> {
    let mut total = 0u64;
    let mut from = batch.first_job_id;
    while from <= batch.last_job_id {
        let to = from.saturating_add(CANCEL_CHUNK - 1).min(batch.last_job_id);
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(CANCEL_CHUNK_SQL.as_str()))
            .bind(from)
            .bind(to)
            .bind(batch.id)
            .bind(&actor.name)
            .bind(&actor.request_id)
            .bind(&actor.client_request_id)
            .fetch_one(db)
            .await?;
        total += n as u64;
        from = to + 1;
    }
    Ok(total)
}

/// Runs [`cancel_batch`] as a task of `runs` and waits for its count: the walk goes on to the end even
/// when the request that asked for it is cut by its deadline or its client goes away (a walk stopped
/// half-way leaves the rest of the batch waiting to be sent), and shutdown waits for it. The task logs
/// its outcome itself, since nobody may be left to hear it.
pub(crate) async fn cancel_batch_detached(
    db: &PgPool,
    runs: &TaskTracker,
    batch: Batch,
    actor: Actor,
) -> Result<Result<u64, sqlx::Error>, tokio::task::JoinError> {
    let db = db.clone();
    runs.spawn(async move {
        let started = std::time::Instant::now();
        let outcome = cancel_batch(&db, &batch, &actor).await;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        match &outcome {
            Ok(canceled) => tracing::info!(batch = batch.id, canceled, ms, actor = %actor.name, "batch canceled"),
            Err(e) => tracing::warn!(batch = batch.id, ms, actor = %actor.name, error = %e, "batch cancel failed"),
        }
        outcome
    })
    .await
}

crate::statements::statements_of!(CANCEL_ONE, CANCEL_CHUNK_SQL);
