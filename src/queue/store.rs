//! `notification_jobs` on the workers' hot path, through the [`crate::claim`] contract: the claim
//! of a group (`claiming`), fenced finishes and heartbeats. The maintenance sweeps (`sweeps`) and
//! the API's read model of a job (`job_view`) are apart and re-exported here.

use std::sync::LazyLock;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use uuid::Uuid;

use crate::claim::{ClaimTable, Fenced};
use crate::queue::privacy;
use crate::queue::status::JobStatus;

mod claiming;
mod job_view;
pub(crate) mod sweeps;

pub use claiming::{ClaimClass, Claimed, claim, claim_begin_sql, claim_locks_sql, claim_sql};
pub(crate) use claiming::{cap_can_bind, mark_unreadable};
pub(crate) use job_view::JobView;
pub(crate) use job_view::get_job;
pub use sweeps::{Purge, erase_due, expire_overdue, purge_finished, rescue_expired_leases};

/// `notification_jobs` as a claimable table.
pub(crate) const JOBS: ClaimTable = ClaimTable {
    table: "notification_jobs",
    key: &["id"],
    state: "status",
    token: "lease_token",
    lease: "lease_expires_at",
};

/// SQL literals of the claimable states.
static CLAIMABLE: LazyLock<String> = LazyLock::new(|| JobStatus::sql_list(&JobStatus::CLAIMABLE));
/// SQL literal of the held state.
static SENDING: LazyLock<String> = LazyLock::new(|| JobStatus::Sending.sql());

/// A job a worker holds under a lease: what it needs to send it and to finish it, fenced.
#[derive(Debug, Clone)]
pub struct ClaimedJob {
    /// Job id, also the provider's idempotency key (a job sent twice is one delivery).
    pub id: i64,
    /// Message class; decides the provider, retries and deadline.
    pub class: String,
    /// Tenant the job was enqueued for (fairness, in-flight caps).
    pub tenant: String,
    /// Phone number, device token, … as enqueued.
    pub recipient: String,
    /// Message data, handed to the provider as it is.
    pub payload: serde_json::Value,
    /// This attempt's number (1-based): the claim counted it.
    pub attempt: i32,
    /// Attempts allowed before the job is dead-lettered.
    pub max_attempts: i32,
    /// Time after which the job must not be sent, if its class has a deadline.
    pub deadline: Option<DateTime<Utc>>,
    /// Fencing token of this claim: every finish must present it.
    pub token: Uuid,
    /// When it was enqueued (queue wait = `picked_at - created_at`).
    pub created_at: DateTime<Utc>,
    /// When a worker first claimed it (kept across retries).
    pub picked_at: DateTime<Utc>,
    /// The enqueuing request's W3C trace context, when traces were on: the send continues its trace.
    pub traceparent: Option<String>,
}

impl From<&ClaimedJob> for crate::queue::provider::Message {
    fn from(job: &ClaimedJob) -> Self {
        crate::queue::provider::Message {
            id: job.id,
            class: job.class.clone(),
            tenant: job.tenant.clone(),
            recipient: job.recipient.clone(),
            payload: job.payload.clone(),
            attempt: job.attempt,
        }
    }
}

/// `$5` is what the attempt costs: 0 for a throttled send (the claim counted an attempt the provider
/// never made), 1 otherwise.
static MARK_RETRY: LazyLock<String> = LazyLock::new(|| {
    JOBS.fenced_update_sql(
        &SENDING,
        "id = $2",
        &format!(
            "status = {retrying}, run_after = now() + $3::float8 * interval '1 second', last_error = $4, \
             attempts = attempts - 1 + $5, lease_token = NULL, lease_expires_at = NULL",
            retrying = JobStatus::Retrying.sql()
        ),
        None,
    )
});

static MARK_FINAL: LazyLock<String> = LazyLock::new(|| {
    JOBS.fenced_update_sql(
        &SENDING,
        "id = $2",
        &format!(
            "status = $3, last_error = $4, finished_at = clock_timestamp(), lease_token = NULL,              lease_expires_at = NULL, {erase}",
            erase = privacy::erase_on_finish_into("$3")
        ),
        None,
    )
});

static HEARTBEAT: LazyLock<String> = LazyLock::new(|| JOBS.extend_sql(&SENDING, "id = $3", "lease_expires_at"));

/// The provider accepted it: `sent` with its result (provider, reference), fenced by the token, so a
/// job's result is written once, by the worker that still held it.
pub async fn mark_sent(
    db: &PgPool,
    job: &ClaimedJob,
    provider: &str,
    provider_ref: Option<&str>,
) -> Result<Fenced, sqlx::Error> {
    // The one-row case of the batched statement: one SQL text holds the fence of a `sent` finish.
    let done = mark_sent_many(db, &[job.id], &[job.token], &[provider], &[provider_ref]).await?;
    Ok(if done.is_empty() { Fenced::LeaseLost } else { Fenced::Done })
}

