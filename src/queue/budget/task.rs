//! The task that keeps this pod's shares current (one sync every interval, or sooner when a claim
//! asks for more) and gives them back at shutdown once its sends have ended.

use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::{EARLY_SYNC_GAP, SYNC_INTERVAL, leave, register};
use crate::queue::runtime::QueueRuntime;

/// Keeps this pod's shares of every provider current until `stop`, then, once its sends have ended
/// (or after `grace`), gives them back. It syncs on a connection of its own, so a busy pool (every
/// worker finishing at once after a stall) cannot delay a sync into looking like a stall.
pub async fn run(db: PgPool, runtime: std::sync::Arc<QueueRuntime>, grace: Duration, stop: CancellationToken) {
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(5))
        .test_before_acquire(true)
        .connect_lazy_with(db.connect_options().as_ref().clone());
    for handle in runtime.providers.values() {
        if let Err(e) = register(&db, &handle.budget).await {
            tracing::warn!(provider = handle.name, error = %e, "registering the provider budget failed; syncs retry");
        }
    }
    let mut tick = tokio::time::interval(SYNC_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_sync: Option<Instant> = None;
    loop {
        let ticked = tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => true,
            _ = runtime.share_wanted.notified() => {
                if let Some(wait) = last_sync.and_then(|at| EARLY_SYNC_GAP.checked_sub(at.elapsed())) {
                    tokio::time::sleep(wait).await;
                }
                false
            }
        };
        last_sync = Some(Instant::now());
        runtime.sync_budgets(&db).await;
        if !ticked {
            continue;
        }
        if let Err(e) = runtime.refresh_pauses(&db).await {
            tracing::debug!(error = %e, "reading the queue pauses failed; the last ones read stay in force");
        }
    }
    // Keep syncing (the shares stay valid) while the sends of this pod drain, then leave.
    let deadline = Instant::now() + grace;
    while runtime.providers.values().any(|h| h.budget.in_flight() > 0) && Instant::now() < deadline {
        tick.tick().await;
        runtime.sync_budgets(&db).await;
    }
    if let Err(e) = leave(&db, runtime.member).await {
        tracing::debug!(error = %e, "could not give back the provider shares; they expire with their lease");
    }
}
