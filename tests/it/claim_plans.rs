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
    let mut conn = app.state.db.acquire().await.unwrap();
    for n in (5..=8).cycle().take(12) {
        let requests: Vec<Request> =
            (0..n).map(|_| Request { holder: Some("pod".into()), actor: actor.clone() }).collect();
        let held = reserve_many(&mut conn, pool, &requests).await.unwrap();
        assert!(held.iter().all(Option::is_some), "{held:?}");
    }
    drop(conn);
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

/// Inserts `n` waiting promo jobs over 20 tenants, fair keys 1 to `n` (ids too), and analyzes the table.
async fn waiting_promo_jobs(db: &sqlx::PgPool, n: i32) {
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts) \
         SELECT 'promo', 2, 't' || (g % 20), g, 'device', '{}', 5 FROM generate_series(1, $1) AS g",
    )
    .bind(n)
    .execute(db)
    .await
    .unwrap();
    sqlx::query("ANALYZE notification_jobs").execute(db).await.unwrap();
}

/// Promo as a claim takes it: a tenant cap of 1,000 (never reached here, whether the claim takes
/// the cap's lock or not) and all the room it wants.
fn promo_claim(cap_binds: bool) -> cifpool::internals::queue_store::ClaimClass {
    cifpool::internals::queue_store::ClaimClass {
        name: "promo".into(),
        priority: 2,
        tenant_cap: 1_000,
        cap_binds,
        provider: "push".into(),
        free: i32::MAX,
    }
}

/// The shared group of one class, claiming by priority.
fn shared_policy(class: &cifpool::internals::queue_store::ClaimClass) -> cifpool::queue::policy::GroupPolicy {
    use cifpool::queue::policy::{ClaimOrder, GroupPolicy};
    GroupPolicy { name: "shared".into(), size: 256, classes: vec![class.name.clone()], order: ClaimOrder::Priority }
}

/// A worker group's claim keeps one plan as well: its pick size is written into the statement (a
/// claim of 5 to 8 jobs runs the one that picks 8, of its [`PickSizes`]), so after the first five
/// executions on a connection Postgres reuses one plan. With the limit a parameter, as it was, every
/// claim of a drain was planned afresh (~1.3 ms of server CPU each).
#[tokio::test]
async fn queue_claims_reuse_one_plan_per_pick_size() {
    use cifpool::internals::queue_store::{Commit, PickSizes, claim, claim_sql};
    use cifpool::internals::seal::Seal;
    let db = fresh_database().await;
    waiting_promo_jobs(&db.pool, 20_000).await;
    // One connection: every claim runs on the session whose prepared statements are read below.
    let one = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&db.url).await.unwrap();
    let seal = Seal::new(&common::test_master_key(), "test", true);
    for capped in [true, false] {
        let class = promo_claim(capped);
        let policy = shared_policy(&class);
        let sizes = PickSizes::up_to(256);
        let sql = claim_sql(&policy, capped, sizes.sizes()[sizes.index_for(5)], Commit::Unflushed);
        assert!(sql.contains("LIMIT 8 FOR UPDATE SKIP LOCKED"), "{sql}");
        for n in (5..=8).cycle().take(12) {
            let got = claim(
                &one,
                &sql,
                n,
                std::time::Duration::from_secs(60),
                std::slice::from_ref(&class),
                &Default::default(),
                &seal,
            )
            .await
            .unwrap();
            assert_eq!(got.jobs.len(), n, "capped: {capped}");
        }
        let (generic, custom): (i64, i64) =
            sqlx::query_as("SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1")
                .bind(&sql)
                .fetch_one(&one)
                .await
                .unwrap();
        assert_eq!(generic + custom, 12, "capped: {capped}");
        assert!(
            custom <= 5 && generic >= 7,
            "capped: {capped}: {custom} claims planned afresh, {generic} on the kept plan"
        );
    }
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
    const COUNT: &str =
        "SELECT sum(inflight)::int8 FROM notification_jobs_in_flight('{promo}', '{50}', interval '30 seconds')";
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

