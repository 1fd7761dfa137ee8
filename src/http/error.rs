//! The one error type of the HTTP layer, rendered as RFC 9457 `application/problem+json`.
//!
//! Handlers return [`ApiError`]; anything else that produces a 4xx/5xx (axum's extractor rejections,
//! the body-limit and timeout layers, unknown routes, wrong methods) is rewritten into the same shape by
//! [`problem_for_plain_errors`], so a client never has to parse two error formats.

use axum::body::{Body, to_bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::db::is_connectivity_error;

/// Media type of every error body.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// An RFC 9457 problem document.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Problem {
    /// A URI naming the kind of problem (stable; clients may switch on it).
    #[serde(rename = "type")]
    pub kind: String,
    /// Short human summary of the kind.
    pub title: String,
    /// HTTP status code.
    pub status: u16,
    /// What went wrong in this occurrence.
    pub detail: String,
}

impl Problem {
    /// A problem of kind `slug` (`urn:cifpool:problem:<slug>`).
    pub fn new(status: StatusCode, slug: &str, detail: impl Into<String>) -> Problem {
        Problem {
            kind: format!("urn:cifpool:problem:{slug}"),
            title: status.canonical_reason().unwrap_or("Error").to_string(),
            status: status.as_u16(),
            detail: detail.into(),
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self).unwrap_or_default();
        (status, [(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON))], body).into_response()
    }
}

/// Everything a handler can fail with.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ApiError {
    /// 400: the request is malformed.
    #[error("{0}")]
    BadRequest(String),
    /// 401: no API key, or one that is unknown or revoked.
    #[error("missing, unknown or revoked API key")]
    Unauthorized,
    /// 403: the key is valid but may not do this (a missing scope, another tenant).
    #[error("{0}")]
    Forbidden(String),
    /// 404: no such resource.
    #[error("{0}")]
    NotFound(String),
    /// 408: the client sent its body too slowly.
    #[error("{0}")]
    RequestTimeout(String),
    /// 409: the request conflicts with the resource's state (e.g. a stale reservation token).
    #[error("{0}")]
    Conflict(String),
    /// 413: body too large.
    #[error("{0}")]
    PayloadTooLarge(String),
    /// 422: well-formed but semantically invalid.
    #[error("{0}")]
    Unprocessable(String),
    /// 429: intake is shedding load; come back after `retry_after_secs`.
    #[error("{detail}")]
    TooManyRequests {
        /// Why.
        detail: String,
        /// Seconds to wait.
        retry_after_secs: u64,
    },
    /// 503: a dependency (the database, an empty pool) cannot serve now.
    #[error("{detail}")]
    Unavailable {
        /// Why.
        detail: String,
        /// Seconds to wait, when known.
        retry_after_secs: Option<u64>,
    },
    /// A database error; connection trouble maps to 503, anything else to 500.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// A bug or unexpected state: 500, details only in the log.
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl From<crate::cif::CifError> for ApiError {
    fn from(e: crate::cif::CifError) -> ApiError {
        use crate::cif::CifError;
        match e {
            CifError::UnknownType { .. } => ApiError::NotFound(e.to_string()),
            CifError::Malformed(detail) => ApiError::BadRequest(detail),
            CifError::Halted => ApiError::Unavailable { detail: e.to_string(), retry_after_secs: Some(60) },
            CifError::Invalid(detail) => ApiError::Unprocessable(detail),
            CifError::Conflict(detail) => ApiError::Conflict(detail),
            CifError::Interrupted(detail) => ApiError::Internal(anyhow::anyhow!(detail)),
            CifError::Database(e) => ApiError::Database(e),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, slug, detail, retry_after) = match self {
            ApiError::BadRequest(d) => (StatusCode::BAD_REQUEST, "bad-request", d, None),
            ApiError::Unauthorized => {
                let detail = "missing, unknown or revoked API key: send Authorization: Bearer <key>";
                let mut r = Problem::new(StatusCode::UNAUTHORIZED, "unauthorized", detail).into_response();
                r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return r;
            }
            ApiError::Forbidden(d) => (StatusCode::FORBIDDEN, "forbidden", d, None),
            ApiError::NotFound(d) => (StatusCode::NOT_FOUND, "not-found", d, None),
            ApiError::RequestTimeout(d) => (StatusCode::REQUEST_TIMEOUT, "request-timeout", d, None),
            ApiError::Conflict(d) => (StatusCode::CONFLICT, "conflict", d, None),
            ApiError::PayloadTooLarge(d) => (StatusCode::PAYLOAD_TOO_LARGE, "payload-too-large", d, None),
            ApiError::Unprocessable(d) => (StatusCode::UNPROCESSABLE_ENTITY, "unprocessable", d, None),
            ApiError::TooManyRequests { detail, retry_after_secs } => {
                (StatusCode::TOO_MANY_REQUESTS, "overloaded", detail, Some(retry_after_secs))
            }
            ApiError::Unavailable { detail, retry_after_secs } => {
                (StatusCode::SERVICE_UNAVAILABLE, "unavailable", detail, retry_after_secs)
            }
            ApiError::Database(e) if is_connectivity_error(&e) => {
                tracing::warn!(error = %e, "database unavailable");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "database-unavailable",
                    "the database is not reachable".into(),
                    Some(1),
                )
            }
            ApiError::Database(e) => {
                tracing::error!(error = %e, "database error");
                (StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error".into(), None)
            }
            ApiError::Internal(e) => {
                tracing::error!(error = format!("{e:#}"), "internal error");
                (StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error".into(), None)
            }
        };
        let mut response = Problem::new(status, slug, detail).into_response();
        if let Some(secs) = retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// Slug for a status produced outside our handlers.
fn slug_for(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST => "bad-request",
        StatusCode::NOT_FOUND => "not-found",
        StatusCode::METHOD_NOT_ALLOWED => "method-not-allowed",
        StatusCode::PAYLOAD_TOO_LARGE => "payload-too-large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported-media-type",
        StatusCode::UNPROCESSABLE_ENTITY => "unprocessable",
        StatusCode::REQUEST_TIMEOUT | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT => "unavailable",
        s if s.is_client_error() => "client-error",
        _ => "internal",
    }
}

/// Middleware: turns any 4xx/5xx response that is not already problem+json (or an HTML page of the
/// console) into one, keeping the status and headers and using the original text as the detail.
pub(crate) async fn problem_for_plain_errors<B>(response: axum::http::Response<B>) -> Response
where
    B: axum::body::HttpBody<Data = axum::body::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    let response = response.map(Body::new);
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with(PROBLEM_JSON) || v.starts_with("text/html"));
    if is_problem {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = to_bytes(body, 16 * 1024).await.map(|b| String::from_utf8_lossy(&b).trim().to_string());
    let detail = match text {
        Ok(t) if !t.is_empty() && !status.is_server_error() => t,
        _ if status == StatusCode::NOT_FOUND => "no such route".to_string(),
        _ if status == StatusCode::SERVICE_UNAVAILABLE => "request timed out or service unavailable".to_string(),
        _ => status.canonical_reason().unwrap_or("error").to_string(),
    };
    let problem = Problem::new(status, slug_for(status), detail);
    let body = serde_json::to_vec(&problem).unwrap_or_default();
    parts.headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    parts.headers.remove(header::CONTENT_LENGTH);
    if status == StatusCode::SERVICE_UNAVAILABLE && !parts.headers.contains_key(header::RETRY_AFTER) {
        parts.headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    Response::from_parts(parts, Body::from(body))
}
