//! `/v1/cif` (reserve, confirm, release, extend, look up) and `/v1/pools`; `/cif…` are the same
//! handlers under the unversioned path onboarding clients were first given.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::cif::store::{self, By, Confirmed, Reserved};
use crate::cif::{Pool, issue, stats};
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

fn pool_for_type<'a>(state: &'a AppState, customer_type: &str) -> Result<&'a Arc<Pool>, ApiError> {
    state.pools.get(customer_type).ok_or_else(|| {
        ApiError::NotFound(format!(
            "unknown customer_type {customer_type:?}; known types: {}",
            state.pools.names().join(", ")
        ))
    })
}

/// Finds the pool of `cif` and decodes it to its counter; malformed codes are 400.
fn decode<'a>(state: &'a AppState, cif: &str) -> Result<(&'a Arc<Pool>, i64), ApiError> {
    if let Some(position) = cif.chars().position(|c| !c.is_ascii_digit()) {
        return Err(ApiError::BadRequest(format!(
            "code must contain only the digits 0-9, but character {} is not a digit",
            position + 1
        )));
    }
    let pool = state.pools.for_code(cif).ok_or_else(|| {
        ApiError::BadRequest(format!("{cif:?} does not have the length and prefix of any pool's codes"))
    })?;
    let counter = pool.codec.decode(cif).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    Ok((pool, counter as i64))
}

async fn reserve(
    auth: Authorized<needs::CifReserve>,
    State(state): State<AppState>,
    headers: HeaderMap,
    Json(body): Json<ReserveRequest>,
) -> Result<Response, ApiError> {
    let idempotency_key = optional_header(&headers, "idempotency-key")?;
    let holder = optional_header(&headers, "x-holder")?;
    let pool = pool_for_type(&state, &body.customer_type)?;
    if state.incarnation.halted() {
        return Err(ApiError::Unavailable {
            detail: "issuance is halted: the database is not the one codes were issued from (a restore, a \
                     recovery or a failover), and database.on_incarnation_change is \"halt\"; an operator \
                     must run `cifpool pools fence` (or `--accept`)"
                .into(),
            retry_after_secs: Some(60),
        });
    }
    let (status, reservation) =
        match issue::reserve(&state.db, pool, holder, idempotency_key, &auth.actor, &state.upkeep).await? {
            Reserved::Created(r) => (StatusCode::CREATED, r),
            Reserved::Replayed(r) => (StatusCode::OK, r),
            Reserved::Empty => {
                return Err(ApiError::Unavailable {
                    detail: format!(
                        "pool {:?} has no available code right now; a refill has been started",
                        pool.name()
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
    let (pool, counter) = decode(&state, &cif)?;
    let by = By { actor: &auth.actor, holder: optional_header(&headers, "x-holder")? };
    if let Some(r) = &body.customer_ref {
        crate::validate::text("customer_ref", r, MAX_LABEL).map_err(ApiError::Unprocessable)?;
    }
    let token = body.reservation_token;
    let at = match issue::confirm(&state.db, pool, counter, token, body.customer_ref.as_deref(), by).await? {
        Confirmed::Now(at) | Confirmed::Already(at) => at,
        Confirmed::LeaseLost => return Err(lost(&cif)),
        Confirmed::OtherCustomer => {
            return Err(ApiError::Conflict(format!(
                "{cif} is already confirmed by this reservation for another customer_ref: a repeated confirm must \
                 name the same customer (or none, if the first named none)"
            )));
        }
    };
    Ok(Json(StateChange {
        cif,
        customer_type: pool.name().to_string(),
        state: "used",
        confirmed_at: Some(at),
        lease_expires_at: None,
    }))
}

async fn release(
    auth: Authorized<needs::CifReserve>,
    State(state): State<AppState>,
    Path(cif): Path<String>,
    headers: HeaderMap,
    Json(body): Json<TokenRequest>,
) -> Result<Json<impl Serialize>, ApiError> {
    let (pool, counter) = decode(&state, &cif)?;
    let by = By { actor: &auth.actor, holder: optional_header(&headers, "x-holder")? };
    match store::release(&state.db, pool, counter, body.reservation_token, by).await? {
        Fenced::Done => Ok(Json(StateChange {
            cif,
            customer_type: pool.name().to_string(),
            state: "available",
            confirmed_at: None,
            lease_expires_at: None,
        })),
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
    let (pool, counter) = decode(&state, &cif)?;
    let by = By { actor: &auth.actor, holder: optional_header(&headers, "x-holder")? };
    match store::extend(&state.db, pool, counter, body.reservation_token, by).await? {
        Some(until) => Ok(Json(StateChange {
            cif,
            customer_type: pool.name().to_string(),
            state: "reserved",
            confirmed_at: None,
            lease_expires_at: Some(until),
        })),
        None => Err(lost(&cif)),
    }
}

async fn lookup(
    _: Authorized<needs::CifRead>,
    State(state): State<AppState>,
    Path(cif): Path<String>,
) -> Result<Json<store::CodeStatus>, ApiError> {
    let (pool, counter) = decode(&state, &cif)?;
    store::status(&state.db, pool, counter, &cif).await?.map(Json).ok_or_else(|| {
        ApiError::NotFound(format!("{cif} is a well-formed code of pool {:?} that has not been issued", pool.name()))
    })
}

#[derive(Serialize)]
struct PoolsResponse {
    pools: Vec<stats::PoolStats>,
}

async fn pools(_: Authorized<needs::CifRead>, State(state): State<AppState>) -> Result<Json<impl Serialize>, ApiError> {
    Ok(Json(PoolsResponse { pools: stats::refresh(&state.db, &state.pools).await? }))
}
