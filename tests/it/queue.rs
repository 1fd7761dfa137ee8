//! The notification queue against real Postgres and fake HTTP providers, driven one step at a time.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cifpool::cif::Fenced;
use cifpool::config::OverloadMode;
use cifpool::internals::budget::{ProviderBudget, Room};
use cifpool::internals::fake_provider::FakeBehaviour;
use cifpool::internals::stats::ClassStats;
use cifpool::internals::worker::Outcome;
use cifpool::internals::{intake, queue_store as store};
use cifpool::queue::policy::{ClaimOrder, GroupPolicy, Strategy};
use common::queue_env::{Env, drain, env, env_with};
use common::{
    TEST_ADMIN_TOKEN, assert_problem, fake_server, fresh_database, test_settings_with_pools, use_fake_providers,
};
use serde_json::{Value, json};

#[tokio::test]
async fn bulkhead_reserved_group_never_runs_promo_and_bulk_never_runs_otp() {
    let e = env().await;
    let promo = e.enqueue("promo", "shop", 5).await;
    let otp = e.enqueue("otp", "auth", 3).await;
    let reserved = e.group(Strategy::Bulkhead, 0);
    let bulk = e.group(Strategy::Bulkhead, 1);
    let sent = drain(&reserved).await;
    assert_eq!(sent, otp.iter().map(|&id| Outcome::Sent(id)).collect::<Vec<_>>());
    for id in &promo {
        assert_eq!(e.status(*id).await, "pending", "the reserved group left promo alone");
    }
    e.enqueue("otp", "auth", 1).await;
    let sent = drain(&bulk).await;
    assert_eq!(sent.len(), 5, "bulk drained the promo: {sent:?}");
    assert!(sent.iter().all(|o| matches!(o, Outcome::Sent(id) if promo.contains(id))));
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs WHERE class = 'otp' AND status = 'pending'").await, 1);
    assert_eq!(e.sms.fake.report().delivered, 3);
    assert_eq!(e.push.fake.report().delivered, 5);
}

#[tokio::test]
async fn priority_claims_a_new_otp_before_older_promo_and_fifo_does_not() {
    let e = env().await;
    let promo = e.enqueue("promo", "shop", 20).await;
    let otp = e.enqueue("otp", "auth", 1).await[0];
    let fifo = e.group(Strategy::Fifo, 0);
    let first = fifo.try_execute_next().await.unwrap();
    assert_eq!(first, Outcome::Sent(promo[0]), "FIFO serves the oldest promo first");
    let priority = e.group(Strategy::Priority, 0);
    assert_eq!(priority.try_execute_next().await.unwrap(), Outcome::Sent(otp));
}

/// The value of series `name` for worker group `group` in this process's recorder (0 before its first
/// record).
fn group_value(name: &str, group: &str) -> f64 {
    let text = cifpool::telemetry::metrics_handle().render();
    let prefix = format!("{name}{{group=\"{group}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).map_or(0.0, |v| v.trim().parse().unwrap())
}

/// `(count, sum)` of histogram `name` for worker group `group` in this process's recorder.
fn group_series(name: &str, group: &str) -> (f64, f64) {
    (group_value(&format!("{name}_count"), group), group_value(&format!("{name}_sum"), group))
}

/// Every claim statement a group runs is timed and its jobs counted, by group: what shows a group
/// claiming back to back. (Other tests of this process may claim under the same group name at the
/// same time, so the series grow by at least this test's claims.)
#[tokio::test]
async fn each_claim_statement_is_timed_and_sized_by_group() {
    let e = env().await;
    let promo = e.enqueue("promo", "shop", 3).await;
    let group = e.group(Strategy::Priority, 0);
    let name = group.policy.name.clone();
    let (timed_before, seconds_before) = group_series("cifpool_queue_claim_duration_seconds", &name);
    let (sized_before, jobs_before) = group_series("cifpool_queue_claim_size", &name);
    assert_eq!(group.claim(10).await.unwrap().len(), 3);
    assert!(group.claim(10).await.unwrap().is_empty(), "{promo:?} were all claimed");
    let (timed, seconds) = group_series("cifpool_queue_claim_duration_seconds", &name);
    let (sized, jobs) = group_series("cifpool_queue_claim_size", &name);
    assert!(timed >= timed_before + 2.0 && sized >= sized_before + 2.0, "two statements: {timed}, {sized}");
    assert!(jobs >= jobs_before + 3.0, "three jobs taken: {jobs_before} -> {jobs}");
    assert!(seconds > seconds_before, "their time: {seconds_before} -> {seconds}");
}

/// Once a claim from the head of the order has been slow after many jobs (what a held cleanup
/// horizon makes of it), the group's claims start each priority at its floor: they pass over a job
/// that lies below it, take the ones above in order, and each is counted in
/// `cifpool_queue_claims_from_floors_total`.
#[tokio::test]
async fn a_group_claiming_from_its_floors_passes_over_what_lies_below_them_and_counts_it() {
    use cifpool::queue::floor::{Start, WALK_JOBS};
    use std::collections::BTreeMap;
    let e = env().await;
    let promo = e.enqueue("promo", "shop", 6).await;
    let group = e.group(Strategy::Priority, 0);
    let name = group.policy.name.clone();
    let key = |id: i64| {
        let db = e.db.pool.clone();
        async move {
            let row: (i16, f64) = sqlx::query_as("SELECT priority, fair_key FROM notification_jobs WHERE id = $1")
                .bind(id)
                .fetch_one(&db)
                .await
                .unwrap();
            row
        }
    };
    let (priority, floor) = key(promo[3]).await;
    let counted = || group_value("cifpool_queue_claims_from_floors_total", &name);
    let before = counted();
    assert_eq!(group.claim(1).await.unwrap().len(), 1, "a claim from the head is not counted");
    assert_eq!(counted(), before);

    // A slow claim from the head after enough jobs, which began at the fourth job's key.
    let slow = Duration::from_millis(500);
    group.record_claim(&Start::Head, Instant::now(), slow, WALK_JOBS, &BTreeMap::from([(priority, floor)]));
    let mut ids: Vec<i64> = group.claim(10).await.unwrap().iter().map(|j| j.id).collect();
    ids.sort_unstable();
    assert_eq!(ids, promo[3..].to_vec(), "from the floor: the second and third jobs are passed over");
    assert!(counted() >= before + 1.0, "the claim from the floors is counted");
    for id in &promo[1..3] {
        assert_eq!(e.status(*id).await, "pending", "below the floor, {id} waits for a claim from the head");
    }
}

/// Shrinks this pod's share of `provider` to one unit (idle syncs halve it); the caller takes that
/// unit, so the share is full but could grow: the deployment-wide budget is far from used.
async fn shrink_share(e: &Env, provider: &str) -> Arc<ProviderBudget> {
    for _ in 0..12 {
        e.app.state.notifications.runtime().sync_budgets(&e.app.state.db).await;
    }
    e.app.state.notifications.runtime().providers[provider].budget.clone()
}

/// The claim keeps the group's order when the head job's provider is merely slow to grant this pod a
/// larger share: it takes nothing behind that job, asks for more at once, and takes the job once the
/// share has grown. (Stepping over it handed the worker to a hanging push call.)
#[tokio::test]
async fn a_full_share_that_can_grow_holds_the_claim_at_the_head_of_the_order() {
    let e = env().await;
    let promo = e.enqueue("promo", "shop", 3).await;
    let otp = e.enqueue("otp", "auth", 2).await;
    let (db, queue) = (&e.app.state.db, &e.app.state.notifications.runtime());

    let priority = e.group(Strategy::Priority, 0);
    let sms = shrink_share(&e, "sms").await;
    let sms_unit = sms.try_acquire().expect("one unit left");
    assert_eq!(sms.room(), Room::Free(0), "full, and could grow");
    let claimed = priority.claim_in_order(4).await.unwrap();
    assert!(claimed.jobs.is_empty(), "took {:?} while the OTP waited for its provider", claimed.jobs);
    assert_eq!(claimed.stopped_at.as_deref(), Some("otp"));
    queue.sync_budgets(db).await;
    // The share of SMS has grown; push's is still the one unit the idle syncs left it, so the claim
    // goes on in order and stops again at the second promo.
    let claimed = priority.claim_in_order(4).await.unwrap();
    let mut ids: Vec<i64> = claimed.jobs.iter().map(|j| j.id).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![promo[0], otp[0], otp[1]], "both OTPs, then the first promo");
    assert_eq!(claimed.stopped_at.as_deref(), Some("promo"));
    drop(sms_unit);

    // FIFO: the head is the oldest promo; with push held up the claim waits for it, whatever the
    // class behind.
    sqlx::query("UPDATE notification_jobs SET status = 'pending', lease_token = NULL, lease_expires_at = NULL")
        .execute(db)
        .await
        .unwrap();
    let fifo = e.group(Strategy::Fifo, 0);
    let push = shrink_share(&e, "push").await;
    let push_unit = push.try_acquire().expect("one unit left");
    assert_eq!(push.room(), Room::Free(0), "full, and could grow");
    let claimed = fifo.claim_in_order(4).await.unwrap();
    assert!(claimed.jobs.is_empty(), "FIFO took {:?} ahead of the oldest promo", claimed.jobs);
    assert_eq!(claimed.stopped_at.as_deref(), Some("promo"));
    queue.sync_budgets(db).await;
    let first = fifo.claim(1).await.unwrap();
    assert_eq!(first.iter().map(|j| j.id).collect::<Vec<_>>(), vec![promo[0]]);
    drop(push_unit);
}

