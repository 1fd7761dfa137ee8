//! Send providers (SMS gateway, push service): the `Provider` trait, the HTTP provider and the no-op
//! one. In front of each sits its deployment-wide budget ([`crate::queue::budget`]): a call holds a
//! worker until the provider answers or times out, so the budget is what stops a slow or failing
//! provider from soaking up every worker and from being hammered while it recovers.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{ProviderKind, ProviderSettings};
use crate::queue::budget::ProviderBudget;

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
    /// The provider asked to be left alone (429 or 503 with `Retry-After`): the provider is paused
    /// for the whole deployment and the job waits without losing an attempt.
    #[error("throttled by the provider for {0:?}")]
    Throttled(Duration),
}

impl SendError {
    /// Whether the failure says the provider itself is overloaded (feeds the adaptive limit; an
    /// explicit `Retry-After` pauses instead).
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
        // The send span's trace context, so the gateway's own traces join this one.
        let mut trace = reqwest::header::HeaderMap::new();
        crate::telemetry::traces::inject_current(&mut trace);
        let mut request =
            self.client.post(&self.url).header("idempotency-key", message.id.to_string()).headers(trace).json(message);
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
        if matches!(status.as_u16(), 429 | 503)
            && let Some(wait) =
                response.headers().get(reqwest::header::RETRY_AFTER).and_then(|v| v.to_str().ok()).and_then(retry_after)
        {
            return Err(SendError::Throttled(wait));
        }
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

/// Longest `Retry-After` honoured; a longer one is cut to this (an hour-long pause is an incident,
/// not throttling).
pub(crate) const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

/// A `Retry-After` value: delay-seconds or an HTTP date, bounded by [`MAX_RETRY_AFTER`].
pub fn retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    let wait = match value.parse::<u64>() {
        Ok(secs) => Duration::from_secs(secs),
        Err(_) => {
            let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
            (at.with_timezone(&chrono::Utc) - chrono::Utc::now()).to_std().unwrap_or_default()
        }
    };
    Some(wait.min(MAX_RETRY_AFTER))
}

/// Accepts everything and sends nothing (development default).
pub(crate) struct NoopProvider;

#[async_trait::async_trait]
impl Provider for NoopProvider {
    async fn send(&self, _message: &Message) -> Result<Delivery, SendError> {
        Ok(Delivery::default())
    }
}

/// A provider with its budget.
pub struct ProviderHandle {
    /// Name from the configuration.
    pub name: String,
    /// How messages are delivered (HTTP gateway, no-op, a test double).
    pub provider: Arc<dyn Provider>,
    /// This pod's share of the provider's deployment-wide budget, used by every class that sends
    /// through the provider.
    pub budget: Arc<ProviderBudget>,
}

/// Builds every configured provider.
pub(crate) fn build_providers(settings: &BTreeMap<String, ProviderSettings>) -> BTreeMap<String, Arc<ProviderHandle>> {
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
            let budget = Arc::new(ProviderBudget::new(name, p));
            (name.clone(), Arc::new(ProviderHandle { name: name.clone(), provider, budget }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_read_in_seconds_or_as_a_date() {
        assert_eq!(retry_after("7"), Some(Duration::from_secs(7)));
        assert_eq!(retry_after(" 0 "), Some(Duration::ZERO));
        let later = chrono::Utc::now() + chrono::Duration::seconds(30);
        let d = retry_after(&later.to_rfc2822()).unwrap();
        assert!((28..=30).contains(&d.as_secs()), "{d:?}");
        assert_eq!(retry_after("soon"), None);
        assert_eq!(retry_after("99999999"), Some(MAX_RETRY_AFTER), "bounded");
    }
}
