//! Pool configuration: validation and reconciliation with what the database already issued.

mod common;

use std::io::Write;

use cifpool::cif::Pools;
use cifpool::cif::refill::{RefillOptions, refill};
use cifpool::config::Settings;
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
    assert!(Settings::load_with_env(Some(f.path()), Vec::new()).is_err());
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

#[tokio::test]
async fn pinned_fields_cannot_change_once_codes_were_issued() {
    let db = fresh_database().await;
    let key = test_master_key();
    let original = vec![test_pool("individual", "1")];
    let pools = Pools::reconcile(&db.pool, &original, &key).await.unwrap();

    // Before any code exists the format may still change.
    let mut early = original.clone();
    early[0].digits = 10;
    Pools::reconcile(&db.pool, &early, &key).await.unwrap();
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
        ("check", Box::new(|p: &mut cifpool::config::PoolSettings| p.check = cifpool::code::check::CheckScheme::Luhn)),
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
