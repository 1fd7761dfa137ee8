//! Pool configuration: validation and reconciliation with what the database already issued.

use crate::common;

use std::io::Write;

use cifpool::cif::Pools;
use cifpool::config::Settings;
use cifpool::internals::refill::{RefillOptions, RefillOutcome, refill};
use common::{fresh_database, test_master_key, test_pool};

fn pools_file(pools: &[(&str, &str, u32)]) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    for (name, prefix, digits) in pools {
        writeln!(
            f,
            "[[pools]]\nname = \"{name}\"\nprefix = \"{prefix}\"\ndigits = {digits}\nkey_id = \"k\"\nlow_watermark = 10\n\
             batch_size = 10\nmax_batches_per_run = 1\nlease_ttl = \"1m\"\nrefill_schedule = \"*/15 * * * * *\"\n\
             reclaim_schedule = \"*/30 * * * * *\"\n"
        )
        .unwrap();
    }
    f
}

#[test]
fn overlapping_code_spaces_are_refused() {
    // Same total length, "1" starts "12": a code 12xxxxxxxxxx could belong to either.
    let f = pools_file(&[("individual", "1", 10), ("business", "12", 9)]);
    let msg = Settings::load_with_env(Some(f.path()), Vec::new()).unwrap_err().to_string();
    assert!(msg.contains("pools[1].prefix") && msg.contains("overlaps"), "{msg}");
    // Equal prefixes and lengths.
    let f = pools_file(&[("individual", "7", 9), ("business", "7", 9)]);
    let msg = Settings::load_with_env(Some(f.path()), Vec::new()).unwrap_err().to_string();
    assert!(msg.contains("pools[1].prefix") && msg.contains("overlaps"), "{msg}");
    // Different lengths never collide; neither do disjoint prefixes.
    let f = pools_file(&[("individual", "1", 10), ("business", "12", 10), ("sme", "3", 9)]);
    Settings::load_with_env(Some(f.path()), Vec::new()).unwrap();
}

#[test]
fn bad_pool_fields_name_the_key() {
    for (pools, key) in [
        (vec![("individual", "1", 5)], "pools[0].digits"),
        (vec![("individual", "1x", 9)], "pools[0].prefix"),
        (vec![("Bad Name", "1", 9)], "pools[0].name"),
        (vec![("a", "1", 9), ("a", "2", 9)], "pools[1].name"),
    ] {
        let f = pools_file(&pools);
        let msg = Settings::load_with_env(Some(f.path()), Vec::new()).unwrap_err().to_string();
        assert!(msg.contains(key), "expected {key} in {msg}");
    }
    let f = pools_file(&[("individual", "1", 9)]);
    let text = std::fs::read_to_string(f.path()).unwrap().replace("*/15 * * * * *", "every tuesday-ish");
    std::fs::write(f.path(), text).unwrap();
    let msg = Settings::load_with_env(Some(f.path()), Vec::new()).unwrap_err().to_string();
    assert!(msg.contains("pools[0].refill_schedule"), "{msg}");
}

#[test]
fn a_pool_needs_only_its_identity_and_missing_keys_are_named_with_dots() {
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    writeln!(f, "[[pools]]\nname = \"retail\"\nprefix = \"3\"\ndigits = 9\ncheck = \"luhn\"\nkey_id = \"2026-12\"")
        .unwrap();
    let s = Settings::load_with_env(Some(f.path()), Vec::new()).unwrap();
    let p = &s.pools[0];
    assert_eq!((p.low_watermark, p.batch_size, p.max_batches_per_run), (5_000, 2_000, 5));
    assert_eq!(p.lease_ttl, std::time::Duration::from_secs(300));
    assert_eq!((p.refill_schedule.as_str(), p.reclaim_schedule.as_str()), ("*/15 * * * * *", "*/30 * * * * *"));

    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    writeln!(f, "[[pools]]\nname = \"retail\"\nprefix = \"3\"\nkey_id = \"2026-12\"").unwrap();
    let msg = Settings::load_with_env(Some(f.path()), Vec::new()).unwrap_err().to_string();
    assert!(msg.contains("pools[0].digits"), "{msg}");
}

#[tokio::test]
async fn pinned_fields_cannot_change_once_codes_were_issued() {
    let db = fresh_database().await;
    let key = test_master_key();
    let original = vec![test_pool("individual", "1")];
    let pools = Pools::reconcile(&db.pool, &original, &key).await.unwrap();

    // The format is pinned when the pool is created, before any code exists: an instance started with
    // another one is refused at once.
    let mut early = original.clone();
    early[0].digits = 10;
    let msg = Pools::reconcile(&db.pool, &early, &key).await.unwrap_err().to_string();
    assert!(msg.contains("digits") && msg.contains("since the pool was created"), "{msg}");
    let pools_again = Pools::reconcile(&db.pool, &original, &key).await.unwrap();
    drop(pools);
    refill(&db.pool, pools_again.get("individual").unwrap(), RefillOptions { force: true, ..Default::default() })
        .await
        .unwrap();

    for (field, change) in [
        (
            "key_id",
            Box::new(|p: &mut cifpool::config::PoolSettings| p.key_id = "rotated".into()) as Box<dyn Fn(&mut _)>,
        ),
        ("prefix", Box::new(|p: &mut cifpool::config::PoolSettings| p.prefix = "9".into())),
        ("digits", Box::new(|p: &mut cifpool::config::PoolSettings| p.digits = 12)),
        ("check", Box::new(|p: &mut cifpool::config::PoolSettings| p.check = cifpool::code::CheckScheme::Luhn)),
    ] {
        let mut changed = original.clone();
        change(&mut changed[0]);
        let msg = Pools::reconcile(&db.pool, &changed, &key).await.unwrap_err().to_string();
        assert!(msg.contains("individual") && msg.contains(field), "{field}: {msg}");
    }
    // Operational settings are free to change.
    let mut tuned = original.clone();
    tuned[0].low_watermark = 50_000;
    tuned[0].batch_size = 5000;
    Pools::reconcile(&db.pool, &tuned, &key).await.unwrap();
}

