//! Send providers (SMS gateway, push service) and the adaptive concurrency limit in front of each.
//!
//! A provider call holds a worker until it answers or times out, so the limit is what stops a slow
//! or failing provider from soaking up every worker and from being hammered while it recovers: it is
//! cut multiplicatively on timeouts and 5xx answers and grows by about one slot per `limit`
//! successes (AIMD), so after an outage the backlog drains at a rising rate instead of all at once.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::config::{ProviderKind, ProviderSettings};

/// One message to hand to a provider.
#[derive(Debug, Clone, Serialize)]
pub struct Message {
    /// Job id: the provider's idempotency key (the same job sent twice is one delivery).
    pub id: i64,
    /// Message class (a provider may template by it).
    pub class: String,
    /// Tenant the message belongs to (a provider may bill or brand by it).
    pub tenant: String,
    /// Phone number, device token, ….
    pub recipient: String,
    /// Message body / template data.
    pub payload: serde_json::Value,
    /// 1-based attempt number.
    pub attempt: i32,
}

/// The provider accepted the message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Delivery {
    /// The provider's reference, if it gave one.
    pub provider_ref: Option<String>,
}

/// Why a send failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// Worth retrying later (5xx, 429, connection trouble).
    #[error("transient: {0}")]
    Transient(String),
    /// Retrying cannot help (4xx: bad recipient, rejected content).
    #[error("permanent: {0}")]
    Permanent(String),
    /// No answer within the provider's timeout.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
}

impl SendError {
    /// Whether the failure says the provider itself is overloaded (feeds the adaptive limit).
    pub fn is_overload(&self) -> bool {
        matches!(self, SendError::Timeout(_) | SendError::Transient(_))
    }
}

/// A way to deliver messages.
#[async_trait::async_trait]
pub trait Provider: Send + Sync {
    /// Delivers `message`, at least once; `message.id` is the idempotency key.
    async fn send(&self, message: &Message) -> Result<Delivery, SendError>;
}

/// JSON over HTTP: `POST {url}/send` with an `Idempotency-Key` header.
pub struct HttpProvider {
    client: reqwest::Client,
    url: String,
    timeout: Duration,
    authorization: Option<secrecy::SecretString>,
}

#[derive(Deserialize)]
struct SendAnswer {
    #[serde(default)]
    message_id: Option<String>,
}

impl HttpProvider {
    /// A provider at `url` with a per-call `timeout`.
    pub fn new(url: &str, timeout: Duration, authorization: Option<secrecy::SecretString>) -> HttpProvider {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .pool_max_idle_per_host(1024)
            .build()
            .expect("static reqwest configuration");
        HttpProvider { client, url: format!("{}/send", url.trim_end_matches('/')), timeout, authorization }
    }
}

#[async_trait::async_trait]
impl Provider for HttpProvider {
    async fn send(&self, message: &Message) -> Result<Delivery, SendError> {
        let mut request = self.client.post(&self.url).header("idempotency-key", message.id.to_string()).json(message);
        if let Some(auth) = &self.authorization {
            use secrecy::ExposeSecret;
            request = request.header(reqwest::header::AUTHORIZATION, auth.expose_secret());
        }
        let result = request.send().await;
        let response = match result {
            Ok(r) => r,
            Err(e) if e.is_timeout() => return Err(SendError::Timeout(self.timeout)),
            Err(e) => return Err(SendError::Transient(format!("request failed: {e}"))),
        };
        let status = response.status();
        if status.is_success() {
            let answer = response.json::<SendAnswer>().await.ok();
            return Ok(Delivery { provider_ref: answer.and_then(|a| a.message_id) });
        }
        let body: String = response.text().await.unwrap_or_default().chars().take(200).collect();
        let detail = format!("HTTP {status}: {body}");
        if status.is_server_error() || status.as_u16() == 429 || status.as_u16() == 408 {
            Err(SendError::Transient(detail))
        } else {
            Err(SendError::Permanent(detail))
        }
    }
}

/// Accepts everything and sends nothing (development default).
pub struct NoopProvider;

#[async_trait::async_trait]
impl Provider for NoopProvider {
    async fn send(&self, _message: &Message) -> Result<Delivery, SendError> {
        Ok(Delivery::default())
    }
}

#[derive(Debug)]
struct LimitState {
    limit: f64,
    in_flight: u32,
}

/// AIMD concurrency limit of one provider.
#[derive(Debug)]
pub struct AdaptiveLimiter {
    name: String,
    min: f64,
    max: f64,
    state: Mutex<LimitState>,
    freed: Notify,
}

/// One slot of an [`AdaptiveLimiter`]; report how the call went, or drop it (counts as neutral).
#[derive(Debug)]
pub struct Permit {
    limiter: Arc<AdaptiveLimiter>,
}

/// Multiplicative cut on overload.
const DECREASE: f64 = 0.7;

impl AdaptiveLimiter {
    /// Starts at `max` (optimistic), never below `min`.
    pub fn new(name: &str, min: u32, max: u32) -> Arc<AdaptiveLimiter> {
        let limiter = Arc::new(AdaptiveLimiter {
            name: name.to_string(),
            min: f64::from(min),
            max: f64::from(max),
            state: Mutex::new(LimitState { limit: f64::from(max), in_flight: 0 }),
            freed: Notify::new(),
        });
        limiter.publish(f64::from(max), 0);
        limiter
    }

