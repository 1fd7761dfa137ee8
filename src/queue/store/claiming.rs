//! The claim of a worker group: the statement (order, tenant caps, provider room), the classes it
//! takes with what bounds them, and the claimed rows read back (or dead-lettered when unreadable).

use std::time::Duration;

use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::{CLAIMABLE, ClaimedJob, JOBS, SENDING, mark_final_fenced};
use crate::claim::{ClaimSpec, Commit, Fenced, TokenPer};
use crate::queue::policy::GroupPolicy;
use crate::queue::seal::Seal;
use crate::queue::status::JobStatus;

/// The claim statement of one group: its classes, its order, per-tenant in-flight caps, provider room.
/// It picks at most `pick` jobs (written into the statement) and claims at most `$1` of them.
/// Binds: `$1` the jobs wanted (at most `pick`), `$2` lease seconds, `$3` classes (`text[]`), `$4` per-class tenant caps (`int4[]`,
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
/// The function reads the lease index, never the whole table (migration 25): its plan is kept for the
/// connection's life, and one made while the table was small would otherwise stay a table scan.
/// The jobs the previous holder claimed are still pending in that old snapshot, and at the head of
/// the claim order: the pick leaves out the ids the function counted in flight, or it would lock each
/// of them (holding up its finish until this claim commits) only to find it claimed (migration 14).
/// A tenant at its cap is stepped over: waiting for it is what the cap is for.
///
/// The claim's jobs share one fencing token, drawn once ([`TokenPer::Claim`]): each fenced write names
/// the job's id with it. Unless `queue.durable_claims` is set, the claim commits without waiting for
/// its WAL flush ([`Commit::Unflushed`]): claims of a capped class hold its lock through their commit,
/// so the wait for the disk was part of every claim's turn, and the drain's pace is one claim after
/// another. A crash of the database can lose the last claims: their jobs are pending again, to be
/// claimed and sent again as after a lease lost with its pod (at-least-once either way; the attempt
/// lost with the claim is not counted). A job's outcome is written by a flushed commit, which flushes
/// its claim's WAL first.
///
/// With `capped` false (no class of the claim has a cap that can bind: see [`cap_can_bind`]), the
/// statement leaves the caps out: no in-flight count, no tenant gate.
///
/// Why `pick` is written in: with the limit a parameter, the plan Postgres would keep for the
/// prepared statement has to guess it, looks dearer than one made for the actual value, and so every
/// claim was planned afresh (~1.3 ms of server CPU a claim, over half of a drain's claims planned).
/// A caller keeps one statement per size ([`PickSizes`](crate::claim::PickSizes)) and runs the
/// smallest that covers the jobs it wants; the rows picked beyond `$1` are locked until the claim
/// commits and left as they were.
pub fn claim_sql(policy: &GroupPolicy, capped: bool, pick: usize, commit: Commit) -> String {
    let order = policy.order.sql_order_by();
    // Counts each provider's jobs in claim order and stops at the first job past its provider's room.
    let room_gate = |source: &str| {
        format!(
            "sends AS ( \
                 SELECT s.id, s.class, row_number() OVER (ORDER BY {order}) AS pos, \
                        row_number() OVER (PARTITION BY p.provider ORDER BY {order}) AS used, p.free \
                 FROM {source} s JOIN unnest($3::text[], $7::text[], $8::int4[]) AS p(class, provider, free) \
                      ON p.class = s.class), \
             stopped_at AS (SELECT class, pos FROM sends WHERE used > free AND pos <= $1 ORDER BY pos LIMIT 1), \
             admitted AS ( \
                 SELECT id FROM sends WHERE pos < coalesce((SELECT pos FROM stopped_at), $1 + 1))"
        )
    };
    const REPORT: &str = "SELECT class FROM stopped_at";
    if !capped {
        return JOBS.claim_picking_at_most_sql(
            &ClaimSpec {
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
                token: TokenPer::Claim,
                commit,
            },
            pick,
        );
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
    let claim = JOBS.claim_picking_at_most_sql(
        &ClaimSpec {
            free: &CLAIMABLE,
            held: &SENDING,
            filter,
            order_by: &order,
            set: CLAIM_SET,
            returning: CLAIM_RETURNING,
            carry: ", tenant, class, priority, fair_key",
            gate: &gate,
            report: REPORT,
            token: TokenPer::Claim,
            commit,
        },
        pick,
    );
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
const CLAIM_RETURNING: &str = "t.id, t.class, t.tenant, t.recipient, t.payload, t.sealed, t.sealed_with, t.attempts, \
     t.max_attempts, t.deadline, t.lease_token, t.created_at, t.picked_at, t.traceparent";

/// Whether a class's tenant cap can ever bind: not when it is at least its provider's deployment-wide
/// `max_concurrency`, since no more calls than that are ever in flight to the provider at all.
pub(crate) fn cap_can_bind(tenant_cap: u32, provider_max_concurrency: u32) -> bool {
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
    /// How long the claim statement took, its rows opened included (zero when none ran): what the
    /// group's claim histogram records and what tells the claim loop that claims are slow.
    pub lasted: std::time::Duration,
}

/// Claims up to `limit` jobs of `classes` with a prepared [`claim_sql`] statement, one autocommit
/// statement; sealed recipients and payloads are opened with `seal`.
pub async fn claim(
    db: &PgPool,
    sql: &str,
    limit: usize,
    lease: Duration,
    classes: &[ClaimClass],
    seal: &Seal,
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
        match decode(id, &r, seal) {
            Ok(job) => claimed.jobs.push(job),
            Err(e) => {
                claimed.unreadable.push(Unreadable { id, token: r.try_get("lease_token")?, error: e.to_string() })
            }
        }
    }
    Ok(claimed)
}

/// A claimed row as a [`ClaimedJob`], its sealed recipient and payload opened (a row stored in clear
/// is read as it is); an error for a row the worker cannot read (a payload stored before intake
/// refused such payloads, written by hand, or sealed data that does not open).
fn decode(id: i64, r: &sqlx::postgres::PgRow, seal: &Seal) -> Result<ClaimedJob, sqlx::Error> {
    let unreadable = |e: Box<dyn std::error::Error + Send + Sync>| sqlx::Error::Decode(e);
    let (recipient, payload) = match r.try_get::<Option<&[u8]>, _>("sealed")? {
        Some(sealed) => {
            let key_id: Option<&str> = r.try_get("sealed_with")?;
            let opened = seal.open(key_id.unwrap_or_default(), sealed).map_err(|e| unreadable(e.into()))?;
            (opened.recipient, serde_json::from_str(&opened.payload).map_err(|e| unreadable(e.into()))?)
        }
        None => (r.try_get("recipient")?, r.try_get("payload")?),
    };
    Ok(ClaimedJob {
        id,
        class: r.try_get("class")?,
        tenant: r.try_get("tenant")?,
        recipient,
        payload,
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
    /// The job's id.
    pub id: i64,
    /// This claim's fencing token.
    pub token: Uuid,
    /// Why it could not be read.
    pub error: String,
}

/// Dead-letters a claimed row that cannot be read, fenced by its claim's token, with the reason as
/// its last error: retrying it would only fail the same way.
pub(crate) async fn mark_unreadable(db: &PgPool, job: &Unreadable) -> Result<Fenced, sqlx::Error> {
    let error = format!("the stored job cannot be read: {}", job.error);
    mark_final_fenced(db, job.id, job.token, JobStatus::Dead, &error).await
}
