//! The audit trail: a row for every CIF transition and admin action, written with the change (none
//! when the change does not happen), readable by CIF, actor and time, and impossible to rewrite.

use crate::common;

use cifpool::internals::refill::{RefillOptions, refill};
use common::{TEST_ADMIN_TOKEN, TestApp, client_with_key, fresh_database, spawn_passive_app, test_settings_with_pools};
use serde_json::{Value, json};

async fn fill(app: &TestApp) {
    let pool = app.state.cif.pools().get("individual").unwrap();
    refill(&app.state.db, pool, RefillOptions { force: true, ..Default::default() }).await.unwrap();
}

async fn trail(app: &TestApp, query: &str) -> Vec<Value> {
    let admin = client_with_key(TEST_ADMIN_TOKEN);
    let page: Value = admin.get(app.url(&format!("/admin/audit?{query}"))).send().await.unwrap().json().await.unwrap();
    page["events"].as_array().unwrap().clone()
}

fn actions(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["action"].as_str().unwrap()).collect()
}

async fn key_name(app: &TestApp) -> String {
    let digest = cifpool::internals::api_key::digest(&app.key);
    cifpool::internals::api_key::find(&app.state.db, &digest).await.unwrap().unwrap().name
}

#[tokio::test]
async fn a_cifs_life_from_reserve_to_confirm_is_in_the_trail() {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    fill(&app).await;
    let me = key_name(&app).await;
    let r = app
        .client
        .post(app.url("/v1/cif"))
        .header("x-holder", "pod-a")
        .header("x-request-id", "req-reserve")
        .json(&json!({ "customer_type": "individual" }))
        .send()
        .await
        .unwrap();
    let reserve_id = r.headers()["x-request-id"].to_str().unwrap().to_string();
    let held: Value = r.json().await.unwrap();
    let cif = held["cif"].as_str().unwrap().to_string();
    let token = json!({ "reservation_token": held["reservation_token"] });
    let post =
        |action: &str, body: Value| app.client.post(app.url(&format!("/v1/cif/{cif}/{action}"))).json(&body).send();
    assert_eq!(post("extend", token.clone()).await.unwrap().status(), 200);
    // A wrong token changes nothing, so it leaves no row.
    let wrong = json!({ "reservation_token": uuid::Uuid::new_v4() });
    assert_eq!(post("confirm", wrong.clone()).await.unwrap().status(), 409);
    assert_eq!(post("release", wrong).await.unwrap().status(), 409);
    let confirm = json!({ "reservation_token": held["reservation_token"], "customer_ref": "crm-42" });
    assert_eq!(post("confirm", confirm.clone()).await.unwrap().status(), 200);
    assert_eq!(post("confirm", confirm).await.unwrap().status(), 200, "a retried confirm changes nothing");

    let events = trail(&app, &format!("cif={cif}")).await;
    assert_eq!(actions(&events), ["cif.confirmed", "cif.extended", "cif.reserved"], "newest first: {events:#?}");
    for e in &events {
        assert_eq!(e["actor"], me.as_str());
        assert_eq!(e["pool"], "individual");
        assert_eq!(e["holder"], "pod-a", "the hold's holder: {e}");
    }
    assert_eq!(events[2]["request_id"], reserve_id.as_str(), "the service's own id, as in the answer");
    assert_eq!(events[2]["client_request_id"], "req-reserve");
    assert_eq!(events[0]["customer_ref"], "crm-42");
    assert!(events[1]["detail"]["lease_expires_at"].is_string());
    let by_ref = trail(&app, "customer_ref=crm-42").await;
    assert_eq!(actions(&by_ref), ["cif.confirmed"]);
}

