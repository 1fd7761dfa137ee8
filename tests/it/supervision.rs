//! Background tasks under the service's supervisor: a task that fails is restarted and counted, and
//! readiness says so while it is down; one that keeps failing stops the service with an error (the
//! binary then exits non-zero and the orchestrator replaces the pod).

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cifpool::supervise::RestartPolicy;
use common::{build_app, fresh_database, spawn_built, test_settings};

/// Fast enough for a test: restarts after 0.2 s and 0.4 s, given up at the third failure.
const QUICK: RestartPolicy = RestartPolicy {
    first_backoff: Duration::from_millis(200),
    max_backoff: Duration::from_millis(400),
    give_up_after: 3,
};

#[tokio::test]
async fn a_task_that_fails_once_is_restarted_and_counted_and_readiness_recovers() {
    let db = fresh_database().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = build_app(test_settings(&db.url)).await.restarting(QUICK).also_run("flaky sync", move |stop| {
        let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            if first {
                panic!("injected failure");
            }
            stop.cancelled().await;
        }
    });
    let app = spawn_built(app).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ready = app.client.get(app.url("/readyz")).send().await.unwrap();
        if ready.status() == 200 && runs.load(Ordering::SeqCst) == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "never ready again after the restart");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = app.client.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"cifpool_task_restarts_total{task="flaky sync"} 1"#), "{metrics}");
    app.stop().await;
}

#[tokio::test]
async fn a_task_that_keeps_failing_fails_readiness_then_stops_the_service_with_an_error() {
    let db = fresh_database().await;
    let app = build_app(test_settings(&db.url))
        .await
        .restarting(QUICK)
        .also_run("doomed relay", |_stop| async { panic!("injected failure") });
    let app = spawn_built(app).await;
    let (client, url) = (app.client.clone(), app.url("/readyz"));

    // Down between restarts: readiness names it (the database itself answers).
    let mut saw_unready = false;
    let deadline = Instant::now() + Duration::from_secs(20);
    let stopped = loop {
        match client.get(&url).send().await {
            Ok(r) if r.status() == 503 => {
                let body: serde_json::Value = r.json().await.unwrap();
                assert!(body["detail"].as_str().unwrap().contains("doomed relay"), "{body}");
                saw_unready = true;
            }
            Ok(r) => assert!(r.status() == 200, "unexpected {}", r.status()),
            // Given up: the service stopped serving by itself.
            Err(_) => break true,
        }
        if Instant::now() > deadline {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(saw_unready, "readiness never reported the task down");
    assert!(stopped, "the service kept serving after giving the task up");
    let error = app.stop_result().await.expect_err("a given-up task is an error").to_string();
    assert!(error.contains("doomed relay") && error.contains("panicked"), "{error}");
}

#[tokio::test]
async fn background_work_that_cannot_start_fails_the_service_before_it_serves_anything() {
    let db = fresh_database().await;
    let mut settings = common::test_settings_with_pools(&db.url);
    // Configuration checks refuse this schedule; built past them, the scheduler refuses it at start.
    settings.pools[0].refill_schedule = "not a schedule".into();
    let app = spawn_built(build_app(settings).await).await;
    let (client, url) = (app.client.clone(), app.url("/healthz"));
    let error = app.stop_result().await.expect_err("a schedule that cannot start is an error").to_string();
    assert!(error.contains("starting the background work"), "{error}");
    // Nothing is left serving on the port: the listener went with the failed start.
    let answer = client.get(&url).timeout(Duration::from_secs(5)).send().await;
    assert!(answer.is_err(), "still serving after the start failed: {answer:?}");
}
