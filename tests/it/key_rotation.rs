//! Key rotation within a pool, on a 6-digit pool where the new key meets the old key's codes often:
//! such counters are skipped, no code is issued twice, codes of both epochs stay readable, holds
//! survive the rotation, and another instance learns of the new epoch by itself.

use crate::common;

use std::collections::HashSet;

use cifpool::code::Cipher;
use cifpool::internals::refill::{RefillOptions, refill};
use common::{assert_problem, fresh_database, spawn_passive_app, test_pool, test_settings_with_pools};
use serde_json::{Value, json};

use crate::cif_api::{count, post_token, reserve_ok};

/// A pool of 10^6 codes, refilled in large batches (the test drives refills itself).
fn tiny_settings(db_url: &str) -> cifpool::config::Settings {
    let mut settings = test_settings_with_pools(db_url);
    let mut tiny = test_pool("tiny", "5");
    tiny.digits = 6;
    tiny.cipher = Some(Cipher::Ff1);
    tiny.batch_size = 50_000;
    tiny.max_batches_per_run = 4;
    tiny.low_watermark = 1_000;
    settings.pools = vec![tiny];
    settings
}

async fn refill_forced(app: &common::TestApp) -> u64 {
    let pool = app.state.cif.pools().get("tiny").unwrap();
    refill(&app.state.db, pool, RefillOptions { force: true, ..Default::default() }).await.unwrap().codes_added
}

