//! Wiring: turn a [`Settings`] into a running service (database, migrations, HTTP, background jobs).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::cif::Pools;
use crate::config::Settings;
use crate::db::{self, embedded::EmbeddedOptions, embedded::EmbeddedPostgres};
use crate::keys::MasterKey;
use crate::state::AppState;

/// Time after the grace period for worker groups to hand back unfinished sends.
const HAND_BACK_MARGIN: std::time::Duration = std::time::Duration::from_secs(3);

/// A database connection plus the embedded cluster behind it, if any (kept alive as long as this is).
pub struct Database {
    /// The pool.
    pub pool: PgPool,
    /// The embedded cluster, when `database.url` is unset.
    pub embedded: Option<EmbeddedPostgres>,
}

impl Database {
    /// Connects to `database.url`, or starts the embedded cluster in `database.data_dir`.
    pub async fn open(settings: &Settings) -> anyhow::Result<Database> {
        let db = &settings.database;
        if let Some(url) = &db.url {
            let options = db::options_from_url(url).context("database.url is not a valid Postgres URL")?;
            return Ok(Database { pool: db::pool(db, options), embedded: None });
        }
        let data_dir: PathBuf = db.data_dir.clone();
        let opts = EmbeddedOptions::durable(data_dir);
        let started = tokio::task::spawn_blocking(move || EmbeddedPostgres::start(&opts))
            .await
            .context("embedded postgres start task panicked")??;
        tracing::info!(data_dir = %started.data_dir().display(), log = %started.log_file().display(),
            "embedded postgres started");
        let admin = db::pool(db, started.connect_options("postgres"));
        ensure_database(&admin, "cifpool").await?;
        admin.close().await;
        let pool = db::pool(db, started.connect_options("cifpool"));
        Ok(Database { pool, embedded: Some(started) })
    }

    /// Closes the pool, then stops the embedded cluster (cleanly, with a checkpoint).
    pub async fn close(self) {
        self.pool.close().await;
        if let Some(pg) = self.embedded {
            match tokio::task::spawn_blocking(move || pg.stop()).await {
                Ok(Ok(())) => tracing::info!("embedded postgres stopped"),
                Ok(Err(e)) => tracing::error!(error = %e, "embedded postgres stop"),
                Err(e) => tracing::error!(error = %e, "embedded postgres stop task"),
            }
        }
    }
}

/// Drops and re-creates the scratch database `name` on the server `database` is connected to, migrates
/// it, and returns its connect options (the lab and the benchmarks never touch the service's tables).
pub async fn recreate_scratch_database(database: &Database, name: &str) -> anyhow::Result<PgConnectOptions> {
    let options = database.pool.connect_options().as_ref().clone();
    let admin = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with(options.clone()).await?;
    // Identifiers cannot be bound; `name` is a constant of ours, not input.
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))).execute(&admin).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await
        .with_context(|| format!("creating the scratch database {name} (the role needs CREATEDB)"))?;
    admin.close().await;
    let connect = options.database(name);
    let db = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with(connect.clone()).await?;
    db::migrate(&db).await.with_context(|| format!("migrating {name}"))?;
    db.close().await;
    Ok(connect)
}

/// Creates `name` on the cluster unless it exists.
async fn ensure_database(admin: &PgPool, name: &str) -> anyhow::Result<()> {
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(name)
        .fetch_one(admin)
        .await
        .context("querying pg_database")?;
    if !exists {
        // Identifiers cannot be bound; `name` is a constant of ours, not input.
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(admin)
            .await
            .context("creating database")?;
    }
    Ok(())
}

/// A built, not yet running, service: the port is bound, migrations are applied.
pub struct Application {
    listener: TcpListener,
    state: AppState,
    database: Database,
}

impl Application {
    /// Opens the database, applies migrations, reconciles the pools and binds `settings.server.listen`.
    pub async fn build(settings: Settings) -> anyhow::Result<Application> {
        let master = resolve_master_key(&settings, true)?;
        let database = Database::open(&settings).await?;
        Self::build_with(settings, database, &master).await
    }

    /// Like [`Application::build`] on an already opened database and a given key (tests, the lab).
    pub async fn build_with(settings: Settings, database: Database, master: &MasterKey) -> anyhow::Result<Application> {
        db::migrate_when_reachable(&database.pool, settings.database.startup_timeout)
            .await
            .context("applying database migrations")?;
        record_start(&database.pool).await;
        let pools = Pools::reconcile(&database.pool, &settings.pools, master).await?;
        let listener = TcpListener::bind(settings.server.listen)
            .await
            .with_context(|| format!("binding {}", settings.server.listen))?;
        let state = AppState::new(database.pool.clone(), settings, pools);
        Ok(Application { listener, state, database })
    }

