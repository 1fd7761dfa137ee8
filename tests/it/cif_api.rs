//! CIF pools end to end: real Postgres, real HTTP, refill and reclaim driven by the test.

use crate::common;

use std::collections::HashSet;
use std::time::Duration;

use cifpool::cif::Pool;
use cifpool::internals::reclaim;
use cifpool::internals::refill::{RefillOptions, RefillOutcome, refill};
use common::{
    TEST_ADMIN_TOKEN, TestApp, assert_problem, client_with_key, create_key, fresh_database, spawn_passive_app,
    test_settings_with_pools,
};
use serde_json::{Value, json};

pub(crate) fn pool<'a>(app: &'a TestApp, name: &str) -> &'a Pool {
    app.state.cif.pools().get(name).unwrap()
}

pub(crate) async fn fill(app: &TestApp, name: &str) {
    let s = refill(&app.state.db, pool(app, name), RefillOptions { force: true, ..Default::default() }).await.unwrap();
    assert_eq!(s.outcome, RefillOutcome::Refilled);
}

pub(crate) async fn reserve(app: &TestApp, customer_type: &str) -> reqwest::Response {
    app.client.post(app.url("/v1/cif")).json(&json!({ "customer_type": customer_type })).send().await.unwrap()
}

pub(crate) async fn reserve_ok(app: &TestApp, customer_type: &str) -> Value {
    let r = reserve(app, customer_type).await;
    assert_eq!(r.status(), 201);
    r.json().await.unwrap()
}

pub(crate) async fn post_token(app: &TestApp, cif: &str, action: &str, token: &str) -> reqwest::Response {
    app.client
        .post(app.url(&format!("/v1/cif/{cif}/{action}")))
        .json(&json!({ "reservation_token": token }))
        .send()
        .await
        .unwrap()
}

pub(crate) async fn count(db: &sqlx::PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string())).fetch_one(db).await.unwrap()
}

#[tokio::test]
async fn two_hundred_concurrent_reservations_on_two_instances_are_distinct_and_valid() {
    let db = fresh_database().await;
    let a = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    let b = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    fill(&a, "individual").await;

    let mut tasks = Vec::new();
    for i in 0..200 {
        let (client, base) =
            if i % 2 == 0 { (a.client.clone(), a.base.clone()) } else { (b.client.clone(), b.base.clone()) };
        tasks.push(tokio::spawn(async move {
            let r = client
                .post(format!("{base}/v1/cif"))
                .header("x-holder", format!("pod-{}", i % 7))
                .json(&json!({ "customer_type": "individual" }))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 201);
            r.json::<Value>().await.unwrap()["cif"].as_str().unwrap().to_string()
        }));
    }
    let mut codes = HashSet::new();
    for t in tasks {
        codes.insert(common::joined(t).await);
    }
    assert_eq!(codes.len(), 200, "every reservation got its own code");
    let codec = &pool(&a, "individual").codec;
    for code in &codes {
        assert!(code.starts_with('1') && code.len() == codec.format().total_len(), "{code}");
        codec.decode(code).expect("valid for the pool's format and check digit");
    }
    assert_eq!(count(&db.pool, "SELECT count(*) FROM cif_codes WHERE state = 'reserved'").await, 200);
}

