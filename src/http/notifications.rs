//! `/v1/notifications`: enqueue one, enqueue a batch, look one up. Admin: the dead-letter queue.

use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::http::admin::Admin;
use crate::http::error::ApiError;
use crate::queue::dlq::{self, DlqFilter, Replay};
use crate::queue::enqueue::{self, Admission, NewJob};
use crate::state::AppState;

/// Routes with the ordinary body limit.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/notifications", post(enqueue_one))
        .route("/v1/notifications/{id}", get(get_job))
        .route("/admin/dlq", get(dlq_list))
        .route("/admin/dlq/replay", post(dlq_replay))
}

/// The batch route, which carries its own (large) body limit.
pub fn batch_router() -> Router<AppState> {
    Router::new().route("/v1/notifications/batch", post(enqueue_batch)).layer(DefaultBodyLimit::disable())
}

fn admission_error(class: &str, admission: Admission) -> Option<ApiError> {
    match admission {
        Admission::Reject(after) => Some(ApiError::TooManyRequests {
            detail: format!("class {class:?} is over its target wait; retry later"),
            retry_after_secs: after.as_secs().max(1),
        }),
        _ => None,
    }
}

fn delay_of(admission: Admission) -> Duration {
    match admission {
        Admission::Defer(d) => d,
        _ => Duration::ZERO,
    }
}

#[derive(Serialize)]
struct Accepted {
    id: i64,
    status: &'static str,
    created: bool,
}

async fn enqueue_one(
    State(state): State<AppState>,
    Json(mut job): Json<NewJob>,
) -> Result<(StatusCode, Json<Accepted>), ApiError> {
    job.normalize();
    job.validate(&state.queue).map_err(|e| ApiError::Unprocessable(e.0))?;
    // A retried request gets its job back even while intake is shedding load.
    if let Some(key) = &job.idempotency_key
        && let Some(id) = enqueue::existing(&state.db, &job.tenant, key).await?
    {
        return Ok((StatusCode::OK, Json(Accepted { id, status: "accepted", created: false })));
    }
    let admission = enqueue::admit(&state.queue, &state.queue_stats, &job.class);
    if let Some(e) = admission_error(&job.class, admission) {
        metrics::counter!("cifpool_queue_rejected_total", "class" => job.class.clone()).increment(1);
        return Err(e);
    }
    let done = enqueue::enqueue_one(&state.db, &state.queue, &job, delay_of(admission)).await?;
    metrics::counter!("cifpool_queue_enqueued_total", "class" => job.class.clone()).increment(u64::from(done.created));
    let status = if done.created { StatusCode::ACCEPTED } else { StatusCode::OK };
    Ok((status, Json(Accepted { id: done.id, status: "accepted", created: done.created })))
}

/// One job of a batch; `class` and `tenant` default to the batch's.
#[derive(Debug, Deserialize)]
struct BatchJob {
    #[serde(default)]
    class: Option<String>,
    #[serde(default)]
    tenant: Option<String>,
    recipient: String,
    #[serde(default = "enqueue::null_payload")]
    payload: Box<serde_json::value::RawValue>,
    #[serde(default)]
    idempotency_key: Option<String>,
}

#[derive(Debug, Deserialize)]
struct BatchRequest {
    #[serde(default)]
    class: Option<String>,
    #[serde(default)]
    tenant: Option<String>,
    jobs: Vec<BatchJob>,
}

#[derive(Serialize)]
struct BatchAccepted {
    accepted: u64,
    duplicates: u64,
}

