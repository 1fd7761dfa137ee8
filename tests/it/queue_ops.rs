//! Queue operations: scheduled sends, canceling a job or a batch, pausing a class or a provider for
//! every pod, dead letters by id, observe mode and the queue view, against real Postgres and fake
//! providers.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, SubsecRound, Utc};
use cifpool::auth::Scope;
use cifpool::config::OverloadMode;
use cifpool::internals::fake_provider::FakeBehaviour;
use cifpool::internals::intake::{self, Admission};
use cifpool::internals::stats::{ClassStats, Refreshed, STATS_LOCK};
use cifpool::internals::worker::Outcome;
use cifpool::queue::policy::Strategy;
use common::queue_env::{Env, drain, env, env_with};
use common::{
    TEST_ADMIN_TOKEN, TestApp, assert_problem, client_with_key, create_key, spawn_passive_app,
    test_settings_with_pools, use_fake_providers,
};
use serde_json::{Value, json};

async fn post(app: &TestApp, path: &str) -> reqwest::Response {
    app.client.post(app.url(path)).send().await.unwrap()
}

async fn admin_post(app: &TestApp, path: &str) -> reqwest::Response {
    app.client.post(app.url(path)).bearer_auth(TEST_ADMIN_TOKEN).send().await.unwrap()
}

/// GET `path`: `/admin` routes with the admin token, the rest with the app's key.
async fn get_json(app: &TestApp, path: &str) -> Value {
    let mut request = app.client.get(app.url(path));
    if path.starts_with("/admin/") {
        request = request.bearer_auth(TEST_ADMIN_TOKEN);
    }
    let r = request.send().await.unwrap();
    assert_eq!(r.status(), 200, "GET {path}");
    r.json().await.unwrap()
}

async fn enqueue_at(e: &Env, class: &str, run_at: Option<DateTime<Utc>>) -> reqwest::Response {
    let mut job = json!({ "class": class, "tenant": "bank", "recipient": "+84900000001", "payload": {"n": 1} });
    if let Some(at) = run_at {
        job["run_at"] = json!(at.to_rfc3339());
    }
    e.app.client.post(e.app.url("/v1/notifications")).json(&job).send().await.unwrap()
}

async fn audit_count(e: &Env, action: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE action = $1")
        .bind(action)
        .fetch_one(&e.db.pool)
        .await
        .unwrap()
}

