//! Gauges that no event updates: the build, the process (CPU, memory, file descriptors, threads, read
//! at each scrape), this instance's database pool, and whether this instance is ready.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::db::{self, Readiness};

/// The commit the binary was built from (`build.rs`), `unknown` without git.
pub const GIT_SHA: &str = env!("CIFPOOL_GIT_SHA");

/// How often [`probe_loop`] times a connection acquire and re-checks readiness.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Readiness is re-checked every this many probes (it is a query, the acquire probe is not).
const READINESS_EVERY: u32 = 5;

/// Sets `cifpool_build_info{version,git_sha} 1`.
pub fn record_build_info() {
    metrics::gauge!("cifpool_build_info", "version" => env!("CARGO_PKG_VERSION"), "git_sha" => GIT_SHA).set(1.0);
}

/// Updates what is read rather than counted, just before a scrape renders: the process metrics
/// (`process_*`, the names Prometheus client libraries use) and the database pool's connections.
pub fn collect_on_scrape(db: &PgPool) {
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

/// Records whether this instance is ready (`cifpool_ready`), from a readiness check's result.
pub fn record_readiness(readiness: &Readiness) {
    let ready = matches!(readiness, Readiness::Ready);
    metrics::gauge!("cifpool_ready").set(if ready { 1.0 } else { 0.0 });
}

/// Until `stop`: once a second, times how long getting a pooled connection takes
/// (`cifpool_db_pool_acquire_seconds`: an exhausted pool shows as waits before any request times
/// out), and every few seconds runs the readiness check, so `cifpool_ready` is current even where
/// nothing probes `/readyz`.
pub async fn probe_loop(db: PgPool, stop: CancellationToken) {
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut round = 0u32;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let started = Instant::now();
        // The pool's own acquire_timeout bounds the wait; a failure is recorded as that wait.
        drop(db.acquire().await);
        metrics::histogram!("cifpool_db_pool_acquire_seconds").record(started.elapsed().as_secs_f64());
        if round.is_multiple_of(READINESS_EVERY) {
            record_readiness(&db::readiness(&db, PROBE_EVERY).await);
        }
        round = round.wrapping_add(1);
    }
}
