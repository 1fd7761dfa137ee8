//! Personal data does not outlive its use: every way a job finishes (sent, expired, canceled,
//! discarded) erases its payload and masks its recipient in the same statement; a class that keeps them
//! does so for its stated time and the sweep erases them then; dead letters keep them for a retry; a
//! database dump after an OTP was sent holds neither the code nor the number.

use std::time::Duration;

use crate::common;

use cifpool::internals::fake_provider::FakeBehaviour;
use cifpool::queue::policy::Strategy;
use common::TEST_ADMIN_TOKEN;
use common::queue_env::{Env, drain, env_with};
use serde_json::{Value, json};

/// Payload text in clear, recipient column, kept-for, whether its erasure is scheduled, and whether it
/// holds sealed data, of job `id`.
async fn stored(e: &Env, id: i64) -> (Option<String>, String, Option<f64>, bool, bool) {
    sqlx::query_as(
        "SELECT payload::text, recipient, extract(epoch FROM keep_personal_data)::float8, \
                personal_data_erase_at IS NOT NULL, sealed IS NOT NULL FROM notification_jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&e.db.pool)
    .await
    .unwrap()
}

async fn enqueue(e: &Env, body: Value) -> i64 {
    let r = e.app.client.post(e.app.url("/v1/notifications")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());
    r.json::<Value>().await.unwrap()["id"].as_i64().unwrap()
}

/// Promotional messages kept 30 days, everything else erased as it finishes.
async fn promo_kept() -> Env {
    env_with(|s| {
        let promo = s.queue.classes.iter_mut().find(|c| c.name == "promo").unwrap();
        promo.keep_personal_data = Some(Duration::from_secs(30 * 86_400));
    })
    .await
}

#[tokio::test]
async fn a_sent_otp_keeps_nothing_readable_and_a_kept_class_is_erased_when_its_time_is_up() {
    let e = promo_kept().await;
    let otp = enqueue(
        &e,
        json!({ "class": "otp", "tenant": "bank", "recipient": "+84901234567", "payload": {"code": "918273"} }),
    )
    .await;
    let promo = enqueue(&e, json!({ "class": "promo", "tenant": "bank", "recipient": "device-token-abcdef", "payload": {"text": "spring-offer-77"} })).await;
    assert_eq!(stored(&e, otp).await, (None, "********4567".into(), None, false, true), "sealed at intake");
    assert_eq!(stored(&e, promo).await.2, Some(30.0 * 86_400.0));
    drain(&e.group(Strategy::Fifo, 0)).await;
    assert_eq!((e.status(otp).await, e.status(promo).await), ("sent".into(), "sent".into()));

    assert_eq!(stored(&e, otp).await, (None, "********4567".into(), None, false, false), "erased as it was sent");
    let (payload, recipient, _, erase_scheduled, sealed) = stored(&e, promo).await;
    assert_eq!((payload, recipient.as_str(), erase_scheduled, sealed), (None, "***************cdef", true, true));
    let erase_at_in_days: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM personal_data_erase_at - finished_at)::float8 / 86400 FROM notification_jobs WHERE id = $1",
    )
    .bind(promo)
    .fetch_one(&e.db.pool)
    .await
    .unwrap();
    assert!((erase_at_in_days - 30.0).abs() < 0.01, "{erase_at_in_days}");

    // Not due yet: the sweep leaves it. Due: erased, and out of the sweep's index.
    assert_eq!(cifpool::internals::queue_store::erase_due(&e.db.pool, 1000).await.unwrap(), 0);
    sqlx::query("UPDATE notification_jobs SET personal_data_erase_at = now() - interval '1 second' WHERE id = $1")
        .bind(promo)
        .execute(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(cifpool::internals::queue_store::erase_due(&e.db.pool, 1000).await.unwrap(), 1);
    assert_eq!(stored(&e, promo).await, (None, "***************cdef".into(), Some(30.0 * 86_400.0), false, false));

    // What a backup would copy: neither the code nor the number.
    let dump =
        std::process::Command::new(crate::fence::pg_tool("pg_dump")).args(["--dbname", &e.db.url]).output().unwrap();
    assert!(dump.status.success(), "{}", String::from_utf8_lossy(&dump.stderr));
    let dump = String::from_utf8_lossy(&dump.stdout);
    assert!(dump.contains("notification_jobs"), "the dump holds the jobs table");
    for secret in ["918273", "84901234567", "901234567", "device-token", "spring-offer"] {
        assert!(!dump.contains(secret), "the dump holds {secret:?}");
    }
}

