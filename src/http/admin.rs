//! `/admin`, for callers holding the `admin` scope: refill, reclaim, fence and reconcile pools; see, pause and resume the
//! queue; list, replay, retry and discard dead letters; manage API keys; read the audit trail.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use crate::audit::{self, AuditQuery};
use crate::auth::api_key::{self, KeyError, NewKey};
use crate::cif::refill::RefillOptions;
use crate::cif::service::{FenceOutcome, Rotation};
use crate::http::auth::{Authorized, needs};
use crate::http::error::ApiError;
use crate::queue::dlq::{self, DeadLetterAction, DlqFilter, Replay};
use crate::queue::pause::PauseKind;
use crate::queue::store::JobView;
use crate::queue::view::QueueView;
use crate::state::AppState;

type Admin = Authorized<needs::Admin>;

/// Routes of this group.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/admin/pools/{customer_type}/refill", post(refill))
        .route("/admin/pools/{customer_type}/rotate-key", post(rotate_key))
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
    tracing::info!(pool = customer_type, force = q.force, actor = %auth.actor.name, "admin refill");
    let opts = RefillOptions { force: q.force, actor: auth.actor };
    Ok(Json(state.cif.refill(&customer_type, opts).await?))
}

/// The body of a key rotation.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RotateKey {
    /// The label the new key is derived with; new to the pool.
    key_id: String,
}

async fn rotate_key(
    auth: Admin,
    State(state): State<AppState>,
    Path(customer_type): Path<String>,
    Json(body): Json<RotateKey>,
) -> Result<Json<Rotation>, ApiError> {
    tracing::warn!(pool = customer_type, key_id = body.key_id, actor = %auth.actor.name, "admin key rotation");
    Ok(Json(state.cif.rotate_key(&customer_type, &body.key_id, &auth.actor).await?))
}

async fn reclaim(auth: Admin, State(state): State<AppState>) -> Result<Json<impl Serialize>, ApiError> {
    tracing::info!(actor = %auth.actor.name, "admin reclaim");
    Ok(Json(state.cif.reclaim(None, &auth.actor).await?))
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
    use crate::cif::reconcile::ReconcileError;
    use futures_util::TryStreamExt;
    tracing::warn!(apply = q.apply, actor = %auth.actor.name, "admin reconcile");
    let stream = body.into_data_stream().map_err(std::io::Error::other);
    let list = tokio::io::BufReader::new(tokio_util::io::StreamReader::new(stream));
    let report = state.cif.reconcile(list, q.apply, &auth.actor, &|_| {}).await;
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
) -> Result<Json<FenceOutcome>, ApiError> {
    tracing::warn!(accept = q.accept, actor = %auth.actor.name, "admin fence");
    Ok(Json(state.cif.fence(q.accept, &auth.actor).await?))
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
    Ok(Json(DlqPage { jobs: state.notifications.dead_letters(&q.filter, limit).await? }))
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
    let replayed = state.notifications.replay(&req, &auth.actor).await?;
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
    let created = state.auth.create_key(&auth.actor, &new).await?;
    tracing::info!(key = %created.name, scopes = ?created.scopes, actor = %auth.actor.name, "API key created");
    Ok((StatusCode::CREATED, Json(created)))
}

#[derive(Serialize)]
struct KeyList {
    keys: Vec<api_key::ApiKey>,
}

async fn list_keys(_: Admin, State(state): State<AppState>) -> Result<Json<KeyList>, ApiError> {
    Ok(Json(KeyList { keys: state.auth.keys().await? }))
}

async fn revoke_key(
    auth: Admin,
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    state.auth.revoke_key(&auth.actor, &name).await?;
    tracing::info!(key = %name, actor = %auth.actor.name, "API key revoked");
    Ok(StatusCode::NO_CONTENT)
}

async fn audit_search(
    _: Admin,
    State(state): State<AppState>,
    Query(q): Query<AuditQuery>,
) -> Result<Json<audit::AuditPage>, ApiError> {
    q.validate().map_err(ApiError::BadRequest)?;
    Ok(Json(state.audit.search(&q).await?))
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
    dead_letter_answer(id, state.notifications.retry_dead_letter(id, q.extra_attempts, &auth.actor).await?)
}

async fn dlq_discard(
    auth: Admin,
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<JobView>, ApiError> {
    let id = job_id(&id)?;
    dead_letter_answer(id, state.notifications.discard_dead_letter(id, &auth.actor).await?)
}

async fn queue_view(_: Admin, State(state): State<AppState>) -> Result<Json<QueueView>, ApiError> {
    Ok(Json(state.notifications.view().await?))
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
    match state.notifications.set_pause(kind, &name, paused, &auth.actor).await? {
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
