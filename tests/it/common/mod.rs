//! Test harness shared by the service's integration tests (`tests/it`): the database harness of
//! [`cluster`] plus running apps, problem assertions, fake providers and `cifpool serve` processes.
#![allow(dead_code)]

mod cluster;
pub mod queue_env;

pub use cluster::*;

use cifpool::config::Settings;
use cifpool::db::Database;
use cifpool::startup::{Application, RunningApp};
use cifpool::state::AppState;

/// A running app on port 0, stopped when dropped (with the test's runtime).
pub struct TestApp {
    /// `http://127.0.0.1:PORT`
    pub base: String,
    /// HTTP client that sends [`TestApp::key`] unless a request sets its own `Authorization`.
    pub client: reqwest::Client,
    /// An API key with every scope, created for this app.
    pub key: String,
    /// Shared state of the running app (to drive jobs directly).
    pub state: AppState,
    running: RunningApp,
}

impl TestApp {
    /// `base` + `path`.
    pub fn url(&self, path: &str) -> String {
        self.running.url(path)
    }

    /// Graceful stop, waiting (at most a minute) for the app to finish.
    pub async fn stop(self) {
        tokio::time::timeout(std::time::Duration::from_secs(60), self.running.stop())
            .await
            .expect("the app did not stop within a minute")
            .unwrap();
    }

    /// Graceful stop, returning what the service returned (an error when a task it needs failed).
    pub async fn stop_result(self) -> anyhow::Result<()> {
        tokio::time::timeout(std::time::Duration::from_secs(60), self.running.stop())
            .await
            .expect("the app did not stop within a minute")
    }

    /// Stops the app at once, as a crash would (see [`RunningApp::abort`]).
    pub fn kill(self) {
        self.running.abort();
    }
}

impl TestApp {
    async fn start(app: Application) -> TestApp {
        let key = create_key(&app.state().db, &cifpool::auth::Scope::ALL, None).await;
        let running = app.spawn();
        TestApp {
            base: running.base_url.clone(),
            client: client_with_key(&key),
            key,
            state: running.state.clone(),
            running,
        }
    }
}

/// A client that authenticates with `key` (a request's own `Authorization` header wins).
pub fn client_with_key(key: &str) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::AUTHORIZATION, format!("Bearer {key}").parse().unwrap());
    reqwest::Client::builder().default_headers(headers).build().unwrap()
}

/// Creates an API key with `scopes` (and `tenants`) under a fresh name; returns its secret.
pub async fn create_key(db: &sqlx::PgPool, scopes: &[cifpool::auth::Scope], tenants: Option<&[&str]>) -> String {
    let new = cifpool::internals::api_key::NewKey {
        name: format!("test-{}", uuid::Uuid::new_v4().simple()),
        scopes: scopes.iter().map(|s| s.as_str().to_string()).collect(),
        tenants: tenants.map(|t| t.iter().map(|s| s.to_string()).collect()),
    };
    cifpool::internals::api_key::create(db, &cifpool::audit::Actor::system(), &new)
        .await
        .expect("creating a test key")
        .key
}

/// Builds the app on the database of `settings` (tests always name one) with the test master key.
pub async fn build_app(settings: Settings) -> Application {
    cifpool::telemetry::init_logging(cifpool::config::LogFormat::Text, "warn");
    let url = settings.database.url.clone().expect("tests use an explicit database url");
    let database = Database::external(&settings.database, cifpool::db::options_from_url(&url).unwrap());
    Application::build_with(settings, database, &test_master_key()).await.expect("building the app")
}

/// Runs an app built with [`build_app`] (and adjusted by the test).
pub async fn spawn_built(app: Application) -> TestApp {
    TestApp::start(app).await
}

/// Builds and runs the app with `settings`, background work included.
pub async fn spawn_app_with(settings: Settings) -> TestApp {
    TestApp::start(build_app(settings).await).await
}

/// The fixed master key of the test suite.
pub fn test_master_key() -> cifpool::keys::MasterKey {
    cifpool::keys::MasterKey::from_hex(TEST_MASTER_KEY_HEX).unwrap()
}