    /// The bound port (useful after binding port 0).
    pub fn port(&self) -> u16 {
        self.local_addr().port()
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    /// Shared state, for tests that want to drive jobs directly.
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Serves until `shutdown` resolves, then drains: HTTP stops taking requests, in-flight ones get
    /// up to `server.shutdown_grace`, then the database (and the embedded cluster) close.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let Application { listener, state, database } = self;
        let grace = state.settings.server.shutdown_grace;
        let stop = CancellationToken::new();
        let router = crate::http::app(state.clone());
        let addr = listener.local_addr()?;
        let http = tokio::spawn(crate::http::serve(listener, router, stop.clone().cancelled_owned()));
        let scheduler = tokio_cron_scheduler::JobScheduler::new().await?;
        crate::cif::jobs::schedule(&scheduler, &state).await?;
        crate::queue::maintenance::schedule(&scheduler, &state).await?;
        scheduler.start().await?;
        crate::telemetry::register_event_counters(&state);
        let mut background = tokio::task::JoinSet::new();
        background.spawn(crate::cif::jobs::gauges_loop(state.clone(), stop.clone()));
        crate::queue::maintenance::spawn(&state, &stop, &mut background);
        // Fill pools right away rather than at the first tick (a fresh install starts empty).
        for pool in state.pools.iter() {
            crate::cif::jobs::after_claim(&state, pool);
        }
        tracing::info!(%addr, pools = ?state.pools.names(), "cifpool serving");
        shutdown.await;
        tracing::info!(?grace, "shutdown requested: draining");
        stop.cancel();
        let mut scheduler = scheduler;
        if let Err(e) = scheduler.shutdown().await {
            tracing::warn!(error = %e, "stopping the scheduler");
        }
        // HTTP requests and worker sends drain side by side within the grace period; worker groups hand
        // back what is still in flight at its end (the margin lets that hand-back finish).
        let background = async {
            let drained = async { while background.join_next().await.is_some() {} };
            if tokio::time::timeout(grace + HAND_BACK_MARGIN, drained).await.is_err() {
                tracing::warn!("background work outlived the grace period");
            }
        };
        let http = async {
            match tokio::time::timeout(grace, http).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::error!(error = %e, "http server error"),
                Ok(Err(e)) => tracing::error!(error = %e, "http server task"),
                Err(_) => tracing::warn!("in-flight requests outlived the grace period"),
            }
        };
        tokio::join!(background, http);
        database.close().await;
        tracing::info!("cifpool stopped");
        Ok(())
    }
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
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = int.recv() => tracing::info!("SIGINT"),
    }
}

/// Finds the master key: `CIFPOOL_MASTER_KEY` (hex), then `security.master_key_file`; with the embedded
/// database only (a dev set-up), a key generated once into the data directory's parent. Never logged.
pub fn resolve_master_key(settings: &Settings, may_generate: bool) -> anyhow::Result<MasterKey> {
    if let Ok(hex) = std::env::var("CIFPOOL_MASTER_KEY") {
        return MasterKey::from_hex(&hex).context("CIFPOOL_MASTER_KEY");
    }
    if let Some(path) = &settings.security.master_key_file {
        return MasterKey::load_file(path).with_context(|| format!("security.master_key_file ({})", path.display()));
    }
    if settings.database.url.is_some() {
        anyhow::bail!(
            "no master key: set CIFPOOL_MASTER_KEY (64 hex digits, e.g. from `cifpool keygen`) or \
             security.master_key_file; a generated dev key is only used with the embedded database"
        );
    }
    let path = dev_key_path(settings);
    if !may_generate {
        return MasterKey::load_file(&path)
            .with_context(|| format!("no master key configured and no dev key at {}", path.display()));
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let (key, generated) =
        MasterKey::load_or_generate_dev(&path).with_context(|| format!("dev master key {}", path.display()))?;
    if generated {
        tracing::warn!(
            path = %path.display(),
            "GENERATED A NEW DEV MASTER KEY. Every code this instance issues depends on it: losing it makes \
             issued codes unverifiable and changing it re-maps every pool. Use CIFPOOL_MASTER_KEY or \
             security.master_key_file for anything but local development, and back the key up."
        );
    } else {
        tracing::warn!(path = %path.display(), "using the generated dev master key (not for production)");
    }
    Ok(key)
}

/// Where the dev key lives: beside the embedded cluster's data directory.
pub fn dev_key_path(settings: &Settings) -> PathBuf {
    let dir = &settings.database.data_dir;
    dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new(".")).join("master.key")
}
