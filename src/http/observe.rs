//! What each request leaves behind: a request id (the client's if it is short and printable, else a
//! new one), a span continuing the caller's W3C `traceparent`, the request metrics by route template,
//! and one access-log line at `info` naming the client's address.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use axum::extract::{ConnectInfo, MatchedPath, Request, State};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;

use crate::http::limits::{ClientAddr, client_address};
use crate::state::AppState;

/// Longest client-supplied `x-request-id` kept; longer ones are replaced.
pub const MAX_REQUEST_ID_LEN: usize = 64;

/// Where authentication leaves the caller's key name for the access log (the log line is written
/// after the handler, which is the only place that knows it).
#[derive(Clone, Default)]
pub struct CallerName(Arc<OnceLock<Arc<str>>>);

impl CallerName {
    /// Records the authenticated caller's key name.
    pub fn set(&self, name: Arc<str>) {
        let _ = self.0.set(name);
    }
}

/// Whether a client's request id can be kept: 1 to [`MAX_REQUEST_ID_LEN`] visible ASCII characters
/// (no spaces or control characters that could forge or split log lines).
pub fn acceptable_request_id(value: &HeaderValue) -> bool {
    let bytes = value.as_bytes();
    !bytes.is_empty() && bytes.len() <= MAX_REQUEST_ID_LEN && bytes.iter().all(|b| b.is_ascii_graphic())
}

/// Drops a client's `x-request-id` that is not acceptable, so the next layer generates a new one.
pub async fn sanitize_request_id(mut req: Request, next: Next) -> Response {
    if req.headers().get("x-request-id").is_some_and(|v| !acceptable_request_id(v)) {
        req.headers_mut().remove("x-request-id");
    }
    next.run(req).await
}

/// The request's span: route template rather than raw path (so traces group by endpoint), its request
/// id, and the caller's trace as parent.
pub fn request_span(req: &Request) -> tracing::Span {
    let request_id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("");
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str());
    let span = tracing::info_span!(
        "request",
        otel.name = format!("{} {route}", req.method()),
        otel.kind = "server",
        http.request.method = %req.method(),
        http.route = route,
        http.response.status_code = tracing::field::Empty,
        request_id,
    );
    crate::telemetry::traces::continue_from(&span, req.headers());
    span
}

/// Counts and times the request by route template (raw paths would explode cardinality) and writes
/// the access-log line: method, route, status, latency, request id, the client's address and the
/// caller's key name. Puts the client's address ([`ClientAddr`]) in the request for the handlers.
pub async fn record(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let peer = req.extensions().get::<ConnectInfo<SocketAddr>>();
    let client = ClientAddr(client_address(peer, req.headers(), &state.settings.security.trusted_proxies));
    req.extensions_mut().insert(client);
    let route =
        req.extensions().get::<MatchedPath>().map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_owned());
    let method = req.method().clone();
    let request_id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
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
        client = %client,
        key,
        "{method} {route} {status}"
    );
    response
}
