//! Reservation lifecycle on `cif_codes` / `cif_issued`, expressed through the [`crate::claim`] contract:
//! here the claim of a code (alone, many at once, or under an idempotency key); in [`hold`] what its
//! holder does with it next.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::audit::{Actor, Columns, action, audited, insert_from};
use crate::cif::Pool;
use crate::claim::{ClaimSpec, ClaimTable, Commit, PickSizes, TokenPer};

pub(crate) mod hold;

pub(crate) use hold::{By, CodeStatus, Confirmed};
pub use hold::{confirm, extend, release, status};

/// Idempotency records older than this are forgotten: a replay ignores them, and reclaim deletes them.
pub(crate) const IDEMPOTENCY_RETENTION_HOURS: i64 = 24;

/// `cif_codes` as a claimable table.
pub(crate) const CODES: ClaimTable = ClaimTable {
    table: "cif_codes",
    key: &["pool_id", "counter"],
    state: "state",
    token: "lease_token",
    lease: "lease_expires_at",
};

/// SQL literal of the free state.
pub(crate) const AVAILABLE: &str = "'available'";
/// SQL literal of the held state.
pub(crate) const RESERVED: &str = "'reserved'";

/// The claim both reservation statements share: up to `size` available codes of pool `$2` (lease `$1`
/// seconds) from counter `$8` on, lowest first, marked reserved with `set`; `returning` adds to the
/// claimed row's columns and `gate` (empty for none) decides which picked rows are claimed.
fn claim_codes(size: usize, set: &str, returning: &str, gate: &str) -> String {
    let returning = format!("t.code, t.lease_token, t.lease_expires_at, t.holder, t.counter{returning}");
    CODES.claim_at_most_sql(
        &ClaimSpec {
            free: AVAILABLE,
            held: RESERVED,
            filter: "pool_id = $2 AND counter >= $8",
            order_by: "pool_id, counter",
            ranges: &[],
            set,
            returning: &returning,
            carry: "",
            gate,
            report: "",
            // A hold's token is its holder's proof of it, and a reservation handed out must outlive
            // a crash.
            token: TokenPer::Row,
            commit: Commit::Flushed,
        },
        size,
    )
}

/// Claim one code of pool `$2` (lease `$1` seconds), the lowest available from counter `$8` on (see
/// [`crate::cif::cursor`]), for holder `$3`, with its audit row (actor `$4`, request id `$5`, pool name
/// `$6`, client request id `$7`) in the same statement. Its limit is written in (see
/// [`ClaimTable::claim_at_most_sql`]): planned once per connection, not at every reservation.
static RESERVE: LazyLock<String> = LazyLock::new(|| {
    let claim = claim_codes(1, "holder = $3, reserved_at = now()", "", "");
    let columns = Columns {
        actor: "$4",
        request_id: "$5",
        client_request_id: "$7",
        pool: "$6",
        cif: "code",
        holder: "holder",
        ..Default::default()
    };
    audited(
        &claim,
        &insert_from(action::CIF_RESERVED, &columns, "done"),
        "code, lease_token, lease_expires_at, counter",
    )
});

/// Most reservations one shared claim serves.
pub(crate) const MOST_PER_SHARED_CLAIM: usize = 64;

/// Sizes of the shared claim: a statement for `n` waiting reservations is the one of the smallest
/// size that covers them, with its limit written in, so the server keeps one plan per size and
/// connection; a statement locks at most twice the rows it claims, and leaves the extra ones as they
/// were when it ends.
static SHARED_CLAIM_SIZES: LazyLock<PickSizes> = LazyLock::new(|| PickSizes::up_to(MOST_PER_SHARED_CLAIM));

/// [`reserve_many_text`] for each of [`SHARED_CLAIM_SIZES`].
static RESERVE_MANY_BY_SIZE: LazyLock<Vec<String>> =
    LazyLock::new(|| SHARED_CLAIM_SIZES.sizes().iter().map(|&size| reserve_many_text(size)).collect());

/// The shared claim of the largest size, as the catalog shows it (the smaller sizes differ only in
/// their `LIMIT`).
static RESERVE_MANY: LazyLock<String> = LazyLock::new(|| reserve_many_sql(MOST_PER_SHARED_CLAIM).to_string());