#[tokio::test]
async fn reserve_confirm_is_used_and_repeat_confirm_is_idempotent() {
    let (db, app) = passive().await;
    fill(&app, "individual").await;
    let r = reserve_ok(&app, "individual").await;
    let (cif, token) = (r["cif"].as_str().unwrap(), r["reservation_token"].as_str().unwrap());
    assert_eq!(r["customer_type"], "individual");
    assert!(r["lease_expires_at"].is_string());

    let status: Value = app.client.get(app.url(&format!("/v1/cif/{cif}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(status["state"], "reserved");
    assert!(status.get("reservation_token").is_none(), "tokens are never returned by lookups");

    let first = post_token(&app, cif, "confirm", token).await;
    assert_eq!(first.status(), 200);
    let first: Value = first.json().await.unwrap();
    assert_eq!(first["state"], "used");
    let again = post_token(&app, cif, "confirm", token).await;
    assert_eq!(again.status(), 200);
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["confirmed_at"], first["confirmed_at"], "a repeat changes nothing");

    let status: Value = app.client.get(app.url(&format!("/v1/cif/{cif}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(status["state"], "used");
    assert_eq!(count(&db.pool, "SELECT count(*) FROM cif_issued").await, 1);
    // A code is never released or re-confirmed by another token once used.
    let other = uuid::Uuid::new_v4().to_string();
    assert_problem(post_token(&app, cif, "confirm", &other).await, 409).await;
    assert_problem(post_token(&app, cif, "release", token).await, 409).await;
}

#[tokio::test]
async fn a_repeated_confirm_for_another_customer_ref_is_409_not_used() {
    let (db, app) = passive().await;
    fill(&app, "individual").await;
    let r = reserve_ok(&app, "individual").await;
    let (cif, token) = (r["cif"].as_str().unwrap(), r["reservation_token"].as_str().unwrap());
    let confirm = |customer_ref: Option<&str>| {
        let mut body = json!({ "reservation_token": token });
        if let Some(c) = customer_ref {
            body["customer_ref"] = json!(c);
        }
        app.client.post(app.url(&format!("/v1/cif/{cif}/confirm"))).json(&body).send()
    };
    assert_eq!(confirm(Some("customer-1")).await.unwrap().status(), 200);
    assert_eq!(confirm(Some("customer-1")).await.unwrap().status(), 200, "a true retry is idempotent");
    let problem = assert_problem(confirm(Some("customer-2")).await.unwrap(), 409).await;
    assert!(problem["detail"].as_str().unwrap().contains("another customer_ref"), "{problem}");
    assert_problem(confirm(None).await.unwrap(), 409).await;
    let stored: Option<String> =
        sqlx::query_scalar("SELECT customer_ref FROM cif_issued").fetch_one(&db.pool).await.unwrap();
    assert_eq!(stored.as_deref(), Some("customer-1"), "the first customer keeps the number");
}

#[tokio::test]
async fn expired_hold_is_reclaimed_old_token_gets_409_next_holder_confirms() {
    let (db, app) = passive().await;
    fill(&app, "individual").await;
    let r = reserve_ok(&app, "individual").await;
    let (cif, old_token) =
        (r["cif"].as_str().unwrap().to_string(), r["reservation_token"].as_str().unwrap().to_string());

    // Nothing to reclaim while the lease runs.
    let none =
        reclaim::reclaim(&app.state.db, app.state.cif.pools(), None, &cifpool::audit::Actor::system()).await.unwrap();
    assert_eq!(none.total, 0);

    // The pod died: let its lease run out (moved into the past rather than slept through).
    let counter = pool(&app, "individual").codec.decode(&cif).unwrap() as i64;
    sqlx::query("UPDATE cif_codes SET lease_expires_at = now() - interval '1 second' WHERE counter = $1")
        .bind(counter)
        .execute(&db.pool)
        .await
        .unwrap();
    let r = app.client.post(app.url("/admin/reclaim")).bearer_auth(TEST_ADMIN_TOKEN).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let summary: Value = r.json().await.unwrap();
    assert_eq!(summary["reclaimed"]["individual"], 1, "{summary}");

    assert_problem(post_token(&app, &cif, "confirm", &old_token).await, 409).await;
    assert_problem(post_token(&app, &cif, "extend", &old_token).await, 409).await;

    // The code went back to the front of the pool: the next holder gets it and can confirm.
    let next = reserve_ok(&app, "individual").await;
    assert_eq!(next["cif"], cif.as_str());
    assert_ne!(next["reservation_token"], old_token.as_str());
    let r = post_token(&app, &cif, "confirm", next["reservation_token"].as_str().unwrap()).await;
    assert_eq!(r.status(), 200);
    assert_problem(post_token(&app, &cif, "confirm", &old_token).await, 409).await;
}

#[tokio::test]
async fn release_returns_the_code_and_extend_renews_the_lease() {
    let (_db, app) = passive().await;
    fill(&app, "business").await;
    let r = reserve_ok(&app, "business").await;
    let (cif, token) = (r["cif"].as_str().unwrap(), r["reservation_token"].as_str().unwrap());
    assert!(cif.starts_with('2'));

    // Bring the lease close to its end, so a renewal shows: extend sets it a whole lease_ttl ahead.
    sqlx::query("UPDATE cif_codes SET lease_expires_at = now() + interval '5 seconds' WHERE lease_token = $1::uuid")
        .bind(token)
        .execute(&app.state.db)
        .await
        .unwrap();
    let ext = post_token(&app, cif, "extend", token).await;
    assert_eq!(ext.status(), 200);
    let ext: Value = ext.json().await.unwrap();
    let renewed: chrono::DateTime<chrono::Utc> = ext["lease_expires_at"].as_str().unwrap().parse().unwrap();
    let ttl = app.state.cif.pools().get("business").unwrap().settings.lease_ttl;
    let ahead = (renewed - chrono::Utc::now()).to_std().unwrap_or_default();
    assert!(ahead > ttl - Duration::from_secs(30) && ahead <= ttl, "renewed {ahead:?} ahead, lease_ttl {ttl:?}");
    let stored: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT lease_expires_at FROM cif_codes WHERE lease_token = $1::uuid")
            .bind(token)
            .fetch_one(&app.state.db)
            .await
            .unwrap();
    assert_eq!(stored, renewed, "the answer is what was stored");

    let rel = post_token(&app, cif, "release", token).await;
    assert_eq!(rel.status(), 200);
    let status: Value = app.client.get(app.url(&format!("/v1/cif/{cif}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(status["state"], "available");
    // The released token is dead.
    assert_problem(post_token(&app, cif, "confirm", token).await, 409).await;
}

#[tokio::test]
async fn refill_is_bounded_by_max_batches_per_run() {
    let db = fresh_database().await;
    let mut settings = test_settings_with_pools(&db.url);
    settings.pools[0].batch_size = 1000;
    settings.pools[0].max_batches_per_run = 3;
    settings.pools[0].low_watermark = 100_000;
    let app = spawn_passive_app(settings).await;
    let p = pool(&app, "individual");

    let first = refill(&app.state.db, p, RefillOptions::default()).await.unwrap();
    assert_eq!((first.outcome, first.codes_added, first.batches), (RefillOutcome::Refilled, 3000, 3));
    assert_eq!(count(&db.pool, "SELECT count(*) FROM cif_codes").await, 3000);
    let second = refill(&app.state.db, p, RefillOptions::default()).await.unwrap();
    assert_eq!(second.codes_added, 3000);
    assert_eq!(count(&db.pool, "SELECT next_counter FROM cif_pools WHERE name = 'individual'").await, 6000);
}

#[tokio::test]
async fn refill_stops_at_the_watermark() {
    let (db, app) = passive().await;
    let p = pool(&app, "individual"); // watermark 1000, batch 500, max 4
    let first = refill(&app.state.db, p, RefillOptions::default()).await.unwrap();
    assert_eq!(first.codes_added, 1000, "two batches reach the watermark");
    let second = refill(&app.state.db, p, RefillOptions::default()).await.unwrap();
    assert_eq!(second.outcome, RefillOutcome::AboveWatermark);
    assert_eq!(count(&db.pool, "SELECT count(*) FROM cif_codes").await, 1000);
}

#[tokio::test]
async fn concurrent_refills_on_two_instances_never_duplicate_a_counter() {
    let db = fresh_database().await;
    let a = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    let b = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    let mut runs = Vec::new();
    for i in 0..8 {
        let state = if i % 2 == 0 { a.state.clone() } else { b.state.clone() };
        runs.push(tokio::spawn(async move {
            let p = state.cif.pools().get("individual").unwrap().clone();
            refill(&state.db, &p, RefillOptions { force: true, ..Default::default() }).await.unwrap()
        }));
    }
    let mut added = 0;
    let mut busy = 0;
    for r in runs {
        let s = common::joined(r).await;
        added += s.codes_added as i64;
        busy += i64::from(s.outcome == RefillOutcome::Busy);
    }
    assert!(added >= 2000, "at least one run refilled");
    let (rows, distinct_counters, distinct_codes): (i64, i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT counter), count(DISTINCT code) FROM cif_codes")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((rows, distinct_counters, distinct_codes), (added, added, added));
    assert_eq!(count(&db.pool, "SELECT next_counter FROM cif_pools WHERE name = 'individual'").await, added);
    assert_eq!(count(&db.pool, "SELECT max(counter) + 1 FROM cif_codes").await, added, "no gaps either");
    eprintln!("8 concurrent refills: {added} codes added, {busy} found another refill running");
}

#[tokio::test]
async fn idempotency_key_replays_the_same_reservation() {
    let (db, app) = passive().await;
    fill(&app, "individual").await;
    let send = |key: &'static str, ty: &'static str| {
        app.client.post(app.url("/v1/cif")).header("idempotency-key", key).json(&json!({ "customer_type": ty })).send()
    };
    let first = send("onboarding-42", "individual").await.unwrap();
    assert_eq!(first.status(), 201);
    let first: Value = first.json().await.unwrap();
    let again = send("onboarding-42", "individual").await.unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(again.json::<Value>().await.unwrap(), first);
    assert_problem(send("onboarding-42", "business").await.unwrap(), 422).await;

    // Concurrent duplicates: one code, one 201.
    let mut tasks = Vec::new();
    for _ in 0..12 {
        let (client, url) = (app.client.clone(), app.url("/v1/cif"));
        tasks.push(tokio::spawn(async move {
            let r = client
                .post(url)
                .header("idempotency-key", "burst-7")
                .json(&json!({ "customer_type": "individual" }))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap()["cif"].as_str().unwrap().to_string())
        }));
    }
    let mut statuses = Vec::new();
    let mut codes = HashSet::new();
    for t in tasks {
        let (status, cif) = common::joined(t).await;
        statuses.push(status);
        codes.insert(cif);
    }
    assert_eq!(codes.len(), 1, "one key, one code");
    assert_eq!(statuses.iter().filter(|&&s| s == 201).count(), 1, "{statuses:?}");
    assert_eq!(count(&db.pool, "SELECT count(*) FROM cif_codes WHERE state = 'reserved'").await, 2);
}

/// An idempotency key belongs to the key that sent it: another caller's same key is a request of its
/// own (its own code and token), and each caller's replay returns its own hold.
#[tokio::test]
async fn an_idempotency_key_is_scoped_to_its_caller() {
    use cifpool::auth::Scope;
    let (db, app) = passive().await;
    fill(&app, "individual").await;
    let web = client_with_key(&create_key(&db.pool, &[Scope::CifReserve], None).await);
    let mobile = client_with_key(&create_key(&db.pool, &[Scope::CifReserve], None).await);
    let reserve = |client: &reqwest::Client| {
        client
            .post(app.url("/v1/cif"))
            .header("idempotency-key", "application-1001")
            .json(&json!({ "customer_type": "individual" }))
            .send()
    };
    let r = reserve(&web).await.unwrap();
    assert_eq!(r.status(), 201);
    let web_hold: Value = r.json().await.unwrap();
    let r = reserve(&mobile).await.unwrap();
    assert_eq!(r.status(), 201, "another caller's key is a new request");
    let mobile_hold: Value = r.json().await.unwrap();
    assert_ne!(web_hold["cif"], mobile_hold["cif"]);
    assert_ne!(web_hold["reservation_token"], mobile_hold["reservation_token"]);
    for (client, own) in [(&web, &web_hold), (&mobile, &mobile_hold)] {
        let r = reserve(client).await.unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(&r.json::<Value>().await.unwrap(), own, "a replay returns the caller's own hold");
    }
    assert_eq!(count(&db.pool, "SELECT count(*) FROM cif_codes WHERE state = 'reserved'").await, 2);
}

#[tokio::test]
async fn empty_pool_is_503_with_retry_after_and_starts_a_refill() {
    let (db, app) = passive().await;
    let r = reserve(&app, "business").await;
    assert_eq!(r.headers().get("retry-after").unwrap(), "1");
    assert_problem(r, 503).await;
    // The refill was started by the request; wait for it (bounded).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while count(
        &db.pool,
        "SELECT count(*) FROM cif_codes c JOIN cif_pools p ON p.id = c.pool_id WHERE p.name = 'business'",
    )
    .await
        == 0
    {
        assert!(std::time::Instant::now() < deadline, "no refill after an empty-pool response");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    reserve_ok(&app, "business").await;
}

#[tokio::test]
async fn pools_endpoint_reports_depth() {
    let (_db, app) = passive().await;
    fill(&app, "individual").await;
    let r = reserve_ok(&app, "individual").await;
    post_token(&app, r["cif"].as_str().unwrap(), "confirm", r["reservation_token"].as_str().unwrap()).await;
    reserve_ok(&app, "individual").await;
    let body: Value = app.client.get(app.url("/v1/pools")).send().await.unwrap().json().await.unwrap();
    let ind = body["pools"].as_array().unwrap().iter().find(|p| p["customer_type"] == "individual").unwrap();
    assert_eq!(ind["next_counter"], 2000);
    assert_eq!(ind["available"], 1998);
    assert_eq!(ind["reserved"], 1);
    assert_eq!(ind["used"], 1);
    assert_eq!(ind["domain_size"], 1_000_000_000u64);
    assert_eq!(ind["low"], false);
    let bus = body["pools"].as_array().unwrap().iter().find(|p| p["customer_type"] == "business").unwrap();
    assert_eq!(bus["low"], true);
    let metrics = app.client.get(app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains(r#"cifpool_pool_available{pool="individual"} 1998"#), "{metrics}");
}

#[tokio::test]
async fn admin_endpoints_need_the_bearer_token() {
    let (_db, app) = passive().await;
    let url = app.url("/admin/pools/individual/refill");
    let anonymous = reqwest::Client::new();
    assert_problem(anonymous.post(&url).send().await.unwrap(), 401).await;
    assert_problem(anonymous.post(&url).bearer_auth("wrong-token-wrong-token").send().await.unwrap(), 401).await;
    assert_problem(anonymous.post(app.url("/admin/reclaim")).send().await.unwrap(), 401).await;
    let ok = app.client.post(&url).bearer_auth(TEST_ADMIN_TOKEN).send().await.unwrap();
    assert_eq!(ok.status(), 200);
    let summary: Value = ok.json().await.unwrap();
    assert_eq!(summary["codes_added"], 1000);
    assert_eq!(summary["batches"], 2);
    let missing =
        app.client.post(app.url("/admin/pools/nope/refill")).bearer_auth(TEST_ADMIN_TOKEN).send().await.unwrap();
    assert_problem(missing, 404).await;

    // Without a configured token the admin API is closed to everyone.
    let db = fresh_database().await;
    let mut settings = test_settings_with_pools(&db.url);
    settings.security.admin_token = None;
    let closed = spawn_passive_app(settings).await;
    let r = closed.client.post(closed.url("/admin/reclaim")).bearer_auth(TEST_ADMIN_TOKEN).send().await.unwrap();
    assert_problem(r, 401).await;
}

#[tokio::test]
async fn bad_input_is_problem_json_and_writes_nothing() {
    let (db, app) = passive().await;
    fill(&app, "individual").await;
    let before = count(&db.pool, "SELECT count(*) FROM cif_codes WHERE state = 'available'").await;
    let post = |body: &'static str, ct: &'static str| {
        app.client.post(app.url("/v1/cif")).header("content-type", ct).body(body).send()
    };
    assert_problem(post("{not json", "application/json").await.unwrap(), 400).await;
    assert_problem(post(r#"{"customer_type":"individual"}"#, "text/plain").await.unwrap(), 415).await;
    assert_problem(post(r#"{"type":"individual"}"#, "application/json").await.unwrap(), 422).await;
    let unknown = assert_problem(post(r#"{"customer_type":"martian"}"#, "application/json").await.unwrap(), 404).await;
    assert!(unknown["detail"].as_str().unwrap().contains("individual"), "lists the known types: {unknown}");
    let big = format!(r#"{{"customer_type":"{}"}}"#, "x".repeat(100_000));
    let r =
        app.client.post(app.url("/v1/cif")).header("content-type", "application/json").body(big).send().await.unwrap();
    assert_problem(r, 413).await;

    // A real code with one digit changed: the check digit catches it.
    let r = reserve_ok(&app, "individual").await;
    let cif = r["cif"].as_str().unwrap().to_string();
    let token = r["reservation_token"].as_str().unwrap().to_string();
    let mut typo = cif.clone().into_bytes();
    typo[3] = if typo[3] == b'9' { b'0' } else { typo[3] + 1 };
    let typo = String::from_utf8(typo).unwrap();
    let bad = assert_problem(post_token(&app, &typo, "confirm", &token).await, 400).await;
    assert!(bad["detail"].as_str().unwrap().contains("check digit"), "{bad}");
    assert_problem(app.client.get(app.url(&format!("/v1/cif/{typo}"))).send().await.unwrap(), 400).await;
    assert_problem(app.client.get(app.url("/v1/cif/12ab")).send().await.unwrap(), 400).await;
    assert_problem(app.client.get(app.url("/v1/cif/123")).send().await.unwrap(), 400).await;
    assert_problem(post_token(&app, &cif, "confirm", "not-a-uuid").await, 422).await;
    let nul = app
        .client
        .post(app.url(&format!("/v1/cif/{cif}/confirm")))
        .json(&json!({ "reservation_token": token, "customer_ref": "a\u{0}b" }))
        .send()
        .await
        .unwrap();
    assert_problem(nul, 422).await;

    // Only the one good reservation was written.
    assert_eq!(count(&db.pool, "SELECT count(*) FROM cif_codes WHERE state = 'available'").await, before - 1);
    assert_eq!(count(&db.pool, "SELECT count(*) FROM cif_issued").await, 0);
    assert_eq!(count(&db.pool, "SELECT count(*) FROM cif_idempotency").await, 0);
}

#[tokio::test]
async fn well_formed_but_never_issued_code_is_404() {
    let (_db, app) = passive().await;
    let code = pool(&app, "individual").codec.encode(999_999);
    assert_problem(app.client.get(app.url(&format!("/v1/cif/{code}"))).send().await.unwrap(), 404).await;
}

pub(crate) async fn passive() -> (common::TestDb, TestApp) {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    (db, app)
}
