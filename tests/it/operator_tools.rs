//! The tools ops reach for during an incident, through the API and the command line alike: dead
//! letters found by tenant and error and replayed at a pace with extra attempts, the audit trail cut
//! to a time window, and `cifpool migrate` on an empty database.

use crate::common;

use cifpool::internals::fake_provider::FakeBehaviour;
use cifpool::internals::worker::Outcome;
use cifpool::queue::policy::Strategy;
use common::queue_env::{Env, env};
use common::{TEST_ADMIN_TOKEN, assert_cli_error, cifpool_cli, fresh_database, json_lines};
use serde_json::{Value, json};

/// Inserts a dead promo job of `tenant` whose last error is `error`; returns its id.
async fn dead(e: &Env, tenant: &str, error: &str) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, status, \
                                        attempts, finished_at, last_error) \
         VALUES ('promo', 2, $1, 1, 'device', '{}', 5, 'dead', 5, now(), $2) RETURNING id",
    )
    .bind(tenant)
    .bind(error)
    .fetch_one(&e.db.pool)
    .await
    .unwrap()
}

async fn admin_get(e: &Env, path: &str) -> Value {
    let r = e.app.client.get(e.app.url(path)).bearer_auth(TEST_ADMIN_TOKEN).send().await.unwrap();
    assert_eq!(r.status(), 200, "{path}");
    r.json().await.unwrap()
}

fn ids(page: &Value) -> Vec<i64> {
    page["jobs"].as_array().unwrap().iter().map(|j| j["id"].as_i64().unwrap()).collect()
}