/// A job counts as in flight while it is held: with its lease current, and expired but not yet swept,
/// up to a lease length (the count's last argument) past its expiry, not after.
#[tokio::test]
async fn a_lease_expired_for_longer_than_a_lease_no_longer_counts_as_in_flight() {
    let db = fresh_database().await;
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, status, \
                                        attempts, lease_token, lease_expires_at) \
         SELECT 'promo', 2, 't', s, 'device', '{}', 5, 'sending', 1, gen_random_uuid(), now() + s * interval '1 second' \
         FROM unnest(ARRAY[90, 60, 30, -10, -25, -45]) AS s",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let count = |expired_for_secs: f64| {
        sqlx::query_scalar::<_, i64>(
            "SELECT coalesce(sum(inflight), 0)::int8 \
             FROM notification_jobs_in_flight('{promo}', '{50}', $1::float8 * interval '1 second')",
        )
        .bind(expired_for_secs)
        .fetch_one(&db.pool)
    };
    assert_eq!(count(30.0).await.unwrap(), 5, "current, and expired 10 and 25 s ago");
    assert_eq!(count(60.0).await.unwrap(), 6);
    assert_eq!(count(0.0).await.unwrap(), 3, "current only");
}

/// Heap rows of `notification_jobs` read by table scans and index scans alike, as this connection
/// counts them: this transaction's and those of its earlier ones not yet reported to the server's
/// statistics (about once a second), so a caller takes the difference across what it measures.
async fn rows_read(tx: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_xact_user_tables \
         WHERE relname = 'notification_jobs'",
    )
    .fetch_one(tx)
    .await
    .unwrap()
}

/// Fills the queue as a quiet spell leaves it, 2,000 promo jobs sent and none waiting, has
/// autovacuum's ANALYZE see it so, then lets a burst of `burst` waiting promo jobs arrive.
async fn burst_after_a_quiet_analyze(db: &sqlx::PgPool, burst: i32) {
    const JOBS: &str = "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, \
                                                       max_attempts, status) \
                        SELECT 'promo', 2, 't' || (g % 100), g, 'device', '{}', 5, $2 \
                        FROM generate_series(1, $1) AS g";
    sqlx::query(JOBS).bind(2_000).bind("sent").execute(db).await.unwrap();
    sqlx::query("ANALYZE notification_jobs").execute(db).await.unwrap();
    sqlx::query(JOBS).bind(burst).bind("pending").execute(db).await.unwrap();
}

/// Heap rows of `notification_jobs` read by one claim of 64 promo jobs (the shared group's
/// statement, with the tenant cap's gate or without, in the transaction the service runs it in),
/// rolled back.
async fn rows_one_claim_reads(db: &sqlx::PgPool, capped: bool) -> i64 {
    use cifpool::internals::queue_store::{ClaimClass, Commit, claim_begin_sql, claim_sql};
    use cifpool::queue::policy::{ClaimOrder, GroupPolicy};
    let class = ClaimClass {
        name: "promo".into(),
        priority: 2,
        tenant_cap: 50,
        cap_binds: true,
        provider: "push".into(),
        free: i32::MAX,
    };
    let policy =
        GroupPolicy { name: "shared".into(), size: 1, classes: vec![class.name.clone()], order: ClaimOrder::Priority };
    let locked = if capped { vec![class.name.as_str()] } else { Vec::new() };
    let mut tx = db.begin_with(sqlx::AssertSqlSafe(claim_begin_sql(&locked))).await.unwrap();
    let before = rows_read(&mut tx).await;
    let claimed: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(claim_sql(&policy, capped, 64, Commit::Unflushed)))
        .bind(64_i64)
        .bind(30.0)
        .bind(vec![class.name.as_str()])
        .bind(vec![class.tenant_cap])
        .bind(vec![class.priority])
        .bind(vec![class.provider.as_str()])
        .bind(vec![class.free])
        .bind(vec![None::<f64>])
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 64, "capped: {capped}");
    let read = rows_read(&mut tx).await - before;
    tx.rollback().await.unwrap();
    read
}

/// Heap rows of `notification_jobs` read by intake's look for the due front of priority 2, rolled back.
async fn rows_the_due_front_reads(db: &sqlx::PgPool) -> i64 {
    use cifpool::internals::enqueue::{DueFronts, KeysWanted, reserve_fair_keys};
    let mut tx = db.begin().await.unwrap();
    let before = rows_read(&mut tx).await;
    let wanted = KeysWanted { tenant: "newcomer", count: 1, weight: 1.0 };
    let (first, _) = reserve_fair_keys(&mut tx, &DueFronts::default(), 2, &[wanted]).await.unwrap()[0];
    assert_eq!(first, 2.0, "one step past the front (1)");
    let read = rows_read(&mut tx).await - before;
    tx.rollback().await.unwrap();
    read
}

