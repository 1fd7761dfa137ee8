//! Cron schedules for the maintenance jobs (refill, reclaim, …), on tokio-cron-scheduler's in-memory
//! store: every instance runs its own schedule, and the jobs themselves are safe to run concurrently
//! across instances (advisory locks, SKIP LOCKED), so no shared scheduler state is needed.

use std::future::Future;

use tokio_cron_scheduler::{Job, JobScheduler};
use tokio_util::task::TaskTracker;

/// Checks a 6-field (with seconds) cron expression, e.g. `*/15 * * * * *`.
pub(crate) fn validate_cron(schedule: &str) -> Result<(), String> {
    Job::new_async(schedule, |_, _| Box::pin(async {}))
        .map(|_| ())
        .map_err(|_| format!("{schedule:?} is not a cron expression with seconds (e.g. \"*/15 * * * * *\")"))
}

/// Adds a job running `task` on `schedule`, each run tracked by `runs` (so shutdown can wait for it); a
/// run still in progress when the next tick comes is not doubled up by the job itself (the tasks guard
/// that with their own locks).
pub async fn add<F, Fut>(scheduler: &JobScheduler, schedule: &str, runs: &TaskTracker, task: F) -> anyhow::Result<()>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let runs = runs.clone();
    let job = Job::new_async(schedule, move |_, _| Box::pin(runs.track_future(task())))?;
    scheduler.add(job).await?;
    Ok(())
}
