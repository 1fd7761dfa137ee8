//! `cifpool fake-provider`: a stand-in SMS/push gateway for tests, the lab and load runs. It answers
//! `POST /send` after a configurable latency (with jitter), fails a fraction with 503, hangs a fraction,
//! throttles the first calls with 429 + `Retry-After`, counts deliveries per idempotency key so
//! at-least-once duplicates are visible at `GET /deliveries`, and records the most calls it had in
//! flight at once (what a gateway's concurrency limit would see).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use rand::Rng;
use serde::Serialize;

/// Behaviour knobs (changeable while running, e.g. to simulate an outage and recovery).
#[derive(Debug, Clone, Copy, PartialEq, clap::Args)]
pub struct FakeBehaviour {
    /// Answer latency.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Uniform extra latency in [0, jitter].
    #[arg(long, default_value_t = 0)]
    pub jitter_ms: u64,
    /// Fraction of calls answered 503 (transient).
    #[arg(long, default_value_t = 0.0)]
    pub error_rate: f64,
    /// Fraction of calls that never answer (until the caller times out).
    #[arg(long, default_value_t = 0.0)]
    pub hang_rate: f64,
    /// Fraction of calls refused with 422 (permanent: e.g. an invalid recipient).
    #[arg(long, default_value_t = 0.0)]
    pub reject_rate: f64,
    /// The first this many calls are answered 429 with `Retry-After: <retry-after-secs>`.
    #[arg(long, default_value_t = 0)]
    pub throttle_first: u64,
    /// The `Retry-After` of throttled calls, seconds.
    #[arg(long, default_value_t = 1)]
    pub retry_after_secs: u64,
}

impl Default for FakeBehaviour {
    fn default() -> Self {
        FakeBehaviour {
            latency_ms: 0,
            jitter_ms: 0,
            error_rate: 0.0,
            hang_rate: 0.0,
            reject_rate: 0.0,
            throttle_first: 0,
            retry_after_secs: 1,
        }
    }
}

/// Shared state of a running fake provider.
#[derive(Debug)]
pub struct FakeProvider {
    behaviour: Mutex<FakeBehaviour>,
    deliveries: Mutex<HashMap<String, u32>>,
    calls: AtomicU64,
    in_flight: AtomicU64,
    peak_in_flight: AtomicU64,
    /// When each call arrived, relative to the provider's start.
    arrivals: Mutex<Vec<Duration>>,
    started: std::time::Instant,
}

/// `GET /deliveries`.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct DeliveryReport {
    /// Calls received (any outcome).
    pub calls: u64,
    /// Successful deliveries, duplicates included.
    pub delivered: u64,
    /// Distinct idempotency keys delivered.
    pub unique_keys: u64,
    /// Keys delivered more than once.
    pub duplicated_keys: u64,
    /// The most calls in flight at once.
    pub peak_in_flight: u64,
}

impl FakeProvider {
    /// A provider with `behaviour`.
    pub fn new(behaviour: FakeBehaviour) -> Arc<FakeProvider> {
        Arc::new(FakeProvider {
            behaviour: Mutex::new(behaviour),
            deliveries: Mutex::new(HashMap::new()),
            calls: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            peak_in_flight: AtomicU64::new(0),
            arrivals: Mutex::new(Vec::new()),
            started: std::time::Instant::now(),
        })
    }

    /// Changes behaviour from now on.
    pub fn set_behaviour(&self, behaviour: FakeBehaviour) {
        *self.behaviour.lock().expect("lock") = behaviour;
    }

    /// Deliveries recorded for `key`.
    pub fn deliveries_of(&self, key: &str) -> u32 {
        self.deliveries.lock().expect("lock").get(key).copied().unwrap_or(0)
    }

    /// Counts so far.
    pub fn report(&self) -> DeliveryReport {
        let d = self.deliveries.lock().expect("lock");
        DeliveryReport {
            calls: self.calls.load(Ordering::Relaxed),
            delivered: d.values().map(|&n| u64::from(n)).sum(),
            unique_keys: d.len() as u64,
            duplicated_keys: d.values().filter(|&&n| n > 1).count() as u64,
            peak_in_flight: self.peak_in_flight.load(Ordering::Relaxed),
        }
    }

    /// When each call arrived, as time since this provider started, in arrival order.
    pub fn arrivals(&self) -> Vec<Duration> {
        self.arrivals.lock().expect("lock").clone()
    }

    /// Time since this provider started (the clock of [`FakeProvider::arrivals`]).
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The HTTP surface.
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new().route("/send", post(send)).route("/deliveries", get(deliveries)).with_state(self.clone())
    }
}

/// Counts a call in flight for as long as it lives.
struct InFlight<'a>(&'a FakeProvider);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn send(State(fake): State<Arc<FakeProvider>>, headers: HeaderMap) -> axum::response::Response {
    let call = fake.calls.fetch_add(1, Ordering::Relaxed);
    fake.arrivals.lock().expect("lock").push(fake.started.elapsed());
    let now = fake.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
    fake.peak_in_flight.fetch_max(now, Ordering::Relaxed);
    let _counted = InFlight(&fake);
    let b = *fake.behaviour.lock().expect("lock");
    if call < b.throttle_first {
        let body = Json(serde_json::json!({ "error": "slow down" }));
        return (StatusCode::TOO_MANY_REQUESTS, [("retry-after", b.retry_after_secs.to_string())], body)
            .into_response();
    }
    let (delay, fail, hang, reject) = {
        let mut rng = rand::rng();
        let jitter = if b.jitter_ms > 0 { rng.random_range(0..=b.jitter_ms) } else { 0 };
        let mut roll = |p: f64| rng.random_bool(p.clamp(0.0, 1.0));
        (b.latency_ms + jitter, roll(b.error_rate), roll(b.hang_rate), roll(b.reject_rate))
    };
    if hang {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    if fail {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({ "error": "injected failure" })))
            .into_response();
    }
    if reject {
        return (StatusCode::UNPROCESSABLE_ENTITY, Json(serde_json::json!({ "error": "injected rejection" })))
            .into_response();
    }
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    if key.is_empty() {
        return (StatusCode::BAD_REQUEST, Json(serde_json::json!({ "error": "missing Idempotency-Key" })))
            .into_response();
    }
    *fake.deliveries.lock().expect("lock").entry(key.clone()).or_default() += 1;
    (StatusCode::OK, Json(serde_json::json!({ "message_id": format!("fake-{key}") }))).into_response()
}

async fn deliveries(State(fake): State<Arc<FakeProvider>>) -> Json<DeliveryReport> {
    Json(fake.report())
}

/// Serves a fake provider on `listener` until `shutdown`.
pub async fn serve(
    fake: Arc<FakeProvider>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, fake.router()).with_graceful_shutdown(shutdown).await
}