/// A burst into a queue whose statistics say nothing waits: intake's look for the due front reads
/// every waiting job (the planner thinks there are none, so reading them all looks as cheap as
/// stopping at the first). Claims do not: their transaction prices sorting out of the plan, so they
/// read the claim index in order (they read every waiting job too, and sorted them, until it did).
/// The next stats round sees the planner misled and analyzes the table; from then on the due front
/// is found in a few rows.
#[tokio::test]
async fn a_burst_after_a_quiet_analyze_is_claimed_from_the_front_and_the_next_stats_round_mends_intake() {
    use cifpool::internals::stats::{MISLED_BY, expected_waiting, misled};
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    burst_after_a_quiet_analyze(&db.pool, 20_000).await;
    let misled_estimate = expected_waiting(&db.pool, "promo").await.unwrap();
    assert!(misled_estimate * MISLED_BY < 20_000.0, "the planner expects {misled_estimate} waiting promo jobs");
    for capped in [false, true] {
        let read = rows_one_claim_reads(&db.pool, capped).await;
        // The 64 picked jobs, each read again by the update: 128. Every waiting job: over 20,000.
        assert!(read <= 200, "a claim of 64 read {read} jobs with the statistics misled (capped: {capped})");
    }
    let read = rows_the_due_front_reads(&db.pool).await;
    assert!(read >= 20_000, "the misled look for the due front read {read} waiting jobs");

    let (rt, stats) = (app.state.notifications.runtime(), app.state.notifications.stats());
    let analyzed = stats.refresh_now(&db.pool, rt).await.unwrap().expect("the round analyzes the table");
    assert_eq!((analyzed.class.as_str(), analyzed.counted), ("promo", 20_000));
    assert_eq!(analyzed.expected, misled_estimate);
    let expected = expected_waiting(&db.pool, "promo").await.unwrap();
    assert!(expected * MISLED_BY >= 20_000.0, "after ANALYZE the planner expects {expected}");
    for capped in [false, true] {
        let read = rows_one_claim_reads(&db.pool, capped).await;
        // The 64 picked jobs, each read again by the update: 128. Every waiting job: over 20,000.
        assert!(read <= 200, "a claim of 64 read {read} jobs (capped: {capped})");
    }
    let read = rows_the_due_front_reads(&db.pool).await;
    assert!(read <= 5, "looking for the due front read {read} waiting jobs");
    // The planner now sees them, and the next round is within the gap: it leaves the table alone.
    assert_eq!(misled(&db.pool, &[("promo".to_string(), 20_000)]).await.unwrap(), None);
    assert_eq!(stats.refresh_now(&db.pool, rt).await.unwrap(), None);
    app.stop().await;
}

/// An ANALYZE that cannot get the table's lock within its short wait (an autovacuum, here a held
/// lock of the same kind, stands in its way) gives up without using its turn: the round after the
/// lock is released analyzes.
#[tokio::test]
async fn an_analyze_kept_out_by_a_lock_is_tried_again_the_next_round() {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    burst_after_a_quiet_analyze(&db.pool, 20_000).await;
    let (rt, stats) = (app.state.notifications.runtime(), app.state.notifications.stats());
    let mut vacuum_like = db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE notification_jobs IN SHARE UPDATE EXCLUSIVE MODE")
        .execute(&mut *vacuum_like)
        .await
        .unwrap();
    assert_eq!(stats.refresh_now(&db.pool, rt).await.unwrap(), None, "the lock keeps the ANALYZE out");
    vacuum_like.rollback().await.unwrap();
    let analyzed = stats.refresh_now(&db.pool, rt).await.unwrap().expect("the next round analyzes");
    assert_eq!((analyzed.class.as_str(), analyzed.counted), ("promo", 20_000));
    app.stop().await;
}

/// A small burst is cheap to read whatever the plan: no ANALYZE for fewer than
/// [`WORTH_ANALYZING`](cifpool::internals::stats::WORTH_ANALYZING) waiting jobs.
#[tokio::test]
async fn a_small_burst_is_not_worth_an_analyze() {
    use cifpool::internals::stats::WORTH_ANALYZING;
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    burst_after_a_quiet_analyze(&db.pool, WORTH_ANALYZING as i32 - 1).await;
    let (rt, stats) = (app.state.notifications.runtime(), app.state.notifications.stats());
    assert_eq!(stats.refresh_now(&db.pool, rt).await.unwrap(), None);
    app.stop().await;
}

