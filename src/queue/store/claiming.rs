//! The claim of a worker group: the statement (order, tenant caps, provider room), the classes it
//! takes with what bounds them, and the claimed rows read back (or dead-lettered when unreadable).

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::{CLAIMABLE, ClaimedJob, JOBS, SENDING, mark_final_fenced};
use crate::claim::{ClaimSpec, Commit, Fenced, TokenPer};
use crate::queue::policy::{ClaimOrder, GroupPolicy};
use crate::queue::seal::Seal;
use crate::queue::status::JobStatus;

/// The claim statement of one group: its classes, its order, per-tenant in-flight caps, provider room.
/// It picks at most `pick` jobs (written into the statement) and claims at most `$1` of them.
/// Binds: `$1` the jobs wanted (at most `pick`), `$2` lease seconds, `$3` classes (`text[]`), `$4` per-class tenant caps (`int4[]`,
/// aligned with `$3`), `$5` the priorities of those classes (`int2[]`), `$6` each class's provider
/// (`text[]`, aligned with `$3`), `$7` the sends that provider may start now (`int4[]`, aligned with
/// `$3`, the same for every class of one provider) and `$8` the fair key each priority's run starts
/// at (`float8[]`, aligned with `$5`; NULL for its head). See [`ClaimClass`].
///
/// A claim by priority reads each priority's jobs as a run of its own, from that key on
/// ([`ClaimSpec::ranges`]): where its caller knows that nothing claimable is left below a key (see
/// [`crate::queue::floor`]), the scan does not walk the index entries below it, which a held cleanup
/// horizon keeps for every job claimed since.
///
/// A job is due when its `run_after` has passed by the time the statement starts
/// (`statement_timestamp()`, not `now()`: the transaction began before the claim locks were granted,
/// and a job enqueued while the claim waited for them is due).
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
/// in this statement (so a batch cannot overshoot), and the statement runs in a transaction that first
/// takes the claim locks of the classes whose cap can bind ([`claim_locks_sql`]), so two pods claiming at once cannot both fill
/// the same last unit. Claims of one class run one after another; finishes never wait for them. The
/// statement starts once the locks are held, so its snapshot sees every claim settled before it: the
/// jobs the previous holder claimed are in flight, not pending at the head of the claim order.
/// The in-flight count comes from `notification_jobs_in_flight` (migration 28), a function that
/// reads the lease index, never the whole table (migration 25: its plan is kept for the connection's
/// life, and one made while the table was small would otherwise stay a table scan), and only the
/// leases expired for less than a lease length (`$2`): a job counts toward its tenant's cap while it is
/// held, until it is finished or swept, and not once its lease has been expired for a lease length
/// (its holder is gone; the sweep returns it in seconds). Bounded so, the count reads the jobs claimed
/// within the last two lease lengths, not every one a held cleanup horizon keeps.
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
    let ranges = claim_ranges(policy);
    // Counts each provider's jobs in claim order and stops at the first job past its provider's room.
    let room_gate = |source: &str| {
        format!(
            "sends AS ( \
                 SELECT s.id, s.class, row_number() OVER (ORDER BY {order}) AS pos, \
                        row_number() OVER (PARTITION BY p.provider ORDER BY {order}) AS used, p.free \
                 FROM {source} s JOIN unnest($3::text[], $6::text[], $7::int4[]) AS p(class, provider, free) \
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
                filter: "priority = ANY($5) AND class = ANY($3) AND run_after <= statement_timestamp() \
                     AND $4::int4[] IS NOT NULL AND $8::float8[] IS NOT NULL",
                order_by: &order,
                ranges: &ranges,
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
    let filter = "priority = ANY($5) AND class = ANY($3) AND run_after <= statement_timestamp() \
         AND (tenant, class) NOT IN (SELECT tenant, class FROM live WHERE inflight >= cap) \
         AND $8::float8[] IS NOT NULL";
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
            ranges: &ranges,
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
    // The jobs in flight per tenant of the group's classes with each class's cap, ahead of `picked`.
    let live = "live AS ( \
             SELECT f.tenant, f.class, f.inflight, f.cap \
             FROM notification_jobs_in_flight($3::text[], $4::int4[], $2::float8 * interval '1 second') AS f), ";
    claim.replacen("WITH ", &format!("WITH {live}"), 1)
}

/// The statement a capped claim's transaction starts with (sent in one message with its `BEGIN`:
/// [`claim_begin_sql`]): it takes the claim locks of `classes` (those whose tenant cap can bind)
/// before the claim statement runs. Transaction-scoped advisory locks, in a fixed order so that two groups sharing classes cannot
/// deadlock, released by the claim's commit.
///
/// Why before the statement and not inside it: a statement's snapshot is taken when it starts. A
/// claim that waited for the lock inside its statement saw, once it had it, the jobs the holder before
/// it had claimed (and, when their sends were quick, already finished) as still pending, and none of
/// the jobs enqueued while it waited; its pick locked each stale one, found it taken and passed over
/// it. Under a held cleanup horizon, where each turn lasts long, many capped claims of a `bench
/// horizon` took nothing at all. Taken in the transaction's first statement, the locks are held when
/// the claim statement's snapshot is taken. Class names come from the configuration; they are quoted
/// as SQL literals all the same.
pub fn claim_locks_sql(classes: &[&str]) -> String {
    let names: Vec<String> = classes.iter().map(|c| format!("'{}'", c.replace('\'', "''"))).collect();
    format!(
        "SELECT count(pg_advisory_xact_lock({CLAIM_LOCK_SPACE}, k)) \
         FROM (SELECT DISTINCT hashtext(c) AS k FROM unnest(ARRAY[{}]::text[]) AS c ORDER BY k) AS s",
        names.join(", ")
    )
}

/// What a claim's transaction starts with, in one message: `BEGIN`, sorting priced out for its
/// statement's plan (and no just-in-time compilation), a limit on sitting idle, and the claim locks of
/// `locked` (none when it is empty: [`claim_locks_sql`]).
///
/// Why no sort: estimating few waiting jobs, as it does whenever the queue keeps up, the planner
/// preferred reading every waiting job's entry in the smaller FIFO index and sorting them to reading
/// the claim index in order. Both are cheap on a healthy table; while a snapshot is held, the first
/// reads the entry of every job claimed since, wherever the claim's runs start (a `bench horizon`
/// claim that took 245 jobs read 21,557 index and heap pages). A prepared statement keeps the plan
/// it was first given on its connection, and every claim statement runs only in this transaction,
/// so every plan of it is made with the setting. The window functions that rank the picked jobs
/// still sort: they have no other way. Just-in-time compilation is off too: a sort priced out makes
/// the plan's cost look enormous, which made Postgres compile every claim (800 ms each).
pub fn claim_begin_sql(locked: &[&str]) -> String {
    let locks = if locked.is_empty() { String::new() } else { format!(" {};", claim_locks_sql(locked)) };
    format!(
        "BEGIN; SET LOCAL enable_sort = off; SET LOCAL jit = off; \
         SET LOCAL idle_in_transaction_session_timeout = '{}ms';{locks}",
        CLAIM_IDLE_LIMIT.as_millis()
    )
}

/// The first key of the queue's claim locks (the second is the class name's `hashtext`).
const CLAIM_LOCK_SPACE: i32 = 1667853679;

/// How long a claim's transaction may sit idle before Postgres ends its session. Between its
/// statements the client only reads an answer and sends the next, so this is only ever reached by a
/// claim whose task was dropped halfway (a pod killed in the middle of a claim, a future cancelled):
/// its connection would otherwise keep the transaction open, and with it the claim locks that every
/// capped claim of the class, on every pod, waits for.
const CLAIM_IDLE_LIMIT: Duration = Duration::from_secs(2);

/// The runs a claim of `policy` reads one after another: for a claim by priority, each priority of
/// `$5` in turn, from its key in `$8` on (from its head where that is NULL, and none where `$5` has
/// fewer priorities than the group has classes); none for a claim oldest first, whose one scan starts
/// at the head of its index.
fn claim_ranges(policy: &GroupPolicy) -> Vec<String> {
    match policy.order {
        ClaimOrder::Fifo => Vec::new(),
        ClaimOrder::Priority => (1..=policy.classes.len().max(1))
            .map(|i| format!("priority = ($5::int2[])[{i}] AND fair_key >= coalesce(($8::float8[])[{i}], '-Infinity')"))
            .collect(),
    }
}

const CLAIM_SET: &str = "attempts = t.attempts + 1, picked_at = coalesce(t.picked_at, clock_timestamp())";
const CLAIM_RETURNING: &str = "t.id, t.class, t.tenant, t.recipient, t.payload, t.sealed, t.sealed_with, t.attempts, \
     t.max_attempts, t.deadline, t.lease_token, t.created_at, t.picked_at, t.traceparent, t.priority, t.fair_key";

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
    /// The fair key of the first job claimed at each priority: where the next claim of the group may
    /// start that priority's run ([`crate::queue::floor`]).
    pub starts: BTreeMap<i16, f64>,
    /// How long the claim statement took, its rows opened included (zero when none ran): what the
    /// group's claim histogram records and what tells the claim loop that claims are slow.
    pub lasted: std::time::Duration,
}

