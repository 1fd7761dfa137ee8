//! The claim order is defined once ([`ClaimOrder::columns`]); the worker groups' claim statement
//! (Postgres' `ORDER BY`) and the simulator ([`GroupPolicy::compare`]) must order any set of jobs
//! identically, ties, negative zero, infinities and NaN fair keys included.

mod common;

use std::time::Duration;

use cifpool::queue::policy::{ClaimOrder, GroupPolicy, JobKey};
use cifpool::queue::store;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use sqlx::PgPool;

/// Fair keys from a small pool, so ties are common, plus the values where float orders differ.
fn fair_key() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        Just(-0.0),
        Just(f64::NAN),
        Just(f64::INFINITY),
        Just(f64::NEG_INFINITY),
        (-3i32..3).prop_map(f64::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()),
    ]
}

/// Jobs of one class (priorities 0 to 3) in insertion order; ids are assigned by the database.
fn jobs() -> impl Strategy<Value = Vec<(i16, f64)>> {
    prop::collection::vec((0i16..4, fair_key()), 1..30)
}

/// Inserts the jobs, then claims them one at a time with the real claim statement of a group with
/// `order`; returns the ids in claim order and in the order `GroupPolicy::compare` gives.
async fn both_orders(db: &PgPool, order: ClaimOrder, capped: bool, jobs: &[(i16, f64)]) -> (Vec<i64>, Vec<i64>) {
    sqlx::query("TRUNCATE notification_jobs").execute(db).await.unwrap();
    let mut keys = Vec::new();
    for &(priority, fair_key) in jobs {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts) \
             VALUES ('c', $1, 't', $2, 'r', 'null', 1) RETURNING id",
        )
        .bind(priority)
        .bind(fair_key)
        .fetch_one(db)
        .await
        .unwrap();
        keys.push(JobKey { id, priority, fair_key });
    }
    let policy = GroupPolicy { name: "g".into(), size: 1, classes: vec!["c".into()], order };
    let sql = store::claim_sql(&policy, capped);
    let mut claimed = Vec::new();
    loop {
        let got = store::claim(db, &sql, 1, Duration::from_secs(60), &["c".into()], &[i32::MAX], &[0, 1, 2, 3], &[])
            .await
            .unwrap();
        let Some(job) = got.first() else { break };
        claimed.push(job.id);
    }
    keys.sort_by(|a, b| policy.compare(a, b));
    (claimed, keys.iter().map(|k| k.id).collect())
}

#[test]
fn sql_claim_order_and_in_memory_order_agree() {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let db = runtime.block_on(async { common::fresh_database().await.pool });
    let mut runner = TestRunner::new(Config { cases: 48, failure_persistence: None, ..Config::default() });
    for (order, capped) in [(ClaimOrder::Priority, true), (ClaimOrder::Priority, false), (ClaimOrder::Fifo, true)] {
        runner
            .run(&jobs(), |jobs| {
                let (sql, memory) = runtime.block_on(both_orders(&db, order, capped, &jobs));
                if sql == memory {
                    Ok(())
                } else {
                    Err(TestCaseError::fail(format!("{order:?}: claim order {sql:?}, in memory {memory:?}")))
                }
            })
            .unwrap();
    }
}

#[test]
fn order_columns_render_the_claim_index() {
    assert_eq!(ClaimOrder::Priority.sql_order_by(), "priority, fair_key, id");
    let a = JobKey { id: 1, priority: 0, fair_key: f64::NAN };
    let b = JobKey { id: 2, priority: 0, fair_key: f64::INFINITY };
    assert!(ClaimOrder::Priority.compare(&b, &a).is_lt(), "NaN sorts after every number, as in Postgres");
    let z = JobKey { id: 3, priority: 0, fair_key: -0.0 };
    let p = JobKey { id: 4, priority: 0, fair_key: 0.0 };
    assert!(ClaimOrder::Priority.compare(&z, &p).is_lt(), "-0 = 0, so the id decides");
}