#[tokio::test]
async fn release_replay_reclaim_refill_and_admin_actions_are_recorded_by_their_actor() {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    fill(&app).await;
    let me = key_name(&app).await;
    let reserve = |key: &'static str| {
        app.client
            .post(app.url("/v1/cif"))
            .header("idempotency-key", key)
            .header("x-holder", "pod-b")
            .json(&json!({ "customer_type": "individual" }))
            .send()
    };
    let first: Value = reserve("k-1").await.unwrap().json().await.unwrap();
    assert_eq!(reserve("k-1").await.unwrap().status(), 200, "an idempotent replay");
    let cif = first["cif"].as_str().unwrap().to_string();
    let body = json!({ "reservation_token": first["reservation_token"] });
    let r = app.client.post(app.url(&format!("/v1/cif/{cif}/release"))).header("x-holder", "pod-c").json(&body);
    assert_eq!(r.send().await.unwrap().status(), 200);
    assert_eq!(actions(&trail(&app, &format!("cif={cif}")).await), ["cif.released", "cif.replayed", "cif.reserved"]);
    let released = &trail(&app, &format!("cif={cif}&action=cif.released")).await[0];
    assert_eq!(released["holder"], "pod-c");

    // A hold left to expire is taken back by the system, which names the holder it took it from.
    let second: Value = reserve("k-2").await.unwrap().json().await.unwrap();
    let lapsed = second["cif"].as_str().unwrap().to_string();
    sqlx::query("UPDATE cif_codes SET lease_expires_at = now() - interval '1 second' WHERE code = $1")
        .bind(&lapsed)
        .execute(&db.pool)
        .await
        .unwrap();
    cifpool::internals::reclaim::reclaim(&app.state.db, app.state.cif.pools(), None, &cifpool::audit::Actor::system())
        .await
        .unwrap();
    let reclaimed = trail(&app, &format!("cif={lapsed}&action=cif.reclaimed")).await;
    assert_eq!(reclaimed.len(), 1);
    assert_eq!((reclaimed[0]["actor"].as_str(), reclaimed[0]["holder"].as_str()), (Some("system"), Some("pod-b")));

    // Refill batches and admin actions carry who asked.
    let admin = client_with_key(TEST_ADMIN_TOKEN);
    let r = admin.post(app.url("/admin/pools/business/refill?force=true")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let refills = trail(&app, "actor=bootstrap&action=pool.refilled").await;
    assert_eq!(refills.len(), 4, "one row per batch (max_batches_per_run = 4)");
    assert_eq!(refills[3]["detail"]["first_counter"], 0);
    assert_eq!(refills[0]["detail"]["end_counter"], 2000);
    let system_refills = trail(&app, "actor=system&action=pool.refilled").await;
    assert!(!system_refills.is_empty(), "the test's own fill ran as the system");
    let r =
        admin.post(app.url("/admin/dlq/replay")).json(&json!({ "max": 10, "rate_per_sec": 1 })).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let replays = trail(&app, "action=dlq.replayed").await;
    assert_eq!((replays[0]["actor"].as_str(), &replays[0]["detail"]["replayed"]), (Some("bootstrap"), &json!(0)));
    let created = admin.post(app.url("/admin/keys")).json(&json!({ "name": "audited", "scopes": ["cif:read"] }));
    assert_eq!(created.send().await.unwrap().status(), 201);
    assert_eq!(admin.delete(app.url("/admin/keys/audited")).send().await.unwrap().status(), 204);
    let key_events = trail(&app, "actor=bootstrap&action=key.created").await;
    assert_eq!(key_events[0]["detail"]["name"], "audited");
    assert_eq!(trail(&app, "action=key.revoked").await[0]["detail"]["name"], "audited");
    assert!(!trail(&app, &format!("actor={me}")).await.is_empty());
}

