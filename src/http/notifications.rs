//! `/v1/notifications`: enqueue one or a batch (sent now or at `run_at`), look one up, cancel one, and
//! watch or cancel a batch.

use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt as _;
use serde::Serialize;

use crate::http::auth::{Authorized, needs};
use crate::http::error::ApiError;
use crate::queue::cancel::{Batch, BatchView, Canceled};
use crate::queue::intake::{NewJob, SubmitError};
use crate::queue::store::JobView;
use crate::state::AppState;

/// Routes with the ordinary body limit.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/notifications", post(enqueue_one))
        .route("/v1/notifications/{id}", get(get_job))
        .route("/v1/notifications/{id}/cancel", post(cancel_job))
        .route("/v1/notifications/batches/{id}", get(get_batch))
}

/// The batch cancel route, which gets the batch deadline (`queue.batch_timeout`) rather than the
/// ordinary one: canceling a batch of hundreds of thousands of jobs takes longer than any single
/// request should, and the caller wants the count of the whole walk.
pub(crate) fn batch_cancel_router() -> Router<AppState> {
    Router::new().route("/v1/notifications/batches/{id}/cancel", post(cancel_batch))
}

/// The batch route, which carries its own (large) body limit, and at most `max_concurrent_batches`
/// requests of it at once.
pub(crate) fn batch_router(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/v1/notifications/batch", post(enqueue_batch))
        .layer(DefaultBodyLimit::disable())
        .route_layer(middleware::from_fn_with_state(state.clone(), one_of_few_batches))
}

/// Admits a batch request only with a free permit, held until the answer: each batch holds a database
/// connection and a transaction while its body streams in, and a few chunks of memory; the permits
/// bound how many this instance takes at once. Without one: 429.
async fn one_of_few_batches(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let Some(_permit) = state.notifications.try_batch_permit() else {
        metrics::counter!("cifpool_queue_batches_refused_total").increment(1);
        let busy = state.settings.queue.max_concurrent_batches;
        return ApiError::TooManyRequests {
            retry_after_secs: 1,
            detail: format!(
                "this instance is already receiving {busy} batch request(s) (queue.max_concurrent_batches); \
                 retry after the Retry-After delay, or send smaller batches"
            ),
        }
        .into_response();
    };
    next.run(request).await
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        match e {
            SubmitError::Invalid(detail) => ApiError::Unprocessable(detail),
            e @ SubmitError::Forbidden(_) => ApiError::Forbidden(e.to_string()),
            e @ (SubmitError::TooMany { .. } | SubmitError::BodyTooLarge) => ApiError::PayloadTooLarge(e.to_string()),
            SubmitError::Malformed(detail) => ApiError::BadRequest(detail),
            e @ SubmitError::TooSlow(_) => ApiError::RequestTimeout(e.to_string()),
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
    let done = state.notifications.submit_one(&auth.caller, job).await?;
    let status = if done.created { StatusCode::ACCEPTED } else { StatusCode::OK };
    Ok((status, Json(Accepted { id: done.id, status: "accepted", created: done.created })))
}

#[derive(Serialize)]
struct BatchAccepted {
    accepted: u64,
    duplicates: u64,
    batch_id: i64,
}

/// Streams the body into the batch intake; the content type is checked first, as the `Json`
/// extractor did (415 without `application/json`).
async fn enqueue_batch(
    auth: Authorized<needs::NotifySend>,
    State(state): State<AppState>,
    request: Request,
) -> Result<Response, ApiError> {
    if !is_json(request.headers()) {
        let detail = "Expected request with `Content-Type: application/json`";
        return Ok((StatusCode::UNSUPPORTED_MEDIA_TYPE, detail).into_response());
    }
    let body = request.into_body().into_data_stream().map(|frame| frame.map_err(Into::into)).boxed();
    let done = state.notifications.submit_batch(&auth.caller, body).await?;
    let body = BatchAccepted { accepted: done.accepted, duplicates: done.duplicates, batch_id: done.batch_id };
    Ok((StatusCode::ACCEPTED, Json(body)).into_response())
}

/// `application/json` or `application/…+json`, with any parameters.
fn is_json(headers: &axum::http::HeaderMap) -> bool {
    let Some(value) = headers.get(axum::http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

async fn get_job(
    auth: Authorized<needs::NotifyRead>,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>, ApiError> {
    let id = parse_id(&id, "job")?;
    // Another tenant's job is answered as one that does not exist, so a key learns neither that it
    // exists nor whose it is.
    let job = state.notifications.job(&auth.caller, id).await?;
    Ok(Json(job.ok_or_else(|| ApiError::NotFound(format!("no notification {id}")))?))
}

fn parse_id(id: &str, what: &str) -> Result<i64, ApiError> {
    id.parse().map_err(|_| ApiError::BadRequest(format!("{id:?} is not a {what} id")))
}

async fn cancel_job(
    auth: Authorized<needs::NotifySend>,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>, ApiError> {
    let id = parse_id(&id, "job")?;
    match state.notifications.cancel(&auth.caller, id, &auth.actor).await? {
        Canceled::Now(job) | Canceled::Already(job) => Ok(Json(job)),
        Canceled::TooLate(job) => {
            Err(ApiError::Conflict(format!("notification {id} is {}: too late to cancel", job.status)))
        }
        Canceled::NotFound => Err(ApiError::NotFound(format!("no notification {id}"))),
    }
}

/// The batch `id`, if the caller may see every tenant it holds (else, as for a batch that does not
/// exist, 404).
async fn authorized_batch<S>(auth: &Authorized<S>, state: &AppState, id: &str) -> Result<Batch, ApiError> {
    let id = parse_id(id, "batch")?;
    let batch = state.notifications.batch(&auth.caller, id).await?;
    batch.ok_or_else(|| ApiError::NotFound(format!("no batch {id}")))
}

async fn get_batch(
    auth: Authorized<needs::NotifyRead>,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<BatchView>, ApiError> {
    let batch = authorized_batch(&auth, &state, &id).await?;
    Ok(Json(state.notifications.batch_view(&batch).await?))
}

#[derive(Serialize)]
struct BatchCanceled {
    batch_id: i64,
    canceled: u64,
}

async fn cancel_batch(
    auth: Authorized<needs::NotifySend>,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<BatchCanceled>, ApiError> {
    let batch = authorized_batch(&auth, &state, &id).await?;
    let batch_id = batch.id;
    let canceled = state.notifications.cancel_batch(batch, auth.actor).await?;
    Ok(Json(BatchCanceled { batch_id, canceled }))
}
