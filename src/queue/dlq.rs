//! Dead letters: list them, and replay them at a bounded rate (a replay that opened every job at once
//! would be the retry storm that killed the provider in the first place).

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::audit::{Actor, Columns, action, audited, insert_from};
use crate::claim::Pick;
use crate::queue::status::JobStatus;
use crate::queue::store::JOBS;

/// Which dead jobs a listing or a replay covers; every field left out matches all.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct DlqFilter {
    /// Only this class.
    #[serde(default)]
    pub class: Option<String>,
    /// Only this tenant.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Only jobs whose last error contains this text.
    #[serde(default)]
    pub error: Option<String>,
}

/// A dead job as listed (no recipient or payload: a listing is for deciding what to replay).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadJob {
    /// Job id.
    pub id: i64,
    /// Message class.
    pub class: String,
    /// Tenant the job was enqueued for.
    pub tenant: String,
    /// Attempts made before it died.
    pub attempts: i32,
    /// Why it died: the provider's answer, a timeout, or a lost worker.
    pub last_error: Option<String>,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
    /// When it was dead-lettered.
    pub finished_at: Option<DateTime<Utc>>,
}

impl DlqFilter {
    /// Filter values are compared in SQL: no control characters (Postgres text cannot hold NUL).
    pub fn validate(&self) -> Result<(), String> {
        for (field, value) in [("class", &self.class), ("tenant", &self.tenant), ("error", &self.error)] {
            if let Some(v) = value {
                crate::validate::text(field, v, 512)?;
            }
        }
        Ok(())
    }
}

/// Slowest replay rate accepted: one job every ~17 minutes.
pub(crate) const MIN_RATE_PER_SEC: f64 = 0.001;
/// Fastest replay rate accepted.
pub(crate) const MAX_RATE_PER_SEC: f64 = 100_000.0;
/// Most extra attempts a replay may grant.
pub(crate) const MAX_EXTRA_ATTEMPTS: i32 = 100;
/// Most jobs one replay may touch.
pub(crate) const MAX_REPLAY: i64 = 1_000_000;

impl Replay {
    /// Bounds that keep the spacing arithmetic and attempt counts in range.
    pub fn validate(&self) -> Result<(), String> {
        self.filter.validate()?;
        if !(MIN_RATE_PER_SEC..=MAX_RATE_PER_SEC).contains(&self.rate_per_sec) {
            return Err(format!("rate_per_sec must be between {MIN_RATE_PER_SEC} and {MAX_RATE_PER_SEC}"));
        }
        if !(1..=MAX_REPLAY).contains(&self.max) {
            return Err(format!("max must be between 1 and {MAX_REPLAY}"));
        }
        if !(1..=MAX_EXTRA_ATTEMPTS).contains(&self.extra_attempts) {
            return Err(format!("extra_attempts must be between 1 and {MAX_EXTRA_ATTEMPTS}"));
        }
        Ok(())
    }
}

/// The filter on dead jobs; `$2` class, `$3` tenant, `$4` error text (each `NULL` for any).
const FILTER: &str = "($2::text IS NULL OR class = $2) AND ($3::text IS NULL OR tenant = $3) \
                      AND ($4::text IS NULL OR strpos(coalesce(last_error, ''), $4) > 0)";

static LIST: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT id, class, tenant, attempts, last_error, created_at, finished_at FROM notification_jobs \
         WHERE status = {dead} AND {FILTER} ORDER BY id LIMIT $1",
        dead = JobStatus::Dead.sql()
    )
});

/// Lists up to `limit` dead jobs, oldest first.
pub async fn list(db: &PgPool, filter: &DlqFilter, limit: i64) -> Result<Vec<DeadJob>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(LIST.as_str()))
        .bind(limit)
        .bind(&filter.class)
        .bind(&filter.tenant)
        .bind(&filter.error)
        .fetch_all(db)
        .await
}

static COUNT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT count(*) FROM (SELECT 1 FROM notification_jobs WHERE status = {dead} AND {FILTER} LIMIT $1) AS d",
        dead = JobStatus::Dead.sql()
    )
});

/// How many dead jobs match `filter`, counting no further than `limit` (what a replay of at most
/// `limit` would take, told to an operator before they confirm it).
pub async fn count(db: &PgPool, filter: &DlqFilter, limit: i64) -> Result<u64, sqlx::Error> {
    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(COUNT.as_str()))
        .bind(limit)
        .bind(&filter.class)
        .bind(&filter.tenant)
        .bind(&filter.error)
        .fetch_one(db)
        .await?;
    Ok(n as u64)
}

/// A replay: which dead jobs, how many, and how fast they become due again.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Replay {
    /// Which dead jobs.
    #[serde(flatten)]
    pub filter: DlqFilter,
    /// At most this many jobs.
    pub max: i64,
    /// Jobs per second they become due at (spread with `run_after`).
    pub rate_per_sec: f64,
    /// Extra attempts granted to each (default 1).
    #[serde(default = "one")]
    pub extra_attempts: i32,
}

fn one() -> i32 {
    1
}

