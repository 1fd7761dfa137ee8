//! `/v1/cif` (reserve, confirm, release, extend, look up) and `/v1/pools`; `/cif…` are the same
//! handlers under the unversioned path onboarding clients were first given.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::cif::stats::PoolStats;
use crate::cif::store::{By, CodeStatus, Confirmed, Reserved};
use crate::claim::Fenced;
use crate::http::auth::{Authorized, needs};
use crate::http::error::ApiError;
use crate::state::AppState;

/// Longest accepted `Idempotency-Key`.
const MAX_IDEMPOTENCY_KEY: usize = 200;
/// Longest accepted `X-Holder` / `customer_ref`.
const MAX_LABEL: usize = 200;

/// Routes of this group; the unversioned `/cif` paths are aliases (same handlers, same scopes).
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/cif", post(reserve))
        .route("/v1/cif/{cif}", get(lookup))
        .route("/v1/cif/{cif}/confirm", post(confirm))
        .route("/v1/cif/{cif}/release", post(release))
        .route("/v1/cif/{cif}/extend", post(extend))
        .route("/v1/pools", get(pools))
        .route("/cif", post(reserve))
        .route("/cif/{cif}", get(lookup))
        .route("/cif/{cif}/confirm", post(confirm))
        .route("/cif/{cif}/release", post(release))
        .route("/cif/{cif}/extend", post(extend))
}

/// `POST /v1/cif` body.
#[derive(Debug, Deserialize)]
pub(crate) struct ReserveRequest {
    /// Pool to draw from, e.g. `individual`.
    pub customer_type: String,
}

/// `confirm` / `release` / `extend` body.
#[derive(Debug, Deserialize)]
pub(crate) struct TokenRequest {
    /// Token from the reservation.
    pub reservation_token: Uuid,
    /// Caller's reference for the customer (confirm only; kept for audit).
    #[serde(default)]
    pub customer_ref: Option<String>,
}

fn optional_header<'h>(headers: &'h HeaderMap, name: &str) -> Result<Option<&'h str>, ApiError> {
    let Some(value) = headers.get(name) else { return Ok(None) };
    let text = value.to_str().map_err(|_| ApiError::BadRequest(format!("{name} must be visible ASCII")))?;
    if text.is_empty() || text.len() > MAX_IDEMPOTENCY_KEY.max(MAX_LABEL) {
        return Err(ApiError::BadRequest(format!("{name} must be 1 to {MAX_IDEMPOTENCY_KEY} characters")));
    }
    Ok(Some(text))
}

async fn reserve(
    auth: Authorized<needs::CifReserve>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Json(body): Json<ReserveRequest>,
) -> Result<Response, ApiError> {
    let idempotency_key = optional_header(&headers, "idempotency-key")?;
    let holder = optional_header(&headers, "x-holder")?;
    let (status, reservation) =
        match state.cif.reserve(&body.customer_type, holder, idempotency_key, &auth.actor).await? {
            Reserved::Created(r) => (StatusCode::CREATED, r),
            Reserved::Replayed(r) => (StatusCode::OK, r),
            Reserved::Empty => {
                return Err(ApiError::Unavailable {
                    detail: format!(
                        "pool {:?} has no available code right now; a refill has been started",
                        body.customer_type
                    ),
                    retry_after_secs: Some(1),
                });
            }
            Reserved::KeyReused { .. } => {
                return Err(ApiError::Unprocessable(
                    "this Idempotency-Key was already used for a different customer_type".into(),
                ));
            }
        };
    let location = HeaderValue::try_from(format!("/v1/cif/{}", reservation.cif)).ok();
    let mut response = (status, Json(reservation)).into_response();
    if let Some(location) = location {
        response.headers_mut().insert(header::LOCATION, location);
    }
    Ok(response)
}

/// Response of confirm / release / extend.
#[derive(Debug, Serialize)]
struct StateChange {
    cif: String,
    customer_type: String,
    state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    confirmed_at: Option<DateTime<Utc>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_expires_at: Option<DateTime<Utc>>,
}

