//! Reservation lifecycle on `cif_codes` / `cif_issued`, expressed through the [`crate::claim`] contract.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::cif::Pool;
use crate::claim::{ClaimSpec, ClaimTable, Fenced};

/// `cif_codes` as a claimable table.
pub const CODES: ClaimTable = ClaimTable {
    table: "cif_codes",
    key: &["pool_id", "counter"],
    state: "state",
    token: "lease_token",
    lease: "lease_expires_at",
};

/// SQL literal of the free state.
pub const AVAILABLE: &str = "'available'";
/// SQL literal of the held state.
pub const RESERVED: &str = "'reserved'";

/// Claim one code of pool `$3` for holder `$4`. Ordered by the primary key so the claim walks the
/// index from the pool's lowest counter.
static RESERVE: LazyLock<String> = LazyLock::new(|| {
    CODES.claim_sql(&ClaimSpec {
        free: AVAILABLE,
        held: RESERVED,
        filter: "pool_id = $3",
        order_by: "pool_id, counter",
        set: "holder = $4, reserved_at = now()",
        returning: "t.code, t.lease_token, t.lease_expires_at",
    })
});

/// The one-statement reservation the API runs (binds: `$1` limit, `$2` lease seconds, `$3` pool id,
/// `$4` holder), for benchmarks that compare the service with the same raw SQL.
pub fn reserve_sql() -> &'static str {
    RESERVE.as_str()
}

/// Move a held code to `cif_issued`, fenced by its token: `$1` token, `$2` pool, `$3` counter, `$4` ref.
static CONFIRM: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH gone AS ({}) \
         INSERT INTO cif_issued (pool_id, counter, code, customer_ref, holder, lease_token, reserved_at) \
         SELECT pool_id, counter, code, $4, holder, lease_token, reserved_at FROM gone \
         RETURNING confirmed_at",
        CODES.fenced_delete_sql(
            RESERVED,
            "pool_id = $2 AND counter = $3",
            "pool_id, counter, code, holder, lease_token, reserved_at"
        )
    )
});

static RELEASE: LazyLock<String> = LazyLock::new(|| {
    CODES.fenced_update_sql(
        RESERVED,
        "pool_id = $2 AND counter = $3",
        "state = 'available', lease_token = NULL, lease_expires_at = NULL, holder = NULL, reserved_at = NULL",
        None,
    )
});

static EXTEND: LazyLock<String> = LazyLock::new(|| CODES.extend_sql(RESERVED, "pool_id = $3 AND counter = $4"));

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

/// Reserves one code of `pool`.
pub async fn reserve(
    db: &PgPool,
    pool: &Pool,
    holder: Option<&str>,
    idempotency_key: Option<&str>,
) -> Result<Reserved, sqlx::Error> {
    let lease_secs = pool.settings.lease_ttl.as_secs_f64();
    let Some(key) = idempotency_key else {
        // The common path: one autocommit statement.
        let row = sqlx::query(sqlx::AssertSqlSafe(RESERVE.as_str()))
            .bind(1_i64)
            .bind(lease_secs)
            .bind(pool.id)
            .bind(holder)
            .fetch_optional(db)
            .await?;
        return Ok(row.map_or(Reserved::Empty, |r| Reserved::Created(reservation(pool, &r))));
    };

    if let Some(found) = replay(db, pool, key).await? {
        return Ok(found);
    }
    // Claim and record the key atomically; a concurrent request with the same key loses the insert,
    // rolls its claim back and replays the winner's reservation.
    let mut tx = db.begin().await?;
    let Some(row) = sqlx::query(sqlx::AssertSqlSafe(RESERVE.as_str()))
        .bind(1_i64)
        .bind(lease_secs)
        .bind(pool.id)
        .bind(holder)
        .fetch_optional(&mut *tx)
        .await?
    else {
        return Ok(Reserved::Empty);
    };
    let held = reservation(pool, &row);
    let inserted = sqlx::query(
        "INSERT INTO cif_idempotency (idempotency_key, pool_id, counter, code, lease_token, lease_expires_at) \
         SELECT $1, $2, counter, code, $4, $5 FROM cif_codes WHERE pool_id = $2 AND code = $3 \
         ON CONFLICT (idempotency_key) DO NOTHING",
    )
    .bind(key)
    .bind(pool.id)
    .bind(&held.cif)
    .bind(held.reservation_token)
    .bind(held.lease_expires_at)
    .execute(&mut *tx)
    .await?;
    if inserted.rows_affected() == 0 {
        tx.rollback().await?;
        return Ok(replay(db, pool, key).await?.unwrap_or(Reserved::Empty));
    }
    tx.commit().await?;
    Ok(Reserved::Created(held))
}

