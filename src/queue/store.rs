//! `notification_jobs` through the [`crate::claim`] contract: claim for a group, fenced finishes,
//! heartbeats, and the maintenance sweeps.

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::claim::{ClaimSpec, ClaimTable, Fenced, Pick};
use crate::queue::policy::GroupPolicy;
use crate::queue::status::JobStatus;

/// `notification_jobs` as a claimable table.
pub const JOBS: ClaimTable = ClaimTable {
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

/// The claim statement of one group: its classes, its order, per-tenant in-flight caps, provider room.
/// Binds: `$1` limit, `$2` lease seconds, `$3` classes (`text[]`), `$4` per-class tenant caps (`int4[]`,
/// aligned with `$3`), `$5` the priorities of those classes (`int2[]`), `$6` the classes whose tenant
/// cap can bind (`text[]`: their claim locks), `$7` each class's provider (`text[]`, aligned with `$3`)
/// and `$8` the sends that provider may start now (`int4[]`, aligned with `$3`, the same for every
/// class of one provider). See [`ClaimClass`].
///
/// The priority condition is implied by the class one, but it is what lets the claim index
/// (`priority, fair_key, id`) seek straight to the group's priorities: filtering on class alone, an
/// OTP-only group facing a promo backlog either walked every promo entry or, as the planner chose
/// after an ANALYZE, scanned the whole table for each empty claim (60 ms at 100,000 jobs).
///
/// Provider room keeps the group's order: the claim takes the picked jobs in that order and stops at
/// the first one whose provider has no room left for it, whatever comes after it; the statement
/// returns that job's class as `report` (the caller asks that provider for more and waits on it). A
/// class whose provider must not be waited on (see [`ClaimClass::free`]) is left out of `$3` instead.
/// Stepping over a job whose provider is merely slow to grant this pod a larger share would hand its
/// worker to a job behind it (a hanging push call, say) and keep the urgent job waiting for the next
/// worker to free.
///
/// Tenant caps are exact: of the picked jobs a tenant gets only as many as its cap leaves free, counted
/// in this statement (so a batch cannot overshoot), and the statement first takes the claim locks of
/// `$6` (transaction-scoped advisory locks, in a fixed order), so two pods claiming at once cannot both
/// fill the same last unit. Claims of one class run one after another; finishes never wait for them.
/// The in-flight count comes from `notification_jobs_in_flight` (migration 13), a volatile function
/// whose query takes its own snapshot after the locks are granted: the statement's snapshot, taken
/// before it waited, would miss the jobs the previous holder claimed. Lock, count and claim being one
/// statement, the locks are released by its commit without a round trip to the client in between.
/// The jobs the previous holder claimed are still pending in that old snapshot, and at the head of
/// the claim order: the pick leaves out the ids the function counted in flight, or it would lock each
/// of them (holding up its finish until this claim commits) only to find it claimed (migration 14).
/// A tenant at its cap is stepped over: waiting for it is what the cap is for.
///
/// With `capped` false (no class of the claim has a cap that can bind: see [`cap_can_bind`]), the
/// statement leaves the caps out: no in-flight count, no tenant gate.
pub fn claim_sql(policy: &GroupPolicy, capped: bool) -> String {
    let order = policy.order.sql_order_by();
    // Counts each provider's jobs in claim order and stops at the first job past its provider's room.
    let room_gate = |source: &str| {
        format!(
            "sends AS ( \
                 SELECT s.id, s.class, row_number() OVER (ORDER BY {order}) AS pos, \
                        row_number() OVER (PARTITION BY p.provider ORDER BY {order}) AS used, p.free \
                 FROM {source} s JOIN unnest($3::text[], $7::text[], $8::int4[]) AS p(class, provider, free) \
                      ON p.class = s.class), \
             stopped_at AS (SELECT class, pos FROM sends WHERE used > free ORDER BY pos LIMIT 1), \
             admitted AS ( \
                 SELECT id FROM sends WHERE pos < coalesce((SELECT pos FROM stopped_at), $1 + 1))"
        )
    };
    const REPORT: &str = "SELECT class FROM stopped_at";
    if !capped {
        return JOBS.claim_sql(&ClaimSpec {
            free: &CLAIMABLE,
            held: &SENDING,
            filter: "priority = ANY($5) AND class = ANY($3) AND run_after <= now() \
                     AND $4::int4[] IS NOT NULL AND $6::text[] IS NOT NULL",
            order_by: &order,
            set: CLAIM_SET,
            returning: CLAIM_RETURNING,
            carry: ", class, priority, fair_key",
            gate: &room_gate("picked"),
            report: REPORT,
        });
    }
    let filter = "priority = ANY($5) AND class = ANY($3) AND run_after <= now() \
         AND (tenant, class) NOT IN (SELECT tenant, class FROM live WHERE inflight >= cap) \
         AND id NOT IN (SELECT unnest(ids) FROM live)";
    let gate = format!(
        "ranked AS ( \
             SELECT id, tenant, class, priority, fair_key, \
                    row_number() OVER (PARTITION BY tenant, class ORDER BY {order}) AS n \
             FROM picked), \
         within_cap AS ( \
             SELECT r.id, r.class, r.priority, r.fair_key FROM ranked r \
             JOIN unnest($3::text[], $4::int4[]) AS cap(class, n) ON cap.class = r.class \
             LEFT JOIN live l ON l.tenant = r.tenant AND l.class = r.class \
             WHERE r.n <= cap.n - coalesce(l.inflight, 0)), \
         {room}",
        room = room_gate("within_cap"),
    );
    let claim = JOBS.claim_sql(&ClaimSpec {
        free: &CLAIMABLE,
        held: &SENDING,
        filter,
        order_by: &order,
        set: CLAIM_SET,
        returning: CLAIM_RETURNING,
        carry: ", tenant, class, priority, fair_key",
        gate: &gate,
        report: REPORT,
    });
    // The claim locks, then the jobs in flight per tenant of the group's classes with each class's cap
    // (counted after the locks: the function's argument is the lock count), ahead of `picked`.
    let live = "locks AS ( \
             SELECT count(pg_advisory_xact_lock(1667853679, k)::text) AS taken \
             FROM (SELECT DISTINCT hashtext(c) AS k FROM unnest($6::text[]) AS c ORDER BY k OFFSET 0) AS s), \
         live AS ( \
             SELECT f.tenant, f.class, f.inflight, f.cap, f.ids \
             FROM locks, LATERAL notification_jobs_in_flight($3::text[], $4::int4[], locks.taken) AS f), ";
    claim.replacen("WITH ", &format!("WITH {live}"), 1)
}

const CLAIM_SET: &str = "attempts = t.attempts + 1, picked_at = coalesce(t.picked_at, clock_timestamp())";
const CLAIM_RETURNING: &str = "t.id, t.class, t.tenant, t.recipient, t.payload, t.attempts, t.max_attempts, \
     t.deadline, t.lease_token, t.created_at, t.picked_at, t.traceparent";

/// Whether a class's tenant cap can ever bind: not when it is at least its provider's deployment-wide
/// `max_concurrency`, since no more calls than that are ever in flight to the provider at all.
pub fn cap_can_bind(tenant_cap: u32, provider_max_concurrency: u32) -> bool {
    tenant_cap < provider_max_concurrency
}

/// One class a claim may take, with what bounds it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimClass {
    /// The class's name.
    pub name: String,
    /// Its priority (lets the claim index seek to it).
    pub priority: i16,
    /// Jobs one tenant of it may have in flight.
    pub tenant_cap: i32,
    /// Whether that cap can bind (see [`cap_can_bind`]): the claim then takes the class's claim lock.
    pub cap_binds: bool,
    /// The provider its jobs go through.
    pub provider: String,
    /// Sends that provider may start on this pod now: the claim stops at the first job past it.
    pub free: i32,
}

