//! The HTTP skeleton against a real database: probes, metrics, problem+json everywhere.

use crate::common;

use std::time::{Duration, Instant};

use cifpool::state::AppState;
use common::{
    TEST_ADMIN_TOKEN, assert_problem, block_counter, fresh_database, spawn_app, spawn_passive_app, test_settings,
    test_settings_with_pools, wait_for_a_lock_wait,
};

#[tokio::test]
async fn healthz_and_readyz_are_ok_against_the_real_database() {
    let (app, _db) = spawn_app().await;
    let r = app.client.get(app.url("/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("x-request-id"));

    let r = app.client.get(app.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["status"], "ready");
    assert_eq!(body["schema_version"], cifpool::db::latest_migration());
}

#[tokio::test]
async fn readyz_is_503_when_schema_is_behind() {
    let (app, db) = spawn_app().await;
    sqlx::query("DELETE FROM _sqlx_migrations").execute(&db.pool).await.unwrap();
    let r = app.client.get(app.url("/readyz")).send().await.unwrap();
    let body = assert_problem(r, 503).await;
    assert!(body["detail"].as_str().unwrap().contains("schema"), "{body}");
}

#[tokio::test]
async fn readyz_is_503_problem_quickly_when_the_database_is_unreachable() {
    // A socket directory where no server listens.
    let dir = tempfile::tempdir().unwrap();
    let url = format!("postgres://postgres@localhost/nothing?host={}&port=5432", dir.path().display());
    let settings = test_settings(&url);
    let options = cifpool::db::options_from_url(settings.database.url.as_ref().unwrap()).unwrap();
    let pool = cifpool::db::pool(&settings.database, options, &cifpool::internals::fence::IncarnationGuard::new());
    let state = AppState::new(pool, settings, Default::default(), &common::test_master_key());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(cifpool::http::serve(listener, cifpool::http::app(state), std::future::pending()));

    let client = reqwest::Client::new();
    let started = Instant::now();
    let r = client.get(format!("http://{addr}/readyz")).send().await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(3), "readyz took {:?}", started.elapsed());
    assert_eq!(r.headers().get("retry-after").unwrap(), "1");
    assert_problem(r, 503).await;
    // Liveness does not depend on the database.
    let r = client.get(format!("http://{addr}/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn metrics_is_prometheus_text() {
    let (app, _db) = spawn_app().await;
    app.client.get(app.url("/healthz")).send().await.unwrap();
    let r = app.client.get(app.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
    let text = r.text().await.unwrap();
    assert!(text.contains("# TYPE cifpool_http_requests_total counter"), "{text}");
    assert!(text.contains(r#"route="/healthz""#), "{text}");
}

#[tokio::test]
async fn unknown_route_and_wrong_method_are_problem_json() {
    let (app, _db) = spawn_app().await;
    let r = app.client.get(app.url("/no/such/route")).send().await.unwrap();
    let body = assert_problem(r, 404).await;
    assert_eq!(body["type"], "urn:cifpool:problem:not-found");

    let r = app.client.delete(app.url("/healthz")).send().await.unwrap();
    assert_problem(r, 405).await;
}

#[tokio::test]
async fn oversized_body_is_413_problem_json() {
    let (app, _db) = spawn_app().await;
    let limit = app.state.settings.server.body_limit_bytes;
    let body = vec![b'x'; limit + 1];
    let r = app.client.post(app.url("/healthz")).body(body).send().await.unwrap();
    assert_problem(r, 413).await;
}

/// A graceful stop refuses new connections at once, lets a request already running finish with its
/// real answer, and returns only after it.
#[tokio::test]
async fn graceful_stop_lets_a_running_request_finish_and_refuses_new_ones() {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    // A forced refill that waits for the pool's row lock: a request that is running when the stop comes.
    let blocker = block_counter(&db.pool, "individual").await;
    let url = app.url("/admin/pools/individual/refill?force=true");
    let running =
        tokio::spawn(async move { reqwest::Client::new().post(url).bearer_auth(TEST_ADMIN_TOKEN).send().await });
    wait_for_a_lock_wait(&db.pool).await;

    let healthz = app.url("/healthz");
    let stopping = tokio::spawn(app.stop());
    let by = Instant::now() + Duration::from_secs(10);
    while reqwest::Client::new().get(&healthz).send().await.is_ok() {
        assert!(Instant::now() < by, "new connections still accepted 10 s into the stop");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!stopping.is_finished(), "the stop returned while a request was running");

    blocker.rollback().await.unwrap();
    let answer =
        tokio::time::timeout(Duration::from_secs(30), running).await.expect("the request hung").unwrap().unwrap();
    assert_eq!(answer.status(), 200);
    let body: serde_json::Value = answer.json().await.unwrap();
    assert_eq!(body["outcome"], "refilled", "{body}");
    tokio::time::timeout(Duration::from_secs(30), stopping).await.expect("the stop hung").unwrap();
}