/// Jobs the `batch.canceled` audit rows say were canceled (a row per chunk).
async fn audited_cancels(e: &Env) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum((detail->>'canceled')::int8), 0)::int8 FROM audit_events WHERE action = 'batch.canceled'",
    )
    .fetch_one(&e.db.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_scheduled_job_is_not_claimed_before_run_at_and_is_sent_after() {
    let e = env().await;
    let at = (Utc::now() + chrono::Duration::hours(1)).trunc_subsecs(0);
    let r = enqueue_at(&e, "transactional", Some(at)).await;
    assert_eq!(r.status(), 202);
    let id = r.json::<Value>().await.unwrap()["id"].as_i64().unwrap();
    let view: Value =
        e.app.client.get(e.app.url(&format!("/v1/notifications/{id}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(view["status"], "scheduled", "{view}");
    assert_eq!(view["run_at"].as_str().unwrap().parse::<DateTime<Utc>>().unwrap(), at);

    let group = e.group(Strategy::Priority, 0);
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Idle, "claimed before run_at");
    assert_eq!(e.sms.fake.report().calls, 0);
    assert_eq!(e.promote().await, 0, "not due yet");
    // The hour passes.
    sqlx::query("UPDATE notification_jobs SET run_after = now() WHERE id = $1")
        .bind(id)
        .execute(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Idle, "due, but not staged yet");
    assert_eq!(e.promote().await, 1);
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Sent(id));
    assert_eq!(e.sms.fake.deliveries_of(&id.to_string()), 1);
    let view: Value =
        e.app.client.get(e.app.url(&format!("/v1/notifications/{id}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!((view["status"].as_str(), view["run_at"].is_null()), (Some("sent"), true), "{view}");
}

/// One staging round keys the due jobs of several tenants and priorities: each tenant's jobs get a run
/// of consecutive keys at its priority, in the order they came due, all from the same front.
#[tokio::test]
async fn a_staging_round_keys_each_tenant_s_due_jobs_as_one_run() {
    let e = env().await;
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, status, \
                                        run_after) \
         SELECT c, p, t, 0, 'device', '{}', 5, 'scheduled', now() - interval '1 second' \
         FROM (VALUES ('promo', 2, 'b'), ('promo', 2, 'a'), ('transactional', 1, 'a'), ('promo', 2, 'b'), \
                      ('promo', 2, 'a'), ('promo', 2, 'a')) AS j(c, p, t)",
    )
    .execute(&e.db.pool)
    .await
    .unwrap();
    assert_eq!(e.promote().await, 6);
    let keys: Vec<(i16, String, f64)> = sqlx::query_as(
        "SELECT priority, tenant, fair_key FROM notification_jobs WHERE status = 'pending' ORDER BY priority, tenant, id",
    )
    .fetch_all(&e.db.pool)
    .await
    .unwrap();
    let key = |p: i16, t: &str, k: f64| (p, t.to_string(), k);
    assert_eq!(
        keys,
        [key(1, "a", 1.0), key(2, "a", 1.0), key(2, "a", 2.0), key(2, "a", 3.0), key(2, "b", 1.0), key(2, "b", 2.0)]
    );
}

#[tokio::test]
async fn run_at_too_far_ahead_or_past_a_class_deadline_is_422_and_batches_take_a_default_and_per_job_times() {
    let e = env().await;
    let r = enqueue_at(&e, "transactional", Some(Utc::now() + chrono::Duration::days(31))).await;
    let problem = assert_problem(r, 422).await;
    assert!(problem["detail"].as_str().unwrap().contains("30 days"), "{problem}");
    // An OTP lives 15 s: scheduling it a minute out would only expire it.
    let r = enqueue_at(&e, "otp", Some(Utc::now() + chrono::Duration::minutes(1))).await;
    let problem = assert_problem(r, 422).await;
    assert!(problem["detail"].as_str().unwrap().contains("deadline"), "{problem}");
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs").await, 0, "a refused job writes nothing");
    // A time in the past means now.
    assert_eq!(enqueue_at(&e, "otp", Some(Utc::now() - chrono::Duration::seconds(5))).await.status(), 202);

    let later = Utc::now() + chrono::Duration::hours(2);
    let r = e
        .app
        .client
        .post(e.app.url("/v1/notifications/batch"))
        .json(&json!({ "class": "promo", "tenant": "shop", "run_at": later.to_rfc3339(), "jobs": [
            { "recipient": "a" },
            { "recipient": "b", "run_at": Utc::now().to_rfc3339() },
        ]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let batch_id = r.json::<Value>().await.unwrap()["batch_id"].as_i64().unwrap();
    let view = get_json(&e.app, &format!("/v1/notifications/batches/{batch_id}")).await;
    assert_eq!(view["jobs"], 2);
    assert_eq!(view["by_status"], json!({ "pending": 1, "scheduled": 1 }), "{view}");
    let r = e.app.client.get(e.app.url("/v1/notifications/batches/999999")).send().await.unwrap();
    assert_problem(r, 404).await;
}

#[tokio::test]
async fn cancel_takes_a_waiting_job_out_is_idempotent_and_409_once_sent() {
    let e = env().await;
    let group = e.group(Strategy::Priority, 0);
    let ids = e.enqueue("transactional", "bank", 3).await;
    let scheduled = enqueue_at(&e, "transactional", Some(Utc::now() + chrono::Duration::hours(1))).await;
    let scheduled = scheduled.json::<Value>().await.unwrap()["id"].as_i64().unwrap();

    // Pending.
    let r = post(&e.app, &format!("/v1/notifications/{}/cancel", ids[0])).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "canceled");
    // Again: the same answer, no second audit row.
    let r = post(&e.app, &format!("/v1/notifications/{}/cancel", ids[0])).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "canceled");
    assert_eq!(audit_count(&e, "job.canceled").await, 1);
    // Scheduled.
    let r = post(&e.app, &format!("/v1/notifications/{scheduled}/cancel")).await;
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "canceled");
    // Retrying: a transient failure puts it back in the queue, where it can still be canceled.
    e.sms.fake.set_behaviour(FakeBehaviour { error_rate: 1.0, ..Default::default() });
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Retrying(ids[1]));
    let r = post(&e.app, &format!("/v1/notifications/{}/cancel", ids[1])).await;
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "canceled");
    // Sent: too late.
    e.sms.fake.set_behaviour(FakeBehaviour::default());
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Sent(ids[2]));
    let problem = assert_problem(post(&e.app, &format!("/v1/notifications/{}/cancel", ids[2])).await, 409).await;
    assert!(problem["detail"].as_str().unwrap().contains("sent"), "{problem}");
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Idle, "canceled jobs are never claimed");
    assert_eq!(e.sms.fake.report().delivered, 1);

    assert_problem(post(&e.app, "/v1/notifications/99999999/cancel").await, 404).await;
    assert_problem(post(&e.app, "/v1/notifications/abc/cancel").await, 400).await;
    // A key bound to another tenant may not cancel (or learn about) this one: it is not found.
    let other = create_key(&e.db.pool, &[Scope::NotifySend, Scope::NotifyRead], Some(&["shop"])).await;
    let other = client_with_key(&other);
    let r = other.post(e.app.url(&format!("/v1/notifications/{}/cancel", ids[2]))).send().await.unwrap();
    assert_problem(r, 404).await;
    assert_eq!(e.status(ids[2]).await, "sent", "left as it was");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_racing_a_claimer_has_exactly_one_winner() {
    let e = env().await;
    e.sms.fake.set_behaviour(FakeBehaviour { latency_ms: 5, ..Default::default() });
    let group = e.group(Strategy::Priority, 0);
    let (mut canceled, mut sent) = (0, 0);
    for _ in 0..60 {
        let id = e.enqueue("transactional", "bank", 1).await[0];
        let cancel = e.app.client.post(e.app.url(&format!("/v1/notifications/{id}/cancel"))).send();
        let (claimed, cancel) = tokio::join!(group.try_execute_next(), cancel);
        let (claimed, cancel) = (claimed.unwrap(), cancel.unwrap());
        let status = e.status(id).await;
        let delivered = e.sms.fake.deliveries_of(&id.to_string());
        match cancel.status().as_u16() {
            200 => {
                assert_eq!((status.as_str(), delivered, claimed), ("canceled", 0, Outcome::Idle));
                canceled += 1;
            }
            409 => {
                assert_eq!((status.as_str(), delivered, claimed), ("sent", 1, Outcome::Sent(id)));
                sent += 1;
            }
            other => panic!("cancel answered {other}"),
        }
    }
    eprintln!("cancel won {canceled} races, the claimer {sent}");
    assert_eq!(canceled + sent, 60);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn canceling_a_100k_batch_while_workers_run_leaves_no_job_both_canceled_and_sent() {
    let e = env_with(|s| s.queue.max_batch = 100_000).await;
    let batch = e.batch("promo", "shop", 100_000).await;
    let batch_id = batch["batch_id"].as_i64().unwrap();
    assert_eq!(batch["accepted"], 100_000);

    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..4 {
        let (group, stop) = (e.group(Strategy::Priority, 0), stop.clone());
        workers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                group.try_execute_next().await.unwrap();
            }
        }));
    }
    // Let the workers get going, then cancel under them.
    let by = Instant::now() + Duration::from_secs(30);
    while e.push.fake.report().delivered < 50 {
        assert!(Instant::now() < by && !workers.iter().any(|w| w.is_finished()), "the workers never got going");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let started = Instant::now();
    let r = post(&e.app, &format!("/v1/notifications/batches/{batch_id}/cancel")).await;
    let took = started.elapsed();
    assert_eq!(r.status(), 200);
    let canceled = r.json::<Value>().await.unwrap()["canceled"].as_i64().unwrap();
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        tokio::time::timeout(Duration::from_secs(60), w).await.expect("a worker hung").unwrap();
    }
    eprintln!("canceled {canceled} of 100000 jobs in {took:?} while 4 workers sent");

    let count = |sql: &'static str| e.count(sql);
    assert_eq!(count("SELECT count(*) FROM notification_jobs WHERE status = 'canceled'").await, canceled);
    let sent = count("SELECT count(*) FROM notification_jobs WHERE status = 'sent'").await;
    assert_eq!(canceled + sent, 100_000, "every job is canceled or sent");
    assert!(canceled > 90_000, "the batch was stopped early: {canceled}");
    assert_eq!(
        count("SELECT count(*) FROM notification_jobs j JOIN notification_results r ON r.job_id = j.id WHERE j.status = 'canceled'")
            .await,
        0,
        "no canceled job has a send result"
    );
    let report = e.push.fake.report();
    assert_eq!(
        (report.unique_keys as i64, report.duplicated_keys),
        (sent, 0),
        "the provider saw exactly the sent jobs"
    );
    let view = get_json(&e.app, &format!("/v1/notifications/batches/{batch_id}")).await;
    assert_eq!(view["by_status"], json!({ "canceled": canceled, "sent": sent }));
    assert_eq!(audited_cancels(&e).await, canceled, "the audit rows count every canceled job");
}

