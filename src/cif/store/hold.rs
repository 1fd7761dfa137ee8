//! What a pod does with a hold once it has one: confirm it (the code moves to `cif_issued`), release
//! it, extend its lease, or look a code up. Every transition is fenced by the hold's token and writes
//! its audit row in the same statement.

use std::sync::LazyLock;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgPool, Row};
use uuid::Uuid;

use super::{CODES, RESERVED};
use crate::audit::{Actor, Columns, action, audited, insert_from};
use crate::cif::Pool;
use crate::claim::Fenced;

/// Move a held code to `cif_issued`, fenced by its token: `$1` token, `$2` pool, `$3` counter, `$4`
/// ref; audit row: actor `$5`, request id `$6`, pool name `$7`, holder `$8` (else the hold's), client
/// request id `$9`.
static CONFIRM: LazyLock<String> = LazyLock::new(|| {
    let gone = CODES.fenced_delete_sql(
        RESERVED,
        "pool_id = $2 AND counter = $3",
        "pool_id, counter, code, holder, lease_token, reserved_at",
    );
    let columns = Columns {
        actor: "$5",
        request_id: "$6",
        client_request_id: "$9",
        pool: "$7",
        cif: "code",
        holder: "coalesce($8, holder)",
        customer_ref: "customer_ref",
        ..Default::default()
    };
    format!(
        "WITH gone AS ({gone}), \
         done AS (INSERT INTO cif_issued (pool_id, counter, code, customer_ref, holder, lease_token, reserved_at) \
                  SELECT pool_id, counter, code, $4, holder, lease_token, reserved_at FROM gone \
                  RETURNING code, holder, customer_ref, confirmed_at), \
         audit AS ({insert}) \
         SELECT confirmed_at FROM done",
        insert = insert_from(action::CIF_CONFIRMED, &columns, "done")
    )
});

/// Binds: `$1` token, `$2` pool, `$3` counter; audit row: actor `$4`, request id `$5`, pool name `$6`,
/// holder `$7`, client request id `$8`.
static RELEASE: LazyLock<String> = LazyLock::new(|| {
    let release = CODES.fenced_update_sql(
        RESERVED,
        "pool_id = $2 AND counter = $3",
        "state = 'available', lease_token = NULL, lease_expires_at = NULL, holder = NULL, reserved_at = NULL",
        Some("code"),
    );
    let columns = Columns {
        actor: "$4",
        request_id: "$5",
        client_request_id: "$8",
        pool: "$6",
        cif: "code",
        holder: "$7",
        ..Default::default()
    };
    audited(&release, &insert_from(action::CIF_RELEASED, &columns, "done"), "code")
});

/// Binds: `$1` token, `$2` lease seconds, `$3` pool, `$4` counter; audit row: actor `$5`, request id
/// `$6`, pool name `$7`, holder `$8` (else the hold's), client request id `$9`.
static EXTEND: LazyLock<String> = LazyLock::new(|| {
    let extend = CODES.extend_sql(RESERVED, "pool_id = $3 AND counter = $4", "code, holder, lease_expires_at");
    let columns = Columns {
        actor: "$5",
        request_id: "$6",
        client_request_id: "$9",
        pool: "$7",
        cif: "code",
        holder: "coalesce($8, holder)",
        detail: "jsonb_build_object('lease_expires_at', lease_expires_at)",
        ..Default::default()
    };
    audited(&extend, &insert_from(action::CIF_EXTENDED, &columns, "done"), "lease_expires_at")
});

/// Result of [`confirm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirmed {
    /// The code is now used.
    Now(DateTime<Utc>),
    /// It already was, by this same token and for the same `customer_ref` (a retried confirm).
    Already(DateTime<Utc>),
    /// It already was, by this same token but for another `customer_ref`: one number must not be
    /// handed to two customers, so this is refused, not taken for a retry.
    OtherCustomer,
    /// The token does not hold the code (never did, or its lease was reclaimed).
    LeaseLost,
}

