//! The operations console at `/console`: pools, the queue, dead letters, API keys and the audit trail
//! in a browser, for holders of the `admin` scope. Server-rendered HTML, no script; every action
//! calls the same domain function as its `/admin` endpoint and leaves the same audit row.
//!
//! - [`session`]: sign-in sessions (cookie, digest in Postgres, CSRF token).
//! - [`extract`]: the signed-in [`extract::Operator`], the CSRF-checked [`extract::Action`] form, and
//!   [`extract::ConsoleError`], the HTML error page.
//! - [`templates`]: the templates compiled into the binary and their rendering.
//! - [`sign_in`]: sign-in and sign-out.
//! - [`pages`]: the pages (Pools, Queue, Dead letters, Keys, Audit).
//! - [`actions`]: the buttons and forms that change something.

pub mod actions;
pub mod extract;
pub mod pages;
pub mod session;
pub mod sign_in;
pub mod templates;

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::middleware;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};

use crate::state::AppState;

/// The console's routes, each answer carrying [`protect`]'s headers. Empty when `console.enabled` is
/// off, so every console path is then the ordinary 404.
pub fn router(state: &AppState) -> Router<AppState> {
    if !state.settings.console.enabled {
        return Router::new();
    }
    Router::new()
        .route("/console", get(|| async { Redirect::to("/console/pools") }))
        .route("/console/static/console.css", get(stylesheet))
        .route("/console/sign-in", get(sign_in::form).post(sign_in::sign_in))
        .route("/console/sign-out", post(sign_in::sign_out))
        .route("/console/pools", get(pages::pools))
        .route("/console/pools/{name}/refill", post(actions::refill))
        .route("/console/pools/{name}/reclaim", post(actions::reclaim))
        .route("/console/pools/{name}/rotate-key", post(actions::rotate_key))
        .route("/console/queue", get(pages::queue))
        .route("/console/queue/{kind}/{name}/{change}", post(actions::pause))
        .route("/console/dead-letters", get(pages::dead_letters))
        .route("/console/dead-letters/{id}/{change}", post(actions::dead_letter))
        .route("/console/dead-letters/replay/preview", post(actions::replay_preview))
        .route("/console/dead-letters/replay", post(actions::replay))
        .route("/console/keys", get(pages::keys).post(actions::create_key))
        .route("/console/keys/{name}/revoke", post(actions::revoke_key))
        .route("/console/audit", get(pages::audit))
        .layer(middleware::map_response(protect))
}

/// Headers of every console answer: never cached (pages show a new key once, and state that moves),
/// never framed, only this origin's stylesheet and forms, and no referrer leaving the console.
async fn protect(mut response: Response) -> Response {
    let headers = response.headers_mut();
    let fixed = [
        (header::CACHE_CONTROL, "no-store"),
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; \
             base-uri 'none'",
        ),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "same-origin"),
    ];
    for (name, value) in fixed {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

async fn stylesheet() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], templates::STYLESHEET)
}
