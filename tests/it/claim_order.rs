//! The claim order is defined once ([`ClaimOrder::columns`]); the worker groups' claim statement
//! (Postgres' `ORDER BY`) and the simulator ([`GroupPolicy::compare`]) must order any set of jobs
//! identically, ties, negative zero, infinities and NaN fair keys included.

use crate::common;

use std::time::Duration;

use cifpool::cif::Fenced;
use cifpool::internals::queue_store::{self as store, ClaimClass, Commit};
use cifpool::queue::policy::{ClaimOrder, GroupPolicy, JobKey};
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

/// Class `c<priority>` of that priority, sending through `provider`, which has room for `free`.
fn class(priority: i16, provider: &str, free: i32, cap_binds: bool) -> ClaimClass {
    ClaimClass {
        name: format!("c{priority}"),
        priority,
        tenant_cap: i32::MAX,
        cap_binds,
        provider: provider.into(),
        free,
    }
}

fn policy(order: ClaimOrder, classes: &[ClaimClass]) -> GroupPolicy {
    GroupPolicy { name: "g".into(), size: 1, classes: classes.iter().map(|c| c.name.clone()).collect(), order }
}

/// Empties the queue and inserts `jobs` (priority, fair key) as jobs of class `c<priority>`.
async fn insert_jobs(db: &PgPool, jobs: &[(i16, f64)]) -> Vec<JobKey> {
    sqlx::query("TRUNCATE notification_jobs").execute(db).await.unwrap();
    let mut keys = Vec::new();
    for &(priority, fair_key) in jobs {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts) \
             VALUES ('c' || $1, $1, 't', $2, 'r', 'null', 1) RETURNING id",
        )
        .bind(priority)
        .bind(fair_key)
        .fetch_one(db)
        .await
        .unwrap();
        keys.push(JobKey { id, priority, fair_key });
    }
    keys
}