/// What one claim took, and where it stopped.
#[derive(Debug, Default)]
pub struct Claimed {
    /// The jobs now held, in claim order.
    pub jobs: Vec<ClaimedJob>,
    /// The class of the first job the claim had to stop at because its provider had no room left.
    pub stopped_at: Option<String>,
    /// Claimed rows that could not be read: the caller dead-letters them ([`mark_unreadable`]).
    pub unreadable: Vec<Unreadable>,
}

/// Claims up to `limit` jobs of `classes` with a prepared [`claim_sql`] statement, one autocommit
/// statement.
pub async fn claim(
    db: &PgPool,
    sql: &str,
    limit: usize,
    lease: Duration,
    classes: &[ClaimClass],
) -> Result<Claimed, sqlx::Error> {
    let names: Vec<&str> = classes.iter().map(|c| c.name.as_str()).collect();
    let caps: Vec<i32> = classes.iter().map(|c| c.tenant_cap).collect();
    let mut priorities: Vec<i16> = classes.iter().map(|c| c.priority).collect();
    priorities.sort_unstable();
    priorities.dedup();
    let locked: Vec<&str> = classes.iter().filter(|c| c.cap_binds).map(|c| c.name.as_str()).collect();
    let providers: Vec<&str> = classes.iter().map(|c| c.provider.as_str()).collect();
    let free: Vec<i32> = classes.iter().map(|c| c.free).collect();
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql.to_string()))
        .bind(limit as i64)
        .bind(lease.as_secs_f64())
        .bind(&names)
        .bind(&caps)
        .bind(&priorities)
        .bind(&locked)
        .bind(&providers)
        .bind(&free)
        .fetch_all(db)
        .await?;
    let mut claimed = Claimed::default();
    for r in rows {
        if claimed.stopped_at.is_none() {
            claimed.stopped_at = r.try_get("report")?;
        }
        // The one row of a claim that took nothing has NULL claim columns.
        let Some(id) = r.try_get::<Option<i64>, _>("id")? else { continue };
        match decode(id, &r) {
            Ok(job) => claimed.jobs.push(job),
            Err(e) => {
                claimed.unreadable.push(Unreadable { id, token: r.try_get("lease_token")?, error: e.to_string() })
            }
        }
    }
    Ok(claimed)
}

