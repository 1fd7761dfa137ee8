//! Opening the service's database: an external server (`database.url`) or the embedded cluster, and
//! scratch databases beside it for the measurement tools.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::cif::fence::IncarnationGuard;
use crate::config::Settings;
use crate::db::embedded::{EmbeddedOptions, EmbeddedPostgres};

/// A connection pool plus the embedded cluster behind it, if any (kept running as long as this lives).
pub struct Database {
    /// Connections to the service's database (lazy: opening never waits for the server).
    pub pool: PgPool,
    /// The private cluster started because `database.url` is unset; `None` with an external server.
    pub embedded: Option<EmbeddedPostgres>,
    /// Checks each new connection of `pool` against the database identity codes were issued from.
    pub incarnation: Arc<IncarnationGuard>,
}

impl Database {
    /// Connects to `database.url`, or starts the embedded cluster in `database.data_dir` and creates
    /// the `cifpool` database on it.
    pub async fn open(settings: &Settings) -> anyhow::Result<Database> {
        let db = &settings.database;
        if let Some(url) = &db.url {
            let options = super::options_from_url(url).context("database.url is not a valid Postgres URL")?;
            return Ok(Database::external(db, options));
        }
        let data_dir: PathBuf = db.data_dir.clone();
        let opts = EmbeddedOptions::durable(data_dir);
        let started = tokio::task::spawn_blocking(move || EmbeddedPostgres::start(&opts))
            .await
            .context("embedded postgres start task panicked")??;
        tracing::info!(data_dir = %started.data_dir().display(), log = %started.log_file().display(),
            "embedded postgres started");
        let admin = super::pool(db, started.connect_options("postgres"), &IncarnationGuard::new());
        ensure_database(&admin, "cifpool").await?;
        admin.close().await;
        let incarnation = IncarnationGuard::new();
        let pool = super::pool(db, started.connect_options("cifpool"), &incarnation);
        Ok(Database { pool, embedded: Some(started), incarnation })
    }

    /// A pool with the service's settings on a server someone else runs (tests, the tools' scratch
    /// databases).
    pub fn external(settings: &crate::config::DatabaseSettings, options: PgConnectOptions) -> Database {
        let incarnation = IncarnationGuard::new();
        Database { pool: super::pool(settings, options, &incarnation), embedded: None, incarnation }
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

    /// Drops and re-creates the scratch database `name` on this server, migrates it, and returns its
    /// connect options (the lab and the benchmarks never touch the service's own tables).
    pub async fn recreate_scratch(&self, name: &str) -> anyhow::Result<PgConnectOptions> {
        let options = self.pool.connect_options().as_ref().clone();
        let admin = PgPoolOptions::new().max_connections(1).connect_with(options.clone()).await?;
        // Identifiers cannot be bound; `name` is a constant of the caller's, not input.
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")))
            .execute(&admin)
            .await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&admin)
            .await
            .with_context(|| format!("creating the scratch database {name} (the role needs CREATEDB)"))?;
        admin.close().await;
        let connect = options.database(name);
        let db = PgPoolOptions::new().max_connections(1).connect_with(connect.clone()).await?;
        super::migrate(&db).await.with_context(|| format!("migrating {name}"))?;
        db.close().await;
        Ok(connect)
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
