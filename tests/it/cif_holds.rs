//! The life of a hold at its edges: a lease that has run out but was not reclaimed yet, a confirm and
//! a reclaim racing for one code, the idempotency window, a pool whose codes are all generated, and the
//! schedules that refill and reclaim without anyone asking.

use crate::common;

use std::time::{Duration, Instant};

use cifpool::audit::Actor;
use cifpool::internals::reclaim;
use cifpool::internals::refill::{RefillOptions, RefillOutcome, refill};
use common::{TEST_ADMIN_TOKEN, TestApp, fresh_database, spawn_app_with, test_settings_with_pools};
use serde_json::{Value, json};

use crate::cif_api::{count, fill, passive, pool, post_token, reserve, reserve_ok};

/// Moves the lease of hold `cif` to `seconds` from now (negative: into the past).
async fn set_lease(app: &TestApp, cif: &str, seconds: f64) {
    sqlx::query("UPDATE cif_codes SET lease_expires_at = now() + make_interval(secs => $2) WHERE code = $1")
        .bind(cif)
        .bind(seconds)
        .execute(&app.state.db)
        .await
        .unwrap();
}

async fn state_of(app: &TestApp, cif: &str) -> Value {
    app.client.get(app.url(&format!("/v1/cif/{cif}"))).send().await.unwrap().json().await.unwrap()
}

async fn reclaim_now(app: &TestApp) -> u64 {
    reclaim::reclaim(&app.state.db, app.state.cif.pools(), None, &Actor::system()).await.unwrap().total
}

/// Audit rows of `action` about `cif` after audit row `after`.
async fn audited(app: &TestApp, action: &str, cif: &str, after: i64) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE action = $1 AND cif = $2 AND id > $3")
        .bind(action)
        .bind(cif)
        .bind(after)
        .fetch_one(&app.state.db)
        .await
        .unwrap()
}

/// A hold whose lease has run out is still the holder's until a reclaim run takes it: extend renews it
/// and confirm issues it, and the reclaim that comes later finds nothing to take.
#[tokio::test]
async fn a_lapsed_hold_can_be_extended_or_confirmed_until_reclaim_runs() {
    let (_db, app) = passive().await;
    fill(&app, "individual").await;

    let first = reserve_ok(&app, "individual").await;
    let (cif, token) = (first["cif"].as_str().unwrap(), first["reservation_token"].as_str().unwrap());
    set_lease(&app, cif, -1.0).await;
    let shown = state_of(&app, cif).await;
    assert_eq!(shown["state"], "reserved", "{shown}");
    let extended = post_token(&app, cif, "extend", token).await;
    assert_eq!(extended.status(), 200);
    let until: chrono::DateTime<chrono::Utc> =
        extended.json::<Value>().await.unwrap()["lease_expires_at"].as_str().unwrap().parse().unwrap();
    assert!(until > chrono::Utc::now() + chrono::Duration::seconds(60), "extend renewed a lapsed lease to {until}");
    assert_eq!(reclaim_now(&app).await, 0, "an extended hold is not reclaimed");
    assert_eq!(post_token(&app, cif, "confirm", token).await.status(), 200);

    let second = reserve_ok(&app, "individual").await;
    let (cif, token) = (second["cif"].as_str().unwrap(), second["reservation_token"].as_str().unwrap());
    set_lease(&app, cif, -1.0).await;
    assert_eq!(post_token(&app, cif, "confirm", token).await.status(), 200, "confirmed after the lease ran out");
    assert_eq!(reclaim_now(&app).await, 0, "a confirmed code is not reclaimed");
    assert_eq!(state_of(&app, cif).await["state"], "used");
}