/// One class's backlog beside another class's finished jobs, freshly analyzed: the planner, reading
/// class and status together (migration 26), expects about as many waiting jobs as there are, so the
/// stats round does not analyze again. Taking the two apart it would expect about 900 of 12,000.
#[tokio::test]
async fn a_backlog_beside_another_class_s_history_is_not_analyzed_again() {
    use cifpool::internals::stats::{MISLED_BY, expected_waiting};
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, status) \
         SELECT 'transactional', 1, 't', g, 'device', '{}', 5, 'sent' FROM generate_series(1, 150000) AS g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts) \
         SELECT 'promo', 2, 't' || (g % 100), g, 'device', '{}', 5 FROM generate_series(1, 12000) AS g",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE notification_jobs").execute(&db.pool).await.unwrap();
    let expected = expected_waiting(&db.pool, "promo").await.unwrap();
    assert!(expected * MISLED_BY >= 12_000.0, "the planner expects {expected} waiting promo jobs");
    let (rt, stats) = (app.state.notifications.runtime(), app.state.notifications.stats());
    assert_eq!(stats.refresh_now(&db.pool, rt).await.unwrap(), None);
    app.stop().await;
}

/// Entries of the claim index (`notification_jobs_claim_priority`) handed out by its scans so far,
/// dead ones included, as the statistics count them once this session's own are flushed.
async fn claim_index_entries_read(conn: &mut sqlx::PgConnection) -> i64 {
    // The session flushes its counts when it goes idle after this statement.
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&mut *conn).await.unwrap();
    sqlx::query_scalar(
        "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'notification_jobs_claim_priority'",
    )
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Reserves one key for `tenant` at priority 2 in its own transaction on `conn`: its first key and
/// the claim index's entries the look for the front read.
async fn one_key(
    conn: &mut sqlx::PgConnection,
    fronts: &cifpool::internals::enqueue::DueFronts,
    tenant: &str,
) -> (f64, i64) {
    use cifpool::internals::enqueue::{KeysWanted, reserve_fair_keys};
    use sqlx::Connection;
    let before = claim_index_entries_read(conn).await;
    let mut tx = conn.begin().await.unwrap();
    let wanted = KeysWanted { tenant, count: 1, weight: 1.0 };
    let (first, _) = reserve_fair_keys(&mut tx, fronts, 2, &[wanted]).await.unwrap()[0];
    tx.commit().await.unwrap();
    (first, claim_index_entries_read(conn).await - before)
}

/// While a snapshot is held, the entries of claimed jobs stay in the claim index. Once the queue has
/// drained, intake's first look for the due front walks them and finds no due job; the front is then
/// the highest key this instance handed out, and the next look starts above them (it walked all of
/// them again, at every batch, until the snapshot went).
#[tokio::test]
async fn intake_walks_a_drained_queue_once_while_a_snapshot_is_held() {
    use cifpool::internals::enqueue::{DueFronts, KeysWanted, reserve_fair_keys};
    use sqlx::Connection;
    let db = fresh_database().await;
    let fronts = DueFronts::default();
    let mut conn = db.pool.acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let wanted = KeysWanted { tenant: "t", count: 2_000, weight: 1.0 };
    assert_eq!(reserve_fair_keys(&mut tx, &fronts, 2, &[wanted]).await.unwrap(), [(1.0, 1.0)]);
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, status) \
         SELECT 'promo', 2, 't', g, 'device', '{}', 5, 'pending' FROM generate_series(1, 2000) AS g",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    tx.commit().await.unwrap();
    // An analyst's session keeps a snapshot in which the 2,000 jobs still wait; then they are all sent.
    let mut analyst = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ").execute(&mut *analyst).await.unwrap();
    sqlx::query("SELECT 1 FROM notification_jobs LIMIT 1").execute(&mut *analyst).await.unwrap();
    sqlx::query("UPDATE notification_jobs SET status = 'sent', finished_at = now()").execute(&mut *conn).await.unwrap();

    let (first_a, walked) = one_key(&mut conn, &fronts, "a").await;
    assert!(walked >= 2_000, "the first look after the drain walks the sent jobs' entries ({walked})");
    assert_eq!(first_a, 2_001.0, "a newcomer to the drained queue starts after the last key handed out");
    let (first_b, walked) = one_key(&mut conn, &fronts, "b").await;
    assert!(walked <= 5, "the next look read {walked} entries");
    assert_eq!(first_b, 2_002.0);
    analyst.rollback().await.unwrap();
}

