//! Wiring: turn a [`Settings`] into a running service (database, migrations, HTTP, background jobs).

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::db::{self, embedded::EmbeddedOptions, embedded::EmbeddedPostgres};
use crate::state::AppState;

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
    /// Opens the database, applies migrations and binds `settings.server.listen`.
    pub async fn build(settings: Settings) -> anyhow::Result<Application> {
        let database = Database::open(&settings).await?;
        Self::build_with(settings, database).await
    }

    /// Like [`Application::build`] on an already opened database (tests, the lab).
    pub async fn build_with(settings: Settings, database: Database) -> anyhow::Result<Application> {
        db::migrate(&database.pool).await.context("applying database migrations")?;
        record_start(&database.pool).await;
        let listener = TcpListener::bind(settings.server.listen)
            .await
            .with_context(|| format!("binding {}", settings.server.listen))?;
        let state = AppState::new(database.pool.clone(), settings);
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
        let http = tokio::spawn(crate::http::serve(listener, router, stop.clone().cancelled_owned()));
        tracing::info!(addr = %state.settings.server.listen, "cifpool serving");
        shutdown.await;
        tracing::info!(?grace, "shutdown requested: draining");
        stop.cancel();
        match tokio::time::timeout(grace, http).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::error!(error = %e, "http server error"),
            Ok(Err(e)) => tracing::error!(error = %e, "http server task"),
            Err(_) => tracing::warn!("in-flight requests outlived the grace period"),
        }
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
