//! Pool upkeep under stress: a refill cut short never leaves its lock behind, and an empty pool does not
//! set off a refill per refused reservation.

use crate::common;

use std::time::{Duration, Instant};

use cifpool::internals::refill::{RefillOptions, RefillOutcome, refill};
use cifpool::internals::upkeep;
use common::{
    TEST_ADMIN_TOKEN, TestApp, TestDb, block_counter, fresh_database, spawn_passive_app, test_settings_with_pools,
    wait_for_a_lock_wait,
};
use sqlx::PgPool;

async fn passive() -> (TestDb, TestApp) {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    (db, app)
}

/// What a refill by another instance (its own connection pool) answers, waiting up to 5 s for it to
/// stop answering `busy`.
async fn other_instance_refill(url: &str, app: &TestApp) -> RefillOutcome {
    let other = PgPool::connect(url).await.unwrap();
    let pool = app.state.cif.pools().get("individual").unwrap();
    let by = Instant::now() + Duration::from_secs(5);
    loop {
        let outcome = refill(&other, pool, RefillOptions { force: true, ..Default::default() }).await.unwrap().outcome;
        if outcome != RefillOutcome::Busy || Instant::now() > by {
            return outcome;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_refill_dropped_while_it_holds_the_lock_does_not_leave_the_pool_busy() {
    let (db, app) = passive().await;
    let blocker = block_counter(&db.pool, "individual").await;
    let pool = app.state.cif.pools().get("individual").unwrap();
    // Drop the run only once it is waiting for the counter, that is, holding the pool's advisory lock.
    let mut running = Box::pin(refill(&app.state.db, pool, RefillOptions::default()));
    tokio::select! {
        done = &mut running => panic!("the refill finished while the counter was locked: {done:?}"),
        () = wait_for_a_lock_wait(&db.pool) => {}
    }
    drop(running);
    blocker.rollback().await.unwrap();
    // The dropped run's connection was the one holding the lock: it must not be back in the pool with it.
    assert_eq!(other_instance_refill(&db.url, &app).await, RefillOutcome::Refilled);
}

#[tokio::test]
async fn an_admin_refill_whose_client_gives_up_finishes_and_releases_the_lock() {
    let (db, app) = passive().await;
    let blocker = block_counter(&db.pool, "individual").await;
    let impatient = reqwest::Client::builder().timeout(Duration::from_millis(300)).build().unwrap();
    let r = impatient.post(app.url("/admin/pools/individual/refill")).bearer_auth(TEST_ADMIN_TOKEN).send().await;
    assert!(r.is_err_and(|e| e.is_timeout()), "the request should have timed out");
    // Its run goes on, waiting for the counter.
    wait_for_a_lock_wait(&db.pool).await;
    blocker.rollback().await.unwrap();
    // The run went on without its client and refilled the pool.
    let by = Instant::now() + Duration::from_secs(5);
    while sqlx::query_scalar::<_, i64>("SELECT count(*) FROM cif_codes").fetch_one(&db.pool).await.unwrap() == 0 {
        assert!(Instant::now() < by, "the admin refill did not finish after its client left");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(other_instance_refill(&db.url, &app).await, RefillOutcome::Refilled);
}

#[tokio::test]
async fn an_empty_pool_starts_one_refill_not_one_per_refused_reservation() {
    let (_db, app) = passive().await;
    let pool = app.state.cif.pools().get("business").unwrap();
    // A burst of reservations finding the pool empty, before any spawned task can run (this test's
    // runtime has one thread, and the loop does not yield).
    for _ in 0..1000 {
        upkeep::on_empty(&app.state.db, pool, &app.state.upkeep);
    }
    assert_eq!(app.state.upkeep.len(), 1, "refills started by 1000 empty answers");
    // The one refill fills the pool.
    let by = Instant::now() + Duration::from_secs(10);
    while !app.state.upkeep.is_empty() {
        assert!(Instant::now() < by, "the refill did not finish");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let available: i64 =
        sqlx::query_scalar("SELECT count(*) FROM cif_codes WHERE pool_id = $1 AND state = 'available'")
            .bind(pool.id)
            .fetch_one(&app.state.db)
            .await
            .unwrap();
    assert_eq!(available as u64, pool.settings.low_watermark);
}