/// The shared claim for `n` waiting reservations (at most [`MOST_PER_SHARED_CLAIM`]).
fn reserve_many_sql(n: usize) -> &'static str {
    debug_assert!(n <= MOST_PER_SHARED_CLAIM, "{n} requests for one shared claim");
    &RESERVE_MANY_BY_SIZE[SHARED_CLAIM_SIZES.index_for(n)]
}

/// Claim up to `size` codes of pool `$2` (lease `$1` seconds) at once, from counter `$8` on, one per
/// waiting reservation: the i-th claimed row (in claim order) goes to the i-th element of the holder
/// `$3`, actor `$4`, request id `$5` and client request id `$7` arrays, with one audit row each (pool
/// name `$6`); rows picked beyond the arrays' length are not claimed. Returns each row's 1-based
/// request index `rn`.
fn reserve_many_text(size: usize) -> String {
    let claim = claim_codes(
        size,
        "holder = admitted.holder, reserved_at = now()",
        ", admitted.rn, admitted.actor, admitted.request_id, admitted.client_request_id",
        "numbered AS ( \
            SELECT pool_id, counter, row_number() OVER (ORDER BY pool_id, counter) AS rn FROM picked), \
         admitted AS ( \
            SELECT n.pool_id, n.counter, r.rn, r.holder, r.actor, r.request_id, r.client_request_id \
            FROM numbered n \
            JOIN unnest($3::text[], $4::text[], $5::text[], $7::text[]) WITH ORDINALITY \
                 AS r(holder, actor, request_id, client_request_id, rn) ON r.rn = n.rn)",
    );
    let columns = Columns {
        actor: "actor",
        request_id: "request_id",
        client_request_id: "client_request_id",
        pool: "$6",
        cif: "code",
        holder: "holder",
        ..Default::default()
    };
    audited(
        &claim,
        &insert_from(action::CIF_RESERVED, &columns, "done"),
        "rn, code, lease_token, lease_expires_at, counter",
    )
}

/// One reservation waiting to share a claim statement: who holds it and on whose behalf.
#[derive(Debug, Clone)]
pub struct Request {
    /// The pod or process named as holder.
    pub holder: Option<String>,
    /// The caller, for its audit row.
    pub actor: Actor,
}

/// Reserves one code for each of `requests` in one statement on `conn` (no idempotency keys: those
/// take [`reserve`]). The answer is in request order; `None` where the pool ran out.
pub async fn reserve_many(
    conn: &mut PgConnection,
    pool: &Pool,
    requests: &[Request],
) -> Result<Vec<Option<Reservation>>, sqlx::Error> {
    let floor = pool.cursor.floor(now_ms());
    let mut out = claim_in_chunks(conn, pool, requests.iter().collect(), floor).await?;
    let missing: Vec<usize> = (0..out.len()).filter(|&i| out[i].is_none()).collect();
    if !missing.is_empty() && pool.cursor.rewind(floor) {
        let again = claim_in_chunks(conn, pool, missing.iter().map(|&i| &requests[i]).collect(), 0).await?;
        for (i, held) in missing.into_iter().zip(again) {
            out[i] = held;
        }
    }
    Ok(out)
}

/// [`claim_many`] for every [`MOST_PER_SHARED_CLAIM`] of `requests` in turn; the answer is in their
/// order.
async fn claim_in_chunks(
    conn: &mut PgConnection,
    pool: &Pool,
    requests: Vec<&Request>,
    floor: i64,
) -> Result<Vec<Option<Reservation>>, sqlx::Error> {
    let mut out = Vec::with_capacity(requests.len());
    for chunk in requests.chunks(MOST_PER_SHARED_CLAIM) {
        out.extend(claim_many(conn, pool, chunk.to_vec(), floor).await?);
    }
    Ok(out)
}

