//! Budgets for the whole deployment: several app instances on one database, one provider stub that
//! records what a gateway would see (calls in flight, arrival times), and the limits that must hold
//! across every instance: provider concurrency, provider rate, `Retry-After`, tenant caps. Where a
//! limit is a matter of steps (a sync, a claim), the test drives them; where it is a matter of time
//! (a rate), real instances run.

use crate::common;

use std::time::{Duration, Instant};

use cifpool::config::Settings;
use cifpool::internals::budget::Room;
use cifpool::internals::fake_provider::FakeBehaviour;
use cifpool::internals::worker::Outcome;
use cifpool::queue::policy::Strategy;
use common::queue_env::{drain, env};
use common::{FakeServer, TestApp, fake_server, fresh_database, spawn_app_with, test_settings_with_pools};
use serde_json::{Value, json};
use sqlx::PgPool;

/// Settings of one instance: both providers at `sms`, `budget` calls at once for the deployment, a
/// short lease so a dead instance's share comes back quickly.
fn settings(db_url: &str, sms: &FakeServer, budget: u32, workers: usize) -> Settings {
    let mut s = test_settings_with_pools(db_url);
    common::use_fake_providers(&mut s, sms, sms);
    let sms = s.queue.providers.get_mut("sms").unwrap();
    sms.max_concurrency = budget;
    sms.min_concurrency = 2;
    s.queue.workers = workers;
    s.queue.reserved = 4;
    s.queue.lease = Duration::from_secs(6);
    s.queue.poll_interval = Duration::from_millis(50);
    s
}

async fn enqueue(app: &TestApp, class: &str, tenant: &str, n: usize) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(5000) {
        let jobs: Vec<Value> = chunk.iter().map(|i| json!({ "recipient": format!("+8490{i:07}") })).collect();
        let r = app
            .client
            .post(app.url("/v1/notifications/batch"))
            .json(&json!({ "class": class, "tenant": tenant, "jobs": jobs }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());
    }
}

async fn count(db: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string())).fetch_one(db).await.unwrap()
}

