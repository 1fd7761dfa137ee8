//! The database goes away for 10 s: requests fail fast with 503 problem+json, /readyz says so, and the
//! service recovers on its own within 2 s of the database coming back.
//!
//! This test runs its own Postgres (not the shared test cluster) because it stops and restarts it.

use crate::common;

use std::time::{Duration, Instant};

use cifpool::db::embedded::{EmbeddedOptions, EmbeddedPostgres, create_server_owned_dir};
use common::{assert_problem, spawn_app_with, test_settings_with_pools};
use serde_json::json;

fn options(base: &std::path::Path) -> EmbeddedOptions {
    EmbeddedOptions {
        data_dir: base.join("pg"),
        durable: false,
        max_connections: 100,
        remove_on_exit: None,
        settings: Vec::new(),
    }
}

#[tokio::test]
async fn requests_fail_fast_during_an_outage_and_recover_without_a_restart() {
    let base = std::env::temp_dir().join(format!("cifpool-outage-{}", std::process::id()));
    create_server_owned_dir(&base).unwrap();
    let pg = EmbeddedPostgres::start(&options(&base)).unwrap();
    let mut settings = test_settings_with_pools(&pg.url("postgres"));
    settings.database.acquire_timeout = Duration::from_millis(500);
    let app = spawn_app_with(settings).await;
    let reserve = || app.client.post(app.url("/v1/cif")).json(&json!({ "customer_type": "individual" })).send();
    let admin = app.client.post(app.url("/admin/pools/individual/refill")).bearer_auth(common::TEST_ADMIN_TOKEN);
    assert_eq!(admin.send().await.unwrap().status(), 200);
    // The refill at start may hold the pool's refill lock, so the admin refill can answer "busy":
    // wait until the pool has codes before taking the database away.
    let filled_by = Instant::now() + Duration::from_secs(10);
    loop {
        let status = reserve().await.unwrap().status();
        if status == 201 {
            break;
        }
        assert!(Instant::now() < filled_by, "the pool was never filled: last answer {status}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Down for 10 s.
    pg.stop().unwrap();
    let down_until = Instant::now() + Duration::from_secs(10);
    let mut slowest = Duration::ZERO;
    let mut checks = 0;
    while Instant::now() < down_until {
        for path in ["/v1/cif", "/readyz", "/v1/notifications"] {
            let started = Instant::now();
            let response = match path {
                "/v1/cif" => reserve().await.unwrap(),
                "/readyz" => app.client.get(app.url(path)).send().await.unwrap(),
                _ => app
                    .client
                    .post(app.url(path))
                    .json(&json!({ "class": "otp", "tenant": "t", "recipient": "+84900000000" }))
                    .send()
                    .await
                    .unwrap(),
            };
            let took = started.elapsed();
            slowest = slowest.max(took);
            assert!(took < Duration::from_secs(1), "{path} took {took:?} while the database was down");
            assert!(response.headers().contains_key("retry-after"), "{path}: 503 carries Retry-After");
            assert_problem(response, 503).await;
            checks += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(app.client.get(app.url("/healthz")).send().await.unwrap().status(), 200, "liveness holds");

    // Back: the same data directory and socket.
    let pg = EmbeddedPostgres::start(&options(&base)).unwrap();
    let back = Instant::now();
    loop {
        let ready = app.client.get(app.url("/readyz")).send().await.unwrap().status() == 200;
        let reserved = ready && reserve().await.unwrap().status() == 201;
        if reserved {
            break;
        }
        // Each request tries a fresh connection: recovery takes one request once Postgres accepts
        // connections again; the bound leaves room for a loaded machine.
        assert!(
            back.elapsed() < Duration::from_secs(5),
            "not recovered {:?} after the database returned",
            back.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "outage: {checks} requests answered 503, slowest {slowest:?}; recovered {:?} after the database returned",
        back.elapsed()
    );
    app.stop().await;
    pg.stop().unwrap();
    let _ = std::fs::remove_dir_all(&base);
}
