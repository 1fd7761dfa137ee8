//! What each request leaves behind: the service's own request id (a fresh UUID, with the caller's
//! `X-Request-Id` kept beside it when it is short and printable), a span continuing the caller's W3C
//! `traceparent`, the request metrics by route template, and one access-log line at `info` naming the
//! client's address.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use axum::extract::{ConnectInfo, MatchedPath, Request, State};
use axum::http::{Extensions, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;

use crate::audit::Actor;
use crate::http::limits::{ClientAddr, client_address};
use crate::state::AppState;

/// Longest client-supplied `x-request-id` kept; longer ones are dropped.
pub(crate) const MAX_REQUEST_ID_LEN: usize = 64;

/// Where authentication leaves the caller's key name for the access log (the log line is written
/// after the handler, which is the only place that knows it).
#[derive(Clone, Default)]
pub(crate) struct CallerName(Arc<OnceLock<Arc<str>>>);

impl CallerName {
    /// Records the authenticated caller's key name.
    pub fn set(&self, name: Arc<str>) {
        let _ = self.0.set(name);
    }
}

/// Whether a client's request id can be kept: 1 to [`MAX_REQUEST_ID_LEN`] visible ASCII characters
/// (no spaces or control characters that could forge or split log lines).
pub(crate) fn acceptable_request_id(value: &HeaderValue) -> bool {
    let bytes = value.as_bytes();
    !bytes.is_empty() && bytes.len() <= MAX_REQUEST_ID_LEN && bytes.iter().all(|b| b.is_ascii_graphic())
}

/// The two ids of a request: the service's own, which no caller chooses (so an audit row's request
/// id names one request only), and the caller's `X-Request-Id` for its own correlation.
#[derive(Debug, Clone)]
pub struct RequestIds {
    /// A fresh UUID: the request's `x-request-id` inside the service and in its answer.
    pub service: String,
    /// The caller's acceptable `X-Request-Id`, echoed as `x-client-request-id`.
    pub client: Option<String>,
}

impl RequestIds {
    /// `name` acting through this request.
    pub fn actor(&self, name: impl Into<String>) -> Actor {
        Actor { name: name.into(), request_id: Some(self.service.clone()), client_request_id: self.client.clone() }
    }
}

/// `name` acting through the request whose extensions are `extensions` (no request ids outside the
/// HTTP stack, as in a handler called directly).
pub(crate) fn actor_of_request(extensions: &Extensions, name: impl Into<String>) -> Actor {
    match extensions.get::<RequestIds>() {
        Some(ids) => ids.actor(name),
        None => Actor::named(name),
    }
}

/// Gives the request the service's own id (replacing any `x-request-id` the caller sent, which is
/// kept as [`RequestIds::client`] when acceptable and dropped otherwise), and puts both in the answer:
/// `x-request-id` (the service's) and `x-client-request-id` (the caller's, when kept).
pub(crate) async fn assign_request_id(mut req: Request, next: Next) -> Response {
    let client = req.headers_mut().remove("x-request-id").filter(acceptable_request_id);
    let service = uuid::Uuid::new_v4().hyphenated().to_string();
    let service_header = HeaderValue::from_str(&service).ok();
    if let Some(value) = &service_header {
        req.headers_mut().insert("x-request-id", value.clone());
    }
    let client_id = client.as_ref().and_then(|v| v.to_str().ok()).map(str::to_string);
    req.extensions_mut().insert(RequestIds { service, client: client_id });
    let mut response = next.run(req).await;
    if let Some(value) = service_header {
        response.headers_mut().insert("x-request-id", value);
    }
    if let Some(value) = client {
        response.headers_mut().insert("x-client-request-id", value);
    }
    response
}

/// The request's span: route template rather than raw path (so traces group by endpoint), its request
/// id, and the caller's trace as parent.
pub(crate) fn request_span(req: &Request) -> tracing::Span {
    let ids = req.extensions().get::<RequestIds>();
    let request_id = ids.map_or("", |ids| ids.service.as_str());
    let client_request_id = ids.and_then(|ids| ids.client.as_deref()).unwrap_or("");
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str());
    let span = tracing::info_span!(
        "request",
        otel.name = format!("{} {route}", req.method()),
        otel.kind = "server",
        http.request.method = %req.method(),
        http.route = route,
        http.response.status_code = tracing::field::Empty,
        request_id,
        client_request_id,
    );
    crate::telemetry::traces::continue_from(&span, req.headers());
    span
}

/// Counts and times the request by route template (raw paths would explode cardinality) and writes
/// the access-log line: method, route, status, latency, both request ids, the client's address and the
/// caller's key name. Puts the client's address ([`ClientAddr`]) in the request for the handlers.
pub async fn record(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let peer = req.extensions().get::<ConnectInfo<SocketAddr>>();
    let client = ClientAddr(client_address(peer, req.headers(), &state.settings.security.trusted_proxies));
    req.extensions_mut().insert(client);
    let route =
        req.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_owned());
    let method = req.method().clone();
    let ids = req.extensions().get::<RequestIds>();
    let request_id = ids.map_or_else(String::new, |ids| ids.service.clone());
    let client_request_id = ids.and_then(|ids| ids.client.clone()).unwrap_or_default();
    let caller = CallerName::default();
    req.extensions_mut().insert(caller.clone());
    let started = Instant::now();
    let response = next.run(req).await;
    let elapsed = started.elapsed();
    let status = response.status().as_u16();
    tracing::Span::current().record("http.response.status_code", status);
    metrics::histogram!("cifpool_http_request_duration_seconds", "route" => route.clone(), "method" => method.to_string())
        .record(elapsed.as_secs_f64());
    metrics::counter!("cifpool_http_requests_total", "route" => route.clone(), "method" => method.to_string(),
        "status" => status.to_string())
    .increment(1);
    let key = caller.0.get().map_or("-", |name| name);
    tracing::info!(
        target: "cifpool::access",
        method = %method,
        route = %route,
        status,
        latency_ms = (elapsed.as_secs_f64() * 1000.0 * 1000.0).round() / 1000.0,
        request_id = %request_id,
        client_request_id = %client_request_id,
        client = %client,
        key,
        "{method} {route} {status}"
    );
    response
}