#[tokio::test]
async fn a_claim_that_rolls_back_leaves_no_row() {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    fill(&app).await;
    // Sixteen concurrent requests with one idempotency key: each claims a code inside its own
    // transaction, fifteen lose the key's insert and roll back (claim and audit row), then replay.
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (client, url) = (app.client.clone(), app.url("/v1/cif"));
        tasks.push(tokio::spawn(async move {
            let r = client.post(url).header("idempotency-key", "same").json(&json!({ "customer_type": "individual" }));
            r.send().await.unwrap().status().as_u16()
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(common::joined(t).await);
    }
    assert_eq!(statuses.iter().filter(|s| **s == 201).count(), 1, "{statuses:?}");
    let reserved: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE action = 'cif.reserved'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM cif_codes WHERE state = 'reserved'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!((reserved, held), (1, 1), "one hold, one row: the losers' claims and rows rolled back");
    let replayed: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE action = 'cif.replayed'")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert_eq!(replayed, 15);
}

#[tokio::test]
async fn the_trail_cannot_be_rewritten_and_pages_newest_first() {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    fill(&app).await;
    for statement in ["UPDATE audit_events SET actor = 'someone'", "DELETE FROM audit_events", "TRUNCATE audit_events"]
    {
        let err = sqlx::query(statement).execute(&db.pool).await.expect_err(statement);
        assert!(err.to_string().contains("append-only"), "{statement}: {err}");
    }
    let admin = client_with_key(TEST_ADMIN_TOKEN);
    let page = |q: String| {
        let url = app.url(&format!("/admin/audit?action=pool.refilled&limit=3{q}"));
        let admin = admin.clone();
        async move { admin.get(url).send().await.unwrap().json::<Value>().await.unwrap() }
    };
    let first = page(String::new()).await;
    let cursor = first["next_cursor"].as_i64().expect("more than one page");
    let second = page(format!("&cursor={cursor}")).await;
    let ids = |p: &Value| p["events"].as_array().unwrap().iter().map(|e| e["id"].as_i64().unwrap()).collect::<Vec<_>>();
    let (a, b) = (ids(&first), ids(&second));
    assert_eq!(a.len(), 3);
    assert!(a.windows(2).all(|w| w[0] > w[1]) && b.iter().all(|id| *id < a[2]), "{a:?} then {b:?}");
    assert!(second.get("next_cursor").is_none(), "4 refill batches: the second page is the last");
    for bad in ["limit=0", "limit=5000", "since=2026-12-02T00:00:00Z&until=2026-12-01T00:00:00Z", "cursor=x"] {
        let r = admin.get(app.url(&format!("/admin/audit?{bad}"))).send().await.unwrap();
        common::assert_problem(r, 400).await;
    }
}

#[tokio::test]
async fn a_callers_request_id_is_kept_beside_the_services_own_and_cannot_be_shared() {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    fill(&app).await;
    // Two callers that number their requests the same way, and one that copies the other's id.
    let other = client_with_key(&common::create_key(&db.pool, &[cifpool::auth::Scope::CifReserve], None).await);
    let mut answers = Vec::new();
    for client in [&app.client, &other] {
        let r = client
            .post(app.url("/v1/cif"))
            .header("x-request-id", "application-1001")
            .json(&json!({ "customer_type": "individual" }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        assert_eq!(r.headers()["x-client-request-id"], "application-1001", "the caller's id is echoed");
        let service_id = r.headers()["x-request-id"].to_str().unwrap().to_string();
        assert!(uuid::Uuid::parse_str(&service_id).is_ok(), "the service's own id: {service_id:?}");
        let cif = r.json::<Value>().await.unwrap()["cif"].as_str().unwrap().to_string();
        answers.push((service_id, cif));
    }
    assert_ne!(answers[0].0, answers[1].0, "each request gets an id of its own");
    for (service_id, cif) in &answers {
        let events = trail(&app, &format!("cif={cif}")).await;
        assert_eq!(actions(&events), ["cif.reserved"]);
        assert_eq!(events[0]["request_id"], service_id.as_str(), "{events:#?}");
        assert_eq!(events[0]["client_request_id"], "application-1001");
    }
    // No id from the caller: none is recorded as the caller's.
    let r = app.client.post(app.url("/v1/cif")).json(&json!({ "customer_type": "individual" })).send().await.unwrap();
    assert!(!r.headers().contains_key("x-client-request-id"));
    let cif = r.json::<Value>().await.unwrap()["cif"].as_str().unwrap().to_string();
    let events = trail(&app, &format!("cif={cif}")).await;
    assert!(events[0]["request_id"].is_string() && events[0]["client_request_id"].is_null(), "{events:#?}");
}
