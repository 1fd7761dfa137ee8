//! Cron schedules for the maintenance jobs (refill, reclaim, …), on tokio-cron-scheduler's in-memory
//! store: every instance runs its own schedule, and the jobs themselves are safe to run concurrently
//! across instances (advisory locks, SKIP LOCKED), so no shared scheduler state is needed.

use std::future::Future;

use tokio_cron_scheduler::{Job, JobScheduler};
use tokio_util::task::TaskTracker;

/// Checks a 6-field (with seconds) cron expression, e.g. `*/15 * * * * *`, read as the scheduler
/// reads it, and that it fires at all: one that names no real date (February 30th) would be accepted
/// by the scheduler and then never run its task, the pool never refilled, the holds never reclaimed.
pub(crate) fn validate_cron(schedule: &str) -> Result<(), String> {
    let cron = croner::parser::CronParser::builder()
        .seconds(croner::parser::Seconds::Required)
        .dom_and_dow(true)
        .build()
        .parse(schedule)
        .map_err(|_| format!("{schedule:?} is not a cron expression with seconds (e.g. \"*/15 * * * * *\")"))?;
    // The search for a date that does not exist goes on to the year 5000 (0.6 s in a debug build),
    // paid once, when the configuration is refused.
    cron.find_next_occurrence(&chrono::Utc::now(), false)
        .map(|_| ())
        .map_err(|_| format!("{schedule:?} never fires: no date matches it"))
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