#[tokio::test]
async fn a_new_pool_may_not_reuse_a_retired_pools_code_space() {
    let db = fresh_database().await;
    let key = test_master_key();
    let pools = Pools::reconcile(&db.pool, &[test_pool("business", "2")], &key).await.unwrap();
    refill(&db.pool, pools.get("business").unwrap(), RefillOptions { force: true, ..Default::default() })
        .await
        .unwrap();
    let msg = Pools::reconcile(&db.pool, &[test_pool("sme", "2")], &key).await.unwrap_err().to_string();
    assert!(msg.contains("sme") && msg.contains("business"), "{msg}");
}

#[tokio::test]
async fn different_pools_get_different_permutations() {
    let db = fresh_database().await;
    let pools =
        Pools::reconcile(&db.pool, &[test_pool("individual", "1"), test_pool("business", "2")], &test_master_key())
            .await
            .unwrap();
    let a: Vec<String> = (0..20).map(|c| pools.get("individual").unwrap().codec.encode(c)[1..].to_string()).collect();
    let b: Vec<String> = (0..20).map(|c| pools.get("business").unwrap().codec.encode(c)[1..].to_string()).collect();
    assert_ne!(a, b);
}

#[tokio::test]
async fn a_different_master_key_is_refused_once_codes_exist() {
    let db = fresh_database().await;
    let pools = Pools::reconcile(&db.pool, &[test_pool("individual", "1")], &test_master_key()).await.unwrap();
    refill(&db.pool, pools.get("individual").unwrap(), RefillOptions { force: true, ..Default::default() })
        .await
        .unwrap();
    let other = cifpool::keys::MasterKey::generate();
    let msg = Pools::reconcile(&db.pool, &[test_pool("individual", "1")], &other).await.unwrap_err().to_string();
    assert!(msg.contains("individual") && msg.contains("master key"), "{msg}");
    assert!(!msg.contains(&other.to_hex()), "the key itself is never printed");
}

#[tokio::test]
async fn two_instances_starting_together_on_a_new_pool_with_different_keys_cannot_both_serve_it() {
    let db = fresh_database().await;
    let other_master = cifpool::keys::MasterKey::generate();
    let mut other_key_id = vec![test_pool("individual", "1")];
    other_key_id[0].key_id = "test-2".into();
    // Started together: neither has generated a code yet.
    let first = Pools::reconcile(&db.pool, &[test_pool("individual", "1")], &test_master_key()).await.unwrap();
    let msg = Pools::reconcile(&db.pool, &[test_pool("individual", "1")], &other_master).await.unwrap_err().to_string();
    assert!(msg.contains("individual") && msg.contains("key check") && msg.contains("master key"), "{msg}");
    assert!(!msg.contains(&other_master.to_hex()), "the key itself is never printed");
    let msg = Pools::reconcile(&db.pool, &other_key_id, &test_master_key()).await.unwrap_err().to_string();
    assert!(msg.contains("key_id"), "{msg}");

    // A row changed under a running instance: its refill refuses to advance the counter.
    let pool = first.get("individual").unwrap();
    sqlx::query("UPDATE cif_pools SET key_check = 'changed-elsewhere' WHERE name = 'individual'")
        .execute(&db.pool)
        .await
        .unwrap();
    let summary = refill(&db.pool, pool, RefillOptions { force: true, ..Default::default() }).await.unwrap();
    assert_eq!((summary.outcome, summary.codes_added), (RefillOutcome::Refused, 0));
    let next: i64 = sqlx::query_scalar("SELECT next_counter FROM cif_pools").fetch_one(&db.pool).await.unwrap();
    assert_eq!(next, 0, "no counter was taken");
}

#[tokio::test]
async fn a_pool_created_before_key_checks_gets_one_pinned_at_the_next_start() {
    let db = fresh_database().await;
    let pools = Pools::reconcile(&db.pool, &[test_pool("individual", "1")], &test_master_key()).await.unwrap();
    refill(&db.pool, pools.get("individual").unwrap(), RefillOptions { force: true, ..Default::default() })
        .await
        .unwrap();
    sqlx::query("UPDATE cif_pools SET key_check = NULL").execute(&db.pool).await.unwrap();
    // Another key is still caught by the stored codes, and pins nothing.
    let other = cifpool::keys::MasterKey::generate();
    let msg = Pools::reconcile(&db.pool, &[test_pool("individual", "1")], &other).await.unwrap_err().to_string();
    assert!(msg.contains("individual") && msg.contains("master key"), "{msg}");
    let stored: Option<String> =
        sqlx::query_scalar("SELECT key_check FROM cif_pools").fetch_one(&db.pool).await.unwrap();
    assert_eq!(stored, None);
    // The right key pins its check value.
    let pools = Pools::reconcile(&db.pool, &[test_pool("individual", "1")], &test_master_key()).await.unwrap();
    let stored: Option<String> =
        sqlx::query_scalar("SELECT key_check FROM cif_pools").fetch_one(&db.pool).await.unwrap();
    assert_eq!(stored.as_deref(), Some(pools.get("individual").unwrap().key_check.as_str()));
}
