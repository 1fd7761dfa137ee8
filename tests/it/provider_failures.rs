//! What a provider's failures do: how each kind of answer is classified (retried, given up, or a
//! pause), how the deployment-wide limit is cut on overload, and how a job waiting for a provider
//! slot keeps its lease.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use cifpool::internals::fake_provider::FakeBehaviour;
use cifpool::internals::queue_store as store;
use cifpool::internals::worker::Outcome;
use cifpool::queue::policy::Strategy;
use cifpool::queue::provider::{HttpProvider, Message, Provider, SendError};
use common::queue_env::{Env, env_with};
use common::{fake_server, joined};

/// A provider stand-in whose every answer is the status and `Retry-After` the test sets.
struct Scripted {
    url: String,
    answer: Arc<Mutex<(u16, Option<&'static str>)>>,
}

async fn scripted() -> Scripted {
    let answer: Arc<Mutex<(u16, Option<&'static str>)>> = Arc::new(Mutex::new((200, None)));
    let shared = answer.clone();
    let app = axum::Router::new().route(
        "/send",
        axum::routing::post(move || {
            let (status, retry_after) = *shared.lock().unwrap();
            async move {
                let mut headers = HeaderMap::new();
                if let Some(seconds) = retry_after {
                    headers.insert("retry-after", seconds.parse().unwrap());
                }
                (StatusCode::from_u16(status).unwrap(), headers, "{}")
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Scripted { url, answer }
}

fn message() -> Message {
    Message {
        id: 1,
        class: "transactional".into(),
        tenant: "bank".into(),
        recipient: "+84900000001".into(),
        payload: serde_json::json!({}),
        attempt: 1,
    }
}

/// Kinds of outcome, without their details.
#[derive(Debug, PartialEq)]
enum Kind {
    Delivered,
    Transient,
    Permanent,
    Timeout,
    Throttled(Duration),
}

fn kind(result: Result<cifpool::queue::provider::Delivery, SendError>) -> Kind {
    match result {
        Ok(_) => Kind::Delivered,
        Err(SendError::Transient(_)) => Kind::Transient,
        Err(SendError::Permanent(_)) => Kind::Permanent,
        Err(SendError::Timeout(_)) => Kind::Timeout,
        Err(SendError::Throttled(d)) => Kind::Throttled(d),
    }
}

/// A timeout, a refused connection, 5xx, 408 and 429 are worth retrying; 429 and 503 with
/// `Retry-After` pause the provider instead; any other 4xx is permanent. Only timeouts and transient
/// failures count as overload (they cut the limit).
#[tokio::test]
async fn each_kind_of_provider_answer_is_classified_as_documented() {
    let stub = scripted().await;
    let provider = HttpProvider::new(&stub.url, Duration::from_millis(500), None);
    let cases: [(u16, Option<&'static str>, Kind); 12] = [
        (200, None, Kind::Delivered),
        (202, None, Kind::Delivered),
        (408, None, Kind::Transient),
        (429, None, Kind::Transient),
        (500, None, Kind::Transient),
        (502, None, Kind::Transient),
        (503, None, Kind::Transient),
        (429, Some("2"), Kind::Throttled(Duration::from_secs(2))),
        (503, Some("3"), Kind::Throttled(Duration::from_secs(3))),
        (400, None, Kind::Permanent),
        (404, None, Kind::Permanent),
        (422, Some("2"), Kind::Permanent),
    ];
    for (status, retry_after, expected) in cases {
        *stub.answer.lock().unwrap() = (status, retry_after);
        let result = provider.send(&message()).await;
        let overload = result.as_ref().err().is_some_and(SendError::is_overload);
        assert_eq!(overload, expected == Kind::Transient, "{status}: overload {overload}");
        assert_eq!(kind(result), expected, "HTTP {status} with Retry-After {retry_after:?}");
    }

    // No answer within the timeout.
    let hanging = fake_server(FakeBehaviour { hang_rate: 1.0, ..Default::default() }).await;
    let result = HttpProvider::new(&hanging.url, Duration::from_millis(300), None).send(&message()).await;
    assert!(result.as_ref().err().is_some_and(SendError::is_overload));
    assert_eq!(kind(result), Kind::Timeout);

    // Nobody listening.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let result = HttpProvider::new(&url, Duration::from_millis(300), None).send(&message()).await;
    match result {
        Err(SendError::Transient(detail)) => assert!(detail.starts_with("request failed"), "{detail}"),
        other => panic!("a refused connection: {other:?}"),
    }
}

async fn limit_now(e: &Env) -> f64 {
    sqlx::query_scalar("SELECT limit_now FROM provider_budgets WHERE provider = 'sms'")
        .fetch_one(&e.db.pool)
        .await
        .unwrap()
}

async fn age_last_cut(e: &Env) {
    sqlx::query("UPDATE provider_budgets SET last_cut_at = now() - interval '2 seconds' WHERE provider = 'sms'")
        .execute(&e.db.pool)
        .await
        .unwrap();
}

/// Sends one transactional job (SMS) through a step of the worker and syncs the budget.
async fn one_send_then_sync(e: &Env) -> Outcome {
    e.enqueue("transactional", "bank", 1).await;
    let outcome = e.group(Strategy::Priority, 0).try_execute_next().await.unwrap();
    e.app.state.notifications.runtime().sync_budgets(&e.db.pool).await;
    outcome
}

/// A transient failure cuts the provider's deployment-wide limit by 30 % at the next sync, at most
/// once a second, never below `min_concurrency`; a permanent failure does not cut it (a throttle
/// pauses the provider instead: see the budget tests).
#[tokio::test]
async fn overload_cuts_the_provider_limit_once_a_second_down_to_its_floor() {
    let e = env_with(|s| {
        let sms = s.queue.providers.get_mut("sms").unwrap();
        (sms.max_concurrency, sms.min_concurrency) = (100, 4);
    })
    .await;
    sqlx::query("UPDATE provider_budgets SET limit_now = 100, last_cut_at = NULL WHERE provider = 'sms'")
        .execute(&e.db.pool)
        .await
        .unwrap();
    e.sms.fake.set_behaviour(FakeBehaviour { error_rate: 1.0, ..Default::default() });
    assert!(matches!(one_send_then_sync(&e).await, Outcome::Retrying(_)));
    assert!((limit_now(&e).await - 70.0).abs() < 1e-6, "cut by 30 %: {}", limit_now(&e).await);
    assert!(matches!(one_send_then_sync(&e).await, Outcome::Retrying(_)));
    assert!((limit_now(&e).await - 70.0).abs() < 1e-6, "a second cut within a second: {}", limit_now(&e).await);
    age_last_cut(&e).await;
    assert!(matches!(one_send_then_sync(&e).await, Outcome::Retrying(_)));
    assert!((limit_now(&e).await - 49.0).abs() < 1e-6, "cut again a second later: {}", limit_now(&e).await);

    sqlx::query("UPDATE provider_budgets SET limit_now = 5 WHERE provider = 'sms'").execute(&e.db.pool).await.unwrap();
    age_last_cut(&e).await;
    one_send_then_sync(&e).await;
    assert!((limit_now(&e).await - 4.0).abs() < 1e-6, "never below the floor: {}", limit_now(&e).await);

    // A refusal is not overload: the limit stays.
    sqlx::query("UPDATE provider_budgets SET limit_now = 50 WHERE provider = 'sms'").execute(&e.db.pool).await.unwrap();
    age_last_cut(&e).await;
    e.sms.fake.set_behaviour(FakeBehaviour { reject_rate: 1.0, ..Default::default() });
    assert!(matches!(one_send_then_sync(&e).await, Outcome::Dead(_)));
    assert!((limit_now(&e).await - 50.0).abs() < 1e-6, "a permanent failure cut the limit: {}", limit_now(&e).await);
}

/// A job that waits for a provider slot longer than its lease keeps the lease (the worker extends
/// it every third of the lease), is not rescued meanwhile, and is sent once the slot frees; when the
/// lease is taken from it while it waits, it is never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_waiting_for_its_provider_keeps_its_lease_and_one_that_lost_it_is_not_sent() {
    let e = env_with(|s| {
        s.queue.lease = Duration::from_secs(3);
        let sms = s.queue.providers.get_mut("sms").unwrap();
        sms.timeout = Duration::from_secs(1);
        (sms.max_concurrency, sms.min_concurrency) = (1, 1);
    })
    .await;
    let budget = e.app.state.notifications.runtime().providers["sms"].budget.clone();
    let lease_of = |id: i64| {
        let pool = e.db.pool.clone();
        async move {
            sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
                "SELECT lease_expires_at FROM notification_jobs WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };

    let id = e.enqueue("transactional", "bank", 1).await[0];
    let group = e.group(Strategy::Priority, 0);
    let job = group.claim(1).await.unwrap().pop().expect("the job is claimed");
    let claimed_until = lease_of(id).await;
    let slot = budget.try_acquire().expect("the one slot");
    let waiting = tokio::spawn({
        let group = group.clone();
        async move { group.process(job).await.unwrap() }
    });
    tokio::time::sleep(Duration::from_secs(4)).await; // longer than the lease
    let now_until = lease_of(id).await;
    assert!(now_until > claimed_until && now_until > chrono::Utc::now(), "lease {claimed_until} -> {now_until}");
    assert_eq!(store::rescue_expired_leases(&e.db.pool, 100).await.unwrap(), 0, "a kept lease was rescued");
    drop(slot);
    e.app.state.notifications.runtime().sync_budgets(&e.db.pool).await;
    assert_eq!(joined(waiting).await, Outcome::Sent(id));
    assert_eq!(e.sms.fake.report().calls, 1);

    // The same wait, but another worker takes the job over (its lease token changes).
    let id = e.enqueue("transactional", "bank", 1).await[0];
    let job = group.claim(1).await.unwrap().pop().expect("the job is claimed");
    let slot = budget.try_acquire().expect("the one slot");
    let waiting = tokio::spawn({
        let group = group.clone();
        async move { group.process(job).await.unwrap() }
    });
    sqlx::query("UPDATE notification_jobs SET lease_token = gen_random_uuid() WHERE id = $1")
        .bind(id)
        .execute(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(joined(waiting).await, Outcome::LeaseLost(id));
    drop(slot);
    assert_eq!(e.sms.fake.report().calls, 1, "a job whose lease was lost was sent");
}
