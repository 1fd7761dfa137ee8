//! What operators see of a running `cifpool serve`: one access-log line per request at the default
//! level, request ids kept only when safe, traces exported over OTLP that continue the caller's
//! `traceparent` and reach the provider call, and the build, readiness, process and pool metrics.

use crate::common;

use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::routing::post;
use common::{fresh_database, serve_command};
use serde_json::json;

/// What the capture server received: OTLP export bodies and the provider calls' `traceparent`s.
#[derive(Clone, Default)]
struct Captured {
    exports: Arc<Mutex<Vec<Bytes>>>,
    traceparents: Arc<Mutex<Vec<Option<String>>>>,
}

/// One HTTP server playing both the OTLP collector (`POST /v1/traces`) and the SMS/push gateway
/// (`POST /send`).
async fn capture_server() -> (String, Captured) {
    let captured = Captured::default();
    let (exports, traceparents) = (captured.exports.clone(), captured.traceparents.clone());
    let app = axum::Router::new()
        .route(
            "/v1/traces",
            post(move |body: Bytes| async move {
                exports.lock().unwrap().push(body);
                ""
            }),
        )
        .route(
            "/send",
            post(move |headers: HeaderMap| async move {
                let tp = headers.get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_string);
                traceparents.lock().unwrap().push(tp);
                axum::Json(json!({ "message_id": "m-1" }))
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, captured)
}

struct Serve {
    child: Child,
    base: String,
    log: tempfile::NamedTempFile,
}

impl Serve {
    /// Starts `serve` at the default log level (no `CIFPOOL_LOG__LEVEL`, no `RUST_LOG`), its stderr
    /// in a file, and waits until it is ready.
    async fn start(db_url: &str, provider_url: &str, extra: &[(&str, &str)]) -> Serve {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut cmd = serve_command(port, db_url, provider_url);
        cmd.env_remove("CIFPOOL_LOG__LEVEL").env_remove("RUST_LOG").stdout(Stdio::null());
        cmd.stderr(Stdio::from(log.reopen().unwrap()));
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let child = cmd.spawn().unwrap();
        let base = format!("http://127.0.0.1:{port}");
        let ready_by = Instant::now() + Duration::from_secs(30);
        let http = reqwest::Client::new();
        while http.get(format!("{base}/readyz")).send().await.map(|r| r.status() != 200).unwrap_or(true) {
            assert!(Instant::now() < ready_by, "service never became ready");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Serve { child, base, log }
    }

    /// SIGTERM, wait for the exit, and return what it logged.
    async fn stop(mut self) -> String {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let by = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < by, "did not exit after SIGTERM");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        std::fs::read_to_string(self.log.path()).unwrap()
    }
}

async fn named_key(db: &sqlx::PgPool, name: &str) -> String {
    let new = cifpool::internals::api_key::NewKey {
        name: name.to_string(),
        scopes: cifpool::auth::Scope::ALL.iter().map(|s| s.as_str().to_string()).collect(),
        tenants: None,
    };
    cifpool::internals::api_key::create(db, &cifpool::audit::Actor::system(), &new).await.unwrap().key
}

#[tokio::test]
async fn each_request_leaves_one_access_log_line_at_the_default_level() {
    let db = fresh_database().await;
    let key = named_key(&db.pool, "onboarding-pod").await;
    let serve = Serve::start(&db.url, "http://127.0.0.1:9", &[]).await;
    let http = common::client_with_key(&key);
    let r = http.get(format!("{}/v1/pools", serve.base)).header("x-request-id", "req-0042").send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-client-request-id"], "req-0042", "a short printable id is kept beside");
    let service_id = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert!(uuid::Uuid::parse_str(&service_id).is_ok(), "the service's own id is a UUID: {service_id:?}");
    let r = reqwest::Client::new().get(format!("{}/v1/pools", serve.base)).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let unauthenticated_id = r.headers()["x-request-id"].to_str().unwrap().to_string();
    // Ids that could forge log lines or are too long are dropped.
    for bad in ["has space", "x".repeat(65).as_str(), "tab\there"] {
        let r = reqwest::Client::new().get(format!("{}/healthz", serve.base)).header("x-request-id", bad).send().await;
        let r = r.unwrap();
        let id = r.headers()["x-request-id"].to_str().unwrap().to_string();
        assert!(uuid::Uuid::parse_str(&id).is_ok(), "the service's own UUID, got {id:?}");
        assert!(!r.headers().contains_key("x-client-request-id"), "{bad:?} is not echoed");
    }
    let log = serve.stop().await;
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("cifpool::access")).collect();
    let mine: Vec<&&str> = lines.iter().filter(|l| l.contains("req-0042")).collect();
    assert_eq!(mine.len(), 1, "one access line per request: {lines:#?}");
    let line = mine[0];
    let with_ids = format!("request_id={service_id} client_request_id=req-0042");
    for expected in [
        "INFO",
        "GET /v1/pools 200",
        "route=/v1/pools",
        "status=200",
        "key=\"onboarding-pod\"",
        "latency_ms=",
        with_ids.as_str(),
    ] {
        assert!(line.contains(expected), "{expected:?} missing from {line}");
    }
    let refused: Vec<&&str> = lines.iter().filter(|l| l.contains(&unauthenticated_id)).collect();
    assert_eq!(refused.len(), 1, "{lines:#?}");
    assert!(refused[0].contains("status=401") && refused[0].contains("key=\"-\""), "{}", refused[0]);
    assert!(!log.contains("has space"), "a refused request id never reaches the log");
}

