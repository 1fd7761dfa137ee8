//! A job as the API shows it.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

/// A job as `GET /v1/notifications/{id}` shows it (no recipient, no payload: those stay with the
/// provider call).
#[derive(Debug, Clone, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct JobView {
    /// Job id, also the provider's idempotency key.
    pub id: i64,
    /// Message class, e.g. `otp`.
    pub class: String,
    /// Tenant the job was enqueued for.
    pub tenant: String,
    /// Current status (see [`crate::queue::status::JobStatus`]).
    pub status: String,
    /// Attempts made so far (a claim counts as one).
    pub attempts: i32,
    /// Attempts allowed before the job is dead-lettered.
    pub max_attempts: i32,
    /// Earliest time of the next attempt.
    pub run_after: DateTime<Utc>,
    /// When a scheduled job will be sent (its `run_after`, while it is `scheduled`).
    pub run_at: Option<DateTime<Utc>>,
    /// Time after which the job expires unsent, if its class has a deadline.
    pub deadline: Option<DateTime<Utc>>,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// When a worker first claimed it.
    pub picked_at: Option<DateTime<Utc>>,
    /// When it reached a final status.
    pub finished_at: Option<DateTime<Utc>>,
    /// The last failure, if any (provider answer, timeout, expiry reason).
    pub last_error: Option<String>,
}

/// Job `id` as the API shows it, or `None` when no such job exists (or it was purged after its
/// retention).
pub(crate) async fn get_job(db: &PgPool, id: i64) -> Result<Option<JobView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, class, tenant, status, attempts, max_attempts, run_after, \
                CASE WHEN status = 'scheduled' THEN run_after END AS run_at, \
                deadline, created_at, picked_at, finished_at, last_error FROM notification_jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(db)
    .await
}
