//! Intake backpressure from the queue's own numbers: the drain rate counted from the jobs that
//! finished in the last 30 s (no injected figures), the predicted wait per tenant, and the 429 with
//! `Retry-After` it leads to.

use crate::common;

use std::time::Duration;

use common::queue_env::{Env, env_with};
use serde_json::json;

/// Inserts `n` promo jobs of `tenant` with `status`, finished `ago` seconds ago (`None`: waiting).
async fn jobs(e: &Env, tenant: &str, status: &str, n: i64, ago: Option<f64>) {
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, status, \
                                        attempts, finished_at) \
         SELECT 'promo', 2, $1, g, 'device', '{}', 5, $2, 1, now() - make_interval(secs => $4) \
         FROM generate_series(1, $3) AS g",
    )
    .bind(tenant)
    .bind(status)
    .bind(n)
    .bind(ago)
    .execute(&e.db.pool)
    .await
    .unwrap();
}

async fn enqueue(e: &Env, tenant: &str) -> reqwest::Response {
    e.app
        .client
        .post(e.app.url("/v1/notifications"))
        .json(&json!({ "class": "promo", "tenant": tenant, "recipient": "device", "payload": {} }))
        .send()
        .await
        .unwrap()
}

async fn refresh(e: &Env) {
    e.app.state.notifications.stats().refresh_now(&e.app.state.db, e.app.state.notifications.runtime()).await.unwrap();
}

/// 30 jobs that left the queue in the last 30 s make a drain of 1 job/s (older finishes and
/// discarded dead letters do not count); 20 waiting jobs of one tenant then predict 21 s for its next
/// one, over a target of 10 s: 429 with `Retry-After: 11`, while another tenant is still accepted.
/// Once the drain rises, the same tenant is accepted again.
#[tokio::test]
async fn the_drain_rate_counted_from_finished_jobs_decides_who_is_refused() {
    let e = env_with(|s| {
        let promo = s.queue.classes.iter_mut().find(|c| c.name == "promo").unwrap();
        promo.target_wait = Some(Duration::from_secs(10));
    })
    .await;
    jobs(&e, "earlier", "sent", 10, Some(10.0)).await;
    jobs(&e, "earlier", "expired", 10, Some(20.0)).await;
    jobs(&e, "earlier", "canceled", 5, Some(5.0)).await;
    jobs(&e, "earlier", "dead", 5, Some(1.0)).await;
    jobs(&e, "earlier", "sent", 30, Some(40.0)).await; // outside the window
    jobs(&e, "earlier", "discarded", 10, Some(1.0)).await; // a person's clean-up, not the queue draining
    jobs(&e, "shop", "pending", 20, None).await;
    refresh(&e).await;
    let stats = e.app.state.notifications.stats().get("promo").unwrap();
    assert!((stats.drain_per_s - 1.0).abs() < 1e-9, "drain {} jobs/s", stats.drain_per_s);
    assert_eq!(stats.pending, 20);

    let refused = enqueue(&e, "shop").await;
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["retry-after"], "11", "21 s predicted against a 10 s target");
    let problem = common::assert_problem(refused, 429).await;
    assert!(problem["detail"].as_str().unwrap().contains("target wait"), "{problem}");
    assert_eq!(enqueue(&e, "other").await.status(), 202, "another tenant's first job waits ~2 s");

    // Another 600 finishes in the last second: 630 in the window, 21 jobs/s.
    jobs(&e, "earlier", "sent", 600, Some(1.0)).await;
    refresh(&e).await;
    assert!((e.app.state.notifications.stats().get("promo").unwrap().drain_per_s - 21.0).abs() < 1e-9);
    assert_eq!(enqueue(&e, "shop").await.status(), 202);
}

/// Above the sample size the rate is measured over the time the newest finishes took, not the
/// whole window: 6,000 finishes 1 ms apart are ~1,000 jobs/s, not 6,000 / 30 s.
#[tokio::test]
async fn a_fast_drain_is_measured_from_its_newest_finishes() {
    let e = env_with(|_| {}).await;
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, status, \
                                        attempts, finished_at) \
         SELECT 'promo', 2, 'shop', g, 'device', '{}', 5, 'sent', 1, now() - g * interval '1 millisecond' \
         FROM generate_series(1, 6000) AS g",
    )
    .execute(&e.db.pool)
    .await
    .unwrap();
    refresh(&e).await;
    let drain = e.app.state.notifications.stats().get("promo").unwrap().drain_per_s;
    assert!((950.0..=1050.0).contains(&drain), "drain {drain} jobs/s");
}