#[tokio::test]
async fn a_rotated_key_skips_the_old_keys_codes_and_never_issues_one_twice() {
    let db = fresh_database().await;
    let a = spawn_passive_app(tiny_settings(&db.url)).await;
    let b = spawn_passive_app(tiny_settings(&db.url)).await;

    // Epoch 0: 200,000 codes, a fifth of the space. Five are issued and one is held over the rotation.
    assert_eq!(refill_forced(&a).await, 200_000);
    let mut issued = Vec::new();
    for _ in 0..5 {
        let r = reserve_ok(&a, "tiny").await;
        let (cif, token) = (r["cif"].as_str().unwrap(), r["reservation_token"].as_str().unwrap());
        assert_eq!(post_token(&a, cif, "confirm", token).await.status(), 200);
        issued.push(cif.to_string());
    }
    let held = reserve_ok(&a, "tiny").await;

    // Refused: a key id the pool already used, and one that is not a label.
    let rotate =
        |key_id: &str| a.client.post(a.url("/admin/pools/tiny/rotate-key")).json(&json!({ "key_id": key_id })).send();
    assert_problem(rotate("test-1").await.unwrap(), 409).await;
    assert_problem(rotate("two words").await.unwrap(), 422).await;

    let rotated: Value = rotate("leak-1").await.unwrap().json().await.unwrap();
    assert_eq!(rotated["epoch"], 1);
    assert_eq!(rotated["key_id"], "leak-1");
    assert_eq!(rotated["first_counter"], 200_000);
    assert_eq!(rotated["available_discarded"], 200_000 - 6, "every available code of the old key is gone");
    assert_eq!(rotated["refill"]["outcome"], "refilled");
    let audit =
        count(&db.pool, "SELECT count(*) FROM audit_events WHERE action = 'pool.key_rotated' AND pool = 'tiny'");
    assert_eq!(audit.await, 1);

    // Instance b has not heard of the rotation: its refill learns the new epoch and goes on under it.
    let added_by_b = refill_forced(&b).await;
    assert!(added_by_b > 150_000, "{added_by_b}");
    assert_eq!(b.state.cif.pools().get("tiny").unwrap().keys().current().number, 1);
    let refilled: Vec<(i64, i64, i64)> = sqlx::query_as(
        "SELECT (detail->>'codes')::int8, (detail->>'skipped')::int8, (detail->>'key_epoch')::int8 \
           FROM audit_events WHERE action = 'pool.refilled' AND pool = 'tiny' ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
    .unwrap();
    let (made, skipped) = refilled.iter().filter(|r| r.2 == 1).fold((0, 0), |(m, s), r| (m + r.0, s + r.1));
    assert_eq!(refilled.iter().filter(|r| r.2 == 0).map(|r| r.1).sum::<i64>(), 0, "epoch 0 skips nothing");
    // A fifth of the space was the first key's: about one new counter in five meets one of its codes.
    let share = skipped as f64 / (made + skipped) as f64;
    assert!((0.17..0.23).contains(&share), "{skipped} skipped of {}", made + skipped);
    eprintln!("key rotation: {} counters under the new key, {skipped} skipped (forced collisions)", made + skipped);

    // No code twice, anywhere, and every new code is the new key's.
    let all = "SELECT code FROM cif_codes UNION ALL SELECT code FROM cif_issued";
    let total = count(&db.pool, &format!("SELECT count(*) FROM ({all}) AS c")).await;
    let distinct = count(&db.pool, &format!("SELECT count(DISTINCT code) FROM ({all}) AS c")).await;
    assert_eq!(total, distinct);
    assert_eq!(total, made + 6);

    // Issue 500 more (on both instances): all distinct, none of them an old code.
    let mut seen: HashSet<String> = issued.iter().cloned().collect();
    for i in 0..500 {
        let app = if i % 2 == 0 { &a } else { &b };
        let r = reserve_ok(app, "tiny").await;
        let (cif, token) = (r["cif"].as_str().unwrap(), r["reservation_token"].as_str().unwrap());
        assert_eq!(post_token(app, cif, "confirm", token).await.status(), 200);
        assert!(seen.insert(cif.to_string()), "{cif} issued twice");
        if i < 20 {
            let origin = app.state.cif.locate(cif).await.unwrap();
            assert_eq!((origin.epoch, origin.key_id.as_deref()), (Some(1), Some("leak-1")));
        }
    }
    let duplicates = count(&db.pool, "SELECT count(*) - count(DISTINCT code) FROM cif_issued").await;
    assert_eq!(duplicates, 0);

    // The hold taken before the rotation is confirmed after it; old codes read back as epoch 0.
    let (cif, token) = (held["cif"].as_str().unwrap(), held["reservation_token"].as_str().unwrap());
    assert_eq!(post_token(&b, cif, "confirm", token).await.status(), 200);
    for cif in &issued {
        let looked_up: Value =
            b.client.get(b.url(&format!("/v1/cif/{cif}"))).send().await.unwrap().json().await.unwrap();
        assert_eq!(looked_up["state"], "used");
        assert_eq!(b.state.cif.locate(cif).await.unwrap().epoch, Some(0));
    }
}

#[tokio::test]
async fn an_instance_that_missed_the_rotation_finds_codes_of_the_new_key() {
    let db = fresh_database().await;
    let a = spawn_passive_app(tiny_settings(&db.url)).await;
    let b = spawn_passive_app(tiny_settings(&db.url)).await;
    refill_forced(&a).await;
    a.state.cif.rotate_key("tiny", "leak-1", &cifpool::audit::Actor::system()).await.unwrap();
    // Reserved on a (the new key's code), looked up, extended and confirmed on b, which still knows
    // only epoch 0: each first miss makes b read the pool's epochs again.
    let r = reserve_ok(&a, "tiny").await;
    let (cif, token) = (r["cif"].as_str().unwrap(), r["reservation_token"].as_str().unwrap());
    assert_eq!(b.state.cif.pools().get("tiny").unwrap().keys().current().number, 0);
    let looked_up: Value = b.client.get(b.url(&format!("/v1/cif/{cif}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(looked_up["state"], "reserved", "{looked_up}");
    assert_eq!(b.state.cif.pools().get("tiny").unwrap().keys().current().number, 1);
    assert_eq!(post_token(&b, cif, "extend", token).await.status(), 200);
    assert_eq!(post_token(&b, cif, "confirm", token).await.status(), 200);
}

#[tokio::test]
async fn a_pool_takes_at_most_sixteen_rotations() {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    let actor = cifpool::audit::Actor::system();
    for n in 1..=16 {
        let rotation = app.state.cif.rotate_key("individual", &format!("k{n}"), &actor).await.unwrap();
        assert_eq!(rotation.rotated.epoch, n);
    }
    let refused = app.state.cif.rotate_key("individual", "k17", &actor).await.unwrap_err();
    assert!(refused.to_string().contains("16 times"), "{refused}");
    // Sixteen epochs on: what the pool issues is still distinct and readable.
    let mut seen = HashSet::new();
    for _ in 0..50 {
        let r = reserve_ok(&app, "individual").await;
        let cif = r["cif"].as_str().unwrap().to_string();
        assert_eq!(app.state.cif.locate(&cif).await.unwrap().epoch, Some(16));
        assert!(seen.insert(cif));
    }
}