static MARK_SENT_MANY: LazyLock<String> = LazyLock::new(|| {
    // The fence of every row: the held state and that row's own claim token.
    JOBS.fenced_update_many_sql(
        &SENDING,
        "unnest($1::int8[], $2::uuid[], $3::text[], $4::text[]) AS f(id, token, provider, provider_ref)",
        &format!(
            "status = {sent}, provider = f.provider, provider_ref = f.provider_ref, \
             finished_at = clock_timestamp(), lease_token = NULL, lease_expires_at = NULL, last_error = NULL, \
             {erase}",
            sent = JobStatus::Sent.sql(),
            erase = privacy::ERASE_ON_FINISH
        ),
        "t.id",
    )
});

/// [`mark_sent`] for many jobs in one statement (see [`crate::queue::finish`]); returns the ids whose
/// fence held. The arrays are aligned: job id, its claim token, provider, provider reference.
pub async fn mark_sent_many(
    db: &PgPool,
    ids: &[i64],
    tokens: &[Uuid],
    providers: &[&str],
    provider_refs: &[Option<&str>],
) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(MARK_SENT_MANY.as_str()))
        .bind(ids)
        .bind(tokens)
        .bind(providers)
        .bind(provider_refs)
        .fetch_all(db)
        .await
}

/// A transient failure: back to the queue after `delay`, worker freed at once.
/// The error text is kept scrubbed ([`crate::queue::scrub::scrub_error`]).
pub(crate) async fn mark_retry(
    db: &PgPool,
    job: &ClaimedJob,
    delay: Duration,
    error: &str,
) -> Result<Fenced, sqlx::Error> {
    retry(db, job, delay, error, 1).await
}

/// The provider asked to wait (`Retry-After`): back to the queue after `wait`, and the attempt the
/// claim counted is given back (the provider never tried).
pub(crate) async fn mark_throttled(
    db: &PgPool,
    job: &ClaimedJob,
    wait: Duration,
    error: &str,
) -> Result<Fenced, sqlx::Error> {
    retry(db, job, wait, error, 0).await
}

async fn retry(db: &PgPool, job: &ClaimedJob, delay: Duration, error: &str, cost: i32) -> Result<Fenced, sqlx::Error> {
    let error = crate::queue::scrub::scrub_job_error(error, &job.recipient);
    let done = sqlx::query(sqlx::AssertSqlSafe(MARK_RETRY.as_str()))
        .bind(job.token)
        .bind(job.id)
        .bind(delay.as_secs_f64())
        .bind(error)
        .bind(cost)
        .execute(db)
        .await?;
    Ok(Fenced::from_rows(done.rows_affected()))
}

/// Finishes the job as `dead` or `expired` with `error`, fenced; a `sent` finish goes through
/// [`mark_sent`], which also records the provider's reference.
/// The error text is kept scrubbed ([`crate::queue::scrub::scrub_error`]).
pub(crate) async fn mark_final(
    db: &PgPool,
    job: &ClaimedJob,
    state: JobStatus,
    error: &str,
) -> Result<Fenced, sqlx::Error> {
    mark_final_fenced(db, job.id, job.token, state, &crate::queue::scrub::scrub_job_error(error, &job.recipient)).await
}

async fn mark_final_fenced(
    db: &PgPool,
    id: i64,
    token: Uuid,
    state: JobStatus,
    error: &str,
) -> Result<Fenced, sqlx::Error> {
    let error = crate::queue::scrub::scrub_error(error);
    debug_assert!(matches!(state, JobStatus::Dead | JobStatus::Expired), "{state} is not a failed final state");
    let done = sqlx::query(sqlx::AssertSqlSafe(MARK_FINAL.as_str()))
        .bind(token)
        .bind(id)
        .bind(state.as_str())
        .bind(error)
        .execute(db)
        .await?;
    Ok(Fenced::from_rows(done.rows_affected()))
}

/// Extends the lease of a long send; `None` when the lease was already lost.
pub(crate) async fn heartbeat(
    db: &PgPool,
    job: &ClaimedJob,
    lease: Duration,
) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(HEARTBEAT.as_str()))
        .bind(job.token)
        .bind(lease.as_secs_f64())
        .bind(job.id)
        .fetch_optional(db)
        .await
}

crate::statements::statements_of!(MARK_RETRY, MARK_FINAL, HEARTBEAT, MARK_SENT_MANY);