/// A reclaim never takes a code a confirm is working on (it skips the locked row), and a confirm
/// that comes after a reclaim took the code is refused: never both, never neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirm_and_a_reclaim_racing_for_one_code_never_both_win() {
    let (db, app) = passive().await;
    fill(&app, "individual").await;

    // The confirm holds the row (a blocker stands in for its statement): the reclaim passes it by.
    let held = reserve_ok(&app, "individual").await;
    let (cif, token) = (held["cif"].as_str().unwrap().to_string(), held["reservation_token"].as_str().unwrap());
    set_lease(&app, &cif, -1.0).await;
    let mut blocker = db.pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM cif_codes WHERE code = $1 FOR UPDATE").bind(&cif).execute(&mut *blocker).await.unwrap();
    assert_eq!(reclaim_now(&app).await, 0, "reclaim took a row another statement held");
    blocker.rollback().await.unwrap();
    assert_eq!(post_token(&app, &cif, "confirm", token).await.status(), 200);

    // The reclaim holds the row (its update, uncommitted): the confirm waits for it, then is refused.
    let held = reserve_ok(&app, "individual").await;
    let (cif, token) =
        (held["cif"].as_str().unwrap().to_string(), held["reservation_token"].as_str().unwrap().to_string());
    let mut reclaiming = db.pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE cif_codes SET state = 'available', lease_token = NULL, lease_expires_at = NULL, holder = NULL \
         WHERE code = $1",
    )
    .bind(&cif)
    .execute(&mut *reclaiming)
    .await
    .unwrap();
    let confirm = tokio::spawn({
        let (client, url) = (app.client.clone(), app.url(&format!("/v1/cif/{cif}/confirm")));
        async move { client.post(url).json(&json!({ "reservation_token": token })).send().await.unwrap().status() }
    });
    common::wait_for_a_lock_wait(&db.pool).await;
    reclaiming.commit().await.unwrap();
    assert_eq!(common::joined(confirm).await, 409, "a confirm after the code went back must be refused");
    assert_eq!(count(&db.pool, &format!("SELECT count(*) FROM cif_issued WHERE code = '{cif}'")).await, 0);

    // Both at once, many times: exactly one of them wins each code.
    for _ in 0..20 {
        // A code reclaimed in an earlier round may be held again: count this round's rows only.
        let after = count(&db.pool, "SELECT coalesce(max(id), 0) FROM audit_events").await;
        let held = reserve_ok(&app, "individual").await;
        let (cif, token) =
            (held["cif"].as_str().unwrap().to_string(), held["reservation_token"].as_str().unwrap().to_string());
        set_lease(&app, &cif, -1.0).await;
        let (confirmed, reclaimed) = tokio::join!(
            app.client
                .post(app.url(&format!("/v1/cif/{cif}/confirm")))
                .json(&json!({ "reservation_token": token }))
                .send(),
            reclaim_now(&app)
        );
        let confirmed = confirmed.unwrap().status().as_u16();
        match (confirmed, reclaimed) {
            (200, 0) => assert_eq!(state_of(&app, &cif).await["state"], "used"),
            (409, 1) => assert_eq!(state_of(&app, &cif).await["state"], "available"),
            other => panic!("confirm and reclaim of {cif}: {other:?}"),
        }
        let winners =
            audited(&app, "cif.confirmed", &cif, after).await + audited(&app, "cif.reclaimed", &cif, after).await;
        assert_eq!(winners, 1, "{cif}: one audit row for the one winner");
    }
}

