//! [`Application`]: a [`Settings`] turned into a running service (database, migrations, HTTP,
//! background work), and [`RunningApp`], one spawned on the current runtime.

use std::future::Future;
use std::net::SocketAddr;

use anyhow::Context;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_cron_scheduler::JobScheduler;
use tokio_util::sync::CancellationToken;

use crate::cif::Pools;
use crate::cif::fence::check_incarnation;
use crate::cif::upkeep::{GAUGE_INTERVAL, refresh_gauges};
use crate::config::Settings;
use crate::db::{self, Database};
use crate::keys::MasterKey;
use crate::queue::stage::{STAGE_INTERVAL, stage_round};
use crate::queue::stats::{STATS_INTERVAL, refresh_round};
use crate::state::AppState;
use crate::supervise::{RestartPolicy, Supervisor};

/// Time after the grace period for worker groups to hand back unfinished sends.
const HAND_BACK_MARGIN: std::time::Duration = std::time::Duration::from_secs(3);

/// A built, not yet running, service: the port is bound, migrations are applied, pools reconciled.
pub struct Application {
    listener: TcpListener,
    state: AppState,
    database: Database,
    background: bool,
    restart: RestartPolicy,
    extra: Vec<(String, ExtraTask)>,
}

/// A task added with [`Application::also_run`].
type ExtraTask = Box<dyn Fn(CancellationToken) -> futures_util::future::BoxFuture<'static, ()> + Send + Sync>;

impl Application {
    /// Finds the master key, opens the database (starting the embedded cluster without
    /// `database.url`), then [`Application::build_with`]. With the embedded database and no API key
    /// in it, creates a development key with every scope (see [`crate::auth::ensure_dev_key`]).
    pub async fn build(settings: Settings) -> anyhow::Result<Application> {
        settings.check_for_serve()?;
        let master = crate::config::master_key::resolve_master_key(&settings, true)?;
        let database = Database::open(&settings).await?;
        let embedded = database.embedded.is_some();
        let app = Self::build_with(settings, database, &master).await?;
        if embedded && let Some(path) = crate::auth::ensure_dev_key(&app.state.db, &app.state.settings).await? {
            tracing::warn!(
                path = %path.display(),
                "CREATED A DEVELOPMENT API KEY WITH EVERY SCOPE (the embedded database had none). Use it as \
                 `Authorization: Bearer $(cat {})`; for anything but local development create scoped keys \
                 with `cifpool keys create` or POST /admin/keys.",
                path.display()
            );
        }
        Ok(app)
    }

    /// Applies migrations (waiting up to `database.startup_timeout` for the server), reconciles the
    /// configured pools with the database under `master`, and binds `server.listen`.
    pub async fn build_with(settings: Settings, database: Database, master: &MasterKey) -> anyhow::Result<Application> {
        db::migrate_when_reachable(&database.pool, settings.database.startup_timeout)
            .await
            .context("applying database migrations")?;
        record_start(&database.pool).await;
        let pools = Pools::reconcile(&database.pool, &settings.pools, master).await?;
        // After the pools exist (a fence moves their counters) and before anything is issued.
        database
            .incarnation
            .arm(&database.pool, crate::cif::fence::FencePolicy::from_settings(&settings))
            .await
            .context("checking the database's identity")?;
        let listener = TcpListener::bind(settings.server.listen)
            .await
            .with_context(|| format!("binding {}", settings.server.listen))?;
        let state =
            AppState::new(database.pool.clone(), settings, pools, master).guarded_by(database.incarnation.clone());
        state.notifications.runtime().seal.register(&state.db).await.context("checking the personal-data key")?;
        Ok(Application {
            listener,
            state,
            database,
            background: true,
            restart: RestartPolicy::default(),
            extra: Vec::new(),
        })
    }

    /// HTTP only: no schedules, gauges, start-up refill, queue sweep or worker groups. For tests that
    /// drive refill, reclaim and worker steps themselves.
    pub fn without_background(mut self) -> Application {
        self.background = false;
        self
    }