/// At the deployment's limit (every unit the pod may hold is in flight and no pod holds more), a
/// provider's jobs are stepped over: the worker that ends one of its calls claims the next of them,
/// and the other flows keep their workers.
#[tokio::test]
async fn a_provider_at_the_deployment_limit_is_stepped_over() {
    let e = env_with(|s| {
        let sms = s.queue.providers.get_mut("sms").unwrap();
        (sms.max_concurrency, sms.min_concurrency) = (1, 1);
    })
    .await;
    let promo = e.enqueue("promo", "shop", 1).await;
    let otp = e.enqueue("otp", "auth", 1).await;
    let budget = e.app.state.notifications.runtime().providers["sms"].budget.clone();
    let permit = budget.try_acquire().expect("the one unit");
    assert_eq!(budget.room(), Room::AtLimit);
    let priority = e.group(Strategy::Priority, 0);
    let claimed = priority.claim_in_order(2).await.unwrap();
    assert_eq!(claimed.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), promo);
    drop(permit);
    let next = priority.claim(2).await.unwrap();
    assert_eq!(next.iter().map(|j| j.id).collect::<Vec<_>>(), otp, "the freed unit takes the OTP");
}

#[tokio::test]
async fn floor_borrow_shared_workers_take_otp_when_the_floor_is_busy() {
    let e = env().await;
    e.enqueue("promo", "shop", 10).await;
    let otps = e.enqueue("otp", "auth", 4).await;
    let floor = e.group(Strategy::FloorBorrow, 0);
    let shared = e.group(Strategy::FloorBorrow, 1);
    assert_eq!(floor.policy.classes, vec!["otp".to_string()]);
    // The floor claims one OTP and is now busy with it (claimed, not finished).
    let busy = floor.claim(1).await.unwrap();
    assert_eq!(busy.len(), 1);
    // Shared workers borrow: they take the remaining OTPs before any older promo.
    for _ in 0..3 {
        match shared.try_execute_next().await.unwrap() {
            Outcome::Sent(id) => assert!(otps.contains(&id), "shared took promo {id} while OTP waited"),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(matches!(shared.try_execute_next().await.unwrap(), Outcome::Sent(_)));
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs WHERE class = 'promo' AND status = 'sent'").await, 1);
    assert_eq!(floor.process(busy.into_iter().next().unwrap()).await.unwrap(), Outcome::Sent(otps[0]));
}

#[tokio::test]
async fn transient_failures_retry_through_the_queue_then_die_and_replay_revives() {
    let e = env().await;
    e.push.fake.set_behaviour(FakeBehaviour { error_rate: 1.0, ..Default::default() });
    let id = e.enqueue("promo", "shop", 1).await[0];
    let group = e.group(Strategy::Priority, 0);
    let settings = &e.app.state.notifications.runtime().classes["promo"].settings;
    let max_attempts = settings.max_attempts as i32;
    let mut delays = Vec::new();
    for attempt in 1..max_attempts {
        let started = Instant::now();
        assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Retrying(id));
        assert!(started.elapsed() < Duration::from_secs(2), "the worker did not sleep out the backoff");
        let (status, attempts, due_in): (String, i32, f64) = sqlx::query_as(
            "SELECT status, attempts, extract(epoch FROM run_after - now())::float8 FROM notification_jobs WHERE id = $1",
        )
        .bind(id)
        .fetch_one(&e.db.pool)
        .await
        .unwrap();
        assert_eq!((status.as_str(), attempts), ("failed-retrying", attempt));
        // Full jitter under an exponential ceiling: base·2^(attempt-1), capped.
        let ceiling =
            (settings.backoff_base.as_secs_f64() * 2f64.powi(attempt - 1)).min(settings.backoff_cap.as_secs_f64());
        assert!(due_in <= ceiling, "attempt {attempt}: due in {due_in} s, above the ceiling {ceiling} s");
        delays.push(due_in);
        // Not due yet: the worker is free for other work at once.
        e.make_due().await;
    }
    // A backoff of zero would make every delay ~0; with full jitter over ceilings of 5 s and more,
    // all of them under 50 ms has a chance below 1e-9.
    assert!(delays.iter().any(|d| *d > 0.05), "no backoff at all: {delays:?}");
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Dead(id));
    assert_eq!(e.status(id).await, "dead");
    assert_eq!(e.push.fake.report().calls, max_attempts as u64, "attempts are bounded");
    let last_error: String = sqlx::query_scalar("SELECT last_error FROM notification_jobs WHERE id = $1")
        .bind(id)
        .fetch_one(&e.db.pool)
        .await
        .unwrap();
    assert!(last_error.contains("503"), "{last_error}");

    // Ops look at the dead letters and replay them once the provider is back.
    let dlq: Value = e
        .app
        .client
        .get(e.app.url("/admin/dlq?class=promo"))
        .bearer_auth(TEST_ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(dlq["jobs"][0]["id"], id);
    e.push.fake.set_behaviour(FakeBehaviour::default());
    let r = e
        .app
        .client
        .post(e.app.url("/admin/dlq/replay"))
        .bearer_auth(TEST_ADMIN_TOKEN)
        .json(&json!({ "class": "promo", "max": 10, "rate_per_sec": 1000.0 }))
        .send()
        .await
        .unwrap();
    let replayed: Value = r.json().await.unwrap();
    assert_eq!(replayed["replayed"], 1, "{replayed}");
    assert_eq!(e.status(id).await, "scheduled", "a replayed job waits for its slot of the pace");
    assert_eq!(e.promote().await, 1);
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Sent(id));
    assert_eq!(e.count("SELECT count(*) FROM notification_results").await, 1);
}