#[tokio::test]
async fn traces_continue_the_callers_traceparent_and_reach_the_provider_call() {
    let db = fresh_database().await;
    let key = named_key(&db.pool, "notifier").await;
    let (capture, captured) = capture_server().await;
    let serve = Serve::start(&db.url, &capture, &[("CIFPOOL_TELEMETRY__OTLP_ENDPOINT", &capture)]).await;
    let http = common::client_with_key(&key);
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    // The pool fills right after start; until then a reservation is 503.
    let by = Instant::now() + Duration::from_secs(20);
    loop {
        let r = http
            .post(format!("{}/v1/cif", serve.base))
            .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
            .json(&json!({ "customer_type": "individual" }))
            .send()
            .await
            .unwrap();
        if r.status() == 201 {
            break;
        }
        assert_eq!(r.status(), 503);
        assert!(Instant::now() < by, "the pool never filled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The notification's request carries a trace of its own: its send (another task, later) continues it.
    let notify_trace = "0af7651916cd43dd8448eb211c80319c";
    let body = json!({ "class": "transactional", "tenant": "t", "recipient": "+84900000001" });
    let r = http
        .post(format!("{}/v1/notifications", serve.base))
        .header("traceparent", format!("00-{notify_trace}-b7ad6b7169203331-01"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    // A batch (the COPY path) keeps its request's trace for every job.
    let batch_trace = "5c3e1f0a9b8d47e6a2f4c1d0e9b8a7f6";
    let batch = json!({ "class": "transactional", "tenant": "t",
        "jobs": [{ "recipient": "+84900000002" }, { "recipient": "+84900000003" }] });
    let r = http
        .post(format!("{}/v1/notifications/batch", serve.base))
        .header("traceparent", format!("00-{batch_trace}-a1b2c3d4e5f60718-01"))
        .json(&batch)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let by = Instant::now() + Duration::from_secs(20);
    while captured.traceparents.lock().unwrap().len() < 3 {
        if Instant::now() > by {
            let jobs: Vec<(String, Option<String>)> =
                sqlx::query_as("SELECT status, last_error FROM notification_jobs").fetch_all(&db.pool).await.unwrap();
            let log = serve.stop().await;
            panic!("the job was never sent: {jobs:?}\n{log}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    serve.stop().await;
    // Each provider call carried a W3C traceparent: version, 16-byte trace id, 8-byte span id, flags.
    let all: Vec<String> = captured.traceparents.lock().unwrap().iter().map(|t| t.clone().unwrap()).collect();
    let traces: Vec<&str> = all.iter().map(|t| t.split('-').nth(1).unwrap()).collect();
    assert_eq!(traces.iter().filter(|t| **t == batch_trace).count(), 2, "{all:?}");
    let sent = all.iter().find(|t| !t.contains(batch_trace)).unwrap().clone();
    let parts: Vec<&str> = sent.split('-').collect();
    assert_eq!((parts.len(), parts[0], parts[1].len(), parts[2].len()), (4, "00", 32, 16), "{sent}");
    assert_eq!(parts[1], notify_trace, "the provider call is in the trace of the request that enqueued the job");
    // The exports (flushed at shutdown) hold the caller's trace and the send's, as raw 16-byte ids.
    let exports = captured.exports.lock().unwrap().concat();
    let contains = |hex_id: &str| {
        let id = hex::decode(hex_id).unwrap();
        exports.windows(id.len()).any(|w| w == id.as_slice())
    };
    assert!(!exports.is_empty(), "no spans were exported");
    assert!(contains(trace_id), "the request span continues the caller's trace");
    assert!(contains(parts[1]), "the send span that called the provider is exported");
    for name in [&b"claim"[..], b"send", b"POST /v1/cif"] {
        assert!(exports.windows(name.len()).any(|w| w == name), "no {} span", String::from_utf8_lossy(name));
    }
}

#[tokio::test]
async fn metrics_show_the_build_readiness_process_and_database_pool() {
    let db = fresh_database().await;
    let serve = Serve::start(&db.url, "http://127.0.0.1:9", &[]).await;
    let version = env!("CARGO_PKG_VERSION");
    let expected = [
        "cifpool_ready 1",
        "cifpool_db_pool_connections{state=\"idle\"}",
        "cifpool_db_pool_connections{state=\"in_use\"}",
        "cifpool_db_pool_max_connections 16",
        "cifpool_db_pool_acquire_seconds_bucket",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "process_open_fds",
        "# HELP cifpool_provider_pod_share",
    ];
    // The pool probe records its first acquire about a second after start, the provider gauges come
    // with the first budget sync: poll until all are there, with a deadline.
    let by = std::time::Instant::now() + Duration::from_secs(15);
    let text = loop {
        let text = reqwest::get(format!("{}/metrics", serve.base)).await.unwrap().text().await.unwrap();
        if expected.iter().all(|line| text.contains(line)) || std::time::Instant::now() > by {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    serve.stop().await;
    assert!(text.contains(&format!("cifpool_build_info{{version=\"{version}\",git_sha=\"")), "{text}");
    for line in expected {
        assert!(text.contains(line), "{line:?} missing from /metrics");
    }
}

/// An OTP's code and number reach the provider and nothing else an operator keeps: no log line at debug
/// level, no exported span (single enqueue and the batch's COPY path alike).
#[tokio::test]
async fn a_sent_otp_leaves_its_code_and_number_in_no_log_line_and_no_exported_span() {
    let db = fresh_database().await;
    let key = named_key(&db.pool, "notifier").await;
    let (capture, captured) = capture_server().await;
    let env = [("CIFPOOL_TELEMETRY__OTLP_ENDPOINT", capture.as_str()), ("RUST_LOG", "debug")];
    let serve = Serve::start(&db.url, &capture, &env).await;
    let http = common::client_with_key(&key);
    let one = json!({ "class": "otp", "tenant": "t", "recipient": "+84901234567", "payload": { "code": "918273" } });
    let r = http.post(format!("{}/v1/notifications", serve.base)).json(&one).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let batch = json!({ "class": "otp", "tenant": "t", "jobs": [{ "recipient": "+84907654321", "payload": { "code": "550731" } }] });
    let r = http.post(format!("{}/v1/notifications/batch", serve.base)).json(&batch).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let by = Instant::now() + Duration::from_secs(20);
    while captured.traceparents.lock().unwrap().len() < 2 {
        assert!(Instant::now() < by, "the OTPs were never sent");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let log = serve.stop().await;
    assert!(log.contains("DEBUG"), "the log is at debug level");
    let exports = captured.exports.lock().unwrap().concat();
    assert!(!exports.is_empty(), "spans were exported");
    for secret in ["918273", "550731", "84901234567", "901234567", "84907654321", "907654321"] {
        assert!(!log.contains(secret), "the log holds {secret:?}");
        assert!(!exports.windows(secret.len()).any(|w| w == secret.as_bytes()), "an exported span holds {secret:?}");
    }
}

/// docs/METRICS.md names every series a running service exports (each `# TYPE` line of `/metrics`),
/// and every `cifpool_*` name it documents is one the code uses.
#[tokio::test]
async fn every_metric_is_documented() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let doc = std::fs::read_to_string(root.join("docs/METRICS.md")).unwrap();
    let documented: std::collections::BTreeSet<String> = doc
        .split('`')
        .filter(|w| {
            (w.starts_with("cifpool_") || w.starts_with("process_"))
                && w.chars().all(|c| c.is_ascii_lowercase() || c == '_')
        })
        .map(str::to_string)
        .collect();
    let db = fresh_database().await;
    let serve = Serve::start(&db.url, "http://127.0.0.1:9", &[]).await;
    // Some series appear with the first probe or budget sync: give them a few seconds.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let text = reqwest::get(format!("{}/metrics", serve.base)).await.unwrap().text().await.unwrap();
    serve.stop().await;
    let exported: Vec<&str> =
        text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split(' ').next()).collect();
    assert!(exported.len() > 30, "{text}");
    for name in &exported {
        assert!(documented.contains(*name), "/metrics exports {name}, which docs/METRICS.md does not describe");
    }
    let mut code = String::new();
    for entry in walk(&root.join("src")) {
        code.push_str(&std::fs::read_to_string(entry).unwrap());
    }
    for name in documented.iter().filter(|n| n.starts_with("cifpool_")) {
        assert!(code.contains(&format!("\"{name}\"")), "docs/METRICS.md describes {name}, which the code never uses");
    }
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// A session holding a snapshot in the service's database shows in the cleanup-horizon reading for as
/// long as it holds it (what CifDatabaseHorizonHeld watches); no replication slot holds anything here.
#[tokio::test]
async fn an_open_snapshot_shows_in_the_horizon_and_leaves_with_it() {
    use cifpool::internals::horizon;
    let db = fresh_database().await;
    let idle = horizon::read(&db.pool).await.unwrap();
    assert!(idle.oldest_snapshot_age_s < 1.0, "{idle:?}");
    assert_eq!(idle.slot_xmin_age, 0);
    // An analyst's REPEATABLE READ session: its snapshot lives until the transaction ends.
    let mut analyst = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ").execute(&mut *analyst).await.unwrap();
    sqlx::query("SELECT count(*) FROM cif_pools").execute(&mut *analyst).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let held = horizon::read(&db.pool).await.unwrap();
    assert!(held.oldest_snapshot_age_s >= 1.4, "{held:?}");
    analyst.rollback().await.unwrap();
    let released = horizon::read(&db.pool).await.unwrap();
    assert!(released.oldest_snapshot_age_s < 1.0, "{released:?}");
}