#[tokio::test]
async fn expired_canceled_and_discarded_jobs_are_erased_and_dead_letters_keep_theirs() {
    let e = promo_kept().await;
    let job = |recipient: &str| json!({ "class": "transactional", "tenant": "bank", "recipient": recipient, "payload": {"otp": "1"} });

    // Expired while waiting.
    let expired = enqueue(&e, job("+84900000001")).await;
    sqlx::query("UPDATE notification_jobs SET deadline = now() - interval '1 second' WHERE id = $1")
        .bind(expired)
        .execute(&e.db.pool)
        .await
        .unwrap();
    cifpool::internals::queue_store::expire_overdue(&e.db.pool, 100).await.unwrap();
    assert_eq!(e.status(expired).await, "expired");
    assert_eq!(stored(&e, expired).await, (None, "********0001".into(), None, false, false));

    // Canceled, alone and with its batch.
    let canceled = enqueue(&e, job("+84900000002")).await;
    let r = e.app.client.post(e.app.url(&format!("/v1/notifications/{canceled}/cancel"))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(stored(&e, canceled).await, (None, "********0002".into(), None, false, false));
    let batch = e.batch("transactional", "bank", 3).await;
    let r = e
        .app
        .client
        .post(e.app.url(&format!("/v1/notifications/batches/{}/cancel", batch["batch_id"])))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let left = e.count("SELECT count(*) FROM notification_jobs WHERE status = 'canceled' AND (payload IS NOT NULL OR sealed IS NOT NULL OR recipient LIKE 'dev-%')").await;
    assert_eq!(left, 0);

    // Refused by the provider: a dead letter keeps its data for a retry; discarded, it is erased.
    e.sms.fake.set_behaviour(FakeBehaviour { reject_rate: 1.0, ..Default::default() });
    let dead = enqueue(&e, job("+84900000003")).await;
    drain(&e.group(Strategy::Fifo, 0)).await;
    assert_eq!(e.status(dead).await, "dead");
    assert_eq!(stored(&e, dead).await, (None, "********0003".into(), None, false, true), "kept, sealed");
    let admin = common::client_with_key(TEST_ADMIN_TOKEN);
    let r = admin.post(e.app.url(&format!("/admin/dlq/{dead}/discard"))).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    assert_eq!(stored(&e, dead).await, (None, "********0003".into(), None, false, false));

    // A kept class's batch jobs carry its keeping time; the others none.
    e.batch("promo", "bank", 2).await;
    let kept = e
        .count(
            "SELECT count(*) FROM notification_jobs WHERE class = 'promo' AND keep_personal_data = interval '30 days'",
        )
        .await;
    assert_eq!(kept, 2);
    let none = e
        .count("SELECT count(*) FROM notification_jobs WHERE class <> 'promo' AND keep_personal_data IS NOT NULL")
        .await;
    assert_eq!(none, 0);
}

/// The mask is inlined into the statements that call it (a strict SQL function over a non-strict body
/// is called row by row instead, which cost a fifth of the drain rate): the plan shows its body.
#[tokio::test]
async fn the_mask_is_inlined_into_the_finishing_statements() {
    let db = common::fresh_database().await;
    let plan: Vec<String> =
        sqlx::query_scalar("EXPLAIN (VERBOSE) UPDATE notification_jobs SET recipient = notification_masked(recipient)")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let plan = plan.join("\n");
    assert!(plan.contains("right(") || plan.contains("\"right\"("), "{plan}");
    assert!(!plan.contains("notification_masked("), "{plan}");
    let masked: Vec<Option<String>> =
        sqlx::query_scalar("SELECT notification_masked(r) FROM unnest(ARRAY['+84901234567', '123456', '', NULL]) AS r")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    assert_eq!(masked, [Some("********4567".into()), Some("******".into()), Some(String::new()), None]);
}
