//! HTTP layer: [`app`] builds the router (no I/O), [`serve`] runs it on a bound listener until a
//! shutdown future resolves, so tests can bind port 0 and stop the server at will.

pub(crate) mod admin;
pub(crate) mod auth;
pub(crate) mod cif;
pub(crate) mod error;
pub(crate) mod health;
pub(crate) mod limits;
pub(crate) mod notifications;
pub(crate) mod observe;

use std::future::Future;

use axum::Router;
use axum::http::StatusCode;
use axum::middleware;
use tokio::net::TcpListener;
use tower::ServiceBuilder;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;

use crate::state::AppState;
use error::ApiError;

/// The whole HTTP surface with its middleware.
pub fn app(state: AppState) -> Router {
    let server = &state.settings.server;
    let middleware = ServiceBuilder::new()
        .layer(middleware::from_fn(observe::assign_request_id))
        // The access line is observe::record's, at info; tower-http's own events stay off.
        .layer(TraceLayer::new_for_http().make_span_with(observe::request_span).on_response(()).on_failure(()))
        .layer(middleware::from_fn_with_state(state.clone(), observe::record))
        .layer(middleware::map_response(error::problem_for_plain_errors));
    let ordinary = Router::new()
        .merge(health::router())
        .merge(cif::router())
        .merge(admin::router())
        .merge(notifications::router())
        .merge(crate::console::router(&state))
        .layer(RequestBodyLimitLayer::new(server.body_limit_bytes))
        .layer(TimeoutLayer::with_status_code(StatusCode::SERVICE_UNAVAILABLE, server.request_timeout));
    let queue = &state.settings.queue;
    let bulk = notifications::batch_router(&state)
        .layer(RequestBodyLimitLayer::new(queue.batch_body_limit_bytes))
        .layer(TimeoutLayer::with_status_code(StatusCode::SERVICE_UNAVAILABLE, queue.batch_timeout));
    let reconcile = admin::reconcile_router()
        .layer(RequestBodyLimitLayer::new(queue.batch_body_limit_bytes))
        .layer(TimeoutLayer::with_status_code(StatusCode::SERVICE_UNAVAILABLE, queue.batch_timeout));
    let bulk_cancel = notifications::batch_cancel_router()
        .layer(RequestBodyLimitLayer::new(server.body_limit_bytes))
        .layer(TimeoutLayer::with_status_code(StatusCode::SERVICE_UNAVAILABLE, queue.batch_timeout));
    Router::new()
        .merge(ordinary)
        .merge(bulk)
        .merge(bulk_cancel)
        .merge(reconcile)
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .layer(middleware)
        .with_state(state)
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets in-flight requests finish.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Peer addresses, for the access log and the per-address limits.
    let service = router.into_make_service_with_connect_info::<std::net::SocketAddr>();
    axum::serve(listener, service).with_graceful_shutdown(shutdown).await
}
