//! `/admin`, for callers holding the `admin` scope: refill, reclaim, fence and reconcile pools; see, pause and resume the
//! queue; list, replay, retry and discard dead letters; manage API keys; read the audit trail.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use crate::audit::{self, AuditQuery};
use crate::auth::api_key::{self, KeyError, NewKey};
use crate::cif::{fence, reclaim, refill::RefillOptions, upkeep};
use crate::http::auth::{Authorized, needs};
use crate::http::error::ApiError;
use crate::queue::dlq::{self, DeadLetterAction, DlqFilter, Replay};
use crate::queue::pause::PauseKind;
use crate::queue::store::JobView;
use crate::queue::view::{self, QueueView};
use crate::state::AppState;

type Admin = Authorized<needs::Admin>;

/// Routes of this group.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/admin/pools/{customer_type}/refill", post(refill))
        .route("/admin/reclaim", post(reclaim))
        .route("/admin/pools/fence", post(fence))
        .route("/admin/dlq", get(dlq_list))
        .route("/admin/dlq/replay", post(dlq_replay))
        .route("/admin/dlq/{id}/retry", post(dlq_retry))
        .route("/admin/dlq/{id}/discard", post(dlq_discard))
        .route("/admin/queue", get(queue_view))
        .route("/admin/queue/classes/{name}/pause", post(pause_class))
        .route("/admin/queue/classes/{name}/resume", post(resume_class))
        .route("/admin/queue/providers/{name}/pause", post(pause_provider))
        .route("/admin/queue/providers/{name}/resume", post(resume_provider))
        .route("/admin/keys", post(create_key).get(list_keys))
        .route("/admin/keys/{name}", delete(revoke_key))
        .route("/admin/audit", get(audit_search))
}

/// `?force=true` adds `max_batches_per_run` batches even above the watermark.
#[derive(Debug, Deserialize)]
struct RefillQuery {
    #[serde(default)]
    force: bool,
}

async fn refill(
    auth: Admin,
    State(state): State<AppState>,
    Path(customer_type): Path<String>,
    Query(q): Query<RefillQuery>,
) -> Result<Json<impl Serialize>, ApiError> {
    let pool = state
        .pools
        .get(&customer_type)
        .ok_or_else(|| ApiError::NotFound(format!("unknown customer_type {customer_type:?}")))?;
    tracing::info!(pool = pool.name(), force = q.force, actor = %auth.actor.name, "admin refill");
    let opts = RefillOptions { force: q.force, actor: auth.actor };
    let summary = upkeep::refill_requested(&state.db, &state.upkeep, pool.clone(), opts)
        .await
        .map_err(|e| ApiError::Internal(anyhow::anyhow!("refill task: {e}")))??;
    Ok(Json(summary))
}

async fn reclaim(auth: Admin, State(state): State<AppState>) -> Result<Json<impl Serialize>, ApiError> {
    tracing::info!(actor = %auth.actor.name, "admin reclaim");
    Ok(Json(reclaim::reclaim(&state.db, &state.pools, None, &auth.actor).await?))
}

/// `POST /admin/pools/reconcile`: its body is a whole customer base, so it takes the batch body
/// limit and timeout (see `crate::http::app`).
pub(crate) fn reconcile_router() -> Router<AppState> {
    Router::new().route("/admin/pools/reconcile", post(reconcile)).layer(axum::extract::DefaultBodyLimit::disable())
}

#[derive(Debug, Deserialize)]
struct ReconcileQuery {
    #[serde(default)]
    apply: bool,
}

/// Reconciles the pools with the list of issued codes in the body (one per line, optionally followed by
/// a comma or tab and the customer reference), streamed into the database as it arrives; a dry run
/// unless `apply`. Asked to apply a list with invalid lines, it applies nothing and answers 422.
async fn reconcile(
    auth: Admin,
    State(state): State<AppState>,
    Query(q): Query<ReconcileQuery>,
    body: axum::body::Body,
) -> Result<Json<crate::cif::reconcile::ReconcileReport>, ApiError> {
    use crate::cif::reconcile::{self, ReconcileError};
    use futures_util::TryStreamExt;
    tracing::warn!(apply = q.apply, actor = %auth.actor.name, "admin reconcile");
    let stream = body.into_data_stream().map_err(std::io::Error::other);
    let list = tokio::io::BufReader::new(tokio_util::io::StreamReader::new(stream));
    let report = reconcile::reconcile(&state.db, &state.pools, list, q.apply, &auth.actor, &|_| {}).await;
    match report {
        Ok(report) if q.apply && !report.applied => Err(ApiError::Unprocessable(format!(
            "{} of {} lines are not codes of a configured pool, so nothing was applied; first: {}",
            report.invalid,
            report.lines,
            report.invalid_examples.join("; ")
        ))),
        Ok(report) => Ok(Json(report)),
        Err(ReconcileError::Read(e)) => Err(ApiError::BadRequest(format!("reading the list: {e}"))),
        Err(e @ ReconcileError::Empty) => Err(ApiError::BadRequest(e.to_string())),
        Err(ReconcileError::Database(e)) => Err(e.into()),
    }
}

#[derive(Debug, Deserialize)]
struct FenceQuery {
    #[serde(default)]
    accept: bool,
}

