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
