//! Claims that Postgres plans once per connection: a reservation's claim, alone or shared, has its
//! limit written into the statement, so after the server's first few executions it reuses one plan
//! instead of planning every claim again (which cost about as much as running it).

use crate::common;

use cifpool::audit::Actor;
use cifpool::internals::refill::{RefillOptions, refill};
use cifpool::internals::reservations::{Request, Reserved, reserve_many, reserve_sql};
use common::{fresh_database, spawn_passive_app, test_settings_with_pools};

#[tokio::test]
async fn reservations_reuse_one_plan_of_their_claim() {
    let db = fresh_database().await;
    let mut settings = test_settings_with_pools(&db.url);
    // One connection: every reservation runs on the session whose prepared statements are read below.
    settings.database.max_connections = 1;
    settings.database.min_connections = 0;
    // A pool of 100,000 codes, analyzed: on a table that small the plan for a tenth of it still looks
    // cheap, and the difference would not show.
    settings.pools[0].batch_size = 25_000;
    let app = spawn_passive_app(settings).await;
    let pool = app.state.cif.pools().get("individual").unwrap();
    refill(&db.pool, pool, RefillOptions { force: true, ..Default::default() }).await.unwrap();
    sqlx::query("ANALYZE cif_codes").execute(&db.pool).await.unwrap();

    let actor = Actor { name: "planner".into(), request_id: None, client_request_id: None };
    for i in 0..12 {
        let held = app.state.cif.reserve("individual", Some("pod"), None, &actor).await.unwrap();
        assert!(matches!(held, Reserved::Created(_)), "reservation {i}: {held:?}");
    }
    let (generic, custom): (i64, i64) =
        sqlx::query_as("SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1")
            .bind(reserve_sql())
            .fetch_one(&app.state.db)
            .await
            .unwrap();
    // Postgres plans a prepared statement afresh for its first five executions, then keeps the
    // generic plan if it looks no dearer.
    assert_eq!(generic + custom, 12);
    assert!(custom <= 5 && generic >= 7, "{custom} executions planned afresh, {generic} on the kept plan");

    // Shared claims for 5 to 8 waiting reservations run the statement of size 8.
    for n in (5..=8).cycle().take(12) {
        let requests: Vec<Request> =
            (0..n).map(|_| Request { holder: Some("pod".into()), actor: actor.clone() }).collect();
        let held = reserve_many(&app.state.db, pool, &requests).await.unwrap();
        assert!(held.iter().all(Option::is_some), "{held:?}");
    }
    let plans: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements \
         WHERE statement LIKE '%LIMIT 8 FOR UPDATE SKIP LOCKED%' AND statement NOT LIKE '%pg_prepared_statements%'",
    )
    .fetch_all(&app.state.db)
    .await
    .unwrap();
    assert_eq!(plans.len(), 1, "one statement of size 8: {plans:?}");
    let (generic, custom) = plans[0];
    assert_eq!(generic + custom, 12);
    assert!(custom <= 5 && generic >= 7, "{custom} shared claims planned afresh, {generic} on the kept plan");
    app.stop().await;
}

/// Table scans of `notification_jobs` this transaction has made.
async fn table_scans(tx: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar("SELECT coalesce(seq_scan, 0) FROM pg_stat_xact_user_tables WHERE relname = 'notification_jobs'")
        .fetch_one(tx)
        .await
        .unwrap()
}

/// The in-flight count runs under a capped class's claim lock with a plan kept for the connection's
/// life. One made while every row was in flight (where a table scan is cheapest) must not stay a scan
/// of the whole table once 20,000 waiting jobs have arrived.
#[tokio::test]
async fn the_in_flight_count_never_scans_the_whole_table() {
    let db = fresh_database().await;
    let mut conn = db.pool.acquire().await.unwrap();
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, status, \
                                        attempts, lease_token, lease_expires_at) \
         SELECT 'promo', 2, 't' || (g % 10), g, 'device', '{}', 5, 'sending', 1, gen_random_uuid(), \
                now() + interval '30 seconds' \
         FROM generate_series(1, 50) AS g",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    sqlx::query("ANALYZE notification_jobs").execute(&mut *conn).await.unwrap();
    const COUNT: &str = "SELECT sum(inflight)::int8 FROM notification_jobs_in_flight('{promo}', '{50}', 0)";
    // Past the plan cache's first five executions, so the connection keeps one plan.
    for _ in 0..8 {
        let n: i64 = sqlx::query_scalar(COUNT).fetch_one(&mut *conn).await.unwrap();
        assert_eq!(n, 50);
    }
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts) \
         SELECT 'promo', 2, 't' || (g % 10), 100 + g, 'device', '{}', 5 FROM generate_series(1, 20000) AS g",
    )
    .execute(&mut *conn)
    .await
    .unwrap();

    let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
    let n: i64 = sqlx::query_scalar(COUNT).fetch_one(&mut *tx).await.unwrap();
    assert_eq!(n, 50);
    assert_eq!(table_scans(&mut tx).await, 0, "the in-flight count read the whole table");
}
