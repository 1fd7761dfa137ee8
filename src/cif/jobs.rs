//! When refill, reclaim and the gauges run: on their cron schedules, on demand (admin), right away
//! when a pool turns up empty, and after claims (rate-limited depth check).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_cron_scheduler::JobScheduler;
use tokio_util::sync::CancellationToken;

use crate::cif::refill::{self, RefillOptions, RefillSummary};
use crate::cif::{Pool, reclaim, stats};
use crate::state::AppState;

/// Minimum spacing of post-claim depth checks per pool and instance.
const DEPTH_CHECK_INTERVAL_MS: i64 = 1000;
/// How often the pool gauges are refreshed.
pub const GAUGE_INTERVAL: Duration = Duration::from_secs(10);

/// Runs one refill and logs its summary.
pub async fn run_refill(state: &AppState, pool: &Pool, opts: RefillOptions) -> Result<RefillSummary, sqlx::Error> {
    let summary = refill::refill(&state.db, pool, opts).await?;
    if summary.codes_added > 0 {
        tracing::info!(
            pool = pool.name(),
            added = summary.codes_added,
            batches = summary.batches,
            ms = summary.duration_ms,
            "refilled pool"
        );
    }
    Ok(summary)
}

fn spawn_refill(state: &AppState, pool: &Arc<Pool>) {
    let (state, pool) = (state.clone(), pool.clone());
    tokio::spawn(async move {
        if let Err(e) = run_refill(&state, &pool, RefillOptions::default()).await {
            tracing::warn!(pool = pool.name(), error = %e, "refill failed");
        }
    });
}

/// A claim found the pool empty: refill now (the advisory lock collapses concurrent triggers).
pub fn on_empty(state: &AppState, pool: &Arc<Pool>) {
    stats::note_depth(pool, 0);
    spawn_refill(state, pool);
}

/// After a successful claim: at most once a second per pool, check the depth and refill if low.
pub fn after_claim(state: &AppState, pool: &Arc<Pool>) {
    let now = chrono::Utc::now().timestamp_millis();
    let last = pool.last_depth_check_ms.load(Ordering::Relaxed);
    if now - last < DEPTH_CHECK_INTERVAL_MS
        || pool.last_depth_check_ms.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_err()
    {
        return;
    }
    let (state, pool) = (state.clone(), pool.clone());
    tokio::spawn(async move {
        let Ok(mut conn) = state.db.acquire().await else { return };
        let Ok(available) = refill::available_up_to(&mut conn, pool.id, pool.settings.low_watermark).await else {
            return;
        };
        drop(conn);
        stats::note_depth(&pool, available);
        if available < pool.settings.low_watermark {
            spawn_refill(&state, &pool);
        }
    });
}

/// Registers each pool's refill and reclaim schedules.
pub async fn schedule(scheduler: &JobScheduler, state: &AppState) -> anyhow::Result<()> {
    for pool in state.pools.iter() {
        let (st, p) = (state.clone(), pool.clone());
        crate::schedule::add(scheduler, &pool.settings.refill_schedule, move || {
            let (st, p) = (st.clone(), p.clone());
            async move {
                if let Err(e) = run_refill(&st, &p, RefillOptions::default()).await {
                    tracing::warn!(pool = p.name(), error = %e, "scheduled refill failed");
                }
            }
        })
        .await?;
        let (st, id) = (state.clone(), pool.id);
        crate::schedule::add(scheduler, &pool.settings.reclaim_schedule, move || {
            let st = st.clone();
            async move {
                if let Err(e) = reclaim::reclaim(&st.db, &st.pools, Some(id)).await {
                    tracing::warn!(error = %e, "scheduled reclaim failed");
                }
            }
        })
        .await?;
    }
    Ok(())
}

/// Refreshes the pool gauges every [`GAUGE_INTERVAL`] until `stop`.
pub async fn gauges_loop(state: AppState, stop: CancellationToken) {
    let mut tick = tokio::time::interval(GAUGE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match stats::pool_stats(&state.db, &state.pools).await {
            Ok(s) => stats::publish(&s, &state.pools),
            Err(e) => tracing::debug!(error = %e, "pool gauges: database unavailable"),
        }
    }
}