/// Fences every pool now (or, with `accept`, records the database as it is), and tells this instance
/// at once; the others learn it at their next identity check.
async fn fence(
    auth: Admin,
    State(state): State<AppState>,
    Query(q): Query<FenceQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    tracing::warn!(accept = q.accept, actor = %auth.actor.name, "admin fence");
    let answer = if q.accept {
        let changed = fence::accept(&state.db, &auth.actor).await?;
        serde_json::json!({ "outcome": "accepted", "changed": changed })
    } else {
        let policy = fence::FencePolicy::from_settings(&state.settings);
        serde_json::to_value(fence::Checked::Fenced(fence::fence_now(&state.db, &policy, &auth.actor).await?))
            .map_err(|e| ApiError::Internal(e.into()))?
    };
    state.incarnation.note(&fence::Checked::Same);
    Ok(Json(answer))
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
    auth: Admin,
    State(state): State<AppState>,
    Json(req): Json<Replay>,
) -> Result<Json<Replayed>, ApiError> {
    req.validate().map_err(ApiError::Unprocessable)?;
    let replayed = dlq::replay(&state.db, &req, &auth.actor).await?;
    tracing::info!(replayed, filter = ?req.filter, rate = req.rate_per_sec, actor = %auth.actor.name, "dead letters replayed");
    Ok(Json(Replayed { replayed }))
}

impl From<KeyError> for ApiError {
    fn from(e: KeyError) -> ApiError {
        match e {
            KeyError::Invalid(detail) => ApiError::Unprocessable(detail),
            e @ KeyError::Duplicate(_) => ApiError::Conflict(e.to_string()),
            e @ KeyError::NotFound(_) => ApiError::NotFound(e.to_string()),
            KeyError::Database(e) => e.into(),
        }
    }
}

async fn create_key(
    auth: Admin,
    State(state): State<AppState>,
    Json(new): Json<NewKey>,
) -> Result<(StatusCode, Json<api_key::CreatedKey>), ApiError> {
    let created = api_key::create(&state.db, &auth.actor, &new).await?;
    tracing::info!(key = %created.name, scopes = ?created.scopes, actor = %auth.actor.name, "API key created");
    Ok((StatusCode::CREATED, Json(created)))
}

#[derive(Serialize)]
struct KeyList {
    keys: Vec<api_key::ApiKey>,
}

async fn list_keys(_: Admin, State(state): State<AppState>) -> Result<Json<KeyList>, ApiError> {
    Ok(Json(KeyList { keys: api_key::list(&state.db).await? }))
}

async fn revoke_key(
    auth: Admin,
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    api_key::revoke(&state.db, &auth.actor, &name).await?;
    tracing::info!(key = %name, actor = %auth.actor.name, "API key revoked");
    Ok(StatusCode::NO_CONTENT)
}

async fn audit_search(
    _: Admin,
    State(state): State<AppState>,
    Query(q): Query<AuditQuery>,
) -> Result<Json<audit::AuditPage>, ApiError> {
    q.validate().map_err(ApiError::BadRequest)?;
    Ok(Json(audit::search(&state.db, &q).await?))
}

#[derive(Debug, Deserialize)]
struct RetryQuery {
    #[serde(default = "one")]
    extra_attempts: i32,
}

fn one() -> i32 {
    1
}

fn dead_letter_answer(id: i64, done: DeadLetterAction) -> Result<Json<JobView>, ApiError> {
    match done {
        DeadLetterAction::Done(job) => Ok(Json(job)),
        DeadLetterAction::NotDead(status) => {
            Err(ApiError::Conflict(format!("job {id} is {status}, not a dead letter")))
        }
        DeadLetterAction::NotFound => Err(ApiError::NotFound(format!("no job {id}"))),
    }
}

fn job_id(id: &str) -> Result<i64, ApiError> {
    id.parse().map_err(|_| ApiError::BadRequest(format!("{id:?} is not a job id")))
}

async fn dlq_retry(
    auth: Admin,
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<RetryQuery>,
) -> Result<Json<JobView>, ApiError> {
    let id = job_id(&id)?;
    if !(1..=dlq::MAX_EXTRA_ATTEMPTS).contains(&q.extra_attempts) {
        return Err(ApiError::BadRequest(format!("extra_attempts must be between 1 and {}", dlq::MAX_EXTRA_ATTEMPTS)));
    }
    dead_letter_answer(id, dlq::retry_one(&state.db, id, q.extra_attempts, &auth.actor).await?)
}

async fn dlq_discard(
    auth: Admin,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>, ApiError> {
    let id = job_id(&id)?;
    dead_letter_answer(id, dlq::discard_one(&state.db, id, &auth.actor).await?)
}

async fn queue_view(_: Admin, State(state): State<AppState>) -> Result<Json<QueueView>, ApiError> {
    Ok(Json(view::read(&state.db, &state.queue, &state.queue_stats).await?))
}

#[derive(Serialize)]
struct PauseAnswer {
    kind: PauseKind,
    name: String,
    paused: bool,
    /// False when it already was so (nothing changed, nothing recorded).
    changed: bool,
}

async fn set_pause(
    state: &AppState,
    auth: &Admin,
    kind: PauseKind,
    name: String,
    paused: bool,
) -> Result<Json<PauseAnswer>, ApiError> {
    match state.queue.set_pause(&state.db, kind, &name, paused, &auth.actor).await? {
        Some(changed) => Ok(Json(PauseAnswer { kind, name, paused, changed })),
        None => Err(ApiError::NotFound(format!("no {} named {name:?}", kind.as_str()))),
    }
}

async fn pause_class(
    auth: Admin,
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<PauseAnswer>, ApiError> {
    set_pause(&state, &auth, PauseKind::Class, name, true).await
}

async fn resume_class(
    auth: Admin,
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<PauseAnswer>, ApiError> {
    set_pause(&state, &auth, PauseKind::Class, name, false).await
}

async fn pause_provider(
    auth: Admin,
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<PauseAnswer>, ApiError> {
    set_pause(&state, &auth, PauseKind::Provider, name, true).await
}

async fn resume_provider(
    auth: Admin,
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<PauseAnswer>, ApiError> {
    set_pause(&state, &auth, PauseKind::Provider, name, false).await
}
