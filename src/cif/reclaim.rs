//! Reclaim: holds whose lease expired (the pod died or forgot) go back to available, token wiped, so
//! the old holder's confirm is refused (409) and the code can serve someone else.

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Instant;

use serde::Serialize;
use sqlx::PgPool;

use crate::audit::{Actor, Columns, action, audited, insert_from};
use crate::cif::Pools;
use crate::cif::store::{AVAILABLE, CODES, IDEMPOTENCY_RETENTION_HOURS, RESERVED};

/// Rows per sweep statement: bounded so a mass expiry does not become one huge transaction.
const SWEEP_BATCH: i64 = 1000;

/// Binds: `$1` batch, `$2` pool id (`NULL`: every pool); audit rows: actor `$3`, request id `$4`,
/// client request id `$5`.
static SWEEP: LazyLock<String> = LazyLock::new(|| {
    let sweep = CODES.sweep_sql(
        RESERVED,
        AVAILABLE,
        "($2::int2 IS NULL OR pool_id = $2)",
        "holder = NULL, reserved_at = NULL",
        "holder",
        "t.pool_id, t.code, expired.holder",
    );
    let columns = Columns {
        actor: "$3",
        request_id: "$4",
        client_request_id: "$5",
        pool: "(SELECT name FROM cif_pools WHERE id = done.pool_id)",
        cif: "code",
        holder: "holder",
        ..Default::default()
    };
    audited(&sweep, &insert_from(action::CIF_RECLAIMED, &columns, "done"), "pool_id")
});

/// What a reclaim run did.
#[derive(Debug, Clone, Serialize)]
pub struct ReclaimSummary {
    /// Codes returned to available, per pool name.
    pub reclaimed: BTreeMap<String, u64>,
    /// Total over all pools.
    pub total: u64,
    /// Idempotency records purged.
    pub idempotency_purged: u64,
    /// Wall time.
    pub duration_ms: f64,
}

/// Sweeps every expired hold of `only` (or of every pool), in batches; each code taken back gets a
/// `cif.reclaimed` row by `actor` (`system` on the schedule) in the statement that takes it.
pub async fn reclaim(
    db: &PgPool,
    pools: &Pools,
    only: Option<i16>,
    actor: &Actor,
) -> Result<ReclaimSummary, sqlx::Error> {
    let started = Instant::now();
    let mut by_id: BTreeMap<i16, u64> = BTreeMap::new();
    loop {
        let ids: Vec<i16> = sqlx::query_scalar(sqlx::AssertSqlSafe(SWEEP.as_str()))
            .bind(SWEEP_BATCH)
            .bind(only)
            .bind(&actor.name)
            .bind(&actor.request_id)
            .bind(&actor.client_request_id)
            .fetch_all(db)
            .await?;
        for id in &ids {
            *by_id.entry(*id).or_default() += 1;
        }
        if (ids.len() as i64) < SWEEP_BATCH {
            break;
        }
    }
    let purged = sqlx::query("DELETE FROM cif_idempotency WHERE created_at < now() - make_interval(hours => $1)")
        .bind(IDEMPOTENCY_RETENTION_HOURS as i32)
        .execute(db)
        .await?
        .rows_affected();
    // When reclaim last ran on each pool it swept, and what it returned (the console's Pools page).
    let swept: Vec<i16> = pools.iter().map(|p| p.id).filter(|id| only.is_none_or(|o| o == *id)).collect();
    let returned: Vec<i64> = swept.iter().map(|id| by_id.get(id).copied().unwrap_or(0) as i64).collect();
    sqlx::query(
        "UPDATE cif_pools p SET last_reclaim_at = now(), last_reclaim_returned = r.n \
           FROM unnest($1::int2[], $2::int8[]) AS r(id, n) WHERE p.id = r.id",
    )
    .bind(&swept)
    .bind(&returned)
    .execute(db)
    .await?;
    let mut reclaimed = BTreeMap::new();
    for (id, n) in by_id {
        let name = pools.iter().find(|p| p.id == id).map_or_else(|| format!("pool#{id}"), |p| p.name().to_string());
        metrics::counter!("cifpool_reclaimed_total", "pool" => name.clone()).increment(n);
        tracing::info!(pool = %name, codes = n, "reclaimed expired holds");
        reclaimed.insert(name, n);
    }
    let total = reclaimed.values().sum();
    Ok(ReclaimSummary {
        reclaimed,
        total,
        idempotency_purged: purged,
        duration_ms: started.elapsed().as_secs_f64() * 1e3,
    })
}

crate::statements::statements_of!(SWEEP);
