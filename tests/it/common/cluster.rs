//! The test database harness, shared by the service's and the tools' integration tests.
//!
//! One private Postgres cluster per test process (started on first use, fsync off, removed when the
//! process exits), a `template` database migrated once, and for each test a fresh database copied from
//! that template (~25 ms) — so tests never see each other's rows and need no external server.
#![allow(dead_code)]

use std::sync::OnceLock;

use cifpool::config::Settings;
use cifpool::db::embedded::{EmbeddedOptions, EmbeddedPostgres, create_server_owned_dir};
use sqlx::{Connection, PgConnection, PgPool};

const TEMPLATE: &str = "cifpool_template";

/// The process-wide cluster.
pub struct TestCluster {
    pg: EmbeddedPostgres,
}

/// Starts (once) and returns the cluster of this test process.
pub fn cluster() -> &'static TestCluster {
    static CLUSTER: OnceLock<TestCluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        // Async set-up runs on a throw-away runtime in its own thread: this may be called from inside
        // a test's runtime, where blocking on another runtime is not allowed.
        std::thread::spawn(start_cluster).join().expect("test cluster set-up panicked")
    })
}

fn start_cluster() -> TestCluster {
    let base = std::env::temp_dir().join(format!("cifpool-test-{}-{}", std::process::id(), uuid::Uuid::new_v4()));
    create_server_owned_dir(&base).expect("creating the test cluster directory");
    let opts = EmbeddedOptions {
        data_dir: base.join("pg"),
        durable: false,
        max_connections: 400,
        remove_on_exit: Some(base.clone()),
        settings: vec![("shared_buffers".into(), "64MB".into())],
    };
    let pg = EmbeddedPostgres::start(&opts).expect("starting the test Postgres cluster");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut admin = PgConnection::connect_with(&pg.connect_options("postgres")).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {TEMPLATE}"))).execute(&mut admin).await.unwrap();
        let pool = PgPool::connect_with(pg.connect_options(TEMPLATE)).await.unwrap();
        cifpool::db::migrate(&pool).await.expect("migrating the template database");
        pool.close().await;
        admin.close().await.unwrap();
    });
    TestCluster { pg }
}

/// A fresh, migrated database of its own for one test.
pub struct TestDb {
    /// Database name.
    pub name: String,
    /// `postgres://` URL (unix socket) for apps and child processes.
    pub url: String,
    /// A small pool on it for assertions.
    pub pool: PgPool,
}

/// Creates a new database from the migrated template.
pub async fn fresh_database() -> TestDb {
    let cluster = cluster();
    let name = format!("t_{}", uuid::Uuid::new_v4().simple());
    let mut admin = PgConnection::connect_with(&cluster.pg.connect_options("postgres")).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name} TEMPLATE {TEMPLATE}")))
        .execute(&mut admin)
        .await
        .unwrap();
    admin.close().await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(cluster.pg.connect_options(&name))
        .await
        .unwrap();
    TestDb { url: cluster.pg.url(&name), name, pool }
}

/// Settings for tests: the compiled-in defaults (no process environment), port 0, the given database.
pub fn test_settings(db_url: &str) -> Settings {
    let mut settings = Settings::load_with_env(None, Vec::new()).expect("default settings are valid");
    settings.server.listen = "127.0.0.1:0".parse().unwrap();
    settings.database.url = Some(db_url.to_string().into());
    settings.database.max_connections = 8;
    settings.database.min_connections = 0;
    // Generous: a loaded 2-core CI box must not turn queueing for a connection into 503s.
    settings.database.acquire_timeout = std::time::Duration::from_secs(10);
    settings
}