#[tokio::test]
async fn permanent_failure_goes_straight_to_the_dead_letters() {
    let e = env().await;
    e.sms.fake.set_behaviour(FakeBehaviour { reject_rate: 1.0, ..Default::default() });
    let id = e.enqueue("transactional", "bank", 1).await[0];
    let group = e.group(Strategy::Priority, 0);
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Dead(id));
    assert_eq!(e.sms.fake.report().calls, 1);
}

#[tokio::test]
async fn an_otp_past_its_deadline_expires_and_is_never_sent() {
    let e = env().await;
    let ids = e.enqueue("otp", "auth", 2).await;
    let deadline: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT deadline FROM notification_jobs WHERE id = $1")
            .bind(ids[0])
            .fetch_one(&e.db.pool)
            .await
            .unwrap();
    assert!(deadline.is_some(), "OTP gets the 15 s deadline");
    sqlx::query("UPDATE notification_jobs SET deadline = now() - interval '1 second'")
        .execute(&e.db.pool)
        .await
        .unwrap();
    // One expires when a worker picks it, the other in the sweep.
    let group = e.group(Strategy::Priority, 0);
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Expired(ids[0]));
    let expired = store::expire_overdue(&e.db.pool, 100).await.unwrap();
    assert_eq!(expired, [("otp".to_string(), 1)].into());
    assert_eq!(e.status(ids[1]).await, "expired");
    assert_eq!(e.sms.fake.report().calls, 0, "never sent late");
}

