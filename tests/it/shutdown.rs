//! SIGTERM: the process stops taking work, lets in-flight sends finish within the grace period or
//! hands them back to the queue at its end, and exits 0.

use crate::common;

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use cifpool::queue::fake_provider::FakeBehaviour;
use common::{FakeServer, fake_server, fresh_database, serve_command};
use serde_json::json;

fn serve(db_url: &str, provider: &FakeServer, grace: &str, port: u16) -> Child {
    let mut cmd = serve_command(port, db_url, &provider.url);
    cmd.env("CIFPOOL_SERVER__SHUTDOWN_GRACE", grace)
        .env("CIFPOOL_QUEUE__PROVIDERS__SMS__TIMEOUT", "20s")
        .env("CIFPOOL_QUEUE__PROVIDERS__PUSH__TIMEOUT", "20s")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cmd.spawn().unwrap()
}

async fn run(latency_ms: u64, grace: &str) -> (std::process::ExitStatus, Duration, Vec<(String, Option<String>)>) {
    let db = fresh_database().await;
    let provider = fake_server(FakeBehaviour { latency_ms, ..Default::default() }).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let key = common::create_key(&db.pool, &cifpool::auth::Scope::ALL, None).await;
    let mut child = serve(&db.url, &provider, grace, port);
    let http = common::client_with_key(&key);
    let base = format!("http://127.0.0.1:{port}");
    let ready_by = Instant::now() + Duration::from_secs(30);
    while http.get(format!("{base}/readyz")).send().await.map(|r| r.status() != 200).unwrap_or(true) {
        assert!(Instant::now() < ready_by, "service never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in 0..3 {
        let body = json!({ "class": "transactional", "tenant": "t", "recipient": format!("+8490000000{i}") });
        assert_eq!(http.post(format!("{base}/v1/notifications")).json(&body).send().await.unwrap().status(), 202);
    }
    // Wait until the sends are in flight, then ask the process to stop.
    let sending_by = Instant::now() + Duration::from_secs(10);
    loop {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM notification_jobs WHERE status = 'sending'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if n == 3 {
            break;
        }
        assert!(Instant::now() < sending_by, "jobs never went in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let stopped = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(stopped.elapsed() < Duration::from_secs(30), "did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let took = stopped.elapsed();
    let jobs = sqlx::query_as("SELECT status, last_error FROM notification_jobs ORDER BY id")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    (status, took, jobs)
}

#[tokio::test]
async fn in_flight_sends_finish_within_the_grace_period() {
    let (status, took, jobs) = run(800, "10s").await;
    assert!(status.success(), "exit status {status}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(jobs.iter().all(|(s, _)| s == "sent"), "{jobs:?}");
}

#[tokio::test]
async fn sends_outliving_the_grace_period_are_handed_back() {
    let (status, took, jobs) = run(15_000, "1s").await;
    assert!(status.success(), "exit status {status}");
    assert!(took < Duration::from_secs(8), "took {took:?}");
    for (s, error) in &jobs {
        assert_eq!(s, "failed-retrying", "{jobs:?}");
        assert_eq!(error.as_deref(), Some("handed back at shutdown"));
    }
}
