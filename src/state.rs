//! State shared by every request handler and background job.

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::PgPool;

use crate::cif::Pools;
use crate::config::Settings;

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
}

impl AppState {
    /// Bundles the parts.
    pub fn new(db: PgPool, settings: Settings, pools: Pools) -> AppState {
        AppState {
            db,
            settings: Arc::new(settings),
            metrics: crate::telemetry::metrics_handle(),
            pools: Arc::new(pools),
        }
    }
}
