//! Test harness shared by every integration test binary.
//!
//! One private Postgres cluster per test process (started on first use, fsync off, removed when the
//! process exits), a `template` database migrated once, and for each test a fresh database copied from
//! that template (~25 ms) — so tests never see each other's rows and need no external server.
#![allow(dead_code)]

use std::sync::OnceLock;

use cifpool::config::Settings;
use cifpool::db::embedded::{EmbeddedOptions, EmbeddedPostgres, create_server_owned_dir};
use cifpool::startup::{Application, Database};
use cifpool::state::AppState;
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

/// A running app on port 0, stopped when dropped (with the test's runtime).
pub struct TestApp {
    /// `http://127.0.0.1:PORT`
    pub base: String,
    /// HTTP client.
    pub client: reqwest::Client,
    /// Shared state of the running app (to drive jobs directly).
    pub state: AppState,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl TestApp {
    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Graceful stop, waiting for the app to finish.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap().unwrap();
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// Builds and runs the app on `db` with `settings`.
pub async fn spawn_app_with(settings: Settings) -> TestApp {
    cifpool::telemetry::init_logging(cifpool::config::LogFormat::Text, "warn");
    let url = settings.database.url.clone().expect("tests use an explicit database url");
    let options = cifpool::db::options_from_url(&url).unwrap();
    let database = Database { pool: cifpool::db::pool(&settings.database, options), embedded: None };
    let app = Application::build_with(settings, database, &test_master_key()).await.expect("building the app");
    let base = format!("http://{}", app.local_addr());
    let state = app.state().clone();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(app.run_until(async move {
        let _ = rx.await;
    }));
    TestApp { base, client: reqwest::Client::new(), state, stop: Some(tx), task: Some(task) }
}

/// The fixed master key of the test suite.
pub fn test_master_key() -> cifpool::keys::MasterKey {
    cifpool::keys::MasterKey::from_hex(TEST_MASTER_KEY_HEX).unwrap()
}

/// Hex of [`test_master_key`].
pub const TEST_MASTER_KEY_HEX: &str = "5ec2e7000000000000000000000000000000000000000000000000000000c1f0";

/// A pool definition for tests: small batches, schedules that never fire during a test (Feb 30th).
pub fn test_pool(name: &str, prefix: &str) -> cifpool::config::PoolSettings {
    cifpool::config::PoolSettings {
        name: name.into(),
        prefix: prefix.into(),
        digits: 9,
        check: cifpool::code::check::CheckScheme::Damm,
        key_id: "test-1".into(),
        low_watermark: 1000,
        batch_size: 500,
        max_batches_per_run: 4,
        lease_ttl: std::time::Duration::from_secs(300),
        refill_schedule: "0 0 0 30 2 *".into(),
        reclaim_schedule: "0 0 0 30 2 *".into(),
    }
}

/// Settings with the two test pools `individual` (prefix 1) and `business` (prefix 2).
pub fn test_settings_with_pools(db_url: &str) -> Settings {
    let mut settings = test_settings(db_url);
    settings.pools = vec![test_pool("individual", "1"), test_pool("business", "2")];
    settings.security.admin_token = Some(TEST_ADMIN_TOKEN.to_string().into());
    settings
}

/// Admin bearer token of [`test_settings_with_pools`].
pub const TEST_ADMIN_TOKEN: &str = "test-admin-token-0123456789";

/// HTTP only, no schedules or start-up refill: the test drives refill and reclaim itself.
pub async fn spawn_passive_app(settings: Settings) -> TestApp {
    cifpool::telemetry::init_logging(cifpool::config::LogFormat::Text, "warn");
    let url = settings.database.url.clone().expect("tests use an explicit database url");
    let pool = cifpool::db::pool(&settings.database, cifpool::db::options_from_url(&url).unwrap());
    cifpool::db::migrate(&pool).await.unwrap();
    let pools = cifpool::cif::Pools::reconcile(&pool, &settings.pools, &test_master_key()).await.expect("reconcile");
    let state = AppState::new(pool, settings, pools);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let router = cifpool::http::app(state.clone());
    let task = tokio::spawn(async move {
        cifpool::http::serve(listener, router, async move {
            let _ = rx.await;
        })
        .await?;
        Ok(())
    });
    TestApp { base, client: reqwest::Client::new(), state, stop: Some(tx), task: Some(task) }
}

/// A fresh database and an app on it.
pub async fn spawn_app() -> (TestApp, TestDb) {
    let db = fresh_database().await;
    let app = spawn_app_with(test_settings(&db.url)).await;
    (app, db)
}

/// Asserts `response` is problem+json with `status`, returning the parsed document.
pub async fn assert_problem(response: reqwest::Response, status: u16) -> serde_json::Value {
    assert_eq!(response.status().as_u16(), status, "unexpected status");
    let content_type = response.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    assert!(content_type.starts_with("application/problem+json"), "content-type was {content_type:?}");
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["status"], status, "problem status field: {body}");
    for field in ["type", "title", "detail"] {
        assert!(body[field].is_string(), "problem lacks {field}: {body}");
    }
    body
}

/// An in-process fake provider on port 0.
pub struct FakeServer {
    /// Its state (behaviour, delivery counts).
    pub fake: std::sync::Arc<cifpool::queue::fake_provider::FakeProvider>,
    /// Base URL.
    pub url: String,
}

/// Starts a fake provider for the rest of the test.
pub async fn fake_server(behaviour: cifpool::queue::fake_provider::FakeBehaviour) -> FakeServer {
    let fake = cifpool::queue::fake_provider::FakeProvider::new(behaviour);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(cifpool::queue::fake_provider::serve(fake.clone(), listener, std::future::pending()));
    FakeServer { fake, url }
}

/// Points the `sms` and `push` providers of `settings` at two fake servers.
pub fn use_fake_providers(settings: &mut Settings, sms: &FakeServer, push: &FakeServer) {
    for (name, server) in [("sms", sms), ("push", push)] {
        let p = settings.queue.providers.get_mut(name).expect("default providers exist");
        p.kind = cifpool::config::ProviderKind::Http;
        p.url = Some(server.url.clone());
    }
}

/// `cifpool serve` on `port` against `db_url`, with the test master key and both providers pointed at
/// `provider_url`, in a clean environment (no inherited `CIFPOOL_*`); callers add their own settings.
pub fn serve_command(port: u16, db_url: &str, provider_url: &str) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cifpool"));
    for (k, _) in std::env::vars() {
        if k.starts_with("CIFPOOL_") {
            cmd.env_remove(k);
        }
    }
    cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .env("CIFPOOL_DATABASE__URL", db_url)
        .env("CIFPOOL_MASTER_KEY", TEST_MASTER_KEY_HEX)
        .env("CIFPOOL_LOG__LEVEL", "warn");
    for provider in ["SMS", "PUSH"] {
        cmd.env(format!("CIFPOOL_QUEUE__PROVIDERS__{provider}__KIND"), "http")
            .env(format!("CIFPOOL_QUEUE__PROVIDERS__{provider}__URL"), provider_url);
    }
    cmd
}