    fn publish(&self, limit: f64, in_flight: u32) {
        metrics::gauge!("cifpool_provider_limit", "provider" => self.name.clone()).set(limit.floor());
        metrics::gauge!("cifpool_provider_in_flight", "provider" => self.name.clone()).set(f64::from(in_flight));
        metrics::gauge!("cifpool_provider_limit_at_floor", "provider" => self.name.clone()).set(if limit <= self.min {
            1.0
        } else {
            0.0
        });
    }

    /// Free slots right now.
    pub fn available(&self) -> u32 {
        let s = self.state.lock().expect("limiter lock");
        (s.limit.floor() as u32).saturating_sub(s.in_flight)
    }

    /// Current limit.
    pub fn limit(&self) -> u32 {
        self.state.lock().expect("limiter lock").limit.floor() as u32
    }

    /// Resolves at the next release of a slot (create it before checking [`AdaptiveLimiter::available`]
    /// so a release in between is not missed).
    pub fn slot_freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }

    /// A slot if one is free.
    pub fn try_acquire(self: &Arc<Self>) -> Option<Permit> {
        let mut s = self.state.lock().expect("limiter lock");
        if f64::from(s.in_flight) + 1.0 > s.limit.floor() {
            return None;
        }
        s.in_flight += 1;
        self.publish(s.limit, s.in_flight);
        Some(Permit { limiter: self.clone() })
    }

    /// Waits for a slot.
    pub async fn acquire(self: &Arc<Self>) -> Permit {
        loop {
            let freed = self.freed.notified();
            if let Some(p) = self.try_acquire() {
                return p;
            }
            freed.await;
        }
    }

    fn release(&self, outcome: Option<bool>) {
        let mut s = self.state.lock().expect("limiter lock");
        s.in_flight = s.in_flight.saturating_sub(1);
        match outcome {
            Some(true) => s.limit = (s.limit + 1.0 / s.limit.max(1.0)).min(self.max),
            Some(false) => {
                let cut = (s.limit * DECREASE).max(self.min);
                if cut < s.limit {
                    tracing::warn!(provider = %self.name, from = s.limit.floor(), to = cut.floor(),
                        "provider overloaded: cutting its concurrency");
                }
                s.limit = cut;
            }
            None => {}
        }
        self.publish(s.limit, s.in_flight);
        drop(s);
        self.freed.notify_waiters();
    }
}

impl Permit {
    /// The call succeeded: grow the limit a little.
    pub fn success(self) {
        self.finish(Some(true));
    }

    /// The provider timed out or failed server-side: cut the limit.
    pub fn overload(self) {
        self.finish(Some(false));
    }

    fn finish(self, outcome: Option<bool>) {
        self.limiter.release(outcome);
        std::mem::forget(self);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.limiter.release(None);
    }
}

/// A provider with its limit.
pub struct ProviderHandle {
    /// Name from the configuration.
    pub name: String,
    /// How messages are delivered (HTTP gateway, no-op, a test double).
    pub provider: Arc<dyn Provider>,
    /// Its adaptive concurrency limit, shared by every class that uses the provider.
    pub limiter: Arc<AdaptiveLimiter>,
}

/// Builds every configured provider.
pub fn build_providers(settings: &BTreeMap<String, ProviderSettings>) -> BTreeMap<String, Arc<ProviderHandle>> {
    settings
        .iter()
        .map(|(name, p)| {
            let provider: Arc<dyn Provider> = match p.kind {
                ProviderKind::Http => Arc::new(HttpProvider::new(
                    p.url.as_deref().unwrap_or_default(),
                    p.timeout,
                    p.authorization.clone(),
                )),
                ProviderKind::Noop => {
                    tracing::warn!(provider = %name, "provider is a no-op: messages are marked sent but go nowhere");
                    Arc::new(NoopProvider)
                }
            };
            let limiter = AdaptiveLimiter::new(name, p.min_concurrency, p.max_concurrency);
            (name.clone(), Arc::new(ProviderHandle { name: name.clone(), provider, limiter }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_cuts_on_overload_and_regrows_slowly() {
        let l = AdaptiveLimiter::new("t", 2, 10);
        assert_eq!(l.limit(), 10);
        for _ in 0..3 {
            l.try_acquire().unwrap().overload();
        }
        assert_eq!(l.limit(), 3, "10 * 0.7^3 = 3.43");
        for _ in 0..10 {
            l.try_acquire().unwrap().overload();
        }
        assert_eq!(l.limit(), 2, "never below the floor");
        // About `limit` successes per extra slot.
        for _ in 0..5 {
            l.try_acquire().unwrap().success();
        }
        assert_eq!(l.limit(), 3);
        let a = l.try_acquire().unwrap();
        let b = l.try_acquire().unwrap();
        let c = l.try_acquire().unwrap();
        assert!(l.try_acquire().is_none(), "limit reached");
        drop((a, b, c));
        assert_eq!(l.available(), 3);
    }
}
