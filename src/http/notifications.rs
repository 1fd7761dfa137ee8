//! `/v1/notifications`: enqueue one, enqueue a batch, look one up.

use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;

use crate::http::auth::{Authorized, needs};
use crate::http::error::ApiError;
use crate::queue::intake::{self, BatchRequest, NewJob, SubmitError};
use crate::queue::store::{self, JobView};
use crate::state::AppState;

/// Routes with the ordinary body limit.
pub fn router() -> Router<AppState> {
    Router::new().route("/v1/notifications", post(enqueue_one)).route("/v1/notifications/{id}", get(get_job))
}

/// The batch route, which carries its own (large) body limit.
pub fn batch_router() -> Router<AppState> {
    Router::new().route("/v1/notifications/batch", post(enqueue_batch)).layer(DefaultBodyLimit::disable())
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        match e {
            SubmitError::Invalid(detail) => ApiError::Unprocessable(detail),
            e @ SubmitError::Forbidden(_) => ApiError::Forbidden(e.to_string()),
            e @ SubmitError::TooMany { .. } => ApiError::PayloadTooLarge(e.to_string()),
            SubmitError::Overloaded { ref retry_after, .. } => {
                ApiError::TooManyRequests { retry_after_secs: retry_after.as_secs().max(1), detail: e.to_string() }
            }
            SubmitError::Database(e) => e.into(),
        }
    }
}

#[derive(Serialize)]
struct Accepted {
    id: i64,
    status: &'static str,
    created: bool,
}

async fn enqueue_one(
    auth: Authorized<needs::NotifySend>,
    State(state): State<AppState>,
    Json(job): Json<NewJob>,
) -> Result<(StatusCode, Json<Accepted>), ApiError> {
    let done = intake::submit_one(&state.db, &state.queue, &state.queue_stats, &auth.caller, job).await?;
    let status = if done.created { StatusCode::ACCEPTED } else { StatusCode::OK };
    Ok((status, Json(Accepted { id: done.id, status: "accepted", created: done.created })))
}

#[derive(Serialize)]
struct BatchAccepted {
    accepted: u64,
    duplicates: u64,
}

async fn enqueue_batch(
    auth: Authorized<needs::NotifySend>,
    State(state): State<AppState>,
    Json(req): Json<BatchRequest>,
) -> Result<(StatusCode, Json<BatchAccepted>), ApiError> {
    let done = intake::submit_batch(&state.db, &state.queue, &state.queue_stats, &auth.caller, req).await?;
    Ok((StatusCode::ACCEPTED, Json(BatchAccepted { accepted: done.accepted, duplicates: done.duplicates })))
}

async fn get_job(
    auth: Authorized<needs::NotifyRead>,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>, ApiError> {
    let id: i64 = id.parse().map_err(|_| ApiError::BadRequest(format!("{id:?} is not a job id")))?;
    let job =
        store::get_job(&state.db, id).await?.ok_or_else(|| ApiError::NotFound(format!("no notification {id}")))?;
    auth.check_tenant(&job.tenant)?;
    Ok(Json(job))
}