#[tokio::test]
async fn a_lease_lost_mid_send_still_yields_exactly_one_result() {
    let e = env().await;
    e.sms.fake.set_behaviour(FakeBehaviour { latency_ms: 400, ..Default::default() });
    let id = e.enqueue("otp", "auth", 1).await[0];
    let a = e.group(Strategy::Priority, 0);
    let b = e.group(Strategy::Priority, 0);
    let job = a.claim(1).await.unwrap().pop().unwrap();
    let first = tokio::spawn({
        let a = a.clone();
        async move { a.process(job).await.unwrap() }
    });
    // Worker A is mid-send when its lease runs out (moved into the past) and the sweep rescues the job.
    tokio::time::sleep(Duration::from_millis(50)).await;
    sqlx::query("UPDATE notification_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1")
        .bind(id)
        .execute(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(store::rescue_expired_leases(&e.db.pool, 100).await.unwrap(), 1);
    // Worker B claims it again and sends it again.
    let second = b.try_execute_next().await.unwrap();
    let first = common::joined(first).await;
    let mut outcomes = [first, second];
    outcomes.sort_by_key(|o| matches!(o, Outcome::Sent(_)));
    assert_eq!(outcomes, [Outcome::LeaseLost(id), Outcome::Sent(id)], "exactly one finish wins the fence");
    assert_eq!(e.count("SELECT count(*) FROM notification_results").await, 1);
    assert_eq!(e.sms.fake.deliveries_of(&id.to_string()), 2, "at-least-once: the provider saw the key twice");
    assert_eq!(e.status(id).await, "sent");
}

#[tokio::test]
async fn a_small_tenant_is_not_starved_by_a_huge_batch() {
    let e = env().await;
    e.batch("promo", "tenant-x", 50_000).await;
    e.batch("promo", "tenant-y", 100).await;
    let group = e.group(Strategy::Priority, 0);
    let mut done_before_last_y = 0;
    let mut y_left = 100;
    while y_left > 0 {
        let jobs = group.claim(16).await.unwrap();
        assert!(!jobs.is_empty());
        for job in jobs {
            if job.tenant == "tenant-y" {
                y_left -= 1;
            } else {
                done_before_last_y += 1;
            }
            assert_eq!(store::mark_sent(&e.db.pool, &job, "push", None).await.unwrap(), Fenced::Done);
        }
    }
    // FIFO would have sent all 50,000 of X first; weighted turns interleave the two tenants.
    assert!(done_before_last_y <= 200, "tenant X got {done_before_last_y} sends before Y's 100 finished");
    assert!(
        e.count("SELECT count(*) FROM notification_jobs WHERE tenant = 'tenant-x' AND status = 'pending'").await
            > 49_000
    );
}

#[tokio::test]
async fn a_new_tenant_is_anchored_at_the_due_front_not_at_a_retry_waiting_out_its_backoff() {
    let e = env().await;
    let group = e.group(Strategy::Priority, 0);
    // Tenant a's first job fails and waits out a long backoff with the lowest key of the priority.
    e.push.fake.set_behaviour(FakeBehaviour { error_rate: 1.0, ..Default::default() });
    let first = e.enqueue("promo", "a", 1).await[0];
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Retrying(first));
    sqlx::query("UPDATE notification_jobs SET run_after = now() + interval '30 minutes' WHERE id = $1")
        .bind(first)
        .execute(&e.db.pool)
        .await
        .unwrap();
    e.push.fake.set_behaviour(FakeBehaviour::default());
    // Tenant a's backlog: 40 more; 20 are sent, so the due front has moved on by 20 turns.
    e.batch("promo", "a", 40).await;
    for _ in 0..20 {
        assert!(matches!(group.try_execute_next().await.unwrap(), Outcome::Sent(_)));
    }
    // Tenant b arrives with 20: they take turns with a's remaining 20, not all 20 ahead of them.
    e.batch("promo", "b", 20).await;
    let mut next_b = 0;
    for _ in 0..20 {
        let Outcome::Sent(id) = group.try_execute_next().await.unwrap() else { panic!("nothing sent") };
        let tenant: String = sqlx::query_scalar("SELECT tenant FROM notification_jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&e.db.pool)
            .await
            .unwrap();
        next_b += usize::from(tenant == "b");
    }
    assert!((8..=12).contains(&next_b), "of the next 20 sends, {next_b} were tenant b's");
}

#[tokio::test]
async fn tenant_weights_give_a_heavier_tenant_more_turns() {
    let e = env_with(|s| {
        s.queue.tenant_weights.insert("gold".into(), 3.0);
        // Caps are exact now: keep them out of the way of the weights this test is about.
        s.queue.classes.iter_mut().for_each(|c| c.tenant_inflight_cap = 1000);
    })
    .await;
    e.batch("promo", "gold", 300).await;
    e.batch("promo", "basic", 300).await;
    let group = e.group(Strategy::Priority, 0);
    let jobs = group.claim(200).await.unwrap();
    let gold = jobs.iter().filter(|j| j.tenant == "gold").count();
    assert!((140..=160).contains(&gold), "3:1 weights give gold ~150 of 200, got {gold}");
}

#[tokio::test]
async fn per_tenant_in_flight_cap_holds_between_claims() {
    let e = env().await;
    let cap = e.app.state.notifications.runtime().classes["promo"].settings.tenant_inflight_cap as usize;
    e.batch("promo", "big", cap * 3).await;
    let group = e.group(Strategy::Priority, 0);
    let mut held = Vec::new();
    loop {
        let jobs = group.claim(8).await.unwrap();
        if jobs.is_empty() {
            break;
        }
        held.extend(jobs);
    }
    assert_eq!(held.len(), cap, "in flight with cap {cap}");
    // Another tenant still gets through while `big` is at its cap.
    e.enqueue("promo", "small", 1).await;
    let other = group.claim(8).await.unwrap();
    assert_eq!(other.len(), 1);
    assert_eq!(other[0].tenant, "small");
}

/// Claims racing for one tenant's backlog never hold more than its cap between them: each takes its
/// class's claim lock, then counts what the claims before it committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_claims_fill_a_tenant_cap_exactly() {
    let e = env().await;
    let cap = e.app.state.notifications.runtime().classes["promo"].settings.tenant_inflight_cap as usize;
    e.batch("promo", "big", cap * 4).await;
    let group = e.group(Strategy::Priority, 0);
    let claims: Vec<_> = (0..16)
        .map(|_| {
            let group = group.clone();
            tokio::spawn(async move { group.claim(7).await.unwrap().len() })
        })
        .collect();
    let mut claimed = 0;
    for c in claims {
        claimed += common::joined(c).await;
    }
    let sending: i64 =
        e.count("SELECT count(*) FROM notification_jobs WHERE status = 'sending' AND tenant = 'big'").await;
    assert_eq!((claimed, sending), (cap, cap as i64), "16 claims of 7 against a cap of {cap}");
}

/// A capped claim that waited for its class's claim lock sees what happened while it waited: the jobs
/// the holder claimed and finished are gone, and the jobs enqueued meanwhile are there to take. (A
/// claim that took the lock inside its statement had a snapshot from before the wait, in which only
/// the holder's jobs were pending: it came back empty.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_waited_for_the_claim_lock_takes_the_jobs_enqueued_meanwhile() {
    let e = env().await;
    let first: Vec<i64> = e.enqueue("promo", "early", 4).await;
    let group = e.group(Strategy::Priority, 0);
    // Another claimer's turn: it holds promo's claim lock while it claims and finishes the four jobs.
    let mut holder = e.db.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(1667853679, hashtext('promo'))").execute(&mut *holder).await.unwrap();
    let waiting = tokio::spawn({
        let group = group.clone();
        async move { group.claim(4).await.unwrap() }
    });
    common::wait_for_a_lock_wait(&e.db.pool).await;
    sqlx::query("UPDATE notification_jobs SET status = 'sent', finished_at = now() WHERE id = ANY($1)")
        .bind(&first)
        .execute(&mut *holder)
        .await
        .unwrap();
    let later: Vec<i64> = e.enqueue("promo", "late", 4).await;
    holder.commit().await.unwrap();
    let claimed: Vec<i64> = common::joined(waiting).await.iter().map(|j| j.id).collect();
    assert_eq!(claimed, later, "the jobs enqueued while the claim waited");
}

