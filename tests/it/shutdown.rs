//! SIGTERM and SIGINT: the process stops taking work, lets in-flight sends and HTTP requests finish
//! within the grace period or hands the sends back to the queue at its end, and exits 0.

use crate::common;

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use cifpool::internals::fake_provider::FakeBehaviour;
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

/// What a stopped `cifpool serve` left: its exit status, how long it took after the signal, the jobs'
/// status and last error, and the answer to a batch upload that was half sent when the signal came.
struct Stopped {
    status: std::process::ExitStatus,
    took: Duration,
    jobs: Vec<(String, Option<String>)>,
    upload: String,
}

/// Starts `cifpool serve`, puts three sends in flight and starts a batch upload, then sends `signal`
/// and finishes the upload.
async fn run(latency_ms: u64, grace: &str, signal: i32) -> Stopped {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
    // A batch upload in flight: its head and half its body are in when the signal comes.
    let body = serde_json::to_vec(&json!({ "class": "promo", "tenant": "t",
        "jobs": (0..200).map(|i| json!({ "recipient": format!("d-{i}") })).collect::<Vec<_>>() }))
    .unwrap();
    let mut upload = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let head = format!(
        "POST /v1/notifications/batch HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    upload.write_all(head.as_bytes()).await.unwrap();
    upload.write_all(&body[..body.len() / 2]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await; // the server has read what was sent
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, signal) };
    let stopped = Instant::now();
    // New connections are refused from now on, while the upload that was running goes on.
    let refused_by = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
        assert!(Instant::now() < refused_by, "new connections still accepted 10 s after the signal");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    upload.write_all(&body[body.len() / 2..]).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(30), upload.read_to_string(&mut answer))
        .await
        .expect("no answer to the upload within 30 s")
        .unwrap();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(stopped.elapsed() < Duration::from_secs(30), "did not exit after signal {signal}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let took = stopped.elapsed();
    let jobs =
        sqlx::query_as("SELECT status, last_error FROM notification_jobs WHERE class = 'transactional' ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let uploaded: i64 = sqlx::query_scalar("SELECT count(*) FROM notification_jobs WHERE class = 'promo'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(uploaded, if answer.starts_with("HTTP/1.1 202") { 200 } else { 0 }, "the upload's jobs: {answer}");
    Stopped { status, took, jobs, upload: answer }
}

#[tokio::test]
async fn in_flight_sends_finish_within_the_grace_period() {
    let stopped = run(800, "10s", libc::SIGTERM).await;
    assert!(stopped.status.success(), "exit status {}", stopped.status);
    assert!(stopped.took < Duration::from_secs(10), "took {:?}", stopped.took);
    assert!(stopped.jobs.iter().all(|(s, _)| s == "sent"), "{:?}", stopped.jobs);
    assert!(stopped.upload.starts_with("HTTP/1.1 202"), "the upload in flight: {}", stopped.upload);
}

/// Ctrl-C in a terminal (SIGINT) stops the service the same graceful way as SIGTERM.
#[tokio::test]
async fn sigint_drains_like_sigterm() {
    let stopped = run(800, "10s", libc::SIGINT).await;
    assert!(stopped.status.success(), "exit status {}", stopped.status);
    assert!(stopped.took < Duration::from_secs(10), "took {:?}", stopped.took);
    assert!(stopped.jobs.iter().all(|(s, _)| s == "sent"), "{:?}", stopped.jobs);
    assert!(stopped.upload.starts_with("HTTP/1.1 202"), "the upload in flight: {}", stopped.upload);
}

#[tokio::test]
async fn sends_outliving_the_grace_period_are_handed_back() {
    let stopped = run(15_000, "1s", libc::SIGTERM).await;
    assert!(stopped.status.success(), "exit status {}", stopped.status);
    assert!(stopped.took < Duration::from_secs(8), "took {:?}", stopped.took);
    for (s, error) in &stopped.jobs {
        assert_eq!(s, "failed-retrying", "{:?}", stopped.jobs);
        assert_eq!(error.as_deref(), Some("handed back at shutdown"));
    }
}
