//! State shared by every request handler and background job.

use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::PgPool;

use tokio_util::task::TaskTracker;

use crate::audit::AuditTrail;
use crate::auth::Authenticator;
use crate::cif::fence::{FencePolicy, IncarnationGuard};
use crate::cif::{Cif, Pools};
use crate::config::Settings;
use crate::queue::Queue;
use crate::queue::runtime::QueueRuntime;

/// Cheap to clone: everything inside is reference-counted.
#[derive(Clone)]
pub struct AppState {
    /// Connections to the service's database (lazy: a down database fails requests, not start-up):
    /// readiness, console sessions and the start-up checks use it; operations go through the services.
    pub db: PgPool,
    /// The effective configuration, after defaults, file and environment.
    pub settings: Arc<Settings>,
    /// Renders the process-wide Prometheus recorder for `/metrics`.
    pub metrics: PrometheusHandle,
    /// CIF issuance and the operator's work on the pools.
    pub cif: Cif,
    /// The notification queue: intake, jobs and batches, and the operator's work on it.
    pub notifications: Queue,
    /// Checks API keys (and the bootstrap admin token) for every `/v1` and `/admin` request, and
    /// manages the keys.
    pub auth: Arc<Authenticator>,
    /// The audit trail, as admins search it.
    pub audit: AuditTrail,
    /// Request rate per key and failed authentications per client address, on this pod.
    pub limits: Arc<crate::http::limits::CallerLimits>,
    /// Maintenance runs (refills, reclaims, sweeps, a key's last-use write) started by requests and
    /// schedules: shutdown waits for them before it closes the database, so none dies half-way on a
    /// closed pool.
    pub upkeep: TaskTracker,
    /// The background tasks running now: readiness fails while one the service needs is down.
    pub liveness: Arc<crate::supervise::Liveness>,
    /// Whether the database is the one codes were issued from (reservations refused while halted).
    pub incarnation: Arc<IncarnationGuard>,
}

impl AppState {
    /// Bundles the parts, building the queue runtime (providers) from the settings; jobs' personal
    /// data is sealed under a key derived from `master`.
    pub fn new(db: PgPool, settings: Settings, pools: Pools, master: &crate::keys::MasterKey) -> AppState {
        let seal = crate::queue::seal::Seal::from_settings(master, &settings.security);
        let queue = QueueRuntime::new(settings.queue.clone(), seal);
        Self::with_queue(db, settings, pools, queue)
    }

    /// Like [`AppState::new`] with a given queue runtime (tests and the lab supply their providers).
    pub(crate) fn with_queue(db: PgPool, settings: Settings, pools: Pools, queue: Arc<QueueRuntime>) -> AppState {
        let upkeep = TaskTracker::new();
        let auth = Arc::new(Authenticator::new(db.clone(), settings.security.admin_token.clone(), upkeep.clone()));
        let limits = Arc::new(crate::http::limits::CallerLimits::new(&settings.security));
        let incarnation = IncarnationGuard::new();
        let fence_policy = FencePolicy::from_settings(&settings);
        AppState {
            notifications: Queue::new(db.clone(), queue, Arc::default(), upkeep.clone()),
            cif: Cif::new(db.clone(), Arc::new(pools), upkeep.clone(), incarnation.clone(), fence_policy),
            audit: AuditTrail::new(db.clone()),
            db,
            auth,
            limits,
            settings: Arc::new(settings),
            metrics: crate::telemetry::metrics_handle(),
            upkeep,
            liveness: Arc::default(),
            incarnation,
        }
    }

    /// The same state, with reservations refused while `incarnation` (the database's, checked at
    /// start and by the watcher) is halted.
    pub fn guarded_by(mut self, incarnation: Arc<IncarnationGuard>) -> AppState {
        self.cif = self.cif.guarded_by(incarnation.clone());
        self.incarnation = incarnation;
        self
    }
}
