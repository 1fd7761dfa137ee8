//! `notification_jobs` through the [`crate::claim`] contract: claim for a group, fenced finishes,
//! heartbeats, and the maintenance sweeps.

use std::sync::LazyLock;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::claim::{ClaimSpec, ClaimTable, Fenced};
use crate::queue::policy::GroupPolicy;

/// `notification_jobs` as a claimable table.
pub const JOBS: ClaimTable = ClaimTable {
    table: "notification_jobs",
    key: &["id"],
    state: "status",
    token: "lease_token",
    lease: "lease_expires_at",
};

/// Claimable states.
pub const CLAIMABLE: &str = "'pending', 'failed-retrying'";
/// Held state.
pub const SENDING: &str = "'sending'";

/// A claimed job.
#[derive(Debug, Clone)]
pub struct ClaimedJob {
    /// Id (the provider's idempotency key).
    pub id: i64,
    /// Class.
    pub class: String,
    /// Tenant.
    pub tenant: String,
    /// Recipient.
    pub recipient: String,
    /// Payload.
    pub payload: serde_json::Value,
    /// This attempt's number (1-based).
    pub attempt: i32,
    /// Attempts allowed.
    pub max_attempts: i32,
    /// Send-by time, if any.
    pub deadline: Option<DateTime<Utc>>,
    /// Fencing token of this claim.
    pub token: Uuid,
    /// Enqueue time.
    pub created_at: DateTime<Utc>,
    /// First pick time.
    pub picked_at: DateTime<Utc>,
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

/// The claim statement of one group: its classes, its order, per-tenant in-flight caps.
/// Binds: `$1` limit, `$2` lease seconds, `$3` classes (`text[]`), `$4` per-class tenant caps (`int4[]`,
/// aligned with `$3`), `$5` the priorities of those classes (`int2[]`).
///
/// The priority condition is implied by the class one, but it is what lets the claim index
/// (`priority, fair_key, id`) seek straight to the group's priorities: filtering on class alone, an
/// OTP-only group facing a promo backlog either walked every promo entry or, as the planner chose
/// after an ANALYZE, scanned the whole table for each empty claim (60 ms at 100,000 jobs).
pub fn claim_sql(policy: &GroupPolicy) -> String {
    JOBS.claim_sql(&ClaimSpec {
        free: CLAIMABLE,
        held: SENDING,
        filter: "priority = ANY($5) AND class = ANY($3) AND run_after <= now() \
                 AND (tenant, class) NOT IN ( \
                     SELECT b.tenant, b.class FROM notification_jobs b \
                     JOIN unnest($3::text[], $4::int4[]) AS cap(class, n) ON cap.class = b.class \
                     WHERE b.lease_expires_at IS NOT NULL AND b.status = 'sending' \
                     GROUP BY b.tenant, b.class HAVING count(*) >= max(cap.n))",
        order_by: policy.sql_order_by(),
        set: "attempts = t.attempts + 1, picked_at = coalesce(t.picked_at, clock_timestamp())",
        returning: "t.id, t.class, t.tenant, t.recipient, t.payload, t.attempts, t.max_attempts, t.deadline, \
                    t.lease_token, t.created_at, t.picked_at",
    })
}

/// Claims up to `limit` jobs with a prepared [`claim_sql`] statement.
pub async fn claim(
    db: &PgPool,
    sql: &str,
    limit: usize,
    lease: Duration,
    classes: &[String],
    caps: &[i32],
    priorities: &[i16],
) -> Result<Vec<ClaimedJob>, sqlx::Error> {
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql.to_string()))
        .bind(limit as i64)
        .bind(lease.as_secs_f64())
        .bind(classes)
        .bind(caps)
        .bind(priorities)
        .fetch_all(db)
        .await?;
    Ok(rows
        .into_iter()
        .map(|r| ClaimedJob {
            id: r.get("id"),
            class: r.get("class"),
            tenant: r.get("tenant"),
            recipient: r.get("recipient"),
            payload: r.get("payload"),
            attempt: r.get("attempts"),
            max_attempts: r.get("max_attempts"),
            deadline: r.get("deadline"),
            token: r.get("lease_token"),
            created_at: r.get("created_at"),
            picked_at: r.get("picked_at"),
        })
        .collect())
}

static MARK_RETRY: LazyLock<String> = LazyLock::new(|| {
    JOBS.fenced_update_sql(
        SENDING,
        "id = $2",
        "status = 'failed-retrying', run_after = now() + $3::float8 * interval '1 second', last_error = $4, \
         lease_token = NULL, lease_expires_at = NULL",
        None,
    )
});

static MARK_FINAL: LazyLock<String> = LazyLock::new(|| {
    JOBS.fenced_update_sql(
        SENDING,
        "id = $2",
        "status = $3, last_error = $4, finished_at = clock_timestamp(), lease_token = NULL, lease_expires_at = NULL",
        None,
    )
});

