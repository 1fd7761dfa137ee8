//! State shared by every request handler and background job.

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::PgPool;

use crate::cif::Pools;
use crate::config::Settings;
use crate::queue::stats::QueueStats;
use crate::queue::worker::QueueRuntime;

/// Cheap to clone: everything inside is reference-counted.
#[derive(Clone)]
pub struct AppState {
    /// Connection pool.
    pub db: PgPool,
    /// Effective configuration.
    pub settings: Arc<Settings>,
    /// Prometheus recorder handle, rendered by `/metrics`.
    pub metrics: PrometheusHandle,
    /// The CIF pools this instance serves.
    pub pools: Arc<Pools>,
    /// Notification classes, providers and limits.
    pub queue: Arc<QueueRuntime>,
    /// Latest queue depth snapshot (gauges, intake backpressure).
    pub queue_stats: Arc<QueueStats>,
}

impl AppState {
    /// Bundles the parts, building the queue runtime (providers) from the settings.
    pub fn new(db: PgPool, settings: Settings, pools: Pools) -> AppState {
        let queue = QueueRuntime::new(settings.queue.clone());
        Self::with_queue(db, settings, pools, queue)
    }

    /// Like [`AppState::new`] with a given queue runtime (tests and the lab supply their providers).
    pub fn with_queue(db: PgPool, settings: Settings, pools: Pools, queue: Arc<QueueRuntime>) -> AppState {
        AppState {
            db,
            settings: Arc::new(settings),
            metrics: crate::telemetry::metrics_handle(),
            pools: Arc::new(pools),
            queue,
            queue_stats: Arc::new(QueueStats::default()),
        }
    }
}