async fn reserve_with_key(app: &TestApp, key: &str) -> (u16, Value) {
    let r = app
        .client
        .post(app.url("/v1/cif"))
        .header("Idempotency-Key", key)
        .json(&json!({ "customer_type": "individual" }))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// An Idempotency-Key replays its reservation for 24 hours and not after: an older key starts a new
/// reservation even before reclaim has deleted it, and reclaim deletes exactly the expired keys.
#[tokio::test]
async fn an_idempotency_key_replays_for_twenty_four_hours_and_is_purged_after() {
    let (db, app) = passive().await;
    fill(&app, "individual").await;
    let (status, first) = reserve_with_key(&app, "application-7").await;
    assert_eq!(status, 201);
    let age = |interval: &'static str| {
        let pool = db.pool.clone();
        async move {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "UPDATE cif_idempotency SET created_at = now() - interval '{interval}'"
            )))
            .execute(&pool)
            .await
            .unwrap();
        }
    };

    age("23 hours 59 minutes").await;
    let (status, again) = reserve_with_key(&app, "application-7").await;
    assert_eq!((status, &again), (200, &first), "within the window: the same reservation");
    let summary = reclaim::reclaim(&db.pool, app.state.cif.pools(), None, &Actor::system()).await.unwrap();
    assert_eq!(summary.idempotency_purged, 0, "a key inside its window is kept");

    age("24 hours 1 second").await;
    let (status, fresh) = reserve_with_key(&app, "application-7").await;
    assert_eq!(status, 201, "past the window the key is forgotten: {fresh}");
    assert_ne!(fresh["cif"], first["cif"]);
    assert_eq!(state_of(&app, first["cif"].as_str().unwrap()).await["state"], "reserved", "the first hold stays");
    let (status, replayed) = reserve_with_key(&app, "application-7").await;
    assert_eq!((status, &replayed), (200, &fresh), "the key now names the new reservation");

    // Reclaim deletes the keys past the window, and only those.
    reserve_with_key(&app, "application-8").await;
    sqlx::query(
        "UPDATE cif_idempotency SET created_at = now() - interval '25 hours' WHERE idempotency_key = 'application-8'",
    )
    .execute(&db.pool)
    .await
    .unwrap();
    let purged: Value = app
        .client
        .post(app.url("/admin/reclaim"))
        .bearer_auth(TEST_ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(purged["idempotency_purged"], 1, "{purged}");
    let left: Vec<String> =
        sqlx::query_scalar("SELECT idempotency_key FROM cif_idempotency").fetch_all(&db.pool).await.unwrap();
    assert_eq!(left, vec!["application-7".to_string()]);
}

