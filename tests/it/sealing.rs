//! Personal data sealed before it reaches Postgres: a job waiting to be sent holds its recipient and
//! payload as ciphertext only (one request or a batch alike), the worker opens them after its claim,
//! rows sealed under an earlier key id are still sent after a rotation, a row whose sealed data was
//! changed is dead-lettered instead of sent, and an instance with another master key is refused at start.

use crate::common;

use cifpool::internals::queue_store::ClaimedJob;
use cifpool::queue::policy::Strategy;
use common::queue_env::{Env, drain, env_with};
use common::{spawn_passive_app, test_settings_with_pools, use_fake_providers};
use serde_json::{Value, json};

async fn enqueue(app: &common::TestApp, body: Value) -> i64 {
    let r = app.client.post(app.url("/v1/notifications")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());
    r.json::<Value>().await.unwrap()["id"].as_i64().unwrap()
}

fn otp(recipient: &str, code: &str) -> Value {
    json!({ "class": "otp", "tenant": "bank", "recipient": recipient, "payload": { "code": code } })
}

/// The database as a plain-SQL dump would copy it.
fn dump(url: &str) -> String {
    let out = std::process::Command::new(crate::fence::pg_tool("pg_dump")).args(["--dbname", url]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn by_id(jobs: &[ClaimedJob], id: i64) -> &ClaimedJob {
    jobs.iter().find(|j| j.id == id).unwrap_or_else(|| panic!("job {id} not claimed"))
}

async fn with_key_id(key_id: &str) -> Env {
    let key_id = key_id.to_string();
    env_with(move |s| s.security.personal_data_key_id = key_id).await
}

#[tokio::test]
async fn a_waiting_job_holds_ciphertext_only_and_the_worker_opens_it_after_the_claim() {
    let e = with_key_id("2026-12").await;
    let single = enqueue(&e.app, otp("+84901234567", "918273")).await;
    let batch = json!({ "class": "otp", "tenant": "bank", "jobs": [
        { "recipient": "+84907654321", "payload": { "code": "564738" } },
        { "recipient": "+84909999888", "payload": { "code": "102938" } } ] });
    let r = e.app.client.post(e.app.url("/v1/notifications/batch")).json(&batch).send().await.unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());

    let rows: Vec<(String, Option<String>, i32, Option<String>)> = sqlx::query_as(
        "SELECT recipient, payload::text, length(sealed), sealed_with FROM notification_jobs ORDER BY id",
    )
    .fetch_all(&e.db.pool)
    .await
    .unwrap();
    let masked: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(masked, ["********4567", "********4321", "********9888"]);
    for (_, payload, sealed_len, key_id) in &rows {
        assert_eq!((payload, key_id.as_deref()), (&None, Some("2026-12")));
        assert!(*sealed_len > 40, "{sealed_len}");
    }
    // What a backup, a replica or the WAL copies while the jobs wait: neither codes nor numbers.
    let waiting = dump(&e.db.url);
    assert!(waiting.contains("2026-12"), "the dump holds the jobs");
    for secret in ["918273", "564738", "102938", "901234567", "907654321", "909999888"] {
        assert!(!waiting.contains(secret), "the dump holds {secret:?}");
    }

    let jobs = e.group(Strategy::Fifo, 0).claim(10).await.unwrap();
    assert_eq!(jobs.len(), 3);
    let sent = by_id(&jobs, single);
    assert_eq!((sent.recipient.as_str(), &sent.payload), ("+84901234567", &json!({ "code": "918273" })));
    let batched: Vec<(&str, &Value)> =
        jobs.iter().filter(|j| j.id != single).map(|j| (j.recipient.as_str(), &j.payload)).collect();
    assert_eq!(
        batched,
        [("+84907654321", &json!({ "code": "564738" })), ("+84909999888", &json!({ "code": "102938" }))]
    );
}

#[tokio::test]
async fn jobs_sealed_under_an_earlier_key_id_are_sent_after_a_rotation() {
    let e = with_key_id("2026-11").await;
    let before = enqueue(&e.app, otp("+84901111111", "111111")).await;

    // The operator starts a new key id; a pod with it seals new jobs under it and opens the old ones.
    let mut settings = test_settings_with_pools(&e.db.url);
    use_fake_providers(&mut settings, &e.sms, &e.push);
    settings.security.personal_data_key_id = "2026-12".into();
    let rotated = spawn_passive_app(settings).await;
    rotated.state.notifications.runtime().join_budgets(&rotated.state.db).await.unwrap();
    // The first pod held every provider's whole budget alone: a sync of each shares it out.
    e.app.state.notifications.runtime().sync_budgets(&e.app.state.db).await;
    rotated.state.notifications.runtime().sync_budgets(&rotated.state.db).await;
    let after = enqueue(&rotated, otp("+84902222222", "222222")).await;

    let key_ids: Vec<(i64, String)> = sqlx::query_as("SELECT id, sealed_with FROM notification_jobs ORDER BY id")
        .fetch_all(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(key_ids, [(before, "2026-11".to_string()), (after, "2026-12".to_string())]);
    let known: Vec<String> = sqlx::query_scalar("SELECT key_id FROM personal_data_keys ORDER BY key_id")
        .fetch_all(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(known, ["2026-11", "2026-12"]);

    // The new pod opens the job sealed under the old id; a pod still on the old id opens the new one.
    let jobs = common::queue_env::group_of(&rotated, Strategy::Fifo, 0).claim(1).await.unwrap();
    assert_eq!(by_id(&jobs, before).recipient, "+84901111111");
    let jobs = e.group(Strategy::Fifo, 0).claim(1).await.unwrap();
    assert_eq!(by_id(&jobs, after).payload, json!({ "code": "222222" }));
    rotated.stop().await;
}

#[tokio::test]
async fn a_job_whose_sealed_data_was_changed_is_dead_lettered_and_the_others_are_sent() {
    let e = env_with(|_| {}).await;
    let forged = enqueue(&e.app, otp("+84901234567", "918273")).await;
    let good = enqueue(&e.app, otp("+84907654321", "564738")).await;
    // One bit of the ciphertext flipped, as a write to the table (or a bad disk) would.
    sqlx::query("UPDATE notification_jobs SET sealed = set_byte(sealed, 30, get_byte(sealed, 30) # 1) WHERE id = $1")
        .bind(forged)
        .execute(&e.db.pool)
        .await
        .unwrap();
    // The step that meets the forged row dead-letters it and sends nothing: a second drain sends the other.
    let group = e.group(Strategy::Fifo, 0);
    drain(&group).await;
    drain(&group).await;
    assert_eq!((e.status(forged).await, e.status(good).await), ("dead".to_string(), "sent".to_string()));
    let error: String = sqlx::query_scalar("SELECT last_error FROM notification_jobs WHERE id = $1")
        .bind(forged)
        .fetch_one(&e.db.pool)
        .await
        .unwrap();
    assert!(error.contains("does not open under key id \"1\""), "{error}");
}

#[tokio::test]
async fn an_instance_with_another_master_key_is_refused_before_it_seals_anything() {
    let e = env_with(|_| {}).await;
    enqueue(&e.app, otp("+84901234567", "918273")).await;
    let mut settings = test_settings_with_pools(&e.db.url);
    // Without pools, whose own key check would refuse it first.
    settings.pools.clear();
    let url = settings.database.url.clone().unwrap();
    let database = cifpool::db::Database::external(&settings.database, cifpool::db::options_from_url(&url).unwrap());
    let other = cifpool::keys::MasterKey::from_bytes([9; 32]);
    let refused = cifpool::startup::Application::build_with(settings, database, &other).await.err().expect("refused");
    let message = format!("{refused:#}");
    assert!(message.contains("personal_data_key_id \"1\" was first used with another master key"), "{message}");
}

/// A customer's erasure request from the command line: their waiting job is canceled, their dead
/// letter discarded and their kept sent job erased, each with nothing readable left; another customer's
/// jobs are untouched; a dry run changes nothing; the audit row has the counts and not the number.
#[tokio::test]
async fn a_customers_erasure_request_leaves_none_of_their_data_and_nothing_of_the_others_changed() {
    let e = env_with(|s| {
        let promo = s.queue.classes.iter_mut().find(|c| c.name == "promo").unwrap();
        promo.keep_personal_data = Some(std::time::Duration::from_secs(86_400));
    })
    .await;
    let customer = "+84901234567";
    let job = |class: &str, recipient: &str| json!({ "class": class, "tenant": "bank", "recipient": recipient, "payload": {"text": "x"} });
    let kept = enqueue(&e.app, job("promo", customer)).await;
    drain(&e.group(Strategy::Fifo, 0)).await;
    e.sms
        .fake
        .set_behaviour(cifpool::internals::fake_provider::FakeBehaviour { reject_rate: 1.0, ..Default::default() });
    let dead = enqueue(&e.app, job("transactional", customer)).await;
    drain(&e.group(Strategy::Fifo, 0)).await;
    let waiting = enqueue(&e.app, job("transactional", customer)).await;
    let other = enqueue(&e.app, job("transactional", "+84909999999")).await;
    assert_eq!(
        (e.status(kept).await, e.status(dead).await, e.status(waiting).await),
        ("sent".into(), "dead".into(), "pending".into())
    );

    let dry = common::json_lines(&common::cifpool_cli(&e.db.url, &["queue", "erase-recipient", customer]));
    assert_eq!(
        (dry[0]["scanned"].as_u64(), dry[0]["matched"].as_u64(), &dry[0]["applied"]),
        (Some(4), Some(3), &json!(false))
    );
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs WHERE sealed IS NOT NULL").await, 4);

    let out = common::cifpool_cli(&e.db.url, &["queue", "erase-recipient", customer, "--tenant", "bank", "--apply"]);
    let done = &common::json_lines(&out)[0];
    assert_eq!(
        (
            &done["matched"],
            &done["canceled"],
            &done["discarded"],
            &done["erased"],
            &done["in_flight"],
            &done["applied"]
        ),
        (&json!(3), &json!(1), &json!(1), &json!(1), &json!(0), &json!(true)),
        "{done}"
    );
    let statuses = (e.status(kept).await, e.status(dead).await, e.status(waiting).await, e.status(other).await);
    assert_eq!(statuses, ("sent".into(), "discarded".into(), "canceled".into(), "pending".into()));
    let left: Vec<(i64, String, bool)> = sqlx::query_as(
        "SELECT id, recipient, sealed IS NOT NULL OR payload IS NOT NULL FROM notification_jobs ORDER BY id",
    )
    .fetch_all(&e.db.pool)
    .await
    .unwrap();
    for (id, recipient, holds_data) in left {
        assert_eq!(holds_data, id == other, "job {id}");
        assert!(recipient.starts_with('*'), "job {id}: {recipient}");
    }
    let audit: (String, Value) =
        sqlx::query_as("SELECT actor, detail FROM audit_events WHERE action = 'personal_data.erased'")
            .fetch_one(&e.db.pool)
            .await
            .unwrap();
    assert!(audit.0.starts_with("cli:"), "{}", audit.0);
    assert_eq!((&audit.1["matched"], &audit.1["tenant"]), (&json!(3), &json!("bank")));
    assert!(!audit.1.to_string().contains("901234567"));
}