/// Claims up to `limit` jobs of `classes` with a prepared [`claim_sql`] statement, each priority's
/// run starting at its key in `floors` (at its head where it has none); sealed recipients and
/// payloads are opened with `seal`. The statement runs in a transaction of its own, which first takes
/// the claim locks where a tenant cap can bind ([`claim_begin_sql`]).
pub async fn claim(
    db: &PgPool,
    sql: &str,
    limit: usize,
    lease: Duration,
    classes: &[ClaimClass],
    floors: &BTreeMap<i16, f64>,
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
    let starts: Vec<Option<f64>> = priorities.iter().map(|p| floors.get(p).copied()).collect();
    let query = sqlx::query(sqlx::AssertSqlSafe(sql.to_string()))
        .bind(limit as i64)
        .bind(lease.as_secs_f64())
        .bind(&names)
        .bind(&caps)
        .bind(&priorities)
        .bind(&providers)
        .bind(&free)
        .bind(&starts);
    // The transaction's settings and the claim locks (see `claim_begin_sql`), then the statement, then
    // at once the commit that releases the locks: the rows are opened after it.
    let mut tx = db.begin_with(sqlx::AssertSqlSafe(claim_begin_sql(&locked))).await?;
    let rows = match query.fetch_all(&mut *tx).await {
        Ok(rows) => rows,
        Err(e) => {
            // Ended here rather than whenever the connection is next used: it holds the claim locks.
            let _ = tx.rollback().await;
            return Err(e);
        }
    };
    tx.commit().await?;
    let mut claimed = Claimed::default();
    for r in rows {
        if claimed.stopped_at.is_none() {
            claimed.stopped_at = r.try_get("report")?;
        }
        // The one row of a claim that took nothing has NULL claim columns.
        let Some(id) = r.try_get::<Option<i64>, _>("id")? else { continue };
        let (priority, fair_key): (i16, f64) = (r.try_get("priority")?, r.try_get("fair_key")?);
        claimed.starts.entry(priority).and_modify(|k| *k = k.min(fair_key)).or_insert(fair_key);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_claim_locks_name_each_class_as_a_literal_and_take_them_in_one_order() {
        let sql = claim_locks_sql(&["promo", "o'tp"]);
        assert!(sql.contains("unnest(ARRAY['promo', 'o''tp']::text[])"), "{sql}");
        assert!(sql.contains("ORDER BY k"), "{sql}");
        let settings = "BEGIN; SET LOCAL enable_sort = off; SET LOCAL jit = off; \
                        SET LOCAL idle_in_transaction_session_timeout = '2000ms';";
        assert_eq!(claim_begin_sql(&["promo", "o'tp"]), format!("{settings} {sql};"));
        assert_eq!(claim_begin_sql(&[]), settings);
    }
}