async fn replay(db: &PgPool, pool: &Pool, key: &str) -> Result<Option<Reserved>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT pool_id, code, lease_token, lease_expires_at FROM cif_idempotency WHERE idempotency_key = $1",
    )
    .bind(key)
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

fn reservation(pool: &Pool, row: &sqlx::postgres::PgRow) -> Reservation {
    Reservation {
        cif: row.get("code"),
        customer_type: pool.name().to_string(),
        reservation_token: row.get("lease_token"),
        lease_expires_at: row.get("lease_expires_at"),
    }
}

/// Result of [`confirm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirmed {
    /// The code is now used.
    Now(DateTime<Utc>),
    /// It already was, by this same token (a retried confirm).
    Already(DateTime<Utc>),
    /// The token does not hold the code (never did, or its lease was reclaimed).
    LeaseLost,
}

/// Marks the code used, fenced by `token`.
pub async fn confirm(
    db: &PgPool,
    pool: &Pool,
    counter: i64,
    token: Uuid,
    customer_ref: Option<&str>,
) -> Result<Confirmed, sqlx::Error> {
    let done: Option<DateTime<Utc>> = sqlx::query_scalar(sqlx::AssertSqlSafe(CONFIRM.as_str()))
        .bind(token)
        .bind(pool.id)
        .bind(counter)
        .bind(customer_ref)
        .fetch_optional(db)
        .await?;
    if let Some(at) = done {
        return Ok(Confirmed::Now(at));
    }
    let earlier: Option<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT confirmed_at FROM cif_issued WHERE pool_id = $1 AND counter = $2 AND lease_token = $3",
    )
    .bind(pool.id)
    .bind(counter)
    .bind(token)
    .fetch_optional(db)
    .await?;
    Ok(earlier.map_or(Confirmed::LeaseLost, Confirmed::Already))
}

/// Returns a held code to the pool, fenced by `token`.
pub async fn release(db: &PgPool, pool: &Pool, counter: i64, token: Uuid) -> Result<Fenced, sqlx::Error> {
    let done =
        sqlx::query(sqlx::AssertSqlSafe(RELEASE.as_str())).bind(token).bind(pool.id).bind(counter).execute(db).await?;
    Ok(Fenced::from_rows(done.rows_affected()))
}

/// Renews the lease for another `lease_ttl`, fenced by `token`; the new expiry, or `None` if lost.
pub async fn extend(db: &PgPool, pool: &Pool, counter: i64, token: Uuid) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(EXTEND.as_str()))
        .bind(token)
        .bind(pool.settings.lease_ttl.as_secs_f64())
        .bind(pool.id)
        .bind(counter)
        .fetch_optional(db)
        .await
}

/// Where a code stands (never exposes tokens).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct CodeStatus {
    /// The code.
    pub cif: String,
    /// Pool / customer type.
    pub customer_type: String,
    /// `available`, `reserved` or `used`.
    pub state: String,
    /// When it was reserved (reserved and used codes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_at: Option<DateTime<Utc>>,
    /// Lease expiry (reserved codes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// When it was confirmed (used codes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confirmed_at: Option<DateTime<Utc>>,
}

/// Looks a code up by its counter; `None` when it has not been generated yet.
pub async fn status(db: &PgPool, pool: &Pool, counter: i64, cif: &str) -> Result<Option<CodeStatus>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT state, reserved_at, lease_expires_at, NULL::timestamptz AS confirmed_at \
           FROM cif_codes WHERE pool_id = $1 AND counter = $2 \
         UNION ALL \
         SELECT 'used', reserved_at, NULL, confirmed_at FROM cif_issued WHERE pool_id = $1 AND counter = $2",
    )
    .bind(pool.id)
    .bind(counter)
    .fetch_optional(db)
    .await?;
    Ok(row.map(|r| CodeStatus {
        cif: cif.to_string(),
        customer_type: pool.name().to_string(),
        state: r.get("state"),
        reserved_at: r.get("reserved_at"),
        lease_expires_at: r.get("lease_expires_at"),
        confirmed_at: r.get("confirmed_at"),
    }))
}
