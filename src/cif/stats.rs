//! Pool depth: the numbers behind `GET /v1/pools`, the gauges, and the watermark warnings.

use std::sync::atomic::Ordering;

use serde::Serialize;
use sqlx::PgPool;

use crate::cif::Pools;

/// One pool's depth.
#[derive(Debug, Clone, Serialize)]
pub struct PoolStats {
    /// Customer type.
    pub customer_type: String,
    /// Codes ready to reserve.
    pub available: u64,
    /// Codes held under a lease.
    pub reserved: u64,
    /// Counters taken that are neither available nor held: the codes confirmed, plus the counters a
    /// fence, a key rotation or a reconcile took out of circulation.
    pub used: u64,
    /// Next counter to generate (= counters ever taken).
    pub next_counter: u64,
    /// Size of the pool's code space (10^digits).
    pub domain_size: u64,
    /// `next_counter / domain_size`.
    pub domain_used_fraction: f64,
    /// Refill threshold.
    pub low_watermark: u64,
    /// `available < low_watermark`.
    pub low: bool,
}

/// Reads every served pool's depth. `used` follows from the invariant that every generated counter
/// sits in exactly one of cif_codes / cif_issued, so the ever-growing cif_issued is never counted.
pub(crate) async fn pool_stats(db: &PgPool, pools: &Pools) -> Result<Vec<PoolStats>, sqlx::Error> {
    let rows: Vec<(i16, i64, i64, i64)> = sqlx::query_as(
        "SELECT p.id, p.next_counter, \
                coalesce(c.available, 0), coalesce(c.reserved, 0) \
           FROM cif_pools p \
           LEFT JOIN (SELECT pool_id, \
                             count(*) FILTER (WHERE state = 'available') AS available, \
                             count(*) FILTER (WHERE state = 'reserved') AS reserved \
                        FROM cif_codes GROUP BY pool_id) c ON c.pool_id = p.id",
    )
    .fetch_all(db)
    .await?;
    Ok(pools
        .iter()
        .filter_map(|pool| {
            let &(_, next, available, reserved) = rows.iter().find(|r| r.0 == pool.id)?;
            let (next, available, reserved) = (next as u64, available as u64, reserved as u64);
            let domain = pool.codec.capacity();
            Some(PoolStats {
                customer_type: pool.name().to_string(),
                available,
                reserved,
                used: next.saturating_sub(available + reserved),
                next_counter: next,
                domain_size: domain,
                domain_used_fraction: next as f64 / domain as f64,
                low_watermark: pool.settings.low_watermark,
                low: available < pool.settings.low_watermark,
            })
        })
        .collect())
}

/// Reads every served pool's depth and publishes it (gauges, watermark warnings) on the way.
pub async fn refresh(db: &PgPool, pools: &Pools) -> Result<Vec<PoolStats>, sqlx::Error> {
    let stats = pool_stats(db, pools).await?;
    publish(&stats, pools);
    Ok(stats)
}

/// Sets the gauges and logs a warning when a pool crosses its watermark (either way).
pub(crate) fn publish(stats: &[PoolStats], pools: &Pools) {
    for s in stats {
        let pool = s.customer_type.clone();
        metrics::gauge!("cifpool_pool_available", "pool" => pool.clone()).set(s.available as f64);
        metrics::gauge!("cifpool_pool_reserved", "pool" => pool.clone()).set(s.reserved as f64);
        metrics::gauge!("cifpool_pool_used", "pool" => pool.clone()).set(s.used as f64);
        metrics::gauge!("cifpool_pool_low_watermark", "pool" => pool.clone()).set(s.low_watermark as f64);
        metrics::gauge!("cifpool_pool_domain_used_ratio", "pool" => pool.clone()).set(s.domain_used_fraction);
        metrics::gauge!("cifpool_pool_low", "pool" => pool.clone()).set(if s.low { 1.0 } else { 0.0 });
        if let Some(p) = pools.get(&s.customer_type) {
            note_depth(p, s.available);
        }
    }
}

/// Records whether `pool` is under its watermark, warning on the crossing.
pub(crate) fn note_depth(pool: &crate::cif::Pool, available: u64) {
    let low = available < pool.settings.low_watermark;
    if pool.low.swap(low, Ordering::Relaxed) != low {
        if low {
            tracing::warn!(
                pool = pool.name(),
                available,
                low_watermark = pool.settings.low_watermark,
                "pool fell below its low watermark"
            );
        } else {
            tracing::info!(pool = pool.name(), available, "pool back above its low watermark");
        }
    }
}

/// When refill and reclaim last ran on a pool (any pod) and what they did.
#[derive(Debug, Clone, Default, Serialize, sqlx::FromRow)]
pub struct PoolUpkeep {
    /// Customer type.
    pub customer_type: String,
    /// End of the last refill that took the pool's lock.
    pub last_refill_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Codes that refill added (0: the pool was above its watermark).
    pub last_refill_added: Option<i64>,
    /// End of the last reclaim that swept the pool.
    pub last_reclaim_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Expired holds that reclaim returned.
    pub last_reclaim_returned: Option<i64>,
}

/// Reads when refill and reclaim last ran, per pool in the database.
pub async fn pool_upkeep(db: &PgPool) -> Result<Vec<PoolUpkeep>, sqlx::Error> {
    sqlx::query_as(
        "SELECT name AS customer_type, last_refill_at, last_refill_added, last_reclaim_at, last_reclaim_returned \
           FROM cif_pools ORDER BY name",
    )
    .fetch_all(db)
    .await
}
