//! The sweeper: on its schedule, jobs whose worker died mid-send (lease expired) go back to the queue,
//! waiting jobs past their deadline expire, finished jobs past their class's `keep_personal_data` lose
//! their payload and recipient, and finished jobs past retention are deleted (dead letters only past
//! `dead_letter_retention`, if set).

use std::sync::Arc;

use sqlx::PgPool;
use tokio_cron_scheduler::JobScheduler;

use crate::queue::runtime::QueueRuntime;
use crate::queue::store::{self, Purge};

/// Rows per sweep statement.
const SWEEP_BATCH: i64 = 1000;
/// Most finished jobs one sweep deletes.
const PURGE_PER_SWEEP: u64 = 500_000;

/// One pass: rescue jobs of dead workers, expire overdue ones, erase kept personal data that is due,
/// purge old finished ones.
pub async fn sweep(db: &PgPool, runtime: &QueueRuntime) -> Result<(), sqlx::Error> {
    let rescued = store::rescue_expired_leases(db, SWEEP_BATCH).await?;
    if rescued > 0 {
        metrics::counter!("cifpool_queue_rescued_total").increment(rescued);
        tracing::warn!(jobs = rescued, "rescued jobs whose worker lost its lease");
    }
    for (class, n) in store::expire_overdue(db, SWEEP_BATCH).await? {
        metrics::counter!("cifpool_queue_expired_total", "class" => class.clone()).increment(n);
        tracing::warn!(%class, jobs = n, "expired jobs that missed their deadline while waiting");
    }
    let erased = store::erase_due(db, SWEEP_BATCH).await?;
    if erased > 0 {
        tracing::info!(jobs = erased, "erased the kept personal data of finished jobs past keep_personal_data");
    }
    // Statements of 10,000, at most 500,000 rows a pass (100,000 jobs/s at the default 5 s schedule):
    // a first purge of a large backlog is many short transactions spread over several sweeps.
    let purged =
        store::purge_finished(db, Purge::Finished, runtime.settings.retention, 10 * SWEEP_BATCH, PURGE_PER_SWEEP)
            .await?;
    if purged > 0 {
        tracing::info!(jobs = purged, "purged finished jobs past retention");
    }
    // Dead letters wait for someone to retry or discard them, unless a retention of their own is set.
    if let Some(retention) = runtime.settings.dead_letter_retention {
        let purged =
            store::purge_finished(db, Purge::DeadLetters, retention, 10 * SWEEP_BATCH, PURGE_PER_SWEEP).await?;
        if purged > 0 {
            tracing::info!(jobs = purged, "purged dead letters past dead_letter_retention");
        }
    }
    Ok(())
}

/// Registers the sweep on `queue.sweep_schedule`.
pub async fn schedule(
    scheduler: &JobScheduler,
    db: &PgPool,
    runtime: &Arc<QueueRuntime>,
    runs: &tokio_util::task::TaskTracker,
) -> anyhow::Result<()> {
    let (db, runtime) = (db.clone(), runtime.clone());
    let cron = runtime.settings.sweep_schedule.clone();
    crate::schedule::add(scheduler, &cron, runs, move || {
        let (db, runtime) = (db.clone(), runtime.clone());
        async move {
            if let Err(e) = sweep(&db, &runtime).await {
                tracing::warn!(error = %e, "queue sweep failed");
            }
        }
    })
    .await
}
