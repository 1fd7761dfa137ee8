//! Gauges that no event updates: the build, the process (CPU, memory, file descriptors, threads, read
//! at each scrape), this instance's database pool, and whether this instance is ready.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::db::{self, Readiness};
use crate::supervise::Liveness;

/// The commit the binary was built from (`build.rs`), `unknown` without git.
pub(crate) const GIT_SHA: &str = env!("CIFPOOL_GIT_SHA");

/// How often [`probe_acquire`] times a connection acquire (and the most [`probe_readiness`] waits).
pub(crate) const PROBE_EVERY: Duration = Duration::from_secs(1);

/// How often [`probe_readiness`] re-checks readiness: less often, as it is a query.
pub(crate) const READINESS_EVERY: Duration = Duration::from_secs(5);

/// Sets `cifpool_build_info{version,git_sha} 1`.
pub(crate) fn record_build_info() {
    metrics::gauge!("cifpool_build_info", "version" => env!("CARGO_PKG_VERSION"), "git_sha" => GIT_SHA).set(1.0);
}

/// Updates what is read rather than counted, just before a scrape renders: the process metrics
/// (`process_*`, the names Prometheus client libraries use) and the database pool's connections.
pub(crate) fn collect_on_scrape(db: &PgPool) {
    static PROCESS: OnceLock<metrics_process::Collector> = OnceLock::new();
    PROCESS
        .get_or_init(|| {
            let collector = metrics_process::Collector::default();
            collector.describe();
            collector
        })
        .collect();
    let size = db.size();
    let idle = u32::try_from(db.num_idle()).unwrap_or(u32::MAX).min(size);
    metrics::gauge!("cifpool_db_pool_connections", "state" => "idle").set(f64::from(idle));
    metrics::gauge!("cifpool_db_pool_connections", "state" => "in_use").set(f64::from(size - idle));
    metrics::gauge!("cifpool_db_pool_max_connections").set(f64::from(db.options().get_max_connections()));
}

/// Records whether this instance is ready (`cifpool_ready`): the database check passed and no
/// background task is down (`tasks_down`), as `/readyz` answers.
pub(crate) fn record_readiness(readiness: &Readiness, tasks_down: &[String]) {
    let ready = matches!(readiness, Readiness::Ready) && tasks_down.is_empty();
    metrics::gauge!("cifpool_ready").set(if ready { 1.0 } else { 0.0 });
}

/// Times how long getting a pooled connection takes (`cifpool_db_pool_acquire_seconds`: an
/// exhausted pool shows as waits before any request times out). Run every [`PROBE_EVERY`].
pub(crate) async fn probe_acquire(db: PgPool) {
    let started = Instant::now();
    // The pool's own acquire_timeout bounds the wait; a failure is recorded as that wait.
    drop(db.acquire().await);
    metrics::histogram!("cifpool_db_pool_acquire_seconds").record(started.elapsed().as_secs_f64());
}

/// Runs the readiness check so `cifpool_ready` is current even where nothing probes `/readyz`. Run
/// every [`READINESS_EVERY`].
pub(crate) async fn probe_readiness(db: PgPool, tasks: Arc<Liveness>) {
    record_readiness(&db::readiness(&db, PROBE_EVERY).await, &tasks.down());
}