/// A claimed row as a [`ClaimedJob`]; an error for a row the worker cannot read (a payload stored
/// before intake refused such payloads, or written by hand).
fn decode(id: i64, r: &sqlx::postgres::PgRow) -> Result<ClaimedJob, sqlx::Error> {
    Ok(ClaimedJob {
        id,
        class: r.try_get("class")?,
        tenant: r.try_get("tenant")?,
        recipient: r.try_get("recipient")?,
        payload: r.try_get("payload")?,
        attempt: r.try_get("attempts")?,
        max_attempts: r.try_get("max_attempts")?,
        deadline: r.try_get("deadline")?,
        token: r.try_get("lease_token")?,
        created_at: r.try_get("created_at")?,
        picked_at: r.try_get("picked_at")?,
        traceparent: r.try_get("traceparent")?,
    })
}

/// A claimed row the worker could not read: it goes to the dead letters ([`mark_unreadable`]).
#[derive(Debug, Clone)]
pub struct Unreadable {
    /// The job.
    pub id: i64,
    /// This claim's fencing token.
    pub token: Uuid,
    /// Why it could not be read.
    pub error: String,
}

/// Dead-letters a claimed row that cannot be read, fenced by its claim's token, with the reason as
/// its last error: retrying it would only fail the same way.
pub async fn mark_unreadable(db: &PgPool, job: &Unreadable) -> Result<Fenced, sqlx::Error> {
    let error = format!("the stored job cannot be read: {}", job.error);
    mark_final_fenced(db, job.id, job.token, JobStatus::Dead, &error).await
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
        "status = $3, last_error = $4, finished_at = clock_timestamp(), lease_token = NULL, lease_expires_at = NULL",
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
             finished_at = clock_timestamp(), lease_token = NULL, lease_expires_at = NULL, last_error = NULL",
            sent = JobStatus::Sent.sql()
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
pub async fn mark_retry(db: &PgPool, job: &ClaimedJob, delay: Duration, error: &str) -> Result<Fenced, sqlx::Error> {
    retry(db, job, delay, error, 1).await
}

/// The provider asked to wait (`Retry-After`): back to the queue after `wait`, and the attempt the
/// claim counted is given back (the provider never tried).
pub async fn mark_throttled(db: &PgPool, job: &ClaimedJob, wait: Duration, error: &str) -> Result<Fenced, sqlx::Error> {
    retry(db, job, wait, error, 0).await
}

async fn retry(db: &PgPool, job: &ClaimedJob, delay: Duration, error: &str, cost: i32) -> Result<Fenced, sqlx::Error> {
    let error = crate::queue::scrub::scrub_error(error);
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
pub async fn mark_final(db: &PgPool, job: &ClaimedJob, state: JobStatus, error: &str) -> Result<Fenced, sqlx::Error> {
    mark_final_fenced(db, job.id, job.token, state, error).await
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
        &SENDING,
        &format!(
            "CASE WHEN t.attempts >= t.max_attempts THEN {dead} ELSE {retrying} END",
            dead = JobStatus::Dead.sql(),
            retrying = JobStatus::Retrying.sql()
        ),
        "TRUE",
        "run_after = now(), last_error = 'lease expired: worker lost during send', \
         finished_at = CASE WHEN t.attempts >= t.max_attempts THEN clock_timestamp() END",
        "",
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

static EXPIRE_OVERDUE: LazyLock<String> = LazyLock::new(|| {
    JOBS.update_picked_sql(
        &Pick { from: &CLAIMABLE, filter: "deadline IS NOT NULL AND deadline < now()", order_by: Some("deadline") },
        &format!(
            "status = {expired}, finished_at = clock_timestamp(), \
             last_error = coalesce(t.last_error, 'deadline passed before it could be sent')",
            expired = JobStatus::Expired.sql()
        ),
        "t.class",
    )
});

/// Waiting jobs past their deadline become `expired` (never sent late), up to `batch` of them;
/// returns how many per class.
pub async fn expire_overdue(db: &PgPool, batch: i64) -> Result<BTreeMap<String, u64>, sqlx::Error> {
    let classes: Vec<String> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(EXPIRE_OVERDUE.as_str())).bind(batch).fetch_all(db).await?;
    let mut per_class = BTreeMap::new();
    for class in classes {
        *per_class.entry(class).or_default() += 1;
    }
    Ok(per_class)
}

/// Which finished jobs a purge deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purge {
    /// Sent, expired, canceled and discarded jobs (`queue.retention`).
    Finished,
    /// Dead letters (`queue.dead_letter_retention`).
    DeadLetters,
}

fn purge_sql(states: &[JobStatus]) -> String {
    JOBS.delete_picked_sql(&Pick {
        from: &JobStatus::sql_list(states),
        filter: "class = $3 AND finished_at < now() - $2::float8 * interval '1 second'",
        order_by: None,
    })
}

static PURGE_FINISHED: LazyLock<String> = LazyLock::new(|| purge_sql(&JobStatus::FINISHED));
static PURGE_DEAD: LazyLock<String> = LazyLock::new(|| purge_sql(&[JobStatus::Dead]));

/// Deletes finished jobs older than `retention`, class by class through the `(class, finished_at)`
/// index, in statements of up to `batch` rows and at most `max_rows` per call (so one call is never one
/// huge transaction); returns how many. The classes are read from that index (a skip scan: one index
/// probe per class), so jobs of a class no longer configured are purged too.
///
/// A single statement without the class could not range-scan that index, and `batch` per sweep capped
/// the purge rate below what the queue can send (10,000 per 5 s sweep is 2,000 jobs/s).
pub async fn purge_finished(
    db: &PgPool,
    which: Purge,
    retention: Duration,
    batch: i64,
    max_rows: u64,
) -> Result<u64, sqlx::Error> {
    let sql = match which {
        Purge::Finished => PURGE_FINISHED.as_str(),
        Purge::DeadLetters => PURGE_DEAD.as_str(),
    };
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
            let done = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(batch)
                .bind(retention.as_secs_f64())
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
    /// Current status (see [`JobStatus`]).
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

/// Looks a job up by id.
pub async fn get_job(db: &PgPool, id: i64) -> Result<Option<JobView>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, class, tenant, status, attempts, max_attempts, run_after, \
                CASE WHEN status = 'scheduled' THEN run_after END AS run_at, \
                deadline, created_at, picked_at, finished_at, last_error FROM notification_jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(db)
    .await
}