/// One shared claim ([`RESERVE_MANY`] of the size that covers `requests`, at most
/// [`MOST_PER_SHARED_CLAIM`]) from counter `floor` on; the answer is in their order.
async fn claim_many(
    conn: &mut PgConnection,
    pool: &Pool,
    requests: Vec<&Request>,
    floor: i64,
) -> Result<Vec<Option<Reservation>>, sqlx::Error> {
    let holders: Vec<Option<&str>> = requests.iter().map(|r| r.holder.as_deref()).collect();
    let actors: Vec<&str> = requests.iter().map(|r| r.actor.name.as_str()).collect();
    let request_ids: Vec<Option<&str>> = requests.iter().map(|r| r.actor.request_id.as_deref()).collect();
    let client_request_ids: Vec<Option<&str>> = requests.iter().map(|r| r.actor.client_request_id.as_deref()).collect();
    let rows = sqlx::query(sqlx::AssertSqlSafe(reserve_many_sql(requests.len())))
        .bind(pool.settings.lease_ttl.as_secs_f64())
        .bind(pool.id)
        .bind(&holders)
        .bind(&actors)
        .bind(&request_ids)
        .bind(pool.name())
        .bind(&client_request_ids)
        .bind(floor)
        .fetch_all(conn)
        .await?;
    let mut out = vec![None; requests.len()];
    for row in &rows {
        let rn: i64 = row.get("rn");
        if let Some(slot) = usize::try_from(rn - 1).ok().and_then(|i| out.get_mut(i)) {
            *slot = Some(reservation(pool, row));
        }
    }
    Ok(out)
}

/// The one-statement reservation the API runs, audit row included (binds: `$1` lease seconds, `$2`
/// pool id, `$3` holder, `$4` actor, `$5` request id, `$6` pool name, `$7` the caller's own request
/// id, `$8` the lowest counter to consider), for benchmarks that compare the service with the same
/// raw SQL.
pub fn reserve_sql() -> &'static str {
    RESERVE.as_str()
}

/// The reservation idempotency key `$1` of caller `$2` produced, with a `cif.replayed` row (actor `$2`,
/// request id `$3`, pool name `$4`, holder `$5`, client request id `$7`) when it belongs to pool `$6`. Keys are the caller's
/// own: another caller's same key is not found; nor is a key older than the retention window, even
/// before reclaim has deleted it.
static REPLAY: LazyLock<String> = LazyLock::new(|| {
    let columns = Columns {
        actor: "$2",
        request_id: "$3",
        client_request_id: "$7",
        pool: "$4",
        cif: "code",
        holder: "$5",
        ..Default::default()
    };
    audited(
        &format!(
            "SELECT pool_id, code, lease_token, lease_expires_at FROM cif_idempotency \
             WHERE caller = $2 AND idempotency_key = $1 AND created_at >= now() - interval '{IDEMPOTENCY_RETENTION_HOURS} hours'"
        ),
        &insert_from(action::CIF_REPLAYED, &columns, "done WHERE pool_id = $6"),
        "pool_id, code, lease_token, lease_expires_at",
    )
});

/// A code held by a pod.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Reservation {
    /// The customer number.
    pub cif: String,
    /// Pool / customer type.
    pub customer_type: String,
    /// Capability to confirm, release or extend this hold.
    pub reservation_token: Uuid,
    /// When reclaim may take the code back.
    pub lease_expires_at: DateTime<Utc>,
}

/// Result of [`reserve`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserved {
    /// A new hold.
    Created(Reservation),
    /// The idempotency key was seen before: the same hold as then.
    Replayed(Reservation),
    /// No available code right now.
    Empty,
    /// The idempotency key was used for another customer type.
    KeyReused {
        /// The type it was used for.
        customer_type_id: i16,
    },
}

/// The claim of one code of `pool` for `holder` by `actor`, scanning from counter `floor` on.
fn claim_one<'q>(
    pool: &'q Pool,
    holder: Option<&'q str>,
    actor: &'q Actor,
    floor: i64,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sqlx::AssertSqlSafe(RESERVE.as_str()))
        .bind(pool.settings.lease_ttl.as_secs_f64())
        .bind(pool.id)
        .bind(holder)
        .bind(&actor.name)
        .bind(&actor.request_id)
        .bind(pool.name())
        .bind(&actor.client_request_id)
        .bind(floor)
}