/// A pool whose every counter has been generated says so: the last refill adds what is left, and the
/// next one is `exhausted`, through the function and the admin endpoint alike.
#[tokio::test]
async fn refill_reports_exhausted_once_every_code_is_generated() {
    let (db, app) = passive().await;
    let individual = pool(&app, "individual");
    let domain = individual.codec.capacity() as i64;
    sqlx::query("UPDATE cif_pools SET next_counter = $1 WHERE name = 'individual'")
        .bind(domain - 700)
        .execute(&db.pool)
        .await
        .unwrap();
    let forced = RefillOptions { force: true, ..Default::default() };
    let last = refill(&db.pool, individual, forced.clone()).await.unwrap();
    assert_eq!((last.outcome, last.codes_added, last.batches), (RefillOutcome::Refilled, 700, 2), "{last:?}");
    let next: i64 = sqlx::query_scalar("SELECT next_counter FROM cif_pools WHERE name = 'individual'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(next, domain);
    let run = refill(&db.pool, individual, forced).await.unwrap();
    assert_eq!((run.outcome, run.codes_added, run.batches), (RefillOutcome::Exhausted, 0, 0), "{run:?}");
    // Unforced, below the watermark (700 codes against 1000): exhausted too, not "nothing to do".
    let run = refill(&db.pool, individual, RefillOptions::default()).await.unwrap();
    assert_eq!(run.outcome, RefillOutcome::Exhausted);

    let answer: Value = app
        .client
        .post(app.url("/admin/pools/individual/refill?force=true"))
        .bearer_auth(TEST_ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answer["outcome"], "exhausted", "{answer}");
    let pools: Value = app.client.get(app.url("/v1/pools")).send().await.unwrap().json().await.unwrap();
    let shown = pools["pools"].as_array().unwrap().iter().find(|p| p["customer_type"] == "individual").unwrap();
    assert_eq!(shown["domain_used_fraction"], 1.0, "{shown}");
}

/// The cron schedules run on their own: with both set to every second, a lapsed hold comes back and
/// an emptied pool refills without a request, by `system`; after a graceful stop nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_refill_and_reclaim_schedules_run_by_themselves_and_stop_with_the_app() {
    let db = fresh_database().await;
    let mut settings = test_settings_with_pools(&db.url);
    settings.pools[0].refill_schedule = "* * * * * *".into();
    settings.pools[0].reclaim_schedule = "* * * * * *".into();
    let app = spawn_app_with(settings).await;
    let available = "SELECT count(*) FROM cif_codes c JOIN cif_pools p ON p.id = c.pool_id \
                     WHERE p.name = 'individual' AND c.state = 'available'";
    let until = |what: &'static str, sql: String| {
        let pool = db.pool.clone();
        async move {
            let by = Instant::now() + Duration::from_secs(15);
            while count(&pool, &sql).await == 0 {
                assert!(Instant::now() < by, "{what} did not happen within 15 s");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    until("the first fill", format!("SELECT (({available}) >= 1000)::int::int8")).await;

    let held = reserve_ok(&app, "individual").await;
    let cif = held["cif"].as_str().unwrap().to_string();
    set_lease(&app, &cif, -1.0).await;
    until(
        "the scheduled reclaim",
        format!(
            "SELECT count(*) FROM audit_events WHERE action = 'cif.reclaimed' AND actor = 'system' AND cif = '{cif}'"
        ),
    )
    .await;
    assert_eq!(state_of(&app, &cif).await["state"], "available");

    let refills_before =
        count(&db.pool, "SELECT count(*) FROM audit_events WHERE action = 'pool.refilled' AND actor = 'system'").await;
    sqlx::query("DELETE FROM cif_codes WHERE state = 'available' AND pool_id = (SELECT id FROM cif_pools WHERE name = 'individual')")
        .execute(&db.pool)
        .await
        .unwrap();
    until(
        "the scheduled refill",
        format!(
            "SELECT (count(*) > {refills_before})::int::int8 FROM audit_events \
             WHERE action = 'pool.refilled' AND actor = 'system'"
        ),
    )
    .await;
    until("the refilled pool", format!("SELECT (({available}) >= 1000)::int::int8")).await;

    // A second hold, lapsed after the stop: no schedule runs any more to take it back.
    let held = reserve_ok(&app, "individual").await;
    let cif = held["cif"].as_str().unwrap().to_string();
    app.stop().await;
    sqlx::query("UPDATE cif_codes SET lease_expires_at = now() - interval '1 second' WHERE code = $1")
        .bind(&cif)
        .execute(&db.pool)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let state: String =
        sqlx::query_scalar("SELECT state FROM cif_codes WHERE code = $1").bind(&cif).fetch_one(&db.pool).await.unwrap();
    assert_eq!(state, "reserved", "a schedule ran after the app stopped");
}

/// Reservations scan from the counter this instance last took (so a held cleanup horizon does not make
/// each one read past every code reserved since), yet a code that becomes available again below that
/// counter is still handed out: once the scan from the cursor finds nothing, the next starts from the
/// lowest counter, in the same request.
#[tokio::test]
async fn a_code_released_below_the_scan_cursor_is_still_handed_out() {
    let (_db, app) = passive().await;
    fill(&app, "individual").await;
    let counter_of = |cif: String| {
        let db = app.state.db.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT counter FROM cif_codes WHERE code = $1")
                .bind(cif)
                .fetch_one(&db)
                .await
                .unwrap()
        }
    };
    let first = reserve_ok(&app, "individual").await;
    let second = reserve_ok(&app, "individual").await;
    let (low, high) = (
        counter_of(first["cif"].as_str().unwrap().to_string()).await,
        counter_of(second["cif"].as_str().unwrap().to_string()).await,
    );
    assert!(low < high, "codes go out lowest counter first: {low}, {high}");
    let released =
        post_token(&app, first["cif"].as_str().unwrap(), "release", first["reservation_token"].as_str().unwrap()).await;
    assert_eq!(released.status(), 200);
    // Everything above the cursor is taken by someone else; only the released code is left.
    sqlx::query(
        "UPDATE cif_codes SET state = 'reserved', lease_token = gen_random_uuid(), \
                lease_expires_at = now() + interval '1 hour', holder = 'elsewhere', reserved_at = now() \
         WHERE state = 'available' AND counter > $1",
    )
    .bind(high)
    .execute(&app.state.db)
    .await
    .unwrap();
    assert_eq!(count(&app.state.db, "SELECT count(*) FROM cif_codes WHERE state = 'available'").await, 1);

    let again = reserve_ok(&app, "individual").await;
    assert_eq!(again["cif"], first["cif"], "the released code, found below the cursor");
    assert_eq!(reserve(&app, "individual").await.status(), 503, "and then the pool is empty");
}

/// A refill batch holds its pool's row from its counter advance until it commits, across the `COPY` of
/// its codes. A confirmation must not wait for it (it did while `cif_issued` had a foreign key to the
/// pool's row, which the batch locked `FOR UPDATE`: every confirmation of the pool waited out the batch).
///
/// The batch is held in its `COPY` on purpose, not caught there by timing: another transaction has
/// inserted, and not committed, a row under one of the batch's counters, so the `COPY` waits on that
/// transaction with the pool's row locked until the test lets it go.
#[tokio::test]
async fn a_confirmation_does_not_wait_for_a_refill_batch_under_way() {
    let db = fresh_database().await;
    let mut settings = test_settings_with_pools(&db.url);
    settings.pools[0].batch_size = 1_000;
    // Above the watermark after the first reservation, so no refill but the test's own starts.
    settings.pools[0].low_watermark = 10;
    settings.pools[0].max_batches_per_run = 1;
    let app = common::spawn_passive_app(settings).await;
    crate::cif_api::fill(&app, "individual").await;
    let held = reserve_ok(&app, "individual").await;
    let (cif, token) = (held["cif"].as_str().unwrap(), held["reservation_token"].as_str().unwrap());

    // The row in the batch's way: the 500th counter it will take.
    let mut blocker = app.state.db.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO cif_codes (pool_id, counter, code) \
         SELECT id, next_counter + 500, 'in the batch''s way' FROM cif_pools WHERE name = 'individual'",
    )
    .execute(&mut *blocker)
    .await
    .unwrap();

    let state = app.state.clone();
    let batch = tokio::spawn(async move {
        let individual = state.cif.pools().get("individual").unwrap();
        refill(&state.db, individual, RefillOptions { force: true, ..Default::default() }).await
    });
    const BATCH_WAITING: &str = "SELECT count(*) FROM pg_stat_activity \
                                 WHERE datname = current_database() AND query LIKE 'COPY cif_codes%' \
                                 AND wait_event_type = 'Lock'";
    let deadline = Instant::now() + Duration::from_secs(60);
    while count(&app.state.db, BATCH_WAITING).await == 0 {
        if batch.is_finished() {
            let ended = batch.await.unwrap();
            panic!("the batch ended without waiting on the row in its way: {ended:?}");
        }
        assert!(Instant::now() < deadline, "the batch's COPY never waited on the row in its way");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // The batch now holds the pool's row, and will until the blocker ends.
    let confirmed = tokio::time::timeout(Duration::from_secs(10), post_token(&app, cif, "confirm", token))
        .await
        .expect("the confirmation waited for the refill batch's transaction");
    assert_eq!(
        confirmed.status(),
        200,
        "the confirmation failed: it waited on the batch's lock until its statement timeout"
    );
    assert_eq!(
        count(&app.state.db, BATCH_WAITING).await,
        1,
        "the batch had ended (its statement timed out) when the confirmation returned: the confirmation waited for it"
    );

    blocker.rollback().await.unwrap();
    let summary = batch.await.unwrap().unwrap();
    assert_eq!(summary.codes_added, 1_000, "{summary:?}");
    app.stop().await;
}