/// Waits until every job is finished (or panics after `limit`), then checks that each was sent once.
async fn all_sent(db: &PgPool, jobs: i64, limit: Duration) {
    let by = Instant::now() + limit;
    while count(db, "SELECT count(*) FROM notification_jobs WHERE finished_at IS NOT NULL").await < jobs {
        assert!(Instant::now() < by, "jobs still unfinished after {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(count(db, "SELECT count(*) FROM notification_jobs WHERE status = 'sent'").await, jobs, "all sent");
    assert_eq!(count(db, "SELECT count(*) FROM notification_results").await, jobs, "one result each");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_never_exceed_the_provider_budget_and_a_dead_ones_share_comes_back() {
    let db = fresh_database().await;
    let sms = fake_server(FakeBehaviour { latency_ms: 15, jitter_ms: 10, ..Default::default() }).await;
    let mut apps = Vec::new();
    for _ in 0..3 {
        apps.push(spawn_app_with(settings(&db.url, &sms, 20, 64)).await);
    }
    enqueue(&apps[0], "transactional", "bank", 3000).await;
    // Let all three take part, then kill one mid-run.
    let by = Instant::now() + Duration::from_secs(20);
    while count(&db.pool, "SELECT count(DISTINCT member) FROM provider_shares WHERE provider = 'sms' AND share > 0")
        .await
        < 3
    {
        assert!(Instant::now() < by, "three instances never shared the provider");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let victim = apps.pop().unwrap();
    let dead = victim.state.notifications.runtime().member;
    let victim_timeout = victim.state.settings.queue.providers["sms"].timeout;
    victim.kill();
    // Its share stays counted until its lease (6 s) expires, then goes back to the others: the lease
    // is at most one lease ahead, and once it has passed the next sync of a live pod drops it.
    let ahead: f64 = sqlx::query_scalar(
        "SELECT coalesce(max(extract(epoch FROM lease_expires_at - now())), 0)::float8 FROM provider_shares \
         WHERE member = $1",
    )
    .bind(dead)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert!(ahead <= 6.0, "the dead pod's share is leased {ahead} s ahead");
    // A share's lease always outlasts the provider timeout, so the dead pod's last calls are over
    // before anyone can take its share; keep that true while skipping the rest of the lease.
    tokio::time::sleep(victim_timeout).await;
    sqlx::query("UPDATE provider_shares SET lease_expires_at = now() - interval '1 millisecond' WHERE member = $1")
        .bind(dead)
        .execute(&db.pool)
        .await
        .unwrap();
    apps[0].state.notifications.runtime().sync_budgets(&db.pool).await;
    let rows = count(&db.pool, &format!("SELECT count(*) FROM provider_shares WHERE member = '{dead}'")).await;
    assert_eq!(rows, 0, "a live pod's sync left the expired share in place");
    all_sent(&db.pool, 3000, Duration::from_secs(120)).await;
    let report = sms.fake.report();
    eprintln!("peak in flight at the provider: {} (budget 20), {report:?}", report.peak_in_flight);
    assert!(report.peak_in_flight <= 20, "the provider saw {} calls at once", report.peak_in_flight);
    assert!(report.peak_in_flight >= 10, "the budget was used ({} at most)", report.peak_in_flight);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_rate_limit_holds_across_instances() {
    let db = fresh_database().await;
    let sms = fake_server(FakeBehaviour { latency_ms: 5, ..Default::default() }).await;
    let mut apps = Vec::new();
    for _ in 0..3 {
        let mut s = settings(&db.url, &sms, 50, 32);
        s.queue.providers.get_mut("sms").unwrap().max_rate_per_second = Some(30.0);
        apps.push(spawn_app_with(s).await);
    }
    enqueue(&apps[0], "transactional", "bank", 2000).await;
    // An app serves HTTP before its worker groups and budget sync have started; in a full `cargo
    // test` on two cores that once took up to 10 s (mostly the scheduler's search for a February
    // 30th, since gone). Measure once all three pods hold a share and send.
    let waited = std::time::Instant::now();
    while count(&db.pool, "SELECT count(*) FROM provider_shares WHERE provider = 'sms'").await < 3
        || count(&db.pool, "SELECT count(*) FROM notification_jobs WHERE status = 'sent'").await == 0
    {
        assert!(waited.elapsed() < Duration::from_secs(60), "the three pods never all took a share and sent");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = sms.fake.elapsed();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let end = sms.fake.elapsed();
    let calls = sms.fake.arrivals().iter().filter(|t| **t >= start && **t < end).count();
    eprintln!("{calls} calls in 10 s at max_rate_per_second = 30 over 3 instances");
    assert!(calls <= 30 * 10 + 30, "{calls} calls: over the rate plus one burst");
    assert!(calls >= 200, "{calls} calls: the limit should still let most of the rate through");
}

/// A `Retry-After` closes the provider on the pod that was told at once, and on every other pod at
/// its next sync; the throttled job keeps its attempt, and once the pause has passed both jobs are
/// sent with one attempt each. Each pod's sync is driven here as a step.
#[tokio::test]
async fn retry_after_pauses_the_provider_on_every_pod_without_spending_attempts() {
    let e = env().await;
    e.sms.fake.set_behaviour(FakeBehaviour { throttle_first: 1, retry_after_secs: 2, ..Default::default() });
    let (b, on_b) = e.second_pod(Strategy::Priority, 0).await;
    let on_a = e.group(Strategy::Priority, 0);
    let ids = e.enqueue("transactional", "bank", 2).await;

    assert_eq!(on_a.try_execute_next().await.unwrap(), Outcome::Throttled(ids[0]));
    let attempts =
        count(&e.db.pool, &format!("SELECT attempts::int8 FROM notification_jobs WHERE id = {}", ids[0])).await;
    assert_eq!(attempts, 0, "the throttled call gave its attempt back");
    assert_eq!(
        e.app.state.notifications.runtime().providers["sms"].budget.room(),
        Room::Closed,
        "closed at once where it was told"
    );
    assert!(on_a.claim(8).await.unwrap().is_empty());
    assert_ne!(b.state.notifications.runtime().providers["sms"].budget.room(), Room::Closed, "b has not synced yet");
    e.app.state.notifications.runtime().sync_budgets(&e.db.pool).await;
    b.state.notifications.runtime().sync_budgets(&b.state.db).await;
    assert_eq!(
        b.state.notifications.runtime().providers["sms"].budget.room(),
        Room::Closed,
        "b closed at its next sync"
    );
    assert!(on_b.claim(8).await.unwrap().is_empty(), "b claims nothing for the paused provider");
    assert_eq!(e.sms.fake.report().calls, 1);

    // Once Retry-After has passed, the next syncs open it again and both jobs go out.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    e.app.state.notifications.runtime().sync_budgets(&e.db.pool).await;
    b.state.notifications.runtime().sync_budgets(&b.state.db).await;
    assert_ne!(b.state.notifications.runtime().providers["sms"].budget.room(), Room::Closed);
    let mut sent = drain(&on_b).await;
    sent.sort_by_key(|o| format!("{o:?}"));
    assert_eq!(sent, vec![Outcome::Sent(ids[0]), Outcome::Sent(ids[1])]);
    let attempts = count(&e.db.pool, "SELECT max(attempts)::int8 FROM notification_jobs").await;
    assert_eq!(attempts, 1, "one attempt each: the throttled call did not spend one");
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_cap_holds_exactly_across_instances_and_claim_batches() {
    let db = fresh_database().await;
    let sms = fake_server(FakeBehaviour { latency_ms: 1, ..Default::default() }).await;
    let mut apps = Vec::new();
    for _ in 0..3 {
        let mut s = settings(&db.url, &sms, 400, 64);
        s.queue.claim_batch = 64;
        s.queue.classes.iter_mut().for_each(|c| c.tenant_inflight_cap = 5);
        // Not a test of backpressure: right after the first 5,000 jobs the drain rate is still averaged
        // over a mostly idle 30 s window, so the second 5,000 could be refused as overload.
        s.queue.overload = cifpool::config::OverloadMode::Observe;
        apps.push(spawn_app_with(s).await);
    }
    enqueue(&apps[0], "transactional", "one-tenant", 10_000).await;
    all_sent(&db.pool, 10_000, Duration::from_secs(180)).await;
    let peak = sms.fake.report().peak_in_flight;
    eprintln!("peak in flight for one tenant with cap 5 over 3 instances: {peak}");
    assert!(peak <= 5, "the provider saw {peak} of the tenant's calls at once");
}