#[tokio::test]
async fn backpressure_rejects_bulk_with_retry_after_but_always_takes_otp() {
    let e = env().await;
    e.app.state.notifications.stats().set(
        "promo",
        ClassStats { pending: 1_000_000, oldest_age_s: 60.0, drain_per_s: 10.0, ..ClassStats::default() },
    );
    let r = e
        .app
        .client
        .post(e.app.url("/v1/notifications"))
        .json(&json!({ "class": "promo", "tenant": "shop", "recipient": "dev-1" }))
        .send()
        .await
        .unwrap();
    let retry_after: u64 = r.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry_after > 0);
    assert_problem(r, 429).await;
    let r = e
        .app
        .client
        .post(e.app.url("/v1/notifications/batch"))
        .json(&json!({ "class": "promo", "tenant": "shop", "jobs": [{ "recipient": "a" }] }))
        .send()
        .await
        .unwrap();
    assert_problem(r, 429).await;
    e.app
        .state
        .notifications
        .stats()
        .set("otp", ClassStats { pending: 1_000_000, oldest_age_s: 600.0, drain_per_s: 1.0, ..ClassStats::default() });
    e.enqueue("otp", "auth", 1).await;
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs").await, 1, "only the OTP was written");
    // Under the target, bulk is accepted again.
    e.app
        .state
        .notifications
        .stats()
        .set("promo", ClassStats { pending: 10, oldest_age_s: 1.0, drain_per_s: 100.0, ..ClassStats::default() });
    e.enqueue("promo", "shop", 1).await;
}

/// Backpressure is judged per tenant: one tenant's backlog puts the class far over its target wait;
/// that tenant is refused, while another tenant of the same class is accepted and, claimed in its
/// turn, served next.
#[tokio::test]
async fn one_tenants_flood_is_refused_and_another_tenant_is_still_accepted_and_served() {
    let e = env().await;
    e.batch("transactional", "flood", 2_000).await;
    // Ten of its jobs finished within the drain window: ~0.33 jobs/s, so the 1,990 waiting are ~100
    // minutes of work against the class's 2 minute target.
    sqlx::query(
        "UPDATE notification_jobs SET status = 'sent', finished_at = now() \
         WHERE id IN (SELECT id FROM notification_jobs ORDER BY id LIMIT 10)",
    )
    .execute(&e.db.pool)
    .await
    .unwrap();
    e.app.state.notifications.stats().refresh_now(&e.app.state.db, e.app.state.notifications.runtime()).await.unwrap();
    let post = |tenant: &str| {
        e.app
            .client
            .post(e.app.url("/v1/notifications"))
            .json(&json!({ "class": "transactional", "tenant": tenant, "recipient": "+84900000009" }))
            .send()
    };
    let r = post("flood").await.unwrap();
    assert!(r.headers().get("retry-after").is_some());
    assert_problem(r, 429).await;
    let r = post("calm").await.unwrap();
    assert_eq!(r.status(), 202, "a tenant within its fair share is admitted");
    let calm = r.json::<Value>().await.unwrap()["id"].as_i64().unwrap();
    // Its fair key is one turn past the head of the queue: the flood's job at the head, the flood's
    // at the same key (older), then it.
    let next: Vec<i64> = e.group(Strategy::Priority, 0).claim(3).await.unwrap().iter().map(|j| j.id).collect();
    assert!(next.contains(&calm), "claimed in its turn, not after the flood: {next:?}");
}

