//! Reconciling the pools with the customer system's list of issued numbers: every listed code ends up
//! issued, wherever it was (issued, available, held, set aside or in no table), each pool's counter
//! moves past the highest, a dry run changes nothing, invalid lists are refused, applying twice changes
//! nothing the second time; through the admin API and the command line.

use std::collections::HashSet;

use crate::common;
use crate::fence::{confirm_numbers, fill};

use common::{TEST_ADMIN_TOKEN, TestApp, client_with_key, spawn_passive_app, test_settings_with_pools};
use serde_json::{Value, json};

async fn reconcile(app: &TestApp, list: &str, apply: bool) -> reqwest::Response {
    let admin = client_with_key(TEST_ADMIN_TOKEN);
    let url = app.url(&format!("/admin/pools/reconcile?apply={apply}"));
    admin.post(url).header("content-type", "text/plain").body(list.to_string()).send().await.unwrap()
}

async fn reconcile_ok(app: &TestApp, list: &str, apply: bool) -> Value {
    let r = reconcile(app, list, apply).await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

fn pool_report<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["pools"].as_array().unwrap().iter().find(|p| p["pool"] == name).unwrap_or_else(|| panic!("{report:#}"))
}

/// What the pools hold, to show that a dry run or a refused list changed nothing.
async fn snapshot(db: &sqlx::PgPool) -> (i64, i64, i64, i64, Vec<i64>) {
    let (issued, codes, held, audited): (i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM cif_issued), (SELECT count(*) FROM cif_codes), \
                (SELECT count(*) FROM cif_codes WHERE state = 'reserved'), \
                (SELECT count(*) FROM audit_events WHERE action = 'pool.reconciled')",
    )
    .fetch_one(db)
    .await
    .unwrap();
    let counters = sqlx::query_scalar("SELECT next_counter FROM cif_pools ORDER BY id").fetch_all(db).await.unwrap();
    (issued, codes, held, audited, counters)
}

async fn counter(db: &sqlx::PgPool, pool: &str) -> i64 {
    sqlx::query_scalar("SELECT next_counter FROM cif_pools WHERE name = $1").bind(pool).fetch_one(db).await.unwrap()
}

/// A fresh database and a service on it whose pools are filled.
async fn filled_pools() -> (common::TestDb, TestApp) {
    let db = common::fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    fill(&app).await;
    (db, app)
}