/// Reserves one code of `pool` for `holder`, recorded as `actor`'s, on `conn`: one autocommit
/// statement, two when the scan from the pool's cursor comes back empty.
pub async fn reserve_on(
    conn: &mut PgConnection,
    pool: &Pool,
    holder: Option<&str>,
    actor: &Actor,
) -> Result<Reserved, sqlx::Error> {
    let floor = pool.cursor.floor(now_ms());
    let mut row = claim_one(pool, holder, actor, floor).fetch_optional(&mut *conn).await?;
    if row.is_none() && pool.cursor.rewind(floor) {
        row = claim_one(pool, holder, actor, 0).fetch_optional(&mut *conn).await?;
    }
    Ok(row.map_or(Reserved::Empty, |r| Reserved::Created(reservation(pool, &r))))
}

/// Reserves one code of `pool` for `holder`, recorded as `actor`'s. With an `idempotency_key`, a
/// key the same actor sent before gets the first reservation back (and a `cif.replayed` row) instead
/// of a second code; the same key from another actor is a request of its own.
pub async fn reserve(
    db: &PgPool,
    pool: &Pool,
    holder: Option<&str>,
    idempotency_key: Option<&str>,
    actor: &Actor,
) -> Result<Reserved, sqlx::Error> {
    let Some(key) = idempotency_key else {
        return reserve_on(&mut *db.acquire().await?, pool, holder, actor).await;
    };
    if let Some(found) = replay(db, pool, key, holder, actor).await? {
        return Ok(found);
    }
    // Claim and record the key atomically; a concurrent request with the same key loses the insert,
    // rolls its claim (and its audit row) back and replays the winner's reservation.
    let mut tx = db.begin().await?;
    let Reserved::Created(held) = reserve_on(&mut tx, pool, holder, actor).await? else {
        return Ok(Reserved::Empty);
    };
    // A key past its window that reclaim has not deleted yet is taken over by this reservation.
    let inserted = sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO cif_idempotency (caller, idempotency_key, pool_id, counter, code, lease_token, lease_expires_at) \
         SELECT $6, $1, $2, counter, code, $4, $5 FROM cif_codes WHERE pool_id = $2 AND code = $3 \
         ON CONFLICT (caller, idempotency_key) DO UPDATE SET pool_id = excluded.pool_id, counter = excluded.counter, \
             code = excluded.code, lease_token = excluded.lease_token, \
             lease_expires_at = excluded.lease_expires_at, created_at = now() \
         WHERE cif_idempotency.created_at < now() - interval '{IDEMPOTENCY_RETENTION_HOURS} hours'"
    )))
    .bind(key)
    .bind(pool.id)
    .bind(&held.cif)
    .bind(held.reservation_token)
    .bind(held.lease_expires_at)
    .bind(&actor.name)
    .execute(&mut *tx)
    .await?;
    if inserted.rows_affected() == 0 {
        tx.rollback().await?;
        return Ok(replay(db, pool, key, holder, actor).await?.unwrap_or(Reserved::Empty));
    }
    tx.commit().await?;
    Ok(Reserved::Created(held))
}

async fn replay(
    db: &PgPool,
    pool: &Pool,
    key: &str,
    holder: Option<&str>,
    actor: &Actor,
) -> Result<Option<Reserved>, sqlx::Error> {
    let row = sqlx::query(sqlx::AssertSqlSafe(REPLAY.as_str()))
        .bind(key)
        .bind(&actor.name)
        .bind(&actor.request_id)
        .bind(pool.name())
        .bind(holder)
        .bind(pool.id)
        .bind(&actor.client_request_id)
        .fetch_optional(db)
        .await?;
    Ok(row.map(|r| {
        let pool_id: i16 = r.get("pool_id");
        if pool_id != pool.id {
            return Reserved::KeyReused { customer_type_id: pool_id };
        }
        Reserved::Replayed(Reservation {
            cif: r.get("code"),
            customer_type: pool.name().to_string(),
            reservation_token: r.get("lease_token"),
            lease_expires_at: r.get("lease_expires_at"),
        })
    }))
}

/// The reservation in a claimed row; the pool's cursor moves to its counter.
fn reservation(pool: &Pool, row: &sqlx::postgres::PgRow) -> Reservation {
    pool.cursor.took(row.get("counter"));
    Reservation {
        cif: row.get("code"),
        customer_type: pool.name().to_string(),
        reservation_token: row.get("lease_token"),
        lease_expires_at: row.get("lease_expires_at"),
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

crate::statements::statements_of!(RESERVE, RESERVE_MANY, REPLAY);
