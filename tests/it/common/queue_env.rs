//! A passive app (no background tasks) with fake SMS and push providers, for tests that drive the queue's
//! worker groups one step at a time.

use std::sync::Arc;

use cifpool::internals::fake_provider::FakeBehaviour;
use cifpool::internals::worker::{Outcome, WorkerGroup};
use cifpool::queue::policy::Strategy;
use serde_json::{Value, json};

use super::{
    FakeServer, TestApp, TestDb, fake_server, fresh_database, spawn_passive_app, test_settings_with_pools,
    use_fake_providers,
};

/// The database, the app and its two providers.
pub struct Env {
    pub db: TestDb,
    pub app: TestApp,
    pub sms: FakeServer,
    pub push: FakeServer,
}

/// An environment with `tweak` applied to the settings.
pub async fn env_with(tweak: impl FnOnce(&mut cifpool::config::Settings)) -> Env {
    let db = fresh_database().await;
    let sms = fake_server(FakeBehaviour::default()).await;
    let push = fake_server(FakeBehaviour::default()).await;
    let mut settings = test_settings_with_pools(&db.url);
    use_fake_providers(&mut settings, &sms, &push);
    tweak(&mut settings);
    let app = spawn_passive_app(settings).await;
    // No budget task runs in a passive app: take this instance's share of each provider once.
    app.state.notifications.runtime().join_budgets(&app.state.db).await.unwrap();
    Env { db, app, sms, push }
}

/// Worker group `index` of `strategy`'s preset on `app`.
pub fn group_of(app: &TestApp, strategy: Strategy, index: usize) -> Arc<WorkerGroup> {
    let all = ["otp", "transactional", "promo"].map(String::from).to_vec();
    let policy = strategy.groups(20, 6, &["otp".to_string()], &all).remove(index);
    WorkerGroup::new(policy, app.state.db.clone(), app.state.notifications.runtime().clone())
}

/// An environment with the test settings.
pub async fn env() -> Env {
    env_with(|_| {}).await
}

impl Env {
    /// Worker group `index` of `strategy`'s preset.
    pub fn group(&self, strategy: Strategy, index: usize) -> Arc<WorkerGroup> {
        group_of(&self.app, strategy, index)
    }

    /// Another pod on the same database and providers (passive too, holding its share of each
    /// provider), with its worker group `index` of `strategy`'s preset.
    pub async fn second_pod(&self, strategy: Strategy, index: usize) -> (TestApp, Arc<WorkerGroup>) {
        let mut settings = test_settings_with_pools(&self.db.url);
        use_fake_providers(&mut settings, &self.sms, &self.push);
        let pod = spawn_passive_app(settings).await;
        pod.state.notifications.runtime().join_budgets(&pod.state.db).await.unwrap();
        // The first pod took every provider's whole budget when it joined alone: a sync of each
        // shares it out.
        self.app.state.notifications.runtime().sync_budgets(&self.app.state.db).await;
        pod.state.notifications.runtime().sync_budgets(&pod.state.db).await;
        let group = group_of(&pod, strategy, index);
        (pod, group)
    }

    /// Enqueues `n` jobs one request each; returns their ids.
    pub async fn enqueue(&self, class: &str, tenant: &str, n: usize) -> Vec<i64> {
        let mut ids = Vec::new();
        for i in 0..n {
            let r = self
                .app
                .client
                .post(self.app.url("/v1/notifications"))
                .json(&json!({ "class": class, "tenant": tenant, "recipient": format!("+84900{i:06}"), "payload": {"n": i} }))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());
            ids.push(r.json::<Value>().await.unwrap()["id"].as_i64().unwrap());
        }
        ids
    }

    /// Enqueues `n` jobs in one batch request; returns its answer.
    pub async fn batch(&self, class: &str, tenant: &str, n: usize) -> Value {
        let jobs: Vec<Value> = (0..n).map(|i| json!({ "recipient": format!("dev-{tenant}-{i}") })).collect();
        let r = self
            .app
            .client
            .post(self.app.url("/v1/notifications/batch"))
            .json(&json!({ "class": class, "tenant": tenant, "jobs": jobs }))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
        r.json().await.unwrap()
    }

    /// A job's stored status.
    pub async fn status(&self, id: i64) -> String {
        sqlx::query_scalar("SELECT status FROM notification_jobs WHERE id = $1")
            .bind(id)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    /// Makes every job waiting out a backoff due now.
    pub async fn make_due(&self) {
        sqlx::query("UPDATE notification_jobs SET run_after = now() WHERE status = 'failed-retrying'")
            .execute(&self.db.pool)
            .await
            .unwrap();
    }

    /// One stager pass: scheduled jobs that are due become pending (what the stager loop does every
    /// second in a running instance); returns how many.
    pub async fn promote(&self) -> u64 {
        cifpool::internals::stage::promote_due(&self.app.state.db, self.app.state.notifications.runtime())
            .await
            .unwrap()
    }

    /// Every job's id, recipient and payload as enqueued, in id order: sealed ones opened as a worker
    /// opens them, ones stored in clear read as they are.
    pub async fn opened(&self) -> Vec<(i64, String, Value)> {
        use sqlx::Row;
        let rows = sqlx::query("SELECT id, recipient, payload, sealed, sealed_with FROM notification_jobs ORDER BY id")
            .fetch_all(&self.db.pool)
            .await
            .unwrap();
        let seal = &self.app.state.notifications.runtime().seal;
        rows.iter()
            .map(|r| match r.get::<Option<&[u8]>, _>("sealed") {
                Some(sealed) => {
                    let opened =
                        seal.open(r.get::<Option<&str>, _>("sealed_with").unwrap_or_default(), sealed).unwrap();
                    (r.get("id"), opened.recipient, serde_json::from_str(&opened.payload).unwrap())
                }
                None => (r.get("id"), r.get("recipient"), r.get::<Option<Value>, _>("payload").unwrap_or(Value::Null)),
            })
            .collect()
    }

    /// Runs a `SELECT count(*)` query.
    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_string())).fetch_one(&self.db.pool).await.unwrap()
    }
}

/// Runs one worker step after another until the group finds nothing.
pub async fn drain(group: &WorkerGroup) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    // A job that keeps coming back due at once (a zero backoff) would make this spin for ever.
    for _ in 0..1_000_000 {
        match group.try_execute_next().await.unwrap() {
            Outcome::Idle => return outcomes,
            o => outcomes.push(o),
        }
    }
    panic!("the group never went idle: {} steps, the last {:?}", outcomes.len(), outcomes.last());
}
