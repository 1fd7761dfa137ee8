//! HTTP layer: [`app`] builds the router (no I/O), [`serve`] runs it on a bound listener until a
//! shutdown future resolves, so tests can bind port 0 and stop the server at will.

pub mod admin;
pub mod auth;
pub mod cif;
pub mod error;
pub mod health;
pub mod notifications;

use std::future::Future;
use std::time::Instant;

use axum::Router;
use axum::extract::{MatchedPath, Request};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::Response;
use tokio::net::TcpListener;
use tower::ServiceBuilder;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;

use crate::state::AppState;
use error::ApiError;

/// The whole HTTP surface with its middleware.
pub fn app(state: AppState) -> Router {
    let server = &state.settings.server;
    let middleware = ServiceBuilder::new()
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
            let request_id = req.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or("");
            tracing::info_span!("http", method = %req.method(), uri = %req.uri().path(), request_id)
        }))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(middleware::from_fn(record_metrics))
        .layer(middleware::map_response(error::problem_for_plain_errors));
    let ordinary = Router::new()
        .merge(health::router())
        .merge(cif::router())
        .merge(admin::router())
        .merge(notifications::router())
        .layer(RequestBodyLimitLayer::new(server.body_limit_bytes))
        .layer(TimeoutLayer::with_status_code(StatusCode::SERVICE_UNAVAILABLE, server.request_timeout));
    let queue = &state.settings.queue;
    let bulk = notifications::batch_router(&state)
        .layer(RequestBodyLimitLayer::new(queue.batch_body_limit_bytes))
        .layer(TimeoutLayer::with_status_code(StatusCode::SERVICE_UNAVAILABLE, queue.batch_timeout));
    Router::new()
        .merge(ordinary)
        .merge(bulk)
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .layer(middleware)
        .with_state(state)
}

/// Request count and latency by route template (not raw path, which would explode cardinality).
async fn record_metrics(req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_owned());
    let method = req.method().to_string();
    let started = Instant::now();
    let response = next.run(req).await;
    let route = route.unwrap_or_else(|| "unmatched".into());
    let status = response.status().as_u16().to_string();
    metrics::histogram!("cifpool_http_request_duration_seconds", "route" => route.clone(), "method" => method.clone())
        .record(started.elapsed().as_secs_f64());
    metrics::counter!("cifpool_http_requests_total", "route" => route, "method" => method, "status" => status)
        .increment(1);
    response
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets in-flight requests finish.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router).with_graceful_shutdown(shutdown).await
}