/// One reservation serves the tenants of a batch: each gets its own run of keys at its weight, from
/// the same front, and the answers come back in the order asked, whatever the order the clocks are
/// locked in.
#[tokio::test]
async fn one_reservation_keys_every_tenant_of_a_batch() {
    use cifpool::internals::enqueue::{DueFronts, KeysWanted, reserve_fair_keys};
    let db = fresh_database().await;
    let fronts = DueFronts::default();
    let mut conn = db.pool.acquire().await.unwrap();
    let wanted = |tenant, count, weight| KeysWanted { tenant, count, weight };
    let keys = reserve_fair_keys(&mut conn, &fronts, 2, &[wanted("zed", 3, 1.0), wanted("amy", 2, 2.0)]).await.unwrap();
    assert_eq!(keys, [(1.0, 1.0), (0.5, 0.5)], "zed takes 1, 2, 3; amy 0.5, 1");
    // Nothing was inserted, so no job is due: the front is the highest key handed out, 3.
    let keys = reserve_fair_keys(&mut conn, &fronts, 2, &[wanted("amy", 1, 2.0), wanted("zed", 1, 1.0)]).await.unwrap();
    assert_eq!(keys, [(3.5, 0.5), (4.0, 1.0)]);
    let clocks: Vec<(String, f64)> =
        sqlx::query_as("SELECT tenant, last_key FROM notification_tenant_clock WHERE priority = 2 ORDER BY tenant")
            .fetch_all(&mut *conn)
            .await
            .unwrap();
    assert_eq!(clocks, [("amy".to_string(), 3.5), ("zed".to_string(), 4.0)]);
}

/// While a snapshot is held, a claim from the head of a priority walks the claim index's entries of
/// every job claimed since; one that starts at its floor (the key of the first job the claim before it
/// took) reads from there only, and takes the jobs a claim from the head would.
#[tokio::test]
async fn a_claim_from_its_floor_skips_what_claims_took_while_a_snapshot_is_held() {
    use cifpool::internals::queue_store::{Commit, claim, claim_sql};
    use cifpool::internals::seal::Seal;
    use std::collections::BTreeMap;
    let db = fresh_database().await;
    waiting_promo_jobs(&db.pool, 3_000).await;
    let mut analyst = db.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ").execute(&mut *analyst).await.unwrap();
    sqlx::query("SELECT 1 FROM notification_jobs LIMIT 1").execute(&mut *analyst).await.unwrap();

    // One connection, whose index reads are counted around each claim.
    let one = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&db.url).await.unwrap();
    let seal = Seal::new(&common::test_master_key(), "test", true);
    let class = promo_claim(true);
    let policy = shared_policy(&class);
    let sql = claim_sql(&policy, true, 256, Commit::Unflushed);
    let claim_from = |floors: BTreeMap<i16, f64>| {
        let (one, sql, class, seal) = (&one, &sql, &class, &seal);
        async move {
            let before = claim_index_entries_read(&mut one.acquire().await.unwrap()).await;
            let claimed =
                claim(one, sql, 250, std::time::Duration::from_secs(60), std::slice::from_ref(class), &floors, seal)
                    .await
                    .unwrap();
            let walked = claim_index_entries_read(&mut one.acquire().await.unwrap()).await - before;
            let mut ids: Vec<i64> = claimed.jobs.iter().map(|j| j.id).collect();
            ids.sort_unstable();
            (ids, claimed.starts, walked)
        }
    };
    for n in 0..8 {
        let (ids, starts, _) = claim_from(BTreeMap::new()).await;
        assert_eq!(ids, (n * 250 + 1..=n * 250 + 250).collect::<Vec<i64>>());
        assert_eq!(starts, BTreeMap::from([(2, (n * 250 + 1) as f64)]));
    }
    let (ids, starts, walked) = claim_from(BTreeMap::new()).await;
    assert_eq!(ids, (2_001..=2_250).collect::<Vec<i64>>());
    assert!(walked >= 2_250, "from the head: {walked} entries read");
    let (ids, _, walked) = claim_from(starts).await;
    assert_eq!(ids, (2_251..=2_500).collect::<Vec<i64>>(), "from the floor, the same order");
    assert!((250..=600).contains(&walked), "from the floor: {walked} entries read");
    analyst.rollback().await.unwrap();
}