/// Binds: `$1` max, `$2`–`$4` the filter, `$5` extra attempts, `$6` rate; the audit row (one per
/// replay, with the count): actor `$7`, request id `$8`.
static REPLAY: LazyLock<String> = LazyLock::new(|| {
    let replay = JOBS.update_picked_sql(
        &Pick { from: &JobStatus::Dead.sql(), filter: FILTER, order_by: Some("id") },
        &format!(
            "status = {scheduled}, finished_at = NULL, max_attempts = t.attempts + $5, \
             run_after = now() + picked.position / $6::float8 * interval '1 second'",
            scheduled = JobStatus::Scheduled.sql()
        ),
        "t.id",
    );
    let columns = Columns {
        actor: "$7",
        request_id: "$8",
        client_request_id: "$9",
        detail: "jsonb_build_object('replayed', count(*), 'max', $1::int8, 'class', $2::text, 'tenant', $3::text, \
                 'error', $4::text, 'extra_attempts', $5::int4, 'rate_per_sec', $6::float8)",
        ..Columns::default()
    };
    audited(&replay, &insert_from(action::DLQ_REPLAYED, &columns, "done"), "count(*)")
});

/// Puts matching dead jobs back in the queue, oldest first, due one every `1 / rate_per_sec`
/// seconds (as `scheduled` jobs: the stager makes each claimable when its time comes), each allowed
/// `extra_attempts` more attempts, with one `dlq.replayed` audit row by `actor`. Returns how many.
pub async fn replay(db: &PgPool, req: &Replay, actor: &Actor) -> Result<u64, sqlx::Error> {
    let replayed: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(REPLAY.as_str()))
        .bind(req.max)
        .bind(&req.filter.class)
        .bind(&req.filter.tenant)
        .bind(&req.filter.error)
        .bind(req.extra_attempts)
        .bind(req.rate_per_sec)
        .bind(&actor.name)
        .bind(&actor.request_id)
        .bind(&actor.client_request_id)
        .fetch_one(db)
        .await?;
    Ok(replayed as u64)
}

/// What a retry or a discard of one dead letter did.
#[derive(Debug, Clone, PartialEq)]
pub enum DeadLetterAction {
    /// Done: the job as it is now.
    Done(crate::queue::store::JobView),
    /// The job is not a dead letter (its current status).
    NotDead(String),
    /// No such job.
    NotFound,
}

static RETRY_ONE: LazyLock<String> = LazyLock::new(|| {
    let retry = format!(
        "UPDATE notification_jobs SET status = {pending}, finished_at = NULL, max_attempts = attempts + $2, \
                run_after = now() WHERE id = $1 AND status = {dead} RETURNING id",
        pending = JobStatus::Pending.sql(),
        dead = JobStatus::Dead.sql()
    );
    let columns = Columns {
        actor: "$3",
        request_id: "$4",
        client_request_id: "$5",
        detail: "jsonb_build_object('job', id, 'extra_attempts', $2::int4)",
        ..Columns::default()
    };
    audited(&retry, &insert_from(action::DLQ_RETRIED, &columns, "done"), "id")
});

static DISCARD_ONE: LazyLock<String> = LazyLock::new(|| {
    let discard = format!(
        "UPDATE notification_jobs SET status = {discarded}, finished_at = clock_timestamp(), {erase} \
         WHERE id = $1 AND status = {dead} RETURNING id",
        discarded = JobStatus::Discarded.sql(),
        erase = crate::queue::privacy::ERASE_ON_FINISH,
        dead = JobStatus::Dead.sql()
    );
    let columns = Columns {
        actor: "$2",
        request_id: "$3",
        client_request_id: "$4",
        detail: "jsonb_build_object('job', id)",
        ..Columns::default()
    };
    audited(&discard, &insert_from(action::DLQ_DISCARDED, &columns, "done"), "id")
});

async fn outcome(db: &PgPool, id: i64, done: Option<i64>) -> Result<DeadLetterAction, sqlx::Error> {
    let Some(view) = crate::queue::store::get_job(db, id).await? else { return Ok(DeadLetterAction::NotFound) };
    Ok(if done.is_some() { DeadLetterAction::Done(view) } else { DeadLetterAction::NotDead(view.status) })
}

/// Puts dead letter `id` back in the queue, due now, with `extra_attempts` more attempts (1 to
/// [`MAX_EXTRA_ATTEMPTS`]), recorded as `actor`'s.
pub(crate) async fn retry_one(
    db: &PgPool,
    id: i64,
    extra_attempts: i32,
    actor: &Actor,
) -> Result<DeadLetterAction, sqlx::Error> {
    let done: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(RETRY_ONE.as_str()))
        .bind(id)
        .bind(extra_attempts)
        .bind(&actor.name)
        .bind(&actor.request_id)
        .bind(&actor.client_request_id)
        .fetch_optional(db)
        .await?;
    outcome(db, id, done).await
}

/// Marks dead letter `id` discarded (kept with its history, purged with the finished jobs), recorded as
/// `actor`'s.
pub(crate) async fn discard_one(db: &PgPool, id: i64, actor: &Actor) -> Result<DeadLetterAction, sqlx::Error> {
    let done: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(DISCARD_ONE.as_str()))
        .bind(id)
        .bind(&actor.name)
        .bind(&actor.request_id)
        .bind(&actor.client_request_id)
        .fetch_optional(db)
        .await?;
    outcome(db, id, done).await
}

crate::statements::statements_of!(LIST, COUNT, REPLAY, RETRY_ONE, DISCARD_ONE);
