//! Chaos: three `cifpool serve` processes on one Postgres, clients reserving, confirming and
//! enqueueing all the while; one process is killed with SIGKILL every few seconds and restarted, and
//! Postgres itself restarts once. Afterwards: no code confirmed twice, every generated code in exactly
//! one state, every accepted notification finished (sent, dead or expired) with at most one result,
//! and the provider never saw a job more often than it was attempted.
//!
//! This test runs its own Postgres because it restarts it.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::process::{Child, Stdio};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cifpool::db::embedded::{EmbeddedOptions, EmbeddedPostgres, create_server_owned_dir};
use cifpool::internals::fake_provider::FakeBehaviour;
use common::{TEST_ADMIN_TOKEN, fake_server, serve_command};
use rand::Rng;
use serde_json::{Value, json};

/// How long the chaos lasts.
const CHAOS: Duration = Duration::from_secs(30);
/// A process is killed this often.
const KILL_EVERY: Duration = Duration::from_secs(3);
/// Longest wait for the queue to drain afterwards.
const DRAIN: Duration = Duration::from_secs(90);
/// How long a client keeps retrying one confirm through kills and the database's restart.
const CONFIRM_PATIENCE: Duration = Duration::from_secs(30);
/// After the database is back, how long the other pods may still answer 503 (a pooled connection
/// notices the restart on its next use).
const DB_SETTLE: Duration = Duration::from_secs(3);

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

struct Node {
    port: u16,
    child: Option<Child>,
}

impl Drop for Node {
    /// A failing assertion must not leave `cifpool serve` processes behind.
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn spawn_node(port: u16, db_url: &str, provider_url: &str, log: &std::path::Path) -> Child {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    let mut cmd = serve_command(port, db_url, provider_url);
    cmd.env("CIFPOOL_DATABASE__MAX_CONNECTIONS", "12")
        .env("CIFPOOL_SECURITY__ADMIN_TOKEN", TEST_ADMIN_TOKEN)
        .env("CIFPOOL_QUEUE__WORKERS", "16")
        .env("CIFPOOL_QUEUE__RESERVED", "4")
        // Short leases and a sweep every second, so a killed node's sends come back quickly.
        .env("CIFPOOL_QUEUE__LEASE", "3s")
        .env("CIFPOOL_QUEUE__SWEEP_SCHEDULE", "* * * * * *")
        .env("CIFPOOL_QUEUE__PROVIDERS__SMS__TIMEOUT", "1s")
        .env("CIFPOOL_QUEUE__PROVIDERS__PUSH__TIMEOUT", "1s")
        .stdout(Stdio::null())
        .stderr(log);
    cmd.spawn().unwrap()
}

/// What the chaos has done so far, so a client can tell an explained failure from a bug: a request
/// that failed to connect to a node that was down (or killed while it waited), or a 503 while the
/// database was away (or its pods still reconnecting), is a failover; anything else fails the test.
struct Weather {
    /// Per node: up (ready) now, and how many times it has been killed.
    nodes: Vec<(AtomicBool, AtomicU64)>,
    /// True from the database's stop until its pods have had time to reconnect.
    db_away: AtomicBool,
    /// Times the database went away.
    db_outages: AtomicU64,
}

/// A snapshot of [`Weather`] for one node, taken when a request starts.
#[derive(Clone, Copy, PartialEq)]
struct Sky {
    node_up: bool,
    node_kills: u64,
    db_away: bool,
    db_outages: u64,
}

impl Weather {
    fn sky(&self, node: usize) -> Sky {
        Sky {
            node_up: self.nodes[node].0.load(SeqCst),
            node_kills: self.nodes[node].1.load(SeqCst),
            db_away: self.db_away.load(SeqCst),
            db_outages: self.db_outages.load(SeqCst),
        }
    }

    /// Whether a request to `node` that started under `before` may have failed to connect.
    fn explains_connection_error(&self, node: usize, before: Sky) -> bool {
        let now = self.sky(node);
        !before.node_up || !now.node_up || before.node_kills != now.node_kills
    }