#[tokio::test]
async fn every_listed_code_is_issued_once_and_the_counters_move_past_them() {
    let (db, app) = filled_pools().await;
    let confirmed = confirm_numbers(&app, 20).await;
    let held = crate::cif_api::reserve_ok(&app, "individual").await;
    let held_cif = held["cif"].as_str().unwrap().to_string();
    let available: Vec<String> =
        sqlx::query_scalar("SELECT code FROM cif_codes WHERE state = 'available' ORDER BY counter DESC LIMIT 5")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    // Numbers the customer system has that this database never generated: ahead of the counter.
    let individual = app.state.cif.pools().get("individual").unwrap();
    let business = app.state.cif.pools().get("business").unwrap();
    let top = counter(&db.pool, "individual").await as u64;
    let ahead = [individual.codec.encode(top + 10), individual.codec.encode(top + 11)];
    let business_code = business.codec.encode(3);

    let mut list = String::new();
    for code in confirmed.iter().chain([&held_cif]).chain(&available) {
        list.push_str(&format!("{code}\n"));
    }
    list.push_str(&format!("{}, crm-ahead-1\n\n{}\tcrm-ahead-2\n", ahead[0], ahead[1]));
    list.push_str(&format!("{business_code}\n{}\n", confirmed[0]));

    let before = snapshot(&db.pool).await;
    let dry = reconcile_ok(&app, &list, false).await;
    assert_eq!(snapshot(&db.pool).await, before, "a dry run changes nothing");
    assert_eq!(
        (&dry["applied"], &dry["lines"], &dry["invalid"], &dry["duplicates"]),
        (&json!(false), &json!(30), &json!(0), &json!(1))
    );
    let expected = json!({
        "pool": "individual", "listed": 28, "already_issued": 20, "were_available": 5, "were_held": 1,
        "were_set_aside": 0, "were_unknown": 2, "counter_before": top, "counter_after": top + 12,
    });
    assert_eq!(pool_report(&dry, "individual"), &expected);
    let b = pool_report(&dry, "business");
    assert_eq!(
        (&b["listed"], &b["were_unknown"], &b["counter_before"], &b["counter_after"]),
        (&json!(1), &json!(1), &json!(0), &json!(4))
    );

    let applied = reconcile_ok(&app, &list, true).await;
    assert_eq!(applied["applied"], true);
    assert_eq!(pool_report(&applied, "individual"), &expected, "applying does what the dry run said");
    let (issued, codes, held_now, audited, counters) = snapshot(&db.pool).await;
    assert_eq!((issued, codes, held_now, audited), (before.0 + 9, before.1 - 6, 0, 2));
    assert_eq!(counters, [top as i64 + 12, 4]);
    let refs: Vec<(String, Option<String>, String)> =
        sqlx::query_as("SELECT code, customer_ref, holder FROM cif_issued WHERE code = ANY($1)")
            .bind(&ahead[..])
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let refs: HashSet<(String, Option<String>, String)> = refs.into_iter().collect();
    let want = [(&ahead[0], "crm-ahead-1"), (&ahead[1], "crm-ahead-2")]
        .map(|(code, r)| (code.clone(), Some(r.to_string()), "reconcile".to_string()));
    assert_eq!(refs, want.into_iter().collect());
    let audit: Value =
        sqlx::query_scalar("SELECT detail FROM audit_events WHERE action = 'pool.reconciled' AND pool = 'individual'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!((&audit["were_held"], &audit["counter_after"]), (&json!(1), &json!(top + 12)));

    // The onboarding that held a listed number cannot confirm it: the customer system gave it to another.
    let r = crate::cif_api::post_token(&app, &held_cif, "confirm", held["reservation_token"].as_str().unwrap()).await;
    common::assert_problem(r, 409).await;

    // Applying again changes nothing.
    let again = reconcile_ok(&app, &list, true).await;
    let p = pool_report(&again, "individual");
    assert_eq!(
        (&p["already_issued"], &p["counter_before"], &p["counter_after"]),
        (&json!(28), &json!(top + 12), &json!(top + 12))
    );
    assert_eq!(snapshot(&db.pool).await.3, 2, "no audit row for a pool that did not change");

    // What the pools hand out next is none of the listed numbers.
    fill(&app).await;
    let listed: HashSet<&str> = list.lines().map(|l| l.split([',', '\t']).next().unwrap().trim()).collect();
    let next = confirm_numbers(&app, 100).await;
    assert!(next.iter().all(|c| !listed.contains(c.as_str())));
    app.stop().await;
}

#[tokio::test]
async fn a_list_with_invalid_lines_is_reported_and_never_applied() {
    let (db, app) = filled_pools().await;
    let good = confirm_numbers(&app, 3).await;
    let mut typo = good[0].clone().into_bytes();
    typo[3] = if typo[3] == b'0' { b'1' } else { b'0' };
    let typo = String::from_utf8(typo).unwrap();
    let list = format!("{}\n{typo}\n99\nnot-a-code\n{}\n{},bad\u{7}ref\n", good[1], good[2], good[0]);
    let before = snapshot(&db.pool).await;

    let dry = reconcile_ok(&app, &list, false).await;
    assert_eq!((&dry["applied"], &dry["lines"], &dry["invalid"]), (&json!(false), &json!(6), &json!(4)));
    let examples = dry["invalid_examples"].to_string();
    for (line, why) in [(2, "check digit"), (3, "prefix"), (4, "prefix"), (6, "control characters")] {
        assert!(examples.contains(&format!("line {line}:")) && examples.contains(why), "{line} {why}: {examples}");
    }
    let problem = common::assert_problem(reconcile(&app, &list, true).await, 422).await;
    assert!(problem["detail"].as_str().unwrap().contains("4 of 6 lines"), "{problem}");
    assert_eq!(snapshot(&db.pool).await, before);

    // An empty list is a mistake (a wrong file), not a list of no customers.
    for body in ["", "\n  \n"] {
        let problem = common::assert_problem(reconcile(&app, body, true).await, 400).await;
        assert!(problem["detail"].as_str().unwrap().contains("the list is empty"), "{problem}");
    }
    assert_eq!(snapshot(&db.pool).await, before);

    // Only an admin may reconcile.
    let key =
        common::create_key(&db.pool, &[cifpool::auth::Scope::CifReserve, cifpool::auth::Scope::CifRead], None).await;
    let r = client_with_key(&key).post(app.url("/admin/pools/reconcile")).body(list).send().await.unwrap();
    common::assert_problem(r, 403).await;
    app.stop().await;
}