#[tokio::test]
async fn defer_mode_accepts_overload_but_schedules_it_later() {
    let e = env_with(|s| s.queue.overload = OverloadMode::Defer).await;
    e.app
        .state
        .notifications
        .stats()
        .set("promo", ClassStats { pending: 100_000, oldest_age_s: 10.0, drain_per_s: 10.0, ..ClassStats::default() });
    let id = e.enqueue("promo", "shop", 1).await[0];
    let later: bool =
        sqlx::query_scalar("SELECT run_after > now() + interval '1 hour' FROM notification_jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&e.db.pool)
            .await
            .unwrap();
    assert!(later, "deferred by the predicted wait beyond the target");
    assert_eq!(e.status(id).await, "scheduled", "out of the claim order until it is due");
    assert_eq!(
        intake::admit(e.app.state.notifications.runtime(), e.app.state.notifications.stats(), "otp"),
        intake::Admission::Accept
    );
}

#[tokio::test]
async fn bad_input_is_422_or_413_problem_json_and_writes_nothing() {
    let e = env_with(|s| s.queue.max_batch = 10).await;
    let post = |body: Value| e.app.client.post(e.app.url("/v1/notifications")).json(&body).send();
    let r = post(json!({ "class": "carrier-pigeon", "tenant": "t", "recipient": "x" })).await.unwrap();
    let p = assert_problem(r, 422).await;
    assert!(p["detail"].as_str().unwrap().contains("otp"), "lists the known classes: {p}");
    assert_problem(post(json!({ "class": "otp", "tenant": "t" })).await.unwrap(), 422).await;
    assert_problem(post(json!({ "class": "otp", "tenant": "t", "recipient": "" })).await.unwrap(), 422).await;
    let nul = post(json!({ "class": "otp", "tenant": "t", "recipient": "x", "payload": {"text": "a\u{0}"} }));
    assert_problem(nul.await.unwrap(), 422).await;
    let jobs: Vec<Value> = (0..11).map(|i| json!({ "recipient": format!("r{i}") })).collect();
    let r = e
        .app
        .client
        .post(e.app.url("/v1/notifications/batch"))
        .json(&json!({ "class": "promo", "tenant": "t", "jobs": jobs }))
        .send()
        .await
        .unwrap();
    assert_problem(r, 413).await;
    let r = e
        .app
        .client
        .post(e.app.url("/v1/notifications/batch"))
        .json(&json!({ "class": "promo", "tenant": "t", "jobs": [{ "recipient": "ok" }, { "recipient": "" }] }))
        .send()
        .await
        .unwrap();
    let p = assert_problem(r, 422).await;
    assert!(p["detail"].as_str().unwrap().contains("jobs[1]"), "{p}");
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs").await, 0);
}

/// Posts `body` as it is (JSON that `serde_json` would not write, such as `1e400`) to `path`.
async fn post_json(e: &Env, path: &str, body: String) -> reqwest::Response {
    e.app.client.post(e.app.url(path)).header("content-type", "application/json").body(body).send().await.unwrap()
}

/// Payloads Postgres would keep but the workers could not read back (or that `jsonb` refuses) are a
/// 422 naming the field, and in a batch the job: never a 500, never stored.
#[tokio::test]
async fn payloads_that_would_not_round_trip_are_refused_alone_and_in_a_batch() {
    let e = env().await;
    let hostile: [(&str, &str); 5] = [
        (r#"{"n": 1e400}"#, "range"),
        (r#"{"n": [-1.7976931348623159e309]}"#, "range"),
        (r#"{"s": "\ud800"}"#, "surrogate"),
        (&format!("{}0{}", "[".repeat(40), "]".repeat(40)), "nested"),
        (&format!(r#"{{"s": "{}"}}"#, "x".repeat(70 * 1024)), "bytes"),
    ];
    for (payload, why) in hostile {
        let single =
            format!(r#"{{"class": "otp", "tenant": "evil", "recipient": "+84900000001", "payload": {payload}}}"#);
        let r = post_json(&e, "/v1/notifications", single).await;
        // The 70 KB one is over the single request's body limit before its payload is read.
        if why == "bytes" {
            assert_problem(r, 413).await;
        } else {
            let p = assert_problem(r, 422).await;
            let detail = p["detail"].as_str().unwrap();
            assert!(detail.contains("payload") && detail.contains(why), "{payload:.40}: {p}");
        }
        let batch = format!(
            r#"{{"class": "promo", "tenant": "evil", "jobs": [{{"recipient": "a"}}, {{"recipient": "b", "payload": {payload}}}]}}"#
        );
        let r = post_json(&e, "/v1/notifications/batch", batch).await;
        let p = assert_problem(r, 422).await;
        let detail = p["detail"].as_str().unwrap();
        assert!(detail.contains("jobs[1]") && detail.contains(why), "{payload:.40}: {p}");
    }
    // A batch job far past any valid job's length is cut off while it streams, not held whole.
    let huge = format!(
        r#"{{"class": "promo", "tenant": "evil", "jobs": [{{"recipient": "a", "payload": "{}"}}]}}"#,
        "x".repeat(8 << 20)
    );
    let r = post_json(&e, "/v1/notifications/batch", huge).await;
    let p = assert_problem(r, 422).await;
    assert!(p["detail"].as_str().unwrap().contains("jobs[0]: longer than"), "{p}");
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs").await, 0);
}

/// A batch body that trickles in is cut off with 408 once it falls below the minimum average rate,
/// instead of holding a batch slot, a connection and a transaction for the whole batch deadline.
#[tokio::test]
async fn a_batch_body_sent_too_slowly_is_cut_off_with_408() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let e = env_with(|s| s.queue.batch_min_bytes_per_second = 1_000).await;
    let address = e.app.url("/").trim_start_matches("http://").trim_end_matches('/').to_string();
    let mut stream = tokio::net::TcpStream::connect(&address).await.unwrap();
    let start = r#"{"class":"promo","tenant":"slow","jobs":[{"recipient":"a"},"#;
    let head = format!(
        "POST /v1/notifications/batch HTTP/1.1\r\nHost: {address}\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{start}",
        e.app.key,
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "no answer within 30 s");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("batch_min_bytes_per_second"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(20), "cut off after the grace, not the batch deadline");
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs").await, 0);
}

/// A stored row the worker cannot read (here a payload written before intake refused such payloads)
/// is dead-lettered with the reason, and the other jobs of its claim, another tenant's OTPs among
/// them, are sent.
#[tokio::test]
async fn an_unreadable_row_is_dead_lettered_and_the_rest_of_its_claim_is_sent() {
    let e = env().await;
    let poison: i64 = sqlx::query_scalar(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts) \
         VALUES ('otp', 0, 'evil', 0, '+84900000000', '{\"n\": 1e400}', 3) RETURNING id",
    )
    .fetch_one(&e.db.pool)
    .await
    .unwrap();
    let good = e.enqueue("otp", "good", 5).await;
    let group = e.group(Strategy::Priority, 0);
    let claimed = group.claim(10).await.unwrap();
    let mut ids: Vec<i64> = claimed.iter().map(|j| j.id).collect();
    ids.sort_unstable();
    assert_eq!(ids, good, "every readable job of the claim");
    for job in claimed {
        let id = job.id;
        assert_eq!(group.process(job).await.unwrap(), Outcome::Sent(id));
    }
    let (status, error): (String, String) =
        sqlx::query_as("SELECT status, last_error FROM notification_jobs WHERE id = $1")
            .bind(poison)
            .fetch_one(&e.db.pool)
            .await
            .unwrap();
    assert_eq!(status, "dead");
    assert!(error.contains("cannot be read") && error.contains("payload"), "{error}");
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs WHERE tenant = 'good' AND status = 'sent'").await, 5);
    assert!(group.claim(10).await.unwrap().is_empty(), "the dead letter is not claimed again");
}

#[tokio::test]
async fn idempotency_key_returns_the_existing_job_and_lookup_shows_state() {
    let e = env().await;
    let body = json!({ "class": "transactional", "tenant": "bank", "recipient": "+84901", "idempotency_key": "tx-1" });
    let a = e.app.client.post(e.app.url("/v1/notifications")).json(&body).send().await.unwrap();
    assert_eq!(a.status(), 202);
    let a: Value = a.json().await.unwrap();
    let b = e.app.client.post(e.app.url("/v1/notifications")).json(&body).send().await.unwrap();
    assert_eq!(b.status(), 200);
    let b: Value = b.json().await.unwrap();
    assert_eq!(a["id"], b["id"]);
    assert_eq!(b["created"], false);
    let id = a["id"].as_i64().unwrap();
    let view: Value =
        e.app.client.get(e.app.url(&format!("/v1/notifications/{id}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(view["status"], "pending");
    e.group(Strategy::Priority, 0).try_execute_next().await.unwrap();
    let view: Value =
        e.app.client.get(e.app.url(&format!("/v1/notifications/{id}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(view["status"], "sent");
    assert_eq!(view["attempts"], 1);
    assert_problem(e.app.client.get(e.app.url("/v1/notifications/999999")).send().await.unwrap(), 404).await;
    assert_problem(e.app.client.get(e.app.url("/v1/notifications/abc")).send().await.unwrap(), 400).await;
}

#[tokio::test]
async fn explicit_groups_from_config_replace_the_preset() {
    let e = env_with(|s| {
        s.queue.groups = vec![GroupPolicy {
            name: "only-transactional".into(),
            size: 2,
            classes: vec!["transactional".into()],
            order: ClaimOrder::Fifo,
        }];
    })
    .await;
    let groups = e.app.state.notifications.runtime().group_policies();
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].name, "only-transactional");
}

#[tokio::test]
async fn serve_runs_the_worker_groups_next_to_the_cif_api() {
    let db = fresh_database().await;
    let sms = fake_server(FakeBehaviour::default()).await;
    let push = fake_server(FakeBehaviour::default()).await;
    let mut settings = test_settings_with_pools(&db.url);
    use_fake_providers(&mut settings, &sms, &push);
    let app = common::spawn_app_with(settings).await;
    let r = app
        .client
        .post(app.url("/v1/notifications"))
        .json(&json!({ "class": "otp", "tenant": "auth", "recipient": "+84900000001", "payload": {"code": "123456"} }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let id = r.json::<Value>().await.unwrap()["id"].as_i64().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let view: Value =
            app.client.get(app.url(&format!("/v1/notifications/{id}"))).send().await.unwrap().json().await.unwrap();
        if view["status"] == "sent" {
            break;
        }
        assert!(Instant::now() < deadline, "OTP not sent by the running workers: {view}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(sms.fake.deliveries_of(&id.to_string()), 1);
    app.stop().await;
}

#[tokio::test]
async fn a_job_that_keeps_killing_its_worker_is_dead_lettered_by_the_sweep() {
    let e = env().await;
    let id = e.enqueue("otp", "auth", 1).await[0];
    let group = e.group(Strategy::Priority, 0);
    let max = e.app.state.notifications.runtime().classes["otp"].settings.max_attempts;
    for round in 1..=max {
        // A worker claims it and dies mid-send: only the lease sweep notices.
        assert_eq!(group.claim(1).await.unwrap().len(), 1, "round {round}");
        sqlx::query("UPDATE notification_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1")
            .bind(id)
            .execute(&e.db.pool)
            .await
            .unwrap();
        assert_eq!(store::rescue_expired_leases(&e.db.pool, 100).await.unwrap(), 1);
    }
    assert_eq!(e.status(id).await, "dead", "attempts are bounded even when no attempt ever finishes");
}

#[tokio::test]
async fn an_idempotent_retry_gets_its_job_even_while_intake_sheds_load() {
    let e = env().await;
    let body = json!({ "class": "promo", "tenant": " shop ", "recipient": " dev-9 ", "idempotency_key": "camp-1" });
    let first: Value =
        e.app.client.post(e.app.url("/v1/notifications")).json(&body).send().await.unwrap().json().await.unwrap();
    e.app
        .state
        .notifications
        .stats()
        .set("promo", ClassStats { pending: 1_000_000, oldest_age_s: 60.0, drain_per_s: 1.0, ..ClassStats::default() });
    let again = e.app.client.post(e.app.url("/v1/notifications")).json(&body).send().await.unwrap();
    assert_eq!(again.status(), 200);
    assert_eq!(again.json::<Value>().await.unwrap()["id"], first["id"]);
    let tenant: String =
        sqlx::query_scalar("SELECT tenant FROM notification_jobs").fetch_one(&e.db.pool).await.unwrap();
    let recipient = e.opened().await.remove(0).1;
    assert_eq!((tenant.as_str(), recipient.as_str()), ("shop", "dev-9"), "stored trimmed");
}

#[tokio::test]
async fn dlq_inputs_out_of_range_are_refused_not_500() {
    let e = env().await;
    let get = |q: &str| e.app.client.get(e.app.url(&format!("/admin/dlq?{q}"))).bearer_auth(TEST_ADMIN_TOKEN).send();
    assert_problem(get("error=%00").await.unwrap(), 400).await;
    assert_problem(get("tenant=a%00b").await.unwrap(), 400).await;
    let replay = |body: Value| {
        e.app.client.post(e.app.url("/admin/dlq/replay")).bearer_auth(TEST_ADMIN_TOKEN).json(&body).send()
    };
    for body in [
        json!({ "max": 5, "rate_per_sec": 5e-324 }),
        json!({ "max": 5, "rate_per_sec": 1e300 }),
        json!({ "max": 10, "rate_per_sec": 1, "extra_attempts": 2147483647 }),
        json!({ "max": 0, "rate_per_sec": 1 }),
        json!({ "error": "\u{0}", "max": 1, "rate_per_sec": 1 }),
    ] {
        assert_problem(replay(body.clone()).await.unwrap(), 422).await;
    }
}

#[tokio::test]
async fn a_batched_finish_writes_only_the_rows_whose_lease_still_holds() {
    let e = env().await;
    let ids = e.enqueue("promo", "acme", 3).await;
    let group = e.group(Strategy::Priority, 0);
    let jobs = group.claim(3).await.unwrap();
    assert_eq!(jobs.len(), 3);
    // The second job's lease expires and the sweep hands it back; another claim takes it.
    let lost = jobs[1].id;
    sqlx::query("UPDATE notification_jobs SET lease_expires_at = now() - interval '1 second' WHERE id = $1")
        .bind(lost)
        .execute(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(store::rescue_expired_leases(&e.db.pool, 100).await.unwrap(), 1);
    sqlx::query("UPDATE notification_jobs SET run_after = now() WHERE id = $1")
        .bind(lost)
        .execute(&e.db.pool)
        .await
        .unwrap();
    let again = group.claim(3).await.unwrap();
    assert_eq!(again.iter().map(|j| j.id).collect::<Vec<_>>(), [lost]);

    let ids_in: Vec<i64> = jobs.iter().map(|j| j.id).collect();
    let tokens: Vec<uuid::Uuid> = jobs.iter().map(|j| j.token).collect();
    let mut done =
        store::mark_sent_many(&e.db.pool, &ids_in, &tokens, &["push"; 3], &[Some("ref-a"), None, None]).await.unwrap();
    done.sort_unstable();
    let mut expected: Vec<i64> = ids.iter().copied().filter(|&id| id != lost).collect();
    expected.sort_unstable();
    assert_eq!(done, expected, "the stale token of the re-claimed job must not finish it");
    assert_eq!(e.status(lost).await, "sending", "still held by the second claim");
    assert_eq!(e.count("SELECT count(*) FROM notification_results").await, 2);
    let first_ref: Option<String> =
        sqlx::query_scalar("SELECT provider_ref FROM notification_results WHERE job_id = $1")
            .bind(jobs[0].id)
            .fetch_one(&e.db.pool)
            .await
            .unwrap();
    assert_eq!(first_ref.as_deref(), Some("ref-a"));
    // The current holder finishes normally; a repeat of the batch changes nothing.
    assert_eq!(store::mark_sent(&e.db.pool, &again[0], "push", None).await.unwrap(), Fenced::Done);
    let repeat = store::mark_sent_many(&e.db.pool, &ids_in, &tokens, &["push"; 3], &[None, None, None]).await.unwrap();
    assert!(repeat.is_empty(), "{repeat:?}");
    assert_eq!(e.count("SELECT count(*) FROM notification_results").await, 3);
}

#[tokio::test]
async fn a_bulk_batch_without_keys_keeps_every_byte_of_its_payloads() {
    let e = env().await;
    let tricky = json!({
        "text": "tab\there, newline\nthere, CR\r, backslash \\ and quote \" — tiếng Việt ✓",
        "nested": {"path": "C:\\temp\\new", "list": [1, 2.5, null, true]},
    });
    let jobs: Vec<Value> = (0..3)
        .map(|i| json!({ "tenant": format!("t{i}"), "recipient": format!("dev\\{i}"), "payload": tricky }))
        .collect();
    let r = e
        .app
        .client
        .post(e.app.url("/v1/notifications/batch"))
        .json(&json!({ "class": "otp", "jobs": jobs }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());
    let rows: Vec<(bool, bool)> =
        sqlx::query_as("SELECT deadline > created_at, run_after <= now() FROM notification_jobs ORDER BY id")
            .fetch_all(&e.db.pool)
            .await
            .unwrap();
    let opened = e.opened().await;
    assert_eq!((rows.len(), opened.len()), (3, 3));
    for (i, ((_, recipient, payload), (deadline_after_creation, due))) in opened.into_iter().zip(rows).enumerate() {
        assert_eq!(recipient, format!("dev\\{i}"));
        assert_eq!(payload, tricky);
        assert!(deadline_after_creation, "an OTP batch gets its 15 s deadline");
        assert!(due);
    }
}

#[tokio::test]
async fn purge_deletes_only_finished_jobs_past_retention_in_every_class_and_keeps_dead_letters() {
    let e = env().await;
    // 25 old sent promo jobs, 5 old expired jobs of a class no longer configured, 4 recent sent jobs,
    // 3 old pending jobs (never finished: kept whatever their age), 6 old dead letters.
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, status, \
                                        finished_at) \
         SELECT c, 2, 't', i, 'r', '{}', 5, s, f FROM ( \
            SELECT 'promo' AS c, 'sent' AS s, now() - interval '8 days' AS f, i FROM generate_series(1, 25) i \
            UNION ALL SELECT 'retired', 'expired', now() - interval '9 days', i FROM generate_series(1, 5) i \
            UNION ALL SELECT 'promo', 'sent', now() - interval '1 hour', i FROM generate_series(1, 4) i \
            UNION ALL SELECT 'promo', 'pending', NULL, i FROM generate_series(1, 3) i \
            UNION ALL SELECT 'transactional', 'dead', now() - interval '30 days', i FROM generate_series(1, 6) i) AS rows",
    )
    .execute(&e.db.pool)
    .await
    .unwrap();
    let week = Duration::from_secs(7 * 86_400);
    // Batches of 10, at most 20 a call: the first call stops at its cap.
    let purge = |which| store::purge_finished(&e.db.pool, which, week, 10, 20);
    assert_eq!(purge(store::Purge::Finished).await.unwrap(), 20);
    assert_eq!(purge(store::Purge::Finished).await.unwrap(), 10);
    assert_eq!(purge(store::Purge::Finished).await.unwrap(), 0);
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs WHERE class = 'retired'").await, 0);
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs WHERE status = 'sent'").await, 4);
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs WHERE status = 'pending'").await, 3);
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs WHERE status = 'dead'").await, 6, "dead letters stay");
    // Only their own retention removes them.
    assert_eq!(purge(store::Purge::DeadLetters).await.unwrap(), 6);
}

/// The whole service with its worker loops running: one tenant's rows that no worker can read
/// (payloads an older intake let through, written straight into the table) stand at the head of the
/// queue, ahead of another tenant's OTPs. Every OTP is still sent within its 15 s deadline, each poison
/// row goes to the dead letters with the reason, nothing panics, and the instance stays ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_rows_do_not_stop_another_tenants_otps_with_the_workers_running() {
    let db = fresh_database().await;
    let sms = fake_server(FakeBehaviour::default()).await;
    let push = fake_server(FakeBehaviour::default()).await;
    let mut settings = test_settings_with_pools(&db.url);
    use_fake_providers(&mut settings, &sms, &push);
    settings.queue.poll_interval = Duration::from_millis(50);
    for payload in [r#"{"n": 1e400}"#, r#"[-1e999]"#, r#"{"a": {"b": 1e400}}"#] {
        for class in ["otp", "promo"] {
            sqlx::query(
                "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts) \
                 VALUES ($1, CASE $1 WHEN 'otp' THEN 0 ELSE 2 END, 'evil', 0, 'x', $2::jsonb, 3)",
            )
            .bind(class)
            .bind(payload)
            .execute(&db.pool)
            .await
            .unwrap();
        }
    }
    let app = common::spawn_app_with(settings).await;
    let started = Instant::now();
    let mut otps = Vec::new();
    for i in 0..40 {
        let body =
            json!({ "class": "otp", "tenant": "good", "recipient": format!("+8490{i:07}"), "payload": {"code": "1"} });
        let r = app.client.post(app.url("/v1/notifications")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 202);
        otps.push(r.json::<Value>().await.unwrap()["id"].as_i64().unwrap());
    }
    let count = |sql: &'static str| {
        let pool = db.pool.clone();
        async move { sqlx::query_scalar::<_, i64>(sql).fetch_one(&pool).await.unwrap() }
    };
    while count("SELECT count(*) FROM notification_jobs WHERE tenant = 'good' AND status = 'sent'").await < 40 {
        assert!(started.elapsed() < Duration::from_secs(15), "OTPs still unsent after their deadline");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let late: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM notification_jobs WHERE tenant = 'good' AND finished_at - created_at > interval '15 s'",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(late, 0, "every OTP within its deadline");
    while count("SELECT count(*) FROM notification_jobs WHERE tenant = 'evil' AND status = 'dead'").await < 6 {
        assert!(started.elapsed() < Duration::from_secs(30), "poison rows not dead-lettered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        count("SELECT count(*) FROM notification_jobs WHERE tenant = 'evil' AND last_error LIKE '%cannot be read%'")
            .await,
        6
    );
    assert_eq!(app.client.get(app.url("/readyz")).send().await.unwrap().status(), 200, "still ready");
    assert_eq!(sms.fake.report().delivered, 40);
}
