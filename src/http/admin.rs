//! `/admin`, behind a bearer token: refill and reclaim pools, list and replay dead letters.

use axum::extract::{FromRequestParts, Path, Query, State};
use axum::http::header;
use axum::http::request::Parts;
use axum::routing::{get, post};
use axum::{Json, Router};
use secrecy::ExposeSecret;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::cif::{reclaim, refill::RefillOptions, upkeep};
use crate::http::error::ApiError;
use crate::queue::dlq::{self, DlqFilter, Replay};
use crate::state::AppState;

/// Routes of this group.
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/admin/pools/{customer_type}/refill", post(refill))
        .route("/admin/reclaim", post(reclaim))
        .route("/admin/dlq", get(dlq_list))
        .route("/admin/dlq/replay", post(dlq_replay))
}

/// Proof that the request carried `Authorization: Bearer <security.admin_token>`.
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let Some(expected) = &state.settings.security.admin_token else {
            return Err(ApiError::Unauthorized);
        };
        let given = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or(ApiError::Unauthorized)?;
        // Comparing fixed-size digests in constant time hides both content and length.
        let a = Sha256::digest(given.as_bytes());
        let b = Sha256::digest(expected.expose_secret().as_bytes());
        if bool::from(a.ct_eq(&b)) { Ok(Admin) } else { Err(ApiError::Unauthorized) }
    }
}

/// `?force=true` adds `max_batches_per_run` batches even above the watermark.
#[derive(Debug, Deserialize)]
struct RefillQuery {
    #[serde(default)]
    force: bool,
}

async fn refill(
    _: Admin,
    State(state): State<AppState>,
    Path(customer_type): Path<String>,
    Query(q): Query<RefillQuery>,
) -> Result<Json<impl Serialize>, ApiError> {
    let pool = state
        .pools
        .get(&customer_type)
        .ok_or_else(|| ApiError::NotFound(format!("unknown customer_type {customer_type:?}")))?;
    tracing::info!(pool = pool.name(), force = q.force, "admin refill");
    Ok(Json(upkeep::run_refill(&state.db, pool, RefillOptions { force: q.force }).await?))
}

async fn reclaim(_: Admin, State(state): State<AppState>) -> Result<Json<impl Serialize>, ApiError> {
    tracing::info!("admin reclaim");
    Ok(Json(reclaim::reclaim(&state.db, &state.pools, None).await?))
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