/// A batch cancel that outlives its request still cancels the whole batch: the walk is a task of its
/// own, so the deadline cutting the request (or a client giving up) cannot stop it between chunks and
/// leave the rest of the batch to be sent.
#[tokio::test]
async fn a_batch_cancel_cut_by_its_deadline_still_cancels_every_job() {
    let e = env_with(|s| s.queue.max_batch = 45_000).await;
    let batch = e.batch("promo", "shop", 45_000).await;
    let batch_id = batch["batch_id"].as_i64().unwrap();
    // A second instance on the same database whose batch deadline is short.
    let mut settings = test_settings_with_pools(&e.db.url);
    use_fake_providers(&mut settings, &e.sms, &e.push);
    settings.queue.batch_timeout = Duration::from_millis(300);
    let hasty = spawn_passive_app(settings).await;

    // Audit rows wait behind this lock, so the first chunk's statement (which writes one) cannot
    // finish before the deadline.
    let mut blocker = e.db.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE audit_events IN SHARE ROW EXCLUSIVE MODE").execute(&mut *blocker).await.unwrap();
    let r = post(&hasty, &format!("/v1/notifications/batches/{batch_id}/cancel")).await;
    assert_eq!(r.status(), 503, "the request is cut at queue.batch_timeout");
    blocker.commit().await.unwrap();

    let deadline = Instant::now() + Duration::from_secs(60);
    let view = loop {
        let view = get_json(&e.app, &format!("/v1/notifications/batches/{batch_id}")).await;
        if view["by_status"] == json!({ "canceled": 45_000 }) || Instant::now() > deadline {
            break view;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(view["by_status"], json!({ "canceled": 45_000 }), "every chunk ran after the request was cut");
    assert_eq!(audited_cancels(&e).await, 45_000, "each chunk's audit row counts its jobs");
}

/// A pause taken through one pod applies there at once and on every other pod at its next budget
/// sync (the sync re-reads the pauses every 200 ms: within a second). Work claimed before it finishes,
/// intake and the other classes go on; a resume restarts claims the same way; a provider pause stops
/// every class that provider sends. Each pod's sync is driven here as a step.
#[tokio::test]
async fn a_pause_reaches_every_pod_at_its_next_sync_and_resume_restarts_claims() {
    let e = env().await;
    let (b, on_b) = e.second_pod(Strategy::Priority, 0).await;
    let on_a = e.group(Strategy::Priority, 0);
    e.batch("promo", "shop", 10).await;
    let claimed_before = on_b.claim(1).await.unwrap().pop().expect("a promo job in flight on b");

    let r = admin_post(&e.app, "/admin/queue/classes/promo/pause").await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({ "kind": "class", "name": "promo", "paused": true, "changed": true })
    );
    assert!(!e.app.state.notifications.runtime().claimable("promo"), "the pod that took the pause applies it at once");
    assert!(on_a.claim(8).await.unwrap().is_empty());
    assert!(b.state.notifications.runtime().claimable("promo"), "b has not synced yet");
    b.state.notifications.runtime().refresh_pauses(&b.state.db).await.unwrap();
    assert!(!b.state.notifications.runtime().claimable("promo"));
    assert!(on_b.claim(8).await.unwrap().is_empty(), "b claims no promo once it has synced");
    // What b took before the pause is still sent.
    let id = claimed_before.id;
    assert_eq!(on_b.process(claimed_before).await.unwrap(), Outcome::Sent(id));
    // Intake goes on, and other classes flow.
    let r = b
        .client
        .post(b.url("/v1/notifications"))
        .json(&json!({ "class": "transactional", "tenant": "bank", "recipient": "+84900000002", "payload": {} }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let flowing = on_b.claim(8).await.unwrap();
    assert_eq!(flowing.iter().map(|j| j.class.as_str()).collect::<Vec<_>>(), ["transactional"]);
    b.state.notifications.stats().refresh_now(&b.state.db, b.state.notifications.runtime()).await.unwrap();
    let view = get_json(&b, "/admin/queue").await;
    let promo = view["classes"].as_array().unwrap().iter().find(|c| c["class"] == "promo").unwrap().clone();
    assert_eq!((&promo["paused"], &promo["pending"]), (&json!(true), &json!(9)), "{view}");

    let r = admin_post(&b, "/admin/queue/classes/promo/resume").await;
    assert_eq!(r.json::<Value>().await.unwrap()["changed"], true);
    assert!(on_b.claim(1).await.unwrap().iter().all(|j| j.class == "promo"), "b resumed at once");
    assert!(!e.app.state.notifications.runtime().claimable("promo"), "a has not synced yet");
    e.app.state.notifications.runtime().refresh_pauses(&e.app.state.db).await.unwrap();
    assert_eq!(on_a.claim(1).await.unwrap().len(), 1, "a claims promo again after its sync");

    // A provider pause stops every class it sends, and only those.
    let r = admin_post(&e.app, "/admin/queue/providers/push/pause").await;
    assert_eq!(r.status(), 200);
    b.state.notifications.runtime().refresh_pauses(&b.state.db).await.unwrap();
    assert!(!b.state.notifications.runtime().claimable("promo"), "promo goes through push");
    assert!(b.state.notifications.runtime().claimable("otp"), "classes of other providers go on");
    assert_problem(admin_post(&e.app, "/admin/queue/classes/nope/pause").await, 404).await;
    let audited: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE action IN ('queue.paused', 'queue.resumed')")
            .fetch_one(&e.db.pool)
            .await
            .unwrap();
    assert_eq!(audited, 3);
    b.stop().await;
}

#[tokio::test]
async fn a_dead_letter_can_be_retried_or_discarded_by_id() {
    let e = env().await;
    e.sms.fake.set_behaviour(FakeBehaviour { reject_rate: 1.0, ..Default::default() });
    let ids = e.enqueue("transactional", "bank", 3).await;
    let group = e.group(Strategy::Priority, 0);
    assert_eq!(drain(&group).await, ids.iter().map(|&id| Outcome::Dead(id)).collect::<Vec<_>>());

    let r = admin_post(&e.app, &format!("/admin/dlq/{}/discard", ids[0])).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "discarded");
    assert_problem(admin_post(&e.app, &format!("/admin/dlq/{}/discard", ids[0])).await, 409).await;
    assert_problem(admin_post(&e.app, &format!("/admin/dlq/{}/retry", ids[0])).await, 409).await;

    e.sms.fake.set_behaviour(FakeBehaviour::default());
    let r = admin_post(&e.app, &format!("/admin/dlq/{}/retry?extra_attempts=2", ids[1])).await;
    assert_eq!(r.status(), 200);
    let job: Value = r.json().await.unwrap();
    assert_eq!(
        (job["status"].as_str(), job["max_attempts"].as_i64()),
        (Some("pending"), Some(job["attempts"].as_i64().unwrap() + 2)),
        "{job}"
    );
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Sent(ids[1]));
    assert_eq!(group.try_execute_next().await.unwrap(), Outcome::Idle, "only the retried job came back");

    assert_problem(admin_post(&e.app, &format!("/admin/dlq/{}/retry?extra_attempts=0", ids[2])).await, 400).await;
    assert_problem(admin_post(&e.app, "/admin/dlq/99999999/retry").await, 404).await;
    assert_problem(admin_post(&e.app, "/admin/dlq/x/discard").await, 400).await;
    let dlq = get_json(&e.app, "/admin/dlq").await;
    let listed: Vec<i64> = dlq["jobs"].as_array().unwrap().iter().map(|j| j["id"].as_i64().unwrap()).collect();
    assert_eq!(listed, vec![ids[2]], "discarded and retried jobs leave the dead letters");
    assert_eq!((audit_count(&e, "dlq.retried").await, audit_count(&e, "dlq.discarded").await), (1, 1));
}

#[tokio::test]
async fn observe_mode_admits_what_reject_would_refuse_and_counts_it() {
    let e = env_with(|s| s.queue.overload = OverloadMode::Observe).await;
    let overloaded = ClassStats { pending: 1_000_000, oldest_age_s: 60.0, drain_per_s: 10.0, ..ClassStats::default() };
    e.app.state.notifications.stats().set("promo", overloaded);
    assert!(matches!(
        intake::admit(e.app.state.notifications.runtime(), e.app.state.notifications.stats(), "promo"),
        Admission::WouldReject(_)
    ));
    assert_eq!(
        intake::admit(e.app.state.notifications.runtime(), e.app.state.notifications.stats(), "otp"),
        Admission::Accept
    );
    let before = would_reject_count(&e).await;
    let id = e.enqueue("promo", "shop", 1).await[0];
    let due_now: bool = sqlx::query_scalar("SELECT run_after <= now() FROM notification_jobs WHERE id = $1")
        .bind(id)
        .fetch_one(&e.db.pool)
        .await
        .unwrap();
    assert!(due_now, "observe mode neither refuses nor defers");
    // The recorder is process-wide and other tests count too: this enqueue adds at least one.
    let after = would_reject_count(&e).await;
    assert!(after >= before + 1.0, "would-reject count {before} before the enqueue, {after} after");
}

/// `cifpool_queue_intake_would_reject_total` for promo in `/metrics`, 0 before the first count.
async fn would_reject_count(e: &Env) -> f64 {
    let text = e.app.client.get(e.app.url("/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .find(|l| l.starts_with("cifpool_queue_intake_would_reject_total{") && l.contains("class=\"promo\""))
        .map_or(0.0, |line| line.rsplit(' ').next().unwrap().parse().unwrap())
}

#[tokio::test]
async fn the_queue_view_matches_the_table() {
    let e = env().await;
    e.enqueue("transactional", "bank", 5).await;
    e.enqueue("promo", "shop", 2).await;
    enqueue_at(&e, "promo", Some(Utc::now() + chrono::Duration::hours(1))).await;
    // One of each other state, straight in the table.
    for sql in [
        "UPDATE notification_jobs SET status = 'sending', attempts = 1, picked_at = now(), lease_expires_at = now() + interval '1 minute' \
         WHERE id = (SELECT min(id) FROM notification_jobs WHERE class = 'transactional')",
        "UPDATE notification_jobs SET status = 'dead', attempts = 1, finished_at = now() - interval '2 hours' \
         WHERE id = (SELECT max(id) FROM notification_jobs WHERE class = 'transactional')",
        "UPDATE notification_jobs SET status = 'failed-retrying', attempts = 1, run_after = now() + interval '1 minute' \
         WHERE id = (SELECT min(id) FROM notification_jobs WHERE class = 'promo')",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&e.db.pool).await.unwrap();
    }
    admin_post(&e.app, "/admin/queue/classes/promo/pause").await;
    // The oldest waiting transactional job has waited 90 s.
    sqlx::query(
        "UPDATE notification_jobs SET created_at = created_at - interval '90 seconds', \
                run_after = run_after - interval '90 seconds' WHERE class = 'transactional' AND status = 'pending'",
    )
    .execute(&e.db.pool)
    .await
    .unwrap();
    // The waiting counts are the statistics' last count: none yet, then this one.
    assert_eq!(get_json(&e.app, "/admin/queue").await["counted_age_s"], serde_json::Value::Null);
    e.app.state.notifications.stats().refresh_now(&e.app.state.db, e.app.state.notifications.runtime()).await.unwrap();
    let view = get_json(&e.app, "/admin/queue").await;
    assert!(view["counted_age_s"].as_f64().unwrap() < 5.0, "{view}");
    let classes = view["classes"].as_array().unwrap();
    assert_eq!(
        classes.iter().map(|c| c["class"].as_str().unwrap()).collect::<Vec<_>>(),
        ["otp", "promo", "transactional"]
    );
    for class in classes {
        let name = class["class"].as_str().unwrap();
        let table: (i64, i64, i64, i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE status = 'pending'), \
                    count(*) FILTER (WHERE status = 'scheduled'), \
                    count(*) FILTER (WHERE status = 'sending'), \
                    count(*) FILTER (WHERE status = 'failed-retrying'), \
                    count(*) FILTER (WHERE status = 'dead') FROM notification_jobs WHERE class = $1",
        )
        .bind(name)
        .fetch_one(&e.db.pool)
        .await
        .unwrap();
        let shown = (
            class["pending"].as_i64().unwrap(),
            class["scheduled"].as_i64().unwrap(),
            class["in_flight"].as_i64().unwrap(),
            class["retrying"].as_i64().unwrap(),
            class["dead"].as_i64().unwrap(),
        );
        assert_eq!(shown, table, "{name}: {class}");
        assert_eq!(class["paused"], name == "promo");
    }
    let transactional = classes.iter().find(|c| c["class"] == "transactional").unwrap();
    assert_eq!(
        (transactional["pending"].as_i64(), transactional["in_flight"].as_i64(), transactional["dead"].as_i64()),
        (Some(3), Some(1), Some(1))
    );
    let age = transactional["oldest_waiting_age_s"].as_f64().unwrap();
    assert!((90.0..120.0).contains(&age), "oldest waiting transactional job: {age} s");
    let promo = classes.iter().find(|c| c["class"] == "promo").unwrap();
    assert_eq!(
        (promo["pending"].as_i64(), promo["scheduled"].as_i64(), promo["retrying"].as_i64()),
        (Some(1), Some(1), Some(1))
    );
    let providers = view["providers"].as_array().unwrap();
    assert_eq!(providers.iter().map(|p| p["provider"].as_str().unwrap()).collect::<Vec<_>>(), ["push", "sms"]);
    for p in providers {
        let configured = &e.app.state.notifications.runtime().providers[p["provider"].as_str().unwrap()];
        assert_eq!(p["max_concurrency"].as_u64(), Some(u64::from(configured.budget.max_concurrency())));
        assert_eq!(p["paused"], false);
    }

    // The oldest dead letter's age reaches the stats (and its gauge).
    e.app.state.notifications.stats().refresh_now(&e.app.state.db, e.app.state.notifications.runtime()).await.unwrap();
    let age = e.app.state.notifications.stats().get("transactional").unwrap().oldest_dead_age_s;
    assert!((7100.0..7300.0).contains(&age), "{age}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_counts_the_queue_stats_and_the_others_read_them() {
    let e = env().await;
    let mut settings = test_settings_with_pools(&e.db.url);
    use_fake_providers(&mut settings, &e.sms, &e.push);
    let other = spawn_passive_app(settings).await;
    let db = &e.app.state.db;
    e.enqueue("promo", "shop", 3).await;

    // Nothing stored yet: the first refresh counts; the next one, within STATS_FRESH, reads its numbers.
    assert_eq!(
        e.app.state.notifications.stats().refresh(db, e.app.state.notifications.runtime()).await.unwrap(),
        Refreshed::Computed
    );
    assert_eq!(
        other.state.notifications.stats().refresh(&other.state.db, other.state.notifications.runtime()).await.unwrap(),
        Refreshed::Shared
    );
    assert_eq!(other.state.notifications.stats().get("promo").unwrap().pending, 3);
    assert_eq!(other.state.notifications.stats().get("otp").unwrap().pending, 0);

    // Stale numbers while another instance counts (holds the lock): read, not counted a second time.
    e.enqueue("promo", "shop", 2).await;
    sqlx::query("UPDATE queue_class_stats SET refreshed_at = now() - interval '1 hour'").execute(db).await.unwrap();
    let mut counting = db.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(STATS_LOCK).execute(&mut *counting).await.unwrap();
    assert_eq!(
        other.state.notifications.stats().refresh(&other.state.db, other.state.notifications.runtime()).await.unwrap(),
        Refreshed::Shared
    );
    assert_eq!(other.state.notifications.stats().get("promo").unwrap().pending, 3);
    counting.rollback().await.unwrap();

    // Stale and nobody counting: counted again.
    assert_eq!(
        other.state.notifications.stats().refresh(&other.state.db, other.state.notifications.runtime()).await.unwrap(),
        Refreshed::Computed
    );
    assert_eq!(other.state.notifications.stats().get("promo").unwrap().pending, 5);

    // Ages are as of the reader's read: stored as instants, they grow between counts.
    sqlx::query("UPDATE queue_class_stats SET oldest_due_at = now() - interval '100 seconds', refreshed_at = now()")
        .execute(db)
        .await
        .unwrap();
    assert_eq!(
        e.app.state.notifications.stats().refresh(db, e.app.state.notifications.runtime()).await.unwrap(),
        Refreshed::Shared
    );
    let age = e.app.state.notifications.stats().get("promo").unwrap().oldest_age_s;
    assert!((100.0..110.0).contains(&age), "{age}");
    other.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_beyond_max_concurrent_batches_are_429_not_held_in_memory() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let e = env_with(|s| s.queue.max_concurrent_batches = 1).await;
    let body = serde_json::to_vec(&json!({ "class": "promo", "tenant": "shop",
        "jobs": (0..1000).map(|i| json!({ "recipient": format!("d-{i}") })).collect::<Vec<_>>() }))
    .unwrap();
    // A client sending its batch slowly: headers and half the body, the rest later.
    let addr = e.app.base.trim_start_matches("http://").to_string();
    let mut slow = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST /v1/notifications/batch HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        e.app.key,
        body.len()
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    slow.write_all(&body[..body.len() / 2]).await.unwrap();
    let by = Instant::now() + Duration::from_secs(5);
    while e.app.state.notifications.runtime().batch_permits.available_permits() > 0 {
        assert!(Instant::now() < by, "the slow batch never took its permit");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Meanwhile another batch is refused at once, before its body is read.
    let r = e
        .app
        .client
        .post(e.app.url("/v1/notifications/batch"))
        .body(body.clone())
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers().get("retry-after").map(|v| v.to_str().unwrap()), Some("1"));
    let problem = assert_problem(r, 429).await;
    assert!(problem["detail"].as_str().unwrap().contains("max_concurrent_batches"), "{problem}");
    // Ordinary requests are not limited.
    assert_eq!(enqueue_at(&e, "promo", None).await.status(), 202);
    // The slow batch completes, and frees its permit.
    slow.write_all(&body[body.len() / 2..]).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(30), slow.read_to_string(&mut answer))
        .await
        .expect("no answer within 30 s")
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 202"), "{answer}");
    assert_eq!(e.app.state.notifications.runtime().batch_permits.available_permits(), 1);
    let r = e
        .app
        .client
        .post(e.app.url("/v1/notifications/batch"))
        .body(body)
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
}