    /// Whether a request to `node` that started under `before` may have been answered 503.
    fn explains_unavailable(&self, node: usize, before: Sky) -> bool {
        let now = self.sky(node);
        before.db_away || now.db_away || before.db_outages != now.db_outages
    }
}

#[derive(Default)]
struct Ledger {
    /// Codes whose confirm answered 200, once per reservation.
    confirmed: Vec<String>,
    /// Notification ids answered 202.
    accepted: Vec<i64>,
    /// Requests refused by a node that was down, by kind: connection errors, 503 while the database
    /// was away. Each was retried elsewhere.
    failovers: [u64; 2],
}

/// One request's outcome, after explained failures were told apart from unexplained ones.
enum Answer {
    Got(reqwest::Response),
    FailedOver,
}

/// Sends `request` to `node`: an explained failure is counted as a failover, an unexplained one
/// (a 5xx or a refused connection while the node and the database were up) fails the test.
async fn send(
    request: reqwest::RequestBuilder,
    node: usize,
    weather: &Weather,
    ledger: &Mutex<Ledger>,
    what: &str,
) -> Answer {
    let before = weather.sky(node);
    match request.send().await {
        Err(e) => {
            // Killed under the request, not listening yet, or stuck on the database while it was away.
            assert!(
                weather.explains_connection_error(node, before) || weather.explains_unavailable(node, before),
                "{what} on node {node} failed while the node and the database were up: {e}"
            );
            ledger.lock().unwrap().failovers[0] += 1;
        }
        Ok(r) if r.status() == 503 => {
            assert!(
                weather.explains_unavailable(node, before),
                "{what} on node {node} got 503 while the database was up: {}",
                r.text().await.unwrap_or_default()
            );
            ledger.lock().unwrap().failovers[1] += 1;
        }
        Ok(r) if r.status().is_server_error() => {
            panic!("{what} on node {node}: {} {}", r.status(), r.text().await.unwrap_or_default())
        }
        Ok(r) => return Answer::Got(r),
    }
    // A refused request is retried on another node after a pause, not in a tight loop.
    tokio::time::sleep(Duration::from_millis(50)).await;
    Answer::FailedOver
}

async fn client(
    ports: Vec<u16>,
    weather: Arc<Weather>,
    ledger: Arc<Mutex<Ledger>>,
    stop: Arc<AtomicBool>,
    key: String,
) {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::AUTHORIZATION, format!("Bearer {key}").parse().unwrap());
    let http = reqwest::Client::builder().default_headers(headers).timeout(Duration::from_secs(5)).build().unwrap();
    let pick = || rand::rng().random_range(0..ports.len());
    while !stop.load(SeqCst) {
        if rand::rng().random_bool(0.3) {
            let class = if rand::rng().random_bool(0.5) { "otp" } else { "transactional" };
            let body = json!({ "class": class, "tenant": "chaos", "recipient": "+84900000000", "payload": {} });
            let node = pick();
            let request = http.post(format!("http://127.0.0.1:{}/v1/notifications", ports[node])).json(&body);
            if let Answer::Got(r) = send(request, node, &weather, &ledger, "enqueue").await {
                assert_eq!(r.status(), 202, "enqueue: {}", r.text().await.unwrap_or_default());
                let id = r.json::<Value>().await.unwrap()["id"].as_i64().unwrap();
                ledger.lock().unwrap().accepted.push(id);
            }
            continue;
        }
        let node = pick();
        let request = http
            .post(format!("http://127.0.0.1:{}/v1/cif", ports[node]))
            .json(&json!({ "customer_type": "individual" }));
        let Answer::Got(r) = send(request, node, &weather, &ledger, "reserve").await else {
            continue;
        };
        assert_eq!(r.status(), 201, "reserve: {}", r.text().await.unwrap_or_default());
        let r: Value = r.json().await.unwrap();
        let (cif, token) =
            (r["cif"].as_str().unwrap().to_string(), r["reservation_token"].as_str().unwrap().to_string());
        // Confirm on any node, retrying through kills and the database's restart: the token is the
        // whole state, and a hold outlives both (its lease is minutes).
        let give_up = Instant::now() + CONFIRM_PATIENCE;
        loop {
            assert!(Instant::now() < give_up, "the confirm of {cif} never succeeded in {CONFIRM_PATIENCE:?}");
            let node = pick();
            let url = format!("http://127.0.0.1:{}/v1/cif/{cif}/confirm", ports[node]);
            let request = http.post(url).json(&json!({ "reservation_token": token }));
            if let Answer::Got(c) = send(request, node, &weather, &ledger, "confirm").await {
                assert_eq!(
                    c.status(),
                    200,
                    "confirm of {cif} with its own token: {}",
                    c.text().await.unwrap_or_default()
                );
                ledger.lock().unwrap().confirmed.push(cif.clone());
                break;
            }
        }
    }
}