    /// Serves every request as an all-scopes caller without checking any key. Only for measuring what
    /// authentication costs (`cifpool-tools bench reserve` runs the service with and without it);
    /// nothing in the configuration reaches it.
    pub fn without_authentication(mut self) -> Application {
        self.state.auth = std::sync::Arc::new(crate::auth::Authenticator::disabled(self.state.db.clone()));
        self
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    /// The state every handler and job of this instance shares.
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Starts the background work, then serves until `shutdown` resolves, then drains: HTTP stops
    /// taking requests, in-flight ones get up to `server.shutdown_grace`, then the database (and the
    /// embedded cluster) close. Background work that cannot start is an error before any request is
    /// served; a background task that keeps failing (see [`crate::supervise`]) shuts the service
    /// down, and then this returns that failure as an error (the process exits non-zero).
    pub(crate) async fn run_until(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let Application { listener, state, database, background, restart, extra } = self;
        let grace = state.settings.server.shutdown_grace;
        let stop = CancellationToken::new();
        let addr = listener.local_addr()?;
        crate::telemetry::register_event_counters(&state);
        crate::telemetry::collectors::record_build_info();
        let mut tasks = Supervisor::new(state.liveness.clone(), stop.clone()).with_policy(restart);
        // The background work starts before the first request is served: an instance whose schedules
        // or worker groups could not start serves nothing (its listener closes), and stops what did
        // start and the database before it returns the error.
        let scheduler = match background {
            false => None,
            true => match start_background(&state, &mut tasks).await {
                Ok(cron) => Some(cron),
                Err(e) => {
                    stop.cancel();
                    tasks.drain(grace + HAND_BACK_MARGIN).await;
                    database.close().await;
                    return Err(e.context("starting the background work (nothing was served)"));
                }
            },
        };
        start_watchers(&state, &mut tasks);
        for (name, task) in extra {
            tasks.keep_running(name, task);
        }
        let router = crate::http::app(state.clone());
        let mut http = tokio::spawn(crate::http::serve(listener, router, stop.clone().cancelled_owned()));
        tracing::info!(%addr, pools = ?state.cif.pools().names(), tasks = ?tasks.names(), "cifpool serving");
        // `http` is awaited again below unless the server is what ended (a handle is polled to its end once).
        let (failure, http_ended) = tokio::select! {
            () = shutdown => (None, false),
            failure = tasks.first_failure() => (Some(failure.to_string()), false),
            ended = &mut http => (Some(format!("the HTTP server stopped: {ended:?}")), true),
        };
        match &failure {
            None => tracing::info!(?grace, "shutdown requested: draining"),
            Some(why) => tracing::error!(why, ?grace, "a task the service needs failed: shutting down"),
        }
        stop.cancel();
        if let Some(mut cron) = scheduler
            && let Err(e) = cron.shutdown().await
        {
            tracing::warn!(error = %e, "stopping the scheduler");
        }
        // HTTP requests and worker sends drain side by side within the grace period; worker groups hand
        // back what is still in flight at its end (the margin lets that hand-back finish).
        let background = async {
            if !tasks.drain(grace + HAND_BACK_MARGIN).await {
                tracing::warn!("background work outlived the grace period");
            }
        };
        let http = async {
            if http_ended {
                return;
            }
            match tokio::time::timeout(grace, http).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::error!(error = %e, "http server error"),
                Ok(Err(e)) => tracing::error!(error = %e, "http server task"),
                Err(_) => tracing::warn!("in-flight requests outlived the grace period"),
            }
        };
        tokio::join!(background, http);
        // Refills, reclaims and sweeps under way finish (each is bounded) before the pool closes.
        state.upkeep.close();
        if tokio::time::timeout(grace, state.upkeep.wait()).await.is_err() {
            tracing::warn!("maintenance work outlived the grace period");
        }
        database.close().await;
        match failure {
            None => {
                tracing::info!("cifpool stopped");
                Ok(())
            }
            Some(why) => Err(anyhow::anyhow!("{why}; stopped so that the pod is replaced")),
        }
    }

    /// Restarts failed background tasks by `policy` instead of the default (tests shorten it).
    pub fn restarting(mut self, policy: RestartPolicy) -> Application {
        self.restart = policy;
        self
    }

    /// Runs one more supervised task beside the service's own, as [`Supervisor::keep_running`] does
    /// (tests use it to see what a failing task does to readiness and to the exit).
    pub fn also_run<F, Fut>(mut self, name: &str, task: F) -> Application
    where
        F: Fn(CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.extra.push((name.to_string(), Box::new(move |stop| Box::pin(task(stop)))));
        self
    }

    /// Runs the service on the current runtime until [`RunningApp::stop`] (or until the handle is
    /// dropped): the one way tests, benchmarks and the lab start an in-process service.
    pub fn spawn(self) -> RunningApp {
        let base_url = format!("http://{}", self.local_addr());
        let state = self.state.clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(self.run_until(async move {
            let _ = stopped.await;
        }));
        RunningApp { base_url, state, stop: Some(stop), task: Some(task) }
    }
}

