//! The queue's background work in `cifpool serve`: the worker groups, the NOTIFY relay, the stats
//! refresh and the scheduled sweep (expired leases back to the queue, overdue jobs expired).

use std::time::Duration;

use tokio::task::JoinSet;
use tokio_cron_scheduler::JobScheduler;
use tokio_util::sync::CancellationToken;

use crate::queue::store;
use crate::queue::worker::{WorkerGroup, listen};
use crate::state::AppState;

/// Rows per sweep statement.
const SWEEP_BATCH: i64 = 1000;
/// Most finished jobs one sweep deletes.
const PURGE_PER_SWEEP: u64 = 500_000;
/// Stats refresh period.
pub const STATS_INTERVAL: Duration = Duration::from_secs(2);

/// One maintenance pass: rescue jobs of dead workers, expire overdue ones.
pub async fn sweep(state: &AppState) -> Result<(), sqlx::Error> {
    let rescued = store::rescue_expired_leases(&state.db, SWEEP_BATCH).await?;
    if rescued > 0 {
        metrics::counter!("cifpool_queue_rescued_total").increment(rescued);
        tracing::warn!(jobs = rescued, "rescued jobs whose worker lost its lease");
    }
    for (class, n) in store::expire_overdue(&state.db, SWEEP_BATCH).await? {
        metrics::counter!("cifpool_queue_expired_total", "class" => class.clone()).increment(n as u64);
        tracing::warn!(%class, jobs = n, "expired jobs that missed their deadline while waiting");
    }
    // Statements of 10,000, at most 500,000 rows a pass (100,000 jobs/s at the default 5 s schedule):
    // a first purge of a large backlog is many short transactions spread over several sweeps.
    let purged =
        store::purge_finished(&state.db, state.queue.settings.retention, 10 * SWEEP_BATCH, PURGE_PER_SWEEP).await?;
    if purged > 0 {
        tracing::info!(jobs = purged, "purged finished jobs past retention");
    }
    Ok(())
}

/// Registers the sweep schedule.
pub async fn schedule(scheduler: &JobScheduler, state: &AppState) -> anyhow::Result<()> {
    let st = state.clone();
    crate::schedule::add(scheduler, &state.queue.settings.sweep_schedule, move || {
        let st = st.clone();
        async move {
            if let Err(e) = sweep(&st).await {
                tracing::warn!(error = %e, "queue sweep failed");
            }
        }
    })
    .await
}

/// Starts the worker groups (if enabled), the NOTIFY relay and the stats loop.
pub fn spawn(state: &AppState, stop: &CancellationToken, tasks: &mut JoinSet<()>) {
    let rt = state.queue.clone();
    if rt.settings.workers_enabled {
        let grace = state.settings.server.shutdown_grace;
        for policy in rt.group_policies() {
            tracing::info!(group = %policy.name, size = policy.size, classes = ?policy.classes, order = ?policy.order,
                "starting worker group");
            let group = WorkerGroup::new(policy, state.db.clone(), rt.clone());
            tasks.spawn(group.run(stop.clone(), grace));
        }
        tasks.spawn(listen(state.db.clone(), rt.clone(), stop.clone()));
    }
    let (st, stop) = (state.clone(), stop.clone());
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(STATS_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! { _ = stop.cancelled() => return, _ = tick.tick() => {} }
            if let Err(e) = st.queue_stats.refresh(&st.db, &st.queue).await {
                tracing::debug!(error = %e, "queue stats: database unavailable");
            }
        }
    });
}
