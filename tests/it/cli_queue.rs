//! `cifpool queue pause|resume|pauses|cancel-batch` and `cifpool dlq retry|discard` against a database,
//! as ops run them.

use crate::common;

use common::{assert_cli_error, cifpool_cli as cifpool, fresh_database, json_lines as lines};
use serde_json::json;

/// Inserts `n` jobs of class `class` with `status`, in batch `batch` if given; returns their ids.
async fn jobs(db: &sqlx::PgPool, class: &str, status: &str, n: i64, batch: Option<i64>) -> Vec<i64> {
    sqlx::query_scalar(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, status, \
                                        attempts, finished_at, batch_id) \
         SELECT $1, 2, 'shop', g, 'r' || g, '{}', 5, $2, CASE WHEN $2 = 'dead' THEN 5 ELSE 0 END, \
                CASE WHEN $2 = 'dead' THEN now() END, $4 \
         FROM generate_series(1, $3) AS g RETURNING id",
    )
    .bind(class)
    .bind(status)
    .bind(n)
    .bind(batch)
    .fetch_all(db)
    .await
    .unwrap()
}

#[tokio::test]
async fn pauses_batch_cancels_and_dead_letters_from_the_command_line() {
    let db = fresh_database().await;
    let out = cifpool(&db.url, &["queue", "pause", "class", "promo"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("class promo paused"));
    let pauses = lines(&cifpool(&db.url, &["queue", "pauses"]));
    assert_eq!((pauses.len(), &pauses[0]["kind"], &pauses[0]["name"]), (1, &json!("class"), &json!("promo")));
    assert!(pauses[0]["paused_by"].as_str().unwrap().starts_with("cli:"), "{}", pauses[0]);
    let again = cifpool(&db.url, &["queue", "pause", "class", "promo"]);
    assert!(again.status.success(), "pausing twice is not an error: {}", String::from_utf8_lossy(&again.stderr));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already paused"));
    let unknown = cifpool(&db.url, &["queue", "pause", "provider", "carrier-pigeon"]);
    assert_cli_error(&unknown, "no provider named");
    assert!(cifpool(&db.url, &["queue", "resume", "class", "promo"]).status.success());
    assert!(lines(&cifpool(&db.url, &["queue", "pauses"])).is_empty());

    // A batch of three, one of them already sent.
    let ids = jobs(&db.pool, "promo", "pending", 3, None).await;
    let batch: i64 = sqlx::query_scalar(
        "INSERT INTO notification_batches (created_by, first_job_id, last_job_id, jobs, tenants) \
         VALUES ('test', $1, $2, 3, '{shop}') RETURNING id",
    )
    .bind(ids[0])
    .bind(ids[2])
    .fetch_one(&db.pool)
    .await
    .unwrap();
    sqlx::query("UPDATE notification_jobs SET batch_id = $1, status = CASE WHEN id = $2 THEN 'sent' ELSE status END")
        .bind(batch)
        .bind(ids[0])
        .execute(&db.pool)
        .await
        .unwrap();
    let canceled = lines(&cifpool(&db.url, &["queue", "cancel-batch", &batch.to_string()]));
    assert_eq!(canceled, vec![json!({ "batch_id": batch, "canceled": 2 })]);
    assert_cli_error(&cifpool(&db.url, &["queue", "cancel-batch", "999999"]), "no batch 999999");

    let dead = jobs(&db.pool, "transactional", "dead", 2, None).await;
    let retried = lines(&cifpool(&db.url, &["dlq", "retry", &dead[0].to_string(), "--extra-attempts", "3"]));
    assert_eq!((&retried[0]["status"], &retried[0]["max_attempts"]), (&json!("pending"), &json!(8)));
    let discarded = lines(&cifpool(&db.url, &["dlq", "discard", &dead[1].to_string()]));
    assert_eq!(discarded[0]["status"], "discarded");
    let twice = cifpool(&db.url, &["dlq", "discard", &dead[1].to_string()]);
    assert_cli_error(&twice, "not a dead letter");
    let zero = cifpool(&db.url, &["dlq", "retry", &dead[0].to_string(), "--extra-attempts", "0"]);
    assert_cli_error(&zero, "--extra-attempts must be between 1 and");

    let actions: Vec<String> =
        lines(&cifpool(&db.url, &["audit"])).iter().map(|e| e["action"].as_str().unwrap().to_string()).collect();
    for action in ["queue.paused", "queue.resumed", "batch.canceled", "dlq.retried", "dlq.discarded"] {
        assert!(actions.iter().any(|a| a == action), "{action} not audited: {actions:?}");
    }
}