async fn enqueue_batch(
    State(state): State<AppState>,
    Json(req): Json<BatchRequest>,
) -> Result<(StatusCode, Json<BatchAccepted>), ApiError> {
    let max = state.queue.settings.max_batch;
    if req.jobs.len() > max {
        return Err(ApiError::PayloadTooLarge(format!("a batch holds at most {max} jobs, got {}", req.jobs.len())));
    }
    if req.jobs.is_empty() {
        return Err(ApiError::Unprocessable("jobs must not be empty".into()));
    }
    let mut jobs = Vec::with_capacity(req.jobs.len());
    for (i, j) in req.jobs.into_iter().enumerate() {
        let mut job = NewJob {
            class: j.class.or_else(|| req.class.clone()).unwrap_or_default(),
            tenant: j.tenant.or_else(|| req.tenant.clone()).unwrap_or_default(),
            recipient: j.recipient,
            payload: j.payload,
            idempotency_key: j.idempotency_key,
        };
        job.normalize();
        job.validate(&state.queue).map_err(|e| ApiError::Unprocessable(format!("jobs[{i}]: {}", e.0)))?;
        jobs.push(job);
    }
    let mut classes: Vec<&str> = jobs.iter().map(|j| j.class.as_str()).collect();
    classes.sort_unstable();
    classes.dedup();
    let mut delay = Duration::ZERO;
    for class in &classes {
        let admission = enqueue::admit(&state.queue, &state.queue_stats, class);
        if let Some(e) = admission_error(class, admission) {
            metrics::counter!("cifpool_queue_rejected_total", "class" => class.to_string())
                .increment(jobs.len() as u64);
            return Err(e);
        }
        delay = delay.max(delay_of(admission));
    }
    let per_class = enqueue::enqueue_batch(&state.db, &state.queue, &jobs, delay).await?;
    for (class, n) in &per_class {
        metrics::counter!("cifpool_queue_enqueued_total", "class" => class.clone()).increment(*n);
    }
    let accepted: u64 = per_class.values().sum();
    Ok((StatusCode::ACCEPTED, Json(BatchAccepted { accepted, duplicates: jobs.len() as u64 - accepted })))
}

/// A job as `GET /v1/notifications/{id}` shows it.
#[derive(Debug, Serialize, sqlx::FromRow)]
struct JobView {
    id: i64,
    class: String,
    tenant: String,
    status: String,
    attempts: i32,
    max_attempts: i32,
    run_after: DateTime<Utc>,
    deadline: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
    picked_at: Option<DateTime<Utc>>,
    finished_at: Option<DateTime<Utc>>,
    last_error: Option<String>,
}

async fn get_job(State(state): State<AppState>, Path(id): Path<String>) -> Result<Json<JobView>, ApiError> {
    let id: i64 = id.parse().map_err(|_| ApiError::BadRequest(format!("{id:?} is not a job id")))?;
    sqlx::query_as(
        "SELECT id, class, tenant, status, attempts, max_attempts, run_after, deadline, created_at, picked_at, \
                finished_at, last_error FROM notification_jobs WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(&state.db)
    .await?
    .map(Json)
    .ok_or_else(|| ApiError::NotFound(format!("no notification {id}")))
}

#[derive(Debug, Deserialize)]
struct DlqQuery {
    #[serde(flatten)]
    filter: DlqFilter,
    #[serde(default)]
    limit: Option<i64>,
}

#[derive(Serialize)]
struct DlqPage {
    jobs: Vec<dlq::DeadJob>,
}

async fn dlq_list(
    _: Admin,
    State(state): State<AppState>,
    Query(q): Query<DlqQuery>,
) -> Result<Json<DlqPage>, ApiError> {
    q.filter.validate().map_err(ApiError::BadRequest)?;
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    Ok(Json(DlqPage { jobs: dlq::list(&state.db, &q.filter, limit).await? }))
}

#[derive(Serialize)]
struct Replayed {
    replayed: u64,
}

async fn dlq_replay(
    _: Admin,
    State(state): State<AppState>,
    Json(req): Json<Replay>,
) -> Result<Json<Replayed>, ApiError> {
    req.validate().map_err(ApiError::Unprocessable)?;
    let replayed = dlq::replay(&state.db, &req).await?;
    tracing::info!(replayed, filter = ?req.filter, rate = req.rate_per_sec, "dead letters replayed");
    Ok(Json(Replayed { replayed }))
}
