//! Liveness, readiness and the Prometheus scrape endpoint.

use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;

use crate::db::{self, Readiness};
use crate::http::error::ApiError;
use crate::state::AppState;

/// How long `/readyz` waits for the database before calling it unreachable.
const READINESS_TIMEOUT: Duration = Duration::from_secs(1);

/// `/healthz`, `/readyz`, `/metrics`.
pub fn router() -> Router<AppState> {
    Router::new().route("/healthz", get(healthz)).route("/readyz", get(readyz)).route("/metrics", get(metrics))
}

/// The process is alive and serving HTTP; says nothing about dependencies (so a database outage does
/// not get every pod restarted by its liveness probe).
async fn healthz() -> impl IntoResponse {
    axum::Json(json!({ "status": "ok" }))
}

/// Ready to take traffic: the database answers and carries the schema this binary needs, and every
/// supervised background task (see `crate::supervise`) has a copy running.
async fn readyz(State(state): State<AppState>) -> Result<Response, ApiError> {
    let readiness = db::readiness(&state.db, READINESS_TIMEOUT).await;
    let down = state.liveness.down();
    crate::telemetry::collectors::record_readiness(&readiness, &down);
    match readiness {
        Readiness::Ready if !down.is_empty() => {
            tracing::warn!(?down, "readiness: background tasks down");
            Err(ApiError::Unavailable {
                detail: format!("not running: {}", down.join(", ")),
                retry_after_secs: Some(1),
            })
        }
        Readiness::Ready => Ok(axum::Json(json!({
            "status": "ready",
            "schema_version": db::latest_migration(),
        }))
        .into_response()),
        Readiness::SchemaBehind { applied, expected } => Err(ApiError::Unavailable {
            detail: format!("database schema is at version {applied}, this build needs {expected}"),
            retry_after_secs: Some(5),
        }),
        Readiness::Unreachable(why) => {
            tracing::warn!(%why, "readiness: database unreachable");
            Err(ApiError::Unavailable { detail: "database unreachable".into(), retry_after_secs: Some(1) })
        }
    }
}

/// Prometheus text exposition format.
async fn metrics(State(state): State<AppState>) -> Response {
    crate::telemetry::collectors::collect_on_scrape(&state.db);
    state.metrics.run_upkeep();
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"))],
        state.metrics.render(),
    )
        .into_response()
}