/// Hex of [`test_master_key`].
pub const TEST_MASTER_KEY_HEX: &str = "5ec2e7000000000000000000000000000000000000000000000000000000c1f0";

/// A cron schedule that does not fire during a test: midnight on February 29th. Not February 30th,
/// which never comes: configuration refuses it, and looking for its next time up to the year 5000
/// took 0.6 s per schedule in a debug build, four per app of the suite with background work.
pub const NEVER_DURING_A_TEST: &str = "0 0 0 29 2 *";

/// A pool definition for tests: small batches, schedules that never fire during a test.
pub fn test_pool(name: &str, prefix: &str) -> cifpool::config::PoolSettings {
    cifpool::config::PoolSettings {
        name: name.into(),
        prefix: prefix.into(),
        digits: 9,
        check: cifpool::code::CheckScheme::Damm,
        key_id: "test-1".into(),
        cipher: None,
        low_watermark: 1000,
        batch_size: 500,
        max_batches_per_run: 4,
        lease_ttl: std::time::Duration::from_secs(300),
        refill_schedule: NEVER_DURING_A_TEST.into(),
        reclaim_schedule: NEVER_DURING_A_TEST.into(),
        fence_margin: None,
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
    TestApp::start(build_app(settings).await.without_background()).await
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
    pub fake: std::sync::Arc<cifpool::internals::fake_provider::FakeProvider>,
    /// Base URL.
    pub url: String,
}

/// Starts a fake provider for the rest of the test.
pub async fn fake_server(behaviour: cifpool::internals::fake_provider::FakeBehaviour) -> FakeServer {
    let fake = cifpool::internals::fake_provider::FakeProvider::new(behaviour);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(cifpool::internals::fake_provider::serve(fake.clone(), listener, std::future::pending()));
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

/// Runs the `cifpool` binary with `args` against `db_url` and the test master key, in a clean
/// environment (no inherited `CIFPOOL_*`), as an operator would.
pub fn cifpool_cli(db_url: &str, args: &[&str]) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cifpool"));
    for (k, _) in std::env::vars() {
        if k.starts_with("CIFPOOL_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("CIFPOOL_DATABASE__URL", db_url).env("CIFPOOL_MASTER_KEY", TEST_MASTER_KEY_HEX);
    cmd.args(args).output().unwrap()
}

/// The JSON objects a successful command printed, one per line.
pub fn json_lines(out: &std::process::Output) -> Vec<serde_json::Value> {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Holds the row lock of pool `name` (what a refill batch needs to advance its counter) until the
/// returned transaction ends, so a refill started meanwhile waits while holding its advisory lock.
pub async fn block_counter(db: &sqlx::PgPool, name: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = db.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM cif_pools WHERE name = $1 FOR UPDATE").bind(name).execute(&mut *tx).await.unwrap();
    tx
}

/// Waits (at most 10 s) until a statement of database `db` waits for a row lock.
pub async fn wait_for_a_lock_wait(db: &sqlx::PgPool) {
    let by = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(db)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        assert!(std::time::Instant::now() < by, "no statement waited for a lock within 10 s");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Asserts that a `cifpool` run failed the way the command itself fails (exit 1, `error: …` naming
/// `what`), not with a usage error (exit 2) that would pass any "it failed" check.
pub fn assert_cli_error(out: &std::process::Output, what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "expected exit 1 with {what:?}; stderr: {stderr}");
    assert!(stderr.contains(what), "expected {what:?} in stderr: {stderr}");
}

/// Awaits a spawned task, at most a minute: a hung task fails its test instead of holding the run
/// until CI's own limit; a panic in the task fails the test with the task's message.
pub async fn joined<T>(task: tokio::task::JoinHandle<T>) -> T {
    match tokio::time::timeout(std::time::Duration::from_secs(60), task).await {
        Ok(Ok(value)) => value,
        Ok(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Ok(Err(e)) => panic!("the task was canceled: {e}"),
        Err(_) => panic!("the task did not finish within a minute"),
    }
}