/// Inserts the jobs, then claims them one at a time with the real claim statement of a group with
/// `order`; returns the ids in claim order and in the order `GroupPolicy::compare` gives.
async fn both_orders(db: &PgPool, order: ClaimOrder, capped: bool, jobs: &[(i16, f64)]) -> (Vec<i64>, Vec<i64>) {
    let mut keys = insert_jobs(db, jobs).await;
    let classes: Vec<ClaimClass> = (0..4).map(|p| class(p, "p", i32::MAX, capped)).collect();
    let policy = policy(order, &classes);
    // One job a claim, from a statement that picks four: the one it takes is still the first in order.
    let sql = store::claim_sql(&policy, capped, 4, Commit::Unflushed);
    let mut claimed = Vec::new();
    loop {
        let got = store::claim(db, &sql, 1, Duration::from_secs(60), &classes, &Default::default(), &test_seal())
            .await
            .unwrap();
        assert_eq!(got.stopped_at, None, "room for every job");
        let Some(job) = got.jobs.first() else { break };
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

/// Inserts the jobs (class `c<priority>`), classes 0 and 1 sending through provider `a` with room
/// for `free.0`, 2 and 3 through `b` with room for `free.1`, and claims up to `wanted` at once with a
/// statement that picks up to 8. Returns what was claimed (in claim order) and where the claim
/// stopped, and what the order says it should be: the longest head of the order, at most `wanted`
/// long, in which neither provider gets more jobs than its room; a stop is reported only within it.
async fn room_gate(
    db: &PgPool,
    order: ClaimOrder,
    capped: bool,
    jobs: &[(i16, f64)],
    free: (i32, i32),
    wanted: usize,
) -> ((Vec<i64>, Option<String>), (Vec<i64>, Option<String>)) {
    let mut keys = insert_jobs(db, jobs).await;
    let classes: Vec<ClaimClass> =
        (0..4).map(|p| if p < 2 { class(p, "a", free.0, capped) } else { class(p, "b", free.1, capped) }).collect();
    let policy = policy(order, &classes);
    let got = store::claim(
        db,
        &store::claim_sql(&policy, capped, 8, Commit::Unflushed),
        wanted,
        Duration::from_secs(60),
        &classes,
        &Default::default(),
        &test_seal(),
    )
    .await
    .unwrap();
    keys.sort_by(|a, b| policy.compare(a, b));
    // An UPDATE returns its rows in no set order: put them in claim order to compare.
    let rank: std::collections::HashMap<i64, usize> = keys.iter().enumerate().map(|(i, k)| (k.id, i)).collect();
    let mut ids: Vec<i64> = got.jobs.iter().map(|j| j.id).collect();
    ids.sort_by_key(|id| rank[id]);
    let (mut used, mut want, mut stopped) = ((0, 0), Vec::new(), None);
    for k in &keys {
        if want.len() == wanted {
            break;
        }
        let (n, room) = if k.priority < 2 { (&mut used.0, free.0) } else { (&mut used.1, free.1) };
        *n += 1;
        if *n > room {
            stopped = Some(format!("c{}", k.priority));
            break;
        }
        want.push(k.id);
    }
    ((ids, got.stopped_at), (want, stopped))
}

/// A claim keeps the group's order when a provider has no room: it takes the jobs ahead of the first
/// job that does not fit and stops there, however many jobs of another provider come after it.
#[test]
fn a_claim_stops_at_the_first_job_its_provider_has_no_room_for() {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let db = runtime.block_on(async { common::fresh_database().await.pool });
    let mut runner = TestRunner::new(Config { cases: 32, failure_persistence: None, ..Config::default() });
    for (order, capped) in [(ClaimOrder::Priority, true), (ClaimOrder::Priority, false), (ClaimOrder::Fifo, false)] {
        runner
            .run(&(jobs(), 0i32..4, 0i32..4, 1usize..=8), |(jobs, a, b, wanted)| {
                let (sql, memory) = runtime.block_on(room_gate(&db, order, capped, &jobs, (a, b), wanted));
                if sql == memory {
                    Ok(())
                } else {
                    Err(TestCaseError::fail(format!(
                        "{order:?}, room {a}/{b}, {wanted} wanted: claimed {sql:?}, the order says {memory:?}"
                    )))
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

/// The rows here are written in clear, as jobs stored before sealing are: the seal only opens sealed ones.
fn test_seal() -> cifpool::internals::seal::Seal {
    cifpool::internals::seal::Seal::new(&crate::common::test_master_key(), "test", true)
}

/// The jobs of one claim share the token drawn for it, and each fenced finish still lands on its own
/// job only. The claim's unflushed commit is its own: the pooled connection it ran on commits its
/// next statement flushed again (a reservation may be the next to use it).
#[tokio::test]
async fn a_claims_jobs_share_its_token_and_its_unflushed_commit_stays_with_it() {
    let db = common::fresh_database().await;
    let one = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&db.url).await.unwrap();
    insert_jobs(&one, &[(0, 1.0), (0, 2.0), (0, 3.0)]).await;
    let classes = [class(0, "p", 8, true)];
    let policy = policy(ClaimOrder::Priority, &classes);
    // The test cluster runs with synchronous_commit off: this session commits flushed, as in production.
    sqlx::query("SET synchronous_commit = on").execute(&one).await.unwrap();
    for (capped, commit) in [(true, Commit::Flushed), (true, Commit::Unflushed), (false, Commit::Unflushed)] {
        sqlx::query("UPDATE notification_jobs SET status = 'pending', payload = '{}', lease_token = NULL, lease_expires_at = NULL")
            .execute(&one)
            .await
            .unwrap();
        let sql = store::claim_sql(&policy, capped, 4, commit);
        assert_eq!(sql.contains("synchronous_commit"), commit == Commit::Unflushed, "{sql}");
        let got = store::claim(&one, &sql, 3, Duration::from_secs(60), &classes, &Default::default(), &test_seal())
            .await
            .unwrap();
        assert_eq!(got.jobs.len(), 3, "{:?} {:?}", got.stopped_at, got.unreadable);
        assert!(got.jobs.iter().all(|j| j.token == got.jobs[0].token), "one token for the claim");
        let after: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&one).await.unwrap();
        assert_eq!(after, "on", "the claim's setting outlived its transaction");

        let (first, others) = got.jobs.split_first().unwrap();
        assert_eq!(store::mark_sent(&one, first, "p", None).await.unwrap(), Fenced::Done);
        let states: Vec<(i64, String)> =
            sqlx::query_as("SELECT id, status FROM notification_jobs ORDER BY id").fetch_all(&one).await.unwrap();
        for (id, status) in states {
            let want = if id == first.id { "sent" } else { "sending" };
            assert_eq!(status, want, "job {id} after finishing job {} with the shared token", first.id);
        }
        assert_eq!(store::mark_sent(&one, first, "p", None).await.unwrap(), Fenced::LeaseLost, "finished once");
        for job in others {
            assert_eq!(store::mark_sent(&one, job, "p", None).await.unwrap(), Fenced::Done);
        }
    }
}