impl StateChange {
    /// `cif`'s new `state`, after an operation that found its pool.
    fn of(
        state: &AppState,
        cif: String,
        new_state: &'static str,
        confirmed_at: Option<DateTime<Utc>>,
        lease_expires_at: Option<DateTime<Utc>>,
    ) -> StateChange {
        let customer_type = state.cif.pool_of(&cif).unwrap_or_default().to_string();
        StateChange { cif, customer_type, state: new_state, confirmed_at, lease_expires_at }
    }
}

fn lost(cif: &str) -> ApiError {
    ApiError::Conflict(format!(
        "reservation token does not hold {cif}: it is wrong, or its lease expired and the code was reclaimed"
    ))
}

async fn confirm(
    auth: Authorized<needs::CifReserve>,
    State(state): State<AppState>,
    Path(cif): Path<String>,
    headers: HeaderMap,
    Json(body): Json<TokenRequest>,
) -> Result<Json<impl Serialize>, ApiError> {
    let by = By { actor: &auth.actor, holder: optional_header(&headers, "x-holder")? };
    if let Some(r) = &body.customer_ref {
        crate::validate::text("customer_ref", r, MAX_LABEL).map_err(ApiError::Unprocessable)?;
    }
    let at = match state.cif.confirm(&cif, body.reservation_token, body.customer_ref.as_deref(), by).await? {
        Confirmed::Now(at) | Confirmed::Already(at) => at,
        Confirmed::LeaseLost => return Err(lost(&cif)),
        Confirmed::OtherCustomer => {
            return Err(ApiError::Conflict(format!(
                "{cif} is already confirmed by this reservation for another customer_ref: a repeated confirm must \
                 name the same customer (or none, if the first named none)"
            )));
        }
    };
    Ok(Json(StateChange::of(&state, cif, "used", Some(at), None)))
}

async fn release(
    auth: Authorized<needs::CifReserve>,
    State(state): State<AppState>,
    Path(cif): Path<String>,
    headers: HeaderMap,
    Json(body): Json<TokenRequest>,
) -> Result<Json<impl Serialize>, ApiError> {
    let by = By { actor: &auth.actor, holder: optional_header(&headers, "x-holder")? };
    match state.cif.release(&cif, body.reservation_token, by).await? {
        Fenced::Done => Ok(Json(StateChange::of(&state, cif, "available", None, None))),
        Fenced::LeaseLost => Err(lost(&cif)),
    }
}

async fn extend(
    auth: Authorized<needs::CifReserve>,
    State(state): State<AppState>,
    Path(cif): Path<String>,
    headers: HeaderMap,
    Json(body): Json<TokenRequest>,
) -> Result<Json<impl Serialize>, ApiError> {
    let by = By { actor: &auth.actor, holder: optional_header(&headers, "x-holder")? };
    match state.cif.extend(&cif, body.reservation_token, by).await? {
        Some(until) => Ok(Json(StateChange::of(&state, cif, "reserved", None, Some(until)))),
        None => Err(lost(&cif)),
    }
}

async fn lookup(
    _: Authorized<needs::CifRead>,
    State(state): State<AppState>,
    Path(cif): Path<String>,
) -> Result<Json<CodeStatus>, ApiError> {
    state.cif.status(&cif).await?.map(Json).ok_or_else(|| {
        let pool = state.cif.pool_of(&cif).unwrap_or_default();
        ApiError::NotFound(format!("{cif} is a well-formed code of pool {pool:?} that has not been issued"))
    })
}

#[derive(Serialize)]
struct PoolsResponse {
    pools: Vec<PoolStats>,
}

async fn pools(_: Authorized<needs::CifRead>, State(state): State<AppState>) -> Result<Json<impl Serialize>, ApiError> {
    Ok(Json(PoolsResponse { pools: state.cif.pool_stats().await? }))
}
