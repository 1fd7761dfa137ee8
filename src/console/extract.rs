//! What every console handler takes and returns: the signed-in [`Operator`] (pages), the
//! CSRF-checked [`Action`] form (every change), and [`ConsoleError`], rendered as an HTML page (or, for
//! a visitor without a session, a redirect to sign-in).

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::audit::Actor;
use crate::console::session::{self, Session};
use crate::console::templates;
use crate::state::AppState;

/// Why a console request failed, as the page the browser shows.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// No live session: go and sign in.
    #[error("sign in first")]
    SignIn,
    /// 400: a form or filter the console cannot use.
    #[error("{0}")]
    BadRequest(String),
    /// 403: a form without this session's CSRF token, or from another origin.
    #[error("{0}")]
    Forbidden(String),
    /// 404: no such pool, class, provider, job or key.
    #[error("{0}")]
    NotFound(String),
    /// 409: the thing is not in a state the action applies to.
    #[error("{0}")]
    Conflict(String),
    /// 503: the database did not answer.
    #[error("the database did not answer: {0}")]
    Unavailable(String),
    /// 500: a page could not be drawn (a bug; the detail is in the log).
    #[error("this page could not be drawn; the error is in the service's log")]
    Internal,
}

impl From<sqlx::Error> for ConsoleError {
    fn from(e: sqlx::Error) -> ConsoleError {
        // The detail goes to the log; the page says only what failed (no SQL or hostnames in a browser).
        tracing::error!(error = %e, "console request failed on the database");
        ConsoleError::Unavailable("try again in a moment; the error is in the service's log".into())
    }
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let status = match &self {
            ConsoleError::SignIn => return Redirect::to("/console/sign-in").into_response(),
            ConsoleError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ConsoleError::Forbidden(_) => StatusCode::FORBIDDEN,
            ConsoleError::NotFound(_) => StatusCode::NOT_FOUND,
            ConsoleError::Conflict(_) => StatusCode::CONFLICT,
            ConsoleError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ConsoleError::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let context = minijinja::context! {
            title => status.canonical_reason().unwrap_or("Error"),
            status => status.as_u16(),
            message => self.to_string(),
        };
        match render("error.html", context) {
            Ok(page) => (status, page).into_response(),
            Err(_) => {
                (status, Html(format!("<!doctype html><title>cifpool console</title><p>{self}</p>"))).into_response()
            }
        }
    }
}

/// Renders template `name`; a failure (a bug) is logged and becomes a 500 page.
pub fn render(name: &str, context: minijinja::Value) -> Result<Html<String>, ConsoleError> {
    templates::render(name, context).map(Html).map_err(|e| {
        tracing::error!(template = name, error = %e, "console template failed");
        ConsoleError::Internal
    })
}

/// A signed-in admin: who acts (with this request's id, like every audit row) and the session.
pub struct Operator {
    /// The actor of the session's audit rows: the key's name or `bootstrap`.
    pub actor: Actor,
    /// The session (its CSRF token and notice).
    pub session: Session,
}

impl Operator {
    /// Leaves `notice` for the next page and sends the browser there (post/redirect/get).
    pub async fn done(&self, state: &AppState, notice: &str, to: &str) -> Result<Redirect, ConsoleError> {
        session::leave_notice(&state.db, &self.session, notice).await?;
        Ok(Redirect::to(to))
    }
}

impl FromRequestParts<AppState> for Operator {
    type Rejection = ConsoleError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let token = session::token_from(&parts.headers).ok_or(ConsoleError::SignIn)?;
        let settings = &state.settings;
        let bootstrap = session::bootstrap_digest(settings);
        let session = session::resume(&state.db, &token, settings.console.idle_timeout, bootstrap)
            .await?
            .ok_or(ConsoleError::SignIn)?;
        if let Some(slot) = parts.extensions.get::<crate::http::observe::CallerName>() {
            slot.set(session.actor_name.as_str().into());
        }
        let actor = crate::http::observe::actor_of_request(&parts.extensions, session.actor_name.clone());
        Ok(Operator { actor, session })
    }
}

/// Refuses a state-changing request that a page of another origin sent: browsers send `Origin` with
/// every form post, and it must name the host the request was sent to.
pub(crate) fn same_origin(headers: &HeaderMap) -> Result<(), ConsoleError> {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return Ok(());
    };
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
    let origin_host = origin.split_once("://").map_or("", |(_, rest)| rest);
    if origin_host.eq_ignore_ascii_case(host) {
        Ok(())
    } else {
        Err(ConsoleError::Forbidden(format!("a form from {origin} may not act on this console")))
    }
}

#[derive(Deserialize)]
struct CsrfField {
    #[serde(default)]
    csrf: String,
}

/// A form that changes something: sent by the signed-in operator from this origin, carrying the
/// session's CSRF token; `T` is the rest of the form.
pub struct Action<T>(pub Operator, pub T);

/// Largest console form accepted.
const MAX_FORM: usize = 64 * 1024;

impl<T: DeserializeOwned + Send> FromRequest<AppState> for Action<T> {
    type Rejection = ConsoleError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let (mut parts, body) = request.into_parts();
        same_origin(&parts.headers)?;
        let operator = Operator::from_request_parts(&mut parts, state).await?;
        let body = axum::body::to_bytes(body, MAX_FORM)
            .await
            .map_err(|_| ConsoleError::BadRequest(format!("a console form is at most {MAX_FORM} bytes")))?;
        let presented: CsrfField = parse_form(&body)?;
        if !session::csrf_matches(&operator.session, &presented.csrf) {
            return Err(ConsoleError::Forbidden(
                "this form is not from your current session (signed in again, or opened elsewhere); reload the \
                 page and try again"
                    .into(),
            ));
        }
        Ok(Action(operator, parse_form(&body)?))
    }
}

/// Parses an `application/x-www-form-urlencoded` body (or query) into `T`.
pub(crate) fn parse_form<T: DeserializeOwned>(body: &Bytes) -> Result<T, ConsoleError> {
    serde_urlencoded::from_bytes(body).map_err(|e| ConsoleError::BadRequest(format!("unusable form: {e}")))
}

/// An optional form field: an empty input means "not given".
pub fn given(value: &Option<String>) -> Option<String> {
    value.as_deref().map(str::trim).filter(|v| !v.is_empty()).map(str::to_string)
}