/// Starts a node and waits until it is ready.
async fn start_node(node: &mut Node, db_url: &str, provider_url: &str, log: &std::path::Path) {
    node.child = Some(spawn_node(node.port, db_url, provider_url, log));
    let http = reqwest::Client::new();
    let ready = Instant::now() + Duration::from_secs(60);
    while http
        .get(format!("http://127.0.0.1:{}/readyz", node.port))
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .map(|r| r.status() != 200)
        .unwrap_or(true)
    {
        assert!(Instant::now() < ready, "node {} never became ready; see {}", node.port, log.display());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_nine_and_a_database_restart_lose_nothing_and_duplicate_nothing() {
    let base = std::env::temp_dir().join(format!("cifpool-chaos-{}", std::process::id()));
    create_server_owned_dir(&base).unwrap();
    let pg_options = EmbeddedOptions {
        data_dir: base.join("pg"),
        durable: false,
        max_connections: 200,
        remove_on_exit: None,
        settings: Vec::new(),
    };
    let mut pg = Some(EmbeddedPostgres::start(&pg_options).unwrap());
    let db_url = pg.as_ref().unwrap().url("postgres");
    let provider = fake_server(FakeBehaviour { latency_ms: 20, jitter_ms: 30, ..Default::default() }).await;
    let log = base.join("nodes.log");

    let mut nodes: Vec<Node> = (0..3).map(|_| Node { port: free_port(), child: None }).collect();
    for n in &mut nodes {
        start_node(n, &db_url, &provider.url, &log).await;
    }
    let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
    let weather = Arc::new(Weather {
        nodes: (0..nodes.len()).map(|_| (AtomicBool::new(true), AtomicU64::new(0))).collect(),
        db_away: AtomicBool::new(false),
        db_outages: AtomicU64::new(0),
    });

    let key = {
        let db = sqlx::PgPool::connect(&db_url).await.unwrap();
        let key = common::create_key(&db, &cifpool::auth::Scope::ALL, None).await;
        db.close().await;
        key
    };
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..6)
        .map(|_| tokio::spawn(client(ports.clone(), weather.clone(), ledger.clone(), stop.clone(), key.clone())))
        .collect();

    let started = Instant::now();
    let mut kills = 0;
    let mut db_restarted = false;
    while started.elapsed() < CHAOS {
        tokio::time::sleep(KILL_EVERY).await;
        let victim = rand::rng().random_range(0..nodes.len());
        weather.nodes[victim].0.store(false, SeqCst);
        weather.nodes[victim].1.fetch_add(1, SeqCst);
        if let Some(mut child) = nodes[victim].child.take() {
            child.kill().unwrap(); // SIGKILL: no graceful anything
            child.wait().unwrap();
            kills += 1;
        }
        let db_restart = !db_restarted && started.elapsed() > CHAOS / 2;
        if db_restart {
            weather.db_away.store(true, SeqCst);
            weather.db_outages.fetch_add(1, SeqCst);
            pg.take().unwrap().stop().unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
            pg = Some(EmbeddedPostgres::start(&pg_options).unwrap());
            db_restarted = true;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        start_node(&mut nodes[victim], &db_url, &provider.url, &log).await;
        weather.nodes[victim].0.store(true, SeqCst);
        if db_restart {
            // The other pods find out on their next use of a pooled connection; give them that use.
            tokio::time::sleep(DB_SETTLE).await;
            weather.db_away.store(false, SeqCst);
        }
    }
    stop.store(true, SeqCst);
    for c in clients {
        tokio::time::timeout(CONFIRM_PATIENCE + Duration::from_secs(10), c)
            .await
            .expect("a client did not stop")
            .unwrap();
    }

    // Let the surviving cluster finish every accepted notification (rescued leases included).
    let db = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&db_url).await.unwrap();
    let drained_by = Instant::now() + DRAIN;
    loop {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM notification_jobs WHERE status IN ('scheduled', 'pending', 'sending', 'failed-retrying')",
        )
        .fetch_one(&db)
        .await
        .unwrap();
        if open == 0 {
            break;
        }
        assert!(Instant::now() < drained_by, "{open} notifications still open after the drain period");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let ledger = std::mem::take(&mut *ledger.lock().unwrap());
    // No code confirmed twice: every successful confirm was for a different code.
    let distinct: HashSet<&String> = ledger.confirmed.iter().collect();
    assert_eq!(distinct.len(), ledger.confirmed.len(), "a code was confirmed by two reservations");
    assert!(ledger.confirmed.len() > 50, "too little traffic to mean anything: {}", ledger.confirmed.len());
    assert!(ledger.accepted.len() > 20, "too few notifications to mean anything: {}", ledger.accepted.len());
    // Each failover paused its client 50 ms: a client can fail over at most ~20 times a second while
    // something is down. Nodes are down ~1 s a kill (more with the database's restart).
    let failovers: u64 = ledger.failovers.iter().sum();
    let bound = 6 * 20 * (kills + 10);
    assert!(failovers <= bound, "{failovers} failovers for {kills} kills and one database restart (bound {bound})");
    let issued: HashSet<String> =
        sqlx::query_scalar("SELECT code FROM cif_issued").fetch_all(&db).await.unwrap().into_iter().collect();
    assert!(distinct.iter().all(|c| issued.contains(*c)), "a confirmed code is missing from cif_issued");

    // Every generated counter is in exactly one state.
    let pools: Vec<(i16, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT p.id, p.next_counter, \
                (SELECT count(*) FROM cif_codes c WHERE c.pool_id = p.id), \
                (SELECT count(*) FROM cif_issued i WHERE i.pool_id = p.id), \
                (SELECT count(*) FROM cif_codes c JOIN cif_issued i USING (pool_id, counter) WHERE c.pool_id = p.id) \
         FROM cif_pools p",
    )
    .fetch_all(&db)
    .await
    .unwrap();
    for (id, next, held, used, both) in pools {
        assert_eq!(both, 0, "pool {id}: a counter is both in the pool and issued");
        assert_eq!(next, held + used, "pool {id}: generated {next} but available+reserved {held} + used {used}");
    }

    // Every accepted notification finished, with exactly one result when sent, and the provider never
    // saw a job more often than it was attempted.
    let jobs: Vec<(i64, String, String, i32, i64)> = sqlx::query_as(
        "SELECT j.id, j.class, j.status, j.attempts, \
                (SELECT count(*) FROM notification_results r WHERE r.job_id = j.id) \
         FROM notification_jobs j",
    )
    .fetch_all(&db)
    .await
    .unwrap();
    let by_id: HashMap<i64, (String, String, i32, i64)> =
        jobs.into_iter().map(|(id, c, s, a, r)| (id, (c, s, a, r))).collect();
    for id in &ledger.accepted {
        assert!(by_id.contains_key(id), "accepted notification {id} is lost");
    }
    let mut duplicates = 0;
    for (id, (class, status, attempts, results)) in &by_id {
        // Nothing makes a send fail here (kills cost an attempt each, three at most for an OTP): every
        // job is sent, or an OTP whose 15 s deadline passed while its pod was down expired.
        assert!(
            status == "sent" || (status == "expired" && class == "otp"),
            "{class} job {id} ended {status} after {attempts} attempts"
        );
        assert_eq!(*results, i64::from(status == "sent"), "job {id} ({status}) has {results} result rows");
        let seen = provider.fake.deliveries_of(&id.to_string());
        assert!(seen <= (*attempts).max(0) as u32, "job {id}: provider saw it {seen} times in {attempts} attempts");
        if status == "sent" {
            assert!(seen >= 1, "job {id} is sent but the provider never saw it");
        }
        duplicates += u32::from(seen > 1);
    }
    let sent = by_id.values().filter(|v| v.1 == "sent").count();
    eprintln!(
        "chaos: {kills} kill -9, 1 database restart; {} codes confirmed, {} notifications accepted ({sent} sent, \
         {} jobs in all, {duplicates} delivered more than once), failovers: {} refused connections, {} 503s",
        ledger.confirmed.len(),
        ledger.accepted.len(),
        by_id.len(),
        ledger.failovers[0],
        ledger.failovers[1]
    );

    for n in &mut nodes {
        if let Some(mut child) = n.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
    db.close().await;
    pg.take().unwrap().stop().unwrap();
    let _ = std::fs::remove_dir_all(&base);
}