/// Between two counts the oldest waiting age is the one counted, not grown since: the job that was
/// oldest then may have been sent the moment after, and a count kept for seconds must not make a
/// healthy OTP queue look stuck.
#[tokio::test]
async fn a_kept_count_shows_the_age_it_counted() {
    let e = env().await;
    let (db, rt, stats) = (&e.app.state.db, e.app.state.notifications.runtime(), e.app.state.notifications.stats());
    e.enqueue("promo", "shop", 1).await;
    stats.refresh_now(db, rt).await.unwrap();
    // Promo counted 30 s ago with its oldest then 3 s old; every count still fresh (each took 10 s).
    sqlx::query(
        "UPDATE queue_class_stats SET counting_s = 10, \
                refreshed_at = CASE WHEN class = 'promo' THEN now() - interval '30 seconds' ELSE now() END, \
                oldest_due_at = CASE WHEN class = 'promo' THEN now() - interval '33 seconds' ELSE oldest_due_at END",
    )
    .execute(db)
    .await
    .unwrap();
    stats.refresh(db, rt).await.unwrap();
    let age = stats.get("promo").unwrap().oldest_age_s;
    assert!((age - 3.0).abs() < 0.5, "the age as counted, not 33 s: {age}");
}

/// Counting a large queue takes long, so the stored numbers stay fresh for forty times as long as the
/// last count took: the deployment then spends at most about a fortieth of a core counting.
#[tokio::test]
async fn a_slow_count_is_repeated_less_often() {
    let e = env().await;
    let (db, rt, stats) = (&e.app.state.db, e.app.state.notifications.runtime(), e.app.state.notifications.stats());
    e.enqueue("promo", "shop", 2).await;
    stats.refresh_now(db, rt).await.unwrap();
    let took: f64 = sqlx::query_scalar("SELECT max(counting_s) FROM queue_class_stats").fetch_one(db).await.unwrap();
    assert!(took > 0.0 && took < 5.0, "the count's own time is kept: {took}");
    // Ten seconds old: stale for a count that took a moment, fresh for one that took a second.
    sqlx::query("UPDATE queue_class_stats SET refreshed_at = now() - interval '10 seconds', counting_s = 1")
        .execute(db)
        .await
        .unwrap();
    assert_eq!(stats.refresh(db, rt).await.unwrap(), Refreshed::Shared);
    sqlx::query("UPDATE queue_class_stats SET refreshed_at = now() - interval '10 seconds', counting_s = 0.01")
        .execute(db)
        .await
        .unwrap();
    // Counted again: by this call, or by the service's own statistics task if it came first (while that
    // task holds the stats lock, even only to look at the stored numbers' age, a call leaves the
    // counting to it, so a call may need to be repeated).
    let mut age = f64::MAX;
    for _ in 0..50 {
        stats.refresh(db, rt).await.unwrap();
        age = sqlx::query_scalar("SELECT max(extract(epoch FROM now() - refreshed_at))::float8 FROM queue_class_stats")
            .fetch_one(db)
            .await
            .unwrap();
        if age < 5.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(age < 5.0, "a stale count that took a moment is repeated: {age} s old");
}
