//! Authentication and authorization of a request: [`Authorized<S>`] is the extractor every `/v1` and
//! `/admin` handler takes first, and `S` names the one scope the route needs. It answers 401 (with
//! `WWW-Authenticate: Bearer`) for a missing, unknown or revoked key, and 403 naming the missing scope,
//! before the body is read; 429 for a client address out of failed attempts (before any look-up) and
//! for a key over its request rate (see [`crate::http::limits`]).

use std::marker::PhantomData;

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;

use crate::audit::Actor;
use crate::auth::authenticator::{AuthError, LookUp};
use crate::auth::{Caller, Scope};
use crate::http::error::ApiError;
use crate::http::limits::ClientAddr;
use crate::state::AppState;

/// A route's required scope, as a type (so each handler's signature says what it needs).
pub trait Needs: Send + Sync + 'static {
    /// The scope.
    const SCOPE: Scope;
}

/// The scope markers.
pub mod needs {
    use super::{Needs, Scope};

    macro_rules! marker {
        ($name:ident, $scope:expr, $doc:literal) => {
            #[doc = $doc]
            pub struct $name;
            impl Needs for $name {
                const SCOPE: Scope = $scope;
            }
        };
    }
    marker!(CifReserve, Scope::CifReserve, "`cif:reserve`: reserve, confirm, release, extend.");
    marker!(CifRead, Scope::CifRead, "`cif:read`: look up a code, read pool depth.");
    marker!(NotifySend, Scope::NotifySend, "`notify:send`: enqueue notifications.");
    marker!(NotifyRead, Scope::NotifyRead, "`notify:read`: read a notification.");
    marker!(Admin, Scope::Admin, "`admin`: everything under `/admin`.");
}

/// An authenticated caller holding the scope `S`, and the actor its changes are recorded under.
pub(crate) struct Authorized<S> {
    /// Who is calling.
    pub caller: Caller,
    /// The caller's name with this request's id, for audit rows.
    pub actor: Actor,
    _needs: PhantomData<S>,
}

impl<S: Needs> FromRequestParts<AppState> for Authorized<S> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let secret = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim);
        let client = parts.extensions.get::<ClientAddr>().and_then(|c| c.0);
        // An address over its failed-attempt budget is still served for the keys this pod knows, so
        // one guesser does not lock out the real callers that share its address.
        let throttled = state.limits.check_address(client).err();
        let look_up = if throttled.is_some() { LookUp::KnownKeysOnly } else { LookUp::Any };
        let presented = secret.is_some_and(|s| !s.is_empty());
        let caller = state.auth.authenticate_with(secret, look_up).await.map_err(|e| match e {
            AuthError::LookUpRefused => ApiError::TooManyRequests {
                detail: "too many failed authentications from this address (security.failed_auth_per_minute); \
                         retry after the Retry-After delay"
                    .into(),
                retry_after_secs: throttled.map_or(1, |wait| wait.as_secs().max(1)),
            },
            AuthError::Unauthenticated => {
                // Only a credential that was presented and refused is a guess; a request without one
                // costs no look-up and proves nothing.
                if presented {
                    state.limits.note_failure(client);
                }
                ApiError::Unauthorized
            }
            AuthError::Database(e) => ApiError::Database(e),
        })?;
        if let Err(wait) = state.limits.check_key(&caller.name) {
            return Err(ApiError::TooManyRequests {
                detail: "this API key is over its request rate on this instance \
                         (security.requests_per_second_per_key); retry after the Retry-After delay"
                    .into(),
                retry_after_secs: wait.as_secs().max(1),
            });
        }
        if let Some(slot) = parts.extensions.get::<crate::http::observe::CallerName>() {
            slot.set(caller.name.clone());
        }
        if !caller.has(S::SCOPE) {
            return Err(ApiError::Forbidden(format!("this API key lacks the {} scope", S::SCOPE)));
        }
        let actor = crate::http::observe::actor_of_request(&parts.extensions, caller.name.to_string());
        Ok(Authorized { caller, actor, _needs: PhantomData })
    }
}
