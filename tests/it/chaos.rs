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
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cifpool::db::embedded::{EmbeddedOptions, EmbeddedPostgres, create_server_owned_dir};
use cifpool::queue::fake_provider::FakeBehaviour;
use common::{TEST_ADMIN_TOKEN, fake_server, serve_command};
use rand::Rng;
use serde_json::{Value, json};

/// How long the chaos lasts.
const CHAOS: Duration = Duration::from_secs(30);
/// A process is killed this often.
const KILL_EVERY: Duration = Duration::from_secs(3);
/// Longest wait for the queue to drain afterwards.
const DRAIN: Duration = Duration::from_secs(90);

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

#[derive(Default)]
struct Ledger {
    /// Codes whose confirm answered 200, once per reservation.
    confirmed: Vec<String>,
    /// Notification ids answered 202.
    accepted: Vec<i64>,
    /// Requests that failed on a dead node (retried elsewhere).
    failovers: u64,
}

async fn client(ports: Vec<u16>, ledger: Arc<Mutex<Ledger>>, stop: Arc<std::sync::atomic::AtomicBool>, key: String) {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert(reqwest::header::AUTHORIZATION, format!("Bearer {key}").parse().unwrap());
    let http = reqwest::Client::builder().default_headers(headers).timeout(Duration::from_secs(5)).build().unwrap();
    let pick = || ports[rand::rng().random_range(0..ports.len())];
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let enqueue = rand::rng().random_bool(0.3);
        if enqueue {
            let class = if rand::rng().random_bool(0.5) { "otp" } else { "transactional" };
            let body = json!({ "class": class, "tenant": "chaos", "recipient": "+84900000000", "payload": {} });
            match http.post(format!("http://127.0.0.1:{}/v1/notifications", pick())).json(&body).send().await {
                Ok(r) if r.status() == 202 => {
                    let id = r.json::<Value>().await.unwrap()["id"].as_i64().unwrap();
                    ledger.lock().unwrap().accepted.push(id);
                }
                _ => ledger.lock().unwrap().failovers += 1,
            }
            continue;
        }
        let reserved = http
            .post(format!("http://127.0.0.1:{}/v1/cif", pick()))
            .json(&json!({ "customer_type": "individual" }))
            .send()
            .await;
        let Ok(r) = reserved else {
            ledger.lock().unwrap().failovers += 1;
            continue;
        };
        if r.status() != 201 {
            continue;
        }
        let r: Value = r.json().await.unwrap();
        let (cif, token) =
            (r["cif"].as_str().unwrap().to_string(), r["reservation_token"].as_str().unwrap().to_string());
        // Confirm on any node, retrying through kills: the token is the whole state.
        for _ in 0..50 {
            let url = format!("http://127.0.0.1:{}/v1/cif/{cif}/confirm", pick());
            match http.post(url).json(&json!({ "reservation_token": token })).send().await {
                Ok(c) if c.status() == 200 => {
                    ledger.lock().unwrap().confirmed.push(cif.clone());
                    break;
                }
                Ok(c) if c.status() == 409 => panic!("confirm of {cif} with its own token got 409"),
                _ => {
                    ledger.lock().unwrap().failovers += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
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
        n.child = Some(spawn_node(n.port, &db_url, &provider.url, &log));
    }
    let ports: Vec<u16> = nodes.iter().map(|n| n.port).collect();
    let http = reqwest::Client::new();
    let ready = Instant::now() + Duration::from_secs(60);
    for port in &ports {
        while http
            .get(format!("http://127.0.0.1:{port}/readyz"))
            .send()
            .await
            .map(|r| r.status() != 200)
            .unwrap_or(true)
        {
            assert!(Instant::now() < ready, "node {port} never became ready; see {}", log.display());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    let key = {
        let db = sqlx::PgPool::connect(&db_url).await.unwrap();
        let key = common::create_key(&db, &cifpool::auth::Scope::ALL, None).await;
        db.close().await;
        key
    };
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let clients: Vec<_> =
        (0..6).map(|_| tokio::spawn(client(ports.clone(), ledger.clone(), stop.clone(), key.clone()))).collect();

    let started = Instant::now();
    let mut kills = 0;
    let mut db_restarted = false;
    while started.elapsed() < CHAOS {
        tokio::time::sleep(KILL_EVERY).await;
        let victim = rand::rng().random_range(0..nodes.len());
        if let Some(mut child) = nodes[victim].child.take() {
            child.kill().unwrap(); // SIGKILL: no graceful anything
            child.wait().unwrap();
            kills += 1;
        }
        if !db_restarted && started.elapsed() > CHAOS / 2 {
            pg.take().unwrap().stop().unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
            pg = Some(EmbeddedPostgres::start(&pg_options).unwrap());
            db_restarted = true;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        nodes[victim].child = Some(spawn_node(nodes[victim].port, &db_url, &provider.url, &log));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
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
    let jobs: Vec<(i64, String, i32, i64)> = sqlx::query_as(
        "SELECT j.id, j.status, j.attempts, (SELECT count(*) FROM notification_results r WHERE r.job_id = j.id) \
         FROM notification_jobs j",
    )
    .fetch_all(&db)
    .await
    .unwrap();
    let by_id: HashMap<i64, (String, i32, i64)> = jobs.into_iter().map(|(id, s, a, r)| (id, (s, a, r))).collect();
    for id in &ledger.accepted {
        assert!(by_id.contains_key(id), "accepted notification {id} is lost");
    }
    let mut duplicates = 0;
    for (id, (status, attempts, results)) in &by_id {
        assert!(["sent", "dead", "expired"].contains(&status.as_str()), "job {id} ended {status}");
        assert_eq!(*results, i64::from(status == "sent"), "job {id} ({status}) has {results} result rows");
        let seen = provider.fake.deliveries_of(&id.to_string());
        assert!(seen <= (*attempts).max(0) as u32, "job {id}: provider saw it {seen} times in {attempts} attempts");
        if status == "sent" {
            assert!(seen >= 1, "job {id} is sent but the provider never saw it");
        }
        duplicates += u32::from(seen > 1);
    }
    let sent = by_id.values().filter(|v| v.0 == "sent").count();
    eprintln!(
        "chaos: {kills} kill -9, 1 database restart; {} codes confirmed, {} notifications accepted ({sent} sent, \
         {} jobs in all, {duplicates} delivered more than once), {} failed-over requests",
        ledger.confirmed.len(),
        ledger.accepted.len(),
        by_id.len(),
        ledger.failovers
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
