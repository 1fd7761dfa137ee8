//! Reservations that arrive together share one claim statement, and each still gets its own code,
//! token, holder and audit row; idempotency keys keep their own transaction.

use crate::common;

use std::collections::HashSet;

use cifpool::audit::Actor;
use cifpool::internals::refill::{RefillOptions, refill};
use cifpool::internals::reservations::{KEPT_CONNECTION_LINGER, KeptConnection, Lent, Request, Reserved, reserve_many};
use common::{fresh_database, spawn_passive_app, test_settings_with_pools};
use serde_json::json;

fn actor(i: usize) -> Actor {
    Actor {
        name: format!("caller-{i}"),
        request_id: Some(format!("req-{i}")),
        client_request_id: Some(format!("client-{i}")),
    }
}

#[tokio::test]
async fn one_statement_reserves_for_many_each_with_its_own_holder_token_and_audit_row() {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    let pool = app.state.cif.pools().get("individual").unwrap();
    refill(&db.pool, pool, RefillOptions { force: true, ..Default::default() }).await.unwrap();
    let requests: Vec<Request> =
        (0..5).map(|i| Request { holder: Some(format!("pod-{i}")), actor: actor(i) }).collect();
    let held = reserve_many(&mut db.pool.acquire().await.unwrap(), pool, &requests).await.unwrap();
    assert_eq!(held.len(), 5);
    let held: Vec<_> = held.into_iter().map(|r| r.expect("the pool has codes")).collect();
    assert_eq!(held.iter().map(|r| &r.cif).collect::<HashSet<_>>().len(), 5, "distinct codes");
    assert_eq!(held.iter().map(|r| r.reservation_token).collect::<HashSet<_>>().len(), 5, "distinct tokens");
    for (i, r) in held.iter().enumerate() {
        let (holder, token): (Option<String>, uuid::Uuid) =
            sqlx::query_as("SELECT holder, lease_token FROM cif_codes WHERE code = $1 AND state = 'reserved'")
                .bind(&r.cif)
                .fetch_one(&db.pool)
                .await
                .unwrap();
        assert_eq!((holder.as_deref(), token), (Some(format!("pod-{i}").as_str()), r.reservation_token));
        let (actor, request_id, client_request_id, audit_holder): (
            String,
            Option<String>,
            Option<String>,
            Option<String>,
        ) = sqlx::query_as(
            "SELECT actor, request_id, client_request_id, holder FROM audit_events \
             WHERE action = 'cif.reserved' AND cif = $1",
        )
        .bind(&r.cif)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        assert_eq!(
            (actor, request_id, client_request_id, audit_holder),
            (format!("caller-{i}"), Some(format!("req-{i}")), Some(format!("client-{i}")), Some(format!("pod-{i}")))
        );
    }

    // With fewer codes left than requests, the first requests get them and the rest get none.
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM cif_codes WHERE pool_id = $1 AND state = 'available'")
        .bind(pool.id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let requests: Vec<Request> = (0..left as usize + 3).map(|i| Request { holder: None, actor: actor(i) }).collect();
    let held = reserve_many(&mut db.pool.acquire().await.unwrap(), pool, &requests).await.unwrap();
    assert!(held[..left as usize].iter().all(Option::is_some));
    assert!(held[left as usize..].iter().all(Option::is_none));
}

/// Reads `cifpool_reservation_batch_size_{count,sum}` for `pool` from the process's recorder.
fn batch_statements(pool: &str) -> (f64, f64) {
    let text = cifpool::telemetry::metrics_handle().render();
    let read = |name: &str| {
        let prefix = format!("{name}{{pool=\"{pool}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&prefix)).map_or(0.0, |v| v.parse().unwrap())
    };
    (read("cifpool_reservation_batch_size_count"), read("cifpool_reservation_batch_size_sum"))
}

#[tokio::test]
async fn sixty_four_reservations_at_once_share_a_statement_and_get_distinct_codes() {
    let db = fresh_database().await;
    // A pool of its own: the batch-size series are the process's, and other tests reserve from
    // "coalescing" at the same time.
    let mut settings = test_settings_with_pools(&db.url);
    settings.pools[1] = common::test_pool("coalescing", "2");
    let app = spawn_passive_app(settings).await;
    let pool = app.state.cif.pools().get("coalescing").unwrap();
    refill(&db.pool, pool, RefillOptions { force: true, ..Default::default() }).await.unwrap();
    let (statements_before, reservations_before) = batch_statements("coalescing");
    // Each request is polled once before the runtime runs anything else: the first finds no statement
    // running and claims alone, the other 63 join the queue before any flusher wakes, and the flusher
    // that wakes first takes them all at once. So 64 reservations make exactly two statements. The
    // codes' table is locked meanwhile, so that the first claim cannot finish within its first poll
    // (on a fast local socket its whole round trip can) and leave the second to claim alone as well.
    let mut lock = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE cif_codes IN SHARE MODE").execute(&mut *lock).await.unwrap();
    let mut reservations: Vec<_> = (0..64)
        .map(|i| {
            let actor = actor(i);
            let app = &app;
            Box::pin(async move { app.state.cif.reserve("coalescing", Some("pod"), None, &actor).await })
        })
        .collect();
    for reservation in &mut reservations {
        assert!(futures_util::poll!(reservation.as_mut()).is_pending(), "a claim finished while its table was locked");
    }
    lock.rollback().await.unwrap();
    let results = futures_util::future::join_all(reservations).await;
    let codes: HashSet<String> = results
        .into_iter()
        .map(|r| match r.unwrap() {
            Reserved::Created(r) => r.cif,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(codes.len(), 64);
    let (statements, reservations) = batch_statements("coalescing");
    assert_eq!(reservations - reservations_before, 64.0);
    let shared = statements - statements_before;
    assert_eq!(shared, 2.0, "statements for 64 reservations: one alone, one for the 63 queued behind it");
    let audited: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT request_id) FROM audit_events WHERE action = 'cif.reserved' AND pool = 'coalescing'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(audited, 64, "one audit row per reservation, with its own request id");
    // A flusher keeps its connection only while requests keep coming: with none for its linger, every
    // connection of the service's pool is back in it (handing one back is a round trip, hence the wait).
    let service_db = &app.state.db;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while service_db.num_idle() < service_db.size() as usize {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {} connections still out of the pool with no request waiting",
            service_db.size() as usize - service_db.num_idle(),
            service_db.size()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn sixty_four_concurrent_requests_with_sixteen_shared_keys_get_exactly_sixteen_codes() {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    let pool = app.state.cif.pools().get("individual").unwrap();
    refill(&db.pool, pool, RefillOptions { force: true, ..Default::default() }).await.unwrap();
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let (client, url) = (app.client.clone(), app.url("/v1/cif"));
            tokio::spawn(async move {
                let r = client
                    .post(url)
                    .header("idempotency-key", format!("onboarding-{}", i % 16))
                    .json(&json!({ "customer_type": "individual" }))
                    .send()
                    .await
                    .unwrap();
                assert!(r.status() == 201 || r.status() == 200, "{}", r.status());
                let body: serde_json::Value = r.json().await.unwrap();
                (i % 16, body["cif"].as_str().unwrap().to_string())
            })
        })
        .collect();
    let mut by_key = std::collections::HashMap::<usize, HashSet<String>>::new();
    for t in tasks {
        let (key, cif) = common::joined(t).await;
        by_key.entry(key).or_default().insert(cif);
    }
    assert_eq!(by_key.len(), 16);
    assert!(by_key.values().all(|codes| codes.len() == 1), "one code per key: {by_key:?}");
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM cif_codes WHERE pool_id = $1 AND state = 'reserved'")
        .bind(pool.id)
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(held, 16, "exactly sixteen codes held");
}

async fn backend_of(lent: &mut Lent) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *lent.conn).await.unwrap()
}

#[tokio::test]
async fn a_lone_claims_connection_serves_the_next_one_and_goes_back_to_the_pool_once_unused() {
    let db = fresh_database().await;
    // Three idle connections in the pool, which hands out the one idle longest: a connection handed
    // back and taken again would be another one.
    let opened: Vec<_> = futures_util::future::try_join_all((0..3).map(|_| db.pool.acquire())).await.unwrap();
    drop(opened);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while db.pool.num_idle() < 3 {
        assert!(std::time::Instant::now() < deadline, "the three connections never came back");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let kept = KeptConnection::start();
    let mut first = kept.lend(&db.pool).await.unwrap();
    let backend = backend_of(&mut first).await;
    kept.keep(first);
    let mut second = kept.lend(&db.pool).await.unwrap();
    assert_eq!(backend_of(&mut second).await, backend, "the next lone claim runs on the kept connection");
    kept.keep(second);
    let kept_at = std::time::Instant::now();
    assert_eq!(db.pool.num_idle(), 2, "the kept connection is out of the pool");
    while db.pool.num_idle() < 3 {
        assert!(std::time::Instant::now() < deadline, "the kept connection never went back to the pool");
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    assert!(kept_at.elapsed() >= KEPT_CONNECTION_LINGER, "handed back only once unused for its linger");
    let mut third = kept.lend(&db.pool).await.unwrap();
    assert_ne!(backend_of(&mut third).await, backend, "once handed back, the next lone claim takes one from the pool");
}