static HEARTBEAT: LazyLock<String> = LazyLock::new(|| JOBS.extend_sql(SENDING, "id = $3"));

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
        SENDING,
        "unnest($1::int8[], $2::uuid[], $3::text[], $4::text[]) AS f(id, token, provider, provider_ref)",
        "status = 'sent', provider = f.provider, provider_ref = f.provider_ref, finished_at = clock_timestamp(), \
         lease_token = NULL, lease_expires_at = NULL, last_error = NULL",
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
pub async fn mark_retry(db: &PgPool, job: &ClaimedJob, delay: Duration, error: &str) -> Result<Fenced, sqlx::Error> {
    let done = sqlx::query(sqlx::AssertSqlSafe(MARK_RETRY.as_str()))
        .bind(job.token)
        .bind(job.id)
        .bind(delay.as_secs_f64())
        .bind(error)
        .execute(db)
        .await?;
    Ok(Fenced::from_rows(done.rows_affected()))
}

/// Final states other than sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalState {
    /// Dead-letter queue.
    Dead,
    /// Missed its deadline.
    Expired,
}

impl FinalState {
    /// Status value.
    pub fn as_str(self) -> &'static str {
        match self {
            FinalState::Dead => "dead",
            FinalState::Expired => "expired",
        }
    }
}

/// `dead` or `expired`, fenced.
pub async fn mark_final(db: &PgPool, job: &ClaimedJob, state: FinalState, error: &str) -> Result<Fenced, sqlx::Error> {
    let done = sqlx::query(sqlx::AssertSqlSafe(MARK_FINAL.as_str()))
        .bind(job.token)
        .bind(job.id)
        .bind(state.as_str())
        .bind(error)
        .execute(db)
        .await?;
    Ok(Fenced::from_rows(done.rows_affected()))
}

/// Extends the lease of a long send; `None` when the lease was already lost.
pub async fn heartbeat(db: &PgPool, job: &ClaimedJob, lease: Duration) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(HEARTBEAT.as_str()))
        .bind(job.token)
        .bind(lease.as_secs_f64())
        .bind(job.id)
        .fetch_optional(db)
        .await
}

static RESCUE: LazyLock<String> = LazyLock::new(|| {
    // A job whose every attempt killed or hung its worker must not loop forever: dead-letter it.
    JOBS.sweep_sql(
        SENDING,
        "CASE WHEN t.attempts >= t.max_attempts THEN 'dead' ELSE 'failed-retrying' END",
        "TRUE",
        "run_after = now(), last_error = 'lease expired: worker lost during send', \
         finished_at = CASE WHEN t.attempts >= t.max_attempts THEN clock_timestamp() END",
        "t.id",
    )
});

/// Jobs whose worker died mid-send (lease expired) go back to the queue; returns how many.
pub async fn rescue_expired_leases(db: &PgPool, batch: i64) -> Result<u64, sqlx::Error> {
    let mut total = 0;
    loop {
        let ids: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(RESCUE.as_str())).bind(batch).fetch_all(db).await?;
        total += ids.len() as u64;
        if (ids.len() as i64) < batch {
            return Ok(total);
        }
    }
}

/// Waiting jobs past their deadline become `expired` (never sent late); returns how many per class.
pub async fn expire_overdue(db: &PgPool, batch: i64) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as(
        "WITH overdue AS (             SELECT id FROM notification_jobs             WHERE deadline IS NOT NULL AND deadline < now() AND status IN ('pending', 'failed-retrying')             ORDER BY deadline LIMIT $1 FOR UPDATE SKIP LOCKED)          , done AS (             UPDATE notification_jobs AS t SET status = 'expired', finished_at = clock_timestamp(),                    last_error = coalesce(t.last_error, 'deadline passed before it could be sent')             FROM overdue WHERE t.id = overdue.id RETURNING t.class)          SELECT class, count(*) FROM done GROUP BY class",
    )
    .bind(batch)
    .fetch_all(db)
    .await
}

/// Deletes finished jobs older than `retention`, class by class through the `(class, finished_at)`
/// index, in statements of up to `batch` rows and at most `max_rows` per call (so one call is never one
/// huge transaction); returns how many. The classes are read from that index (a skip scan: one index
/// probe per class), so jobs of a class no longer configured are purged too.
///
/// A single statement without the class could not range-scan that index, and `batch` per sweep capped
/// the purge rate below what the queue can send (10,000 per 5 s sweep is 2,000 jobs/s).
pub async fn purge_finished(db: &PgPool, retention: Duration, batch: i64, max_rows: u64) -> Result<u64, sqlx::Error> {
    let classes: Vec<String> = sqlx::query_scalar(
        "WITH RECURSIVE c AS ( \
            SELECT min(class) AS class FROM notification_jobs WHERE finished_at IS NOT NULL \
            UNION ALL \
            SELECT (SELECT min(class) FROM notification_jobs WHERE finished_at IS NOT NULL AND class > c.class) \
            FROM c WHERE c.class IS NOT NULL) \
         SELECT class FROM c WHERE class IS NOT NULL",
    )
    .fetch_all(db)
    .await?;
    let mut total = 0;
    for class in classes {
        loop {
            let done = sqlx::query(
                "WITH old AS ( \
                    SELECT id FROM notification_jobs \
                    WHERE class = $3 AND finished_at < now() - $1::float8 * interval '1 second' \
                      AND status IN ('sent', 'dead', 'expired') \
                    LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 DELETE FROM notification_jobs j USING old WHERE j.id = old.id",
            )
            .bind(retention.as_secs_f64())
            .bind(batch)
            .bind(&class)
            .execute(db)
            .await?
            .rows_affected();
            total += done;
            if (done as i64) < batch || total >= max_rows {
                break;
            }
        }
        if total >= max_rows {
            break;
        }
    }
    Ok(total)
}