/// A service started by [`Application::spawn`]; dropping the handle asks it to shut down.
pub struct RunningApp {
    /// `http://127.0.0.1:PORT`, no trailing slash.
    pub base_url: String,
    /// Its state, for driving refill, reclaim or worker steps directly.
    pub state: AppState,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl RunningApp {
    /// `base_url` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base_url, path)
    }

    /// Graceful shutdown, as on SIGTERM, returning once the service has stopped.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.task.take() {
            Some(task) => task.await.context("service task")?,
            None => Ok(()),
        }
    }
}

impl RunningApp {
    /// Stops the service at once, as a crash would (tests of what the other instances do): no drain,
    /// no hand-back, its leases and provider shares left to expire. Sends already handed to the
    /// provider still complete.
    pub fn abort(mut self) {
        self.stop.take();
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Drop for RunningApp {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// What watches the database in every instance, even one without background work: the connection
/// and readiness probes behind `cifpool_db_pool_acquire_seconds` and `cifpool_ready`, the check that
/// the database is still the one codes were issued from, and the cleanup-horizon probe.
fn start_watchers(state: &AppState, tasks: &mut Supervisor) {
    use crate::telemetry::collectors::{PROBE_EVERY, READINESS_EVERY, probe_acquire, probe_readiness};
    let db = state.db.clone();
    tasks.every("connection probe", PROBE_EVERY, move || probe_acquire(db.clone()));
    let (db, liveness) = (state.db.clone(), state.liveness.clone());
    tasks.every("readiness probe", READINESS_EVERY, move || probe_readiness(db.clone(), liveness.clone()));
    let (db, guard) = (state.db.clone(), state.incarnation.clone());
    let interval = state.settings.database.incarnation_check_interval;
    tasks.every("database identity check", interval, move || check_incarnation(db.clone(), guard.clone()));
    let db = state.db.clone();
    let every = crate::telemetry::horizon::HORIZON_EVERY;
    tasks.every("cleanup horizon probe", every, move || crate::telemetry::horizon::probe_horizon(db.clone()));
}

/// The background work of a serving instance: the cron schedules (refill checks, reclaims, the
/// queue sweep), the pool gauges, the stager, the queue statistics, the worker groups with their
/// relay and budget sync, and a first refill of every pool (a fresh install starts empty).
async fn start_background(state: &AppState, tasks: &mut Supervisor) -> anyhow::Result<JobScheduler> {
    let cron = JobScheduler::new().await?;
    crate::cif::upkeep::schedule(&cron, &state.db, state.cif.pools(), &state.upkeep).await?;
    crate::queue::sweep::schedule(&cron, &state.db, state.notifications.runtime(), &state.upkeep).await?;
    cron.start().await?;
    let (db, pools) = (state.db.clone(), state.cif.pools().clone());
    tasks.every("pool gauges", GAUGE_INTERVAL, move || refresh_gauges(db.clone(), pools.clone()));
    let (db, queue) = (state.db.clone(), state.notifications.runtime().clone());
    tasks.every("stager", STAGE_INTERVAL, move || stage_round(db.clone(), queue.clone()));
    let (db, queue, stats) =
        (state.db.clone(), state.notifications.runtime().clone(), state.notifications.stats().clone());
    tasks.every("queue statistics", STATS_INTERVAL, move || refresh_round(db.clone(), queue.clone(), stats.clone()));
    crate::queue::worker::start_all(
        state.notifications.runtime(),
        &state.db,
        state.settings.server.shutdown_grace,
        tasks,
    );
    for pool in state.cif.pools().iter() {
        crate::cif::upkeep::after_claim(&state.db, pool, &state.upkeep);
    }
    Ok(cron)
}

/// Audit trail of which versions ran against this database; failure to write it is not fatal.
async fn record_start(pool: &PgPool) {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown".into());
    let res = sqlx::query("INSERT INTO service_starts (version, hostname) VALUES ($1, $2)")
        .bind(env!("CARGO_PKG_VERSION"))
        .bind(host)
        .execute(pool)
        .await;
    if let Err(e) = res {
        tracing::warn!(error = %e, "could not record service start");
    }
}

/// Resolves on SIGTERM or SIGINT.
pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = int.recv() => tracing::info!("SIGINT"),
    }
}