/// The dead letters of one tenant and one error, oldest first, through the API and the command
/// line; then replayed at 2 a second with 3 more attempts each, the rest left dead.
#[tokio::test]
async fn dead_letters_are_found_by_tenant_and_error_and_replayed_at_a_pace() {
    let e = env().await;
    let a_422 = [dead(&e, "a", "HTTP 422: bad number").await, dead(&e, "a", "HTTP 422: bad number").await];
    let a_timeout = dead(&e, "a", "timed out after 5s").await;
    let b_422 = dead(&e, "b", "HTTP 422: bad number").await;
    let a_422_late = dead(&e, "a", "HTTP 422: opted out").await;

    assert_eq!(ids(&admin_get(&e, "/admin/dlq?tenant=a").await), vec![a_422[0], a_422[1], a_timeout, a_422_late]);
    assert_eq!(ids(&admin_get(&e, "/admin/dlq?error=HTTP%20422").await), vec![a_422[0], a_422[1], b_422, a_422_late]);
    assert_eq!(ids(&admin_get(&e, "/admin/dlq?tenant=a&error=HTTP%20422").await), vec![a_422[0], a_422[1], a_422_late]);
    assert_eq!(ids(&admin_get(&e, "/admin/dlq?tenant=a&error=HTTP%20422&limit=1").await), vec![a_422[0]]);
    let cli: Vec<i64> =
        json_lines(&cifpool_cli(&e.db.url, &["dlq", "list", "--tenant", "a", "--error", "HTTP 422", "--limit", "10"]))
            .iter()
            .map(|j| j["id"].as_i64().unwrap())
            .collect();
    assert_eq!(cli, vec![a_422[0], a_422[1], a_422_late]);
    assert_cli_error(&cifpool_cli(&e.db.url, &["dlq", "list", "--limit", "0"]), "--limit must be at least 1");

    let r = e
        .app
        .client
        .post(e.app.url("/admin/dlq/replay"))
        .bearer_auth(TEST_ADMIN_TOKEN)
        .json(&json!({ "tenant": "a", "error": "HTTP 422", "max": 3, "rate_per_sec": 2.0, "extra_attempts": 3 }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap(), json!({ "replayed": 3 }));
    // One due every half second, oldest first, each with three more attempts.
    let replayed: Vec<(i64, String, i32, f64)> = sqlx::query_as(
        "SELECT id, status, max_attempts, \
                extract(epoch FROM run_after - min(run_after) OVER ())::float8 \
         FROM notification_jobs WHERE status <> 'dead' ORDER BY id",
    )
    .fetch_all(&e.db.pool)
    .await
    .unwrap();
    let expected = [(a_422[0], 0.0), (a_422[1], 0.5), (a_422_late, 1.0)];
    assert_eq!(replayed.len(), 3, "{replayed:?}");
    for ((id, status, max_attempts, offset), (want_id, want_offset)) in replayed.iter().zip(expected) {
        assert_eq!((*id, status.as_str(), *max_attempts), (want_id, "scheduled", 8));
        assert!((offset - want_offset).abs() < 1e-6, "job {id} due {offset} s after the first");
    }
    let still_dead: Vec<i64> = sqlx::query_scalar("SELECT id FROM notification_jobs WHERE status = 'dead' ORDER BY id")
        .fetch_all(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(still_dead, vec![a_timeout, b_422]);
    let audit: Value = sqlx::query_scalar("SELECT detail FROM audit_events WHERE action = 'dlq.replayed'")
        .fetch_one(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(
        (&audit["replayed"], &audit["tenant"], &audit["error"], &audit["rate_per_sec"], &audit["extra_attempts"]),
        (&json!(3), &json!("a"), &json!("HTTP 422"), &json!(2), &json!(3)),
        "{audit}"
    );

    // The stager makes each claimable when its time comes: the first now, the next half a second on.
    assert_eq!(e.promote().await, 1);
    sqlx::query(
        "UPDATE notification_jobs SET run_after = run_after - interval '0.5 seconds' WHERE status = 'scheduled'",
    )
    .execute(&e.db.pool)
    .await
    .unwrap();
    assert_eq!(e.promote().await, 1);

    // From the command line: the rest, with the default single extra attempt.
    let out = cifpool_cli(&e.db.url, &["dlq", "replay", "--max", "5", "--rate", "4"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "replayed 2 jobs at 4/s");
    let attempts: Vec<i32> =
        sqlx::query_scalar("SELECT max_attempts FROM notification_jobs WHERE id = ANY($1) ORDER BY id")
            .bind(vec![a_timeout, b_422])
            .fetch_all(&e.db.pool)
            .await
            .unwrap();
    assert_eq!(attempts, vec![6, 6]);
    let actor: String =
        sqlx::query_scalar("SELECT actor FROM audit_events WHERE action = 'dlq.replayed' ORDER BY id DESC LIMIT 1")
            .fetch_one(&e.db.pool)
            .await
            .unwrap();
    assert!(actor.starts_with("cli:"), "{actor}");
    assert_cli_error(&cifpool_cli(&e.db.url, &["dlq", "replay", "--max", "5", "--rate", "0"]), "rate_per_sec");
}

/// A replayed job gets exactly the attempts the replay granted: with a provider that keeps failing,
/// it is tried again `extra_attempts` times and then is dead once more.
#[tokio::test]
async fn a_replayed_job_gets_exactly_its_extra_attempts() {
    let e = env().await;
    e.push.fake.set_behaviour(FakeBehaviour { error_rate: 1.0, ..Default::default() });
    let id = dead(&e, "a", "HTTP 503").await;
    let r = e
        .app
        .client
        .post(e.app.url("/admin/dlq/replay"))
        .bearer_auth(TEST_ADMIN_TOKEN)
        .json(&json!({ "max": 1, "rate_per_sec": 1.0, "extra_attempts": 2 }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap(), json!({ "replayed": 1 }));
    assert_eq!(e.promote().await, 1);
    let group = e.group(Strategy::Priority, 0);
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Retrying(id));
    e.make_due().await;
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Dead(id));
    assert_eq!(e.push.fake.report().calls, 2);
}

/// `since` is inclusive, `until` exclusive, through the API and `cifpool audit`.
#[tokio::test]
async fn the_audit_trail_is_cut_to_a_time_window() {
    let e = env().await;
    let at: Vec<i64> = sqlx::query_scalar(
        "INSERT INTO audit_events (at, action, actor) \
         SELECT t, 'test.window', 'test' FROM unnest(ARRAY['2026-01-01T00:00:00Z', '2026-01-02T00:00:00Z', \
                '2026-01-03T00:00:00Z']::timestamptz[]) AS t RETURNING id",
    )
    .fetch_all(&e.db.pool)
    .await
    .unwrap();
    let e = &e;
    let window = |query: &str| {
        let path = format!("/admin/audit?action=test.window&{query}");
        async move {
            let page = admin_get(e, &path).await;
            let mut ids: Vec<i64> =
                page["events"].as_array().unwrap().iter().map(|v| v["id"].as_i64().unwrap()).collect();
            ids.sort_unstable();
            ids
        }
    };
    assert_eq!(window("since=2026-01-02T00:00:00Z").await, vec![at[1], at[2]]);
    assert_eq!(window("until=2026-01-03T00:00:00Z").await, vec![at[0], at[1]]);
    assert_eq!(window("since=2026-01-02T00:00:00Z&until=2026-01-03T00:00:00Z").await, vec![at[1]]);
    assert_eq!(window("since=2026-01-02T07:00:00%2B07:00&until=2026-01-02T07:00:00%2B07:00").await, Vec::<i64>::new());
    assert_eq!(window("since=2026-01-02T06:00:00%2B07:00").await, vec![at[1], at[2]], "offsets are honoured");

    let cli: Vec<i64> = json_lines(&cifpool_cli(
        &e.db.url,
        &["audit", "--action", "test.window", "--since", "2026-01-02T00:00:00Z", "--until", "2026-01-03T00:00:00Z"],
    ))
    .iter()
    .map(|v| v["id"].as_i64().unwrap())
    .collect();
    assert_eq!(cli, vec![at[1]]);
    let bad = cifpool_cli(&e.db.url, &["audit", "--since", "yesterday"]);
    assert_eq!(bad.status.code(), Some(2), "a bad time is a usage error: {}", String::from_utf8_lossy(&bad.stderr));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--since"));
}

/// `cifpool migrate` builds the schema on an empty database and is a no-op the second time.
#[tokio::test]
async fn migrate_builds_an_empty_database_and_runs_twice() {
    let db = fresh_database().await;
    sqlx::query("DROP SCHEMA public CASCADE").execute(&db.pool).await.unwrap();
    sqlx::query("CREATE SCHEMA public").execute(&db.pool).await.unwrap();
    for run in 1..=2 {
        let out = cifpool_cli(&db.url, &["migrate"]);
        assert!(out.status.success(), "run {run}: {}", String::from_utf8_lossy(&out.stderr));
    }
    let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success ORDER BY version")
        .fetch_all(&db.pool)
        .await
        .unwrap();
    let shipped: Vec<i64> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .map(|f| f.unwrap().file_name().to_string_lossy().split('_').next().unwrap().parse().unwrap())
        .collect::<std::collections::BTreeSet<i64>>()
        .into_iter()
        .collect();
    assert_eq!(applied, shipped, "every shipped migration applied once");
    let tables: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_tables WHERE schemaname = 'public' AND tablename IN ('cif_codes', 'notification_jobs', 'audit_events')",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(tables, 3);
}