/// Who performs a transition on a hold: the actor of the audit row and the holder (pod) the request
/// names, if any.
#[derive(Debug, Clone, Copy)]
pub struct By<'a> {
    /// The caller and its request id.
    pub actor: &'a Actor,
    /// The `X-Holder` of the request; confirm and extend fall back to the hold's own holder.
    pub holder: Option<&'a str>,
}

/// Marks the code used, fenced by `token`.
pub async fn confirm(
    db: &PgPool,
    pool: &Pool,
    counter: i64,
    token: Uuid,
    customer_ref: Option<&str>,
    by: By<'_>,
) -> Result<Confirmed, sqlx::Error> {
    let done: Option<DateTime<Utc>> = sqlx::query_scalar(sqlx::AssertSqlSafe(CONFIRM.as_str()))
        .bind(token)
        .bind(pool.id)
        .bind(counter)
        .bind(customer_ref)
        .bind(&by.actor.name)
        .bind(&by.actor.request_id)
        .bind(pool.name())
        .bind(by.holder)
        .bind(&by.actor.client_request_id)
        .fetch_optional(db)
        .await?;
    if let Some(at) = done {
        return Ok(Confirmed::Now(at));
    }
    let earlier: Option<(DateTime<Utc>, Option<String>)> = sqlx::query_as(
        "SELECT confirmed_at, customer_ref FROM cif_issued WHERE pool_id = $1 AND counter = $2 AND lease_token = $3",
    )
    .bind(pool.id)
    .bind(counter)
    .bind(token)
    .fetch_optional(db)
    .await?;
    Ok(match earlier {
        None => Confirmed::LeaseLost,
        Some((at, stored)) if stored.as_deref() == customer_ref => Confirmed::Already(at),
        Some(_) => Confirmed::OtherCustomer,
    })
}

/// Returns a held code to the pool, fenced by `token`.
pub async fn release(db: &PgPool, pool: &Pool, counter: i64, token: Uuid, by: By<'_>) -> Result<Fenced, sqlx::Error> {
    let done: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(RELEASE.as_str()))
        .bind(token)
        .bind(pool.id)
        .bind(counter)
        .bind(&by.actor.name)
        .bind(&by.actor.request_id)
        .bind(pool.name())
        .bind(by.holder)
        .bind(&by.actor.client_request_id)
        .fetch_optional(db)
        .await?;
    Ok(if done.is_some() { Fenced::Done } else { Fenced::LeaseLost })
}

/// Renews the lease for another `lease_ttl`, fenced by `token`; the new expiry, or `None` if lost.
pub async fn extend(
    db: &PgPool,
    pool: &Pool,
    counter: i64,
    token: Uuid,
    by: By<'_>,
) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(EXTEND.as_str()))
        .bind(token)
        .bind(pool.settings.lease_ttl.as_secs_f64())
        .bind(pool.id)
        .bind(counter)
        .bind(&by.actor.name)
        .bind(&by.actor.request_id)
        .bind(pool.name())
        .bind(by.holder)
        .bind(&by.actor.client_request_id)
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

/// Looks `cif` up by its counter; `None` when it has not been generated yet (or the counter holds
/// another code: this instance decoded it under key epochs that are no longer the pool's).
pub async fn status(db: &PgPool, pool: &Pool, counter: i64, cif: &str) -> Result<Option<CodeStatus>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT state, reserved_at, lease_expires_at, NULL::timestamptz AS confirmed_at \
           FROM cif_codes WHERE pool_id = $1 AND counter = $2 AND code = $3 \
         UNION ALL \
         SELECT 'used', reserved_at, NULL, confirmed_at FROM cif_issued \
          WHERE pool_id = $1 AND counter = $2 AND code = $3",
    )
    .bind(pool.id)
    .bind(counter)
    .bind(cif)
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

crate::statements::statements_of!(CONFIRM, RELEASE, EXTEND);
