//! Signing in (an API key with the `admin` scope, or the bootstrap admin token, exchanged for a session
//! cookie; the key is not kept anywhere) and signing out. Both leave an audit row.

use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

use crate::audit::BOOTSTRAP;
use crate::audit::{self, Actor, Event};
use crate::auth::Scope;
use crate::auth::authenticator::AuthError;
use crate::console::extract::{Action, ConsoleError, Operator, parse_form, render, same_origin};
use crate::console::session::{self, Credential};
use crate::http::limits::ClientAddr;
use crate::http::observe::RequestIds;
use crate::state::AppState;

/// The sign-in page (or, with a live session already, the Pools page).
pub async fn form(operator: Result<Operator, ConsoleError>) -> Response {
    match operator {
        Ok(_) => Redirect::to("/console/pools").into_response(),
        Err(_) => sign_in_page(StatusCode::OK, None),
    }
}

fn sign_in_page(status: StatusCode, problem: Option<&str>) -> Response {
    match render("sign_in.html", minijinja::context! { title => "Sign in", problem }) {
        Ok(page) => (status, page).into_response(),
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize)]
struct SignInForm {
    #[serde(default)]
    key: String,
}

/// Checks the key, opens a session and sets its cookie. A wrong key or one without `admin` gets the
/// form again (401 / 403); neither says whether such a key exists. Every refusal is audited with the
/// client's address, and a wrong key counts against that address's failed attempts: once they are
/// used up the address gets 429 without its key being looked up.
pub async fn sign_in(
    State(state): State<AppState>,
    client: Option<Extension<ClientAddr>>,
    ids: Option<Extension<RequestIds>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ConsoleError> {
    same_origin(&headers)?;
    let client = client.map_or(ClientAddr(None), |Extension(c)| c);
    let ids = ids.map(|Extension(ids)| ids);
    let actor_named = |name: &str| ids.as_ref().map_or_else(|| Actor::named(name), |ids| ids.actor(name));
    if state.limits.check_address(client.0).is_err() {
        tracing::warn!(%client, "console sign-in refused: too many failed attempts from this address");
        let problem = "Too many failed sign-ins from this address. Wait a minute and try again.";
        return Ok(sign_in_page(StatusCode::TOO_MANY_REQUESTS, Some(problem)));
    }
    let form: SignInForm = parse_form(&body)?;
    let refused = |actor: &str, why: &'static str| {
        let actor = actor_named(actor);
        let detail = serde_json::json!({ "client": client.to_string(), "reason": why });
        let (db, event) = (
            state.db.clone(),
            Event { action: audit::action::CONSOLE_SIGN_IN_REFUSED, detail: Some(detail), ..Event::default() },
        );
        async move {
            let mut tx = db.begin().await?;
            audit::record(&mut tx, &actor, &event).await?;
            tx.commit().await
        }
    };
    let caller = match state.auth.authenticate(Some(form.key.trim())).await {
        Ok(caller) => caller,
        // Every secret may be looked up here (the address was checked above), so no look-up is refused.
        Err(AuthError::Unauthenticated | AuthError::LookUpRefused) => {
            tracing::warn!(%client, "console sign-in refused: unknown or revoked key");
            state.limits.note_failure(client.0);
            refused(audit::ANONYMOUS, "unknown or revoked key").await?;
            return Ok(sign_in_page(StatusCode::UNAUTHORIZED, Some("That key is not accepted.")));
        }
        Err(AuthError::Database(e)) => return Err(e.into()),
    };
    if !caller.has(Scope::Admin) {
        tracing::warn!(key = %caller.name, %client, "console sign-in refused: the key lacks the admin scope");
        refused(&caller.name, "the key lacks the admin scope").await?;
        return Ok(sign_in_page(StatusCode::FORBIDDEN, Some("The console needs a key with the admin scope.")));
    }
    let credential = if &*caller.name == BOOTSTRAP {
        let digest = session::bootstrap_digest(&state.settings)
            .ok_or_else(|| ConsoleError::Forbidden("no bootstrap admin token is configured".into()))?;
        Credential::Bootstrap(digest)
    } else {
        Credential::Key(caller.name.to_string())
    };
    let actor = actor_named(credential.actor_name());
    let console = &state.settings.console;
    let mut tx = state.db.begin().await?;
    let token = session::open(&mut tx, &credential, console.session_ttl).await?;
    audit::record(&mut tx, &actor, &Event { action: audit::action::CONSOLE_SIGNED_IN, ..Event::default() }).await?;
    tx.commit().await?;
    tracing::info!(actor = %actor.name, "console sign-in");
    let cookie = session::cookie(&token, console.session_ttl, console, &headers);
    Ok(([(header::SET_COOKIE, cookie)], Redirect::to("/console/pools")).into_response())
}

/// Ends the session and forgets the cookie.
pub(crate) async fn sign_out(
    State(state): State<AppState>,
    headers: HeaderMap,
    Action(operator, _): Action<serde::de::IgnoredAny>,
) -> Result<Response, ConsoleError> {
    let mut tx = state.db.begin().await?;
    session::close(&mut tx, &operator.session).await?;
    let event = Event { action: audit::action::CONSOLE_SIGNED_OUT, ..Event::default() };
    audit::record(&mut tx, &operator.actor, &event).await?;
    tx.commit().await?;
    let forget = session::cookie("", std::time::Duration::ZERO, &state.settings.console, &headers);
    Ok(([(header::SET_COOKIE, forget)], Redirect::to("/console/sign-in")).into_response())
}
