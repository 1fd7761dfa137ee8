//! Console sessions: an admin signs in once with an API key and the browser then holds only a random
//! session token in an `HttpOnly; SameSite=Strict` cookie. Postgres keeps the token's SHA-256 digest
//! (a database dump cannot be replayed as a session) and the name of the key that signed in.
//!
//! A session is checked at every request, against the database rather than a cache: it must be
//! unexpired, used within the idle timeout, and its key must still be active and hold `admin` (revoking
//! the key ends its console sessions at once). Each state-changing form carries a CSRF token derived
//! from the session token, which a page of another origin can neither read nor compute.

use std::time::Duration;

use axum::http::HeaderMap;
use axum::http::header;
use rand::TryRngCore;
use rand::rngs::OsRng;
use secrecy::ExposeSecret;
use sha2::{Digest, Sha256};
use sqlx::{PgConnection, PgPool};
use subtle::ConstantTimeEq;

use crate::audit::BOOTSTRAP;
use crate::auth::api_key::{self, KeyDigest};
use crate::config::{ConsoleSettings, SecureCookie, Settings};

/// Name of the session cookie.
pub(crate) const COOKIE: &str = "cifpool_console";
/// Path the cookie is sent to: the console's routes and nothing else.
pub(crate) const COOKIE_PATH: &str = "/console";

/// Who signed in: an API key by name, or the bootstrap admin token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Credential {
    /// An API key holding the `admin` scope.
    Key(String),
    /// `security.admin_token`; the digest pins the token in force at sign-in.
    Bootstrap(KeyDigest),
}

impl Credential {
    /// The actor name audit rows carry for this session's actions (the same as the API's).
    pub(crate) fn actor_name(&self) -> &str {
        match self {
            Credential::Key(name) => name,
            Credential::Bootstrap(_) => BOOTSTRAP,
        }
    }
}

/// A live session, as found for one request.
#[derive(Debug, Clone)]
pub struct Session {
    /// Digest of the cookie's token: the row's key.
    pub digest: KeyDigest,
    /// Who acts.
    pub actor_name: String,
    /// The token every form of this session must send back.
    pub csrf: String,
    /// The outcome of the previous action, shown once.
    pub notice: Option<String>,
}

/// A fresh session token: 32 bytes from the operating system's CSPRNG, in hex.
pub(crate) fn new_token() -> String {
    let mut bytes = [0u8; 32];
    OsRng.try_fill_bytes(&mut bytes).expect("operating system random source failed while opening a console session");
    hex::encode(bytes)
}

/// The CSRF token of the session whose cookie holds `token`.
pub(crate) fn csrf_for(token: &str) -> String {
    hex::encode(Sha256::new().chain_update(b"cifpool console csrf\0").chain_update(token.as_bytes()).finalize())
}

/// Whether `presented` is the CSRF token of `session` (compared in constant time).
pub(crate) fn csrf_matches(session: &Session, presented: &str) -> bool {
    presented.len() == session.csrf.len() && bool::from(presented.as_bytes().ct_eq(session.csrf.as_bytes()))
}

/// The digest of the configured bootstrap admin token, if one is set.
pub(crate) fn bootstrap_digest(settings: &Settings) -> Option<KeyDigest> {
    settings.security.admin_token.as_ref().map(|t| api_key::digest(t.expose_secret()))
}

/// The session token the request's cookie carries, if any.
pub(crate) fn token_from(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.to_string())
        .filter(|v| v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Whether the request reached the proxy in front of cifpool over HTTPS.
fn came_over_tls(headers: &HeaderMap) -> bool {
    let forwarded_proto = headers.get("x-forwarded-proto").and_then(|v| v.to_str().ok());
    let forwarded = headers.get(header::FORWARDED).and_then(|v| v.to_str().ok());
    forwarded_proto.is_some_and(|p| p.split(',').next().is_some_and(|p| p.trim().eq_ignore_ascii_case("https")))
        || forwarded.is_some_and(|f| f.to_ascii_lowercase().contains("proto=https"))
}

/// The `Set-Cookie` value that stores `token` for `max_age` (zero and an empty token: forget it).
pub fn cookie(token: &str, max_age: Duration, settings: &ConsoleSettings, headers: &HeaderMap) -> String {
    let secure = match settings.secure_cookie {
        SecureCookie::Always => true,
        SecureCookie::Never => false,
        SecureCookie::Auto => came_over_tls(headers),
    };
    format!(
        "{COOKIE}={token}; Path={COOKIE_PATH}; Max-Age={}; HttpOnly; SameSite=Strict{}",
        max_age.as_secs(),
        if secure { "; Secure" } else { "" }
    )
}

/// Opens a session for `credential`; returns the token for the cookie. Expired sessions of anyone are
/// deleted on the way, so the table holds live sessions only.
pub async fn open(conn: &mut PgConnection, credential: &Credential, ttl: Duration) -> Result<String, sqlx::Error> {
    sqlx::query("DELETE FROM console_sessions WHERE expires_at < now()").execute(&mut *conn).await?;
    let token = new_token();
    let (key_name, bootstrap) = match credential {
        Credential::Key(name) => (Some(name.as_str()), None),
        Credential::Bootstrap(digest) => (None, Some(digest.as_slice())),
    };
    sqlx::query(
        "INSERT INTO console_sessions (digest, key_name, bootstrap_digest, expires_at) \
         VALUES ($1, $2, $3, now() + make_interval(secs => $4))",
    )
    .bind(api_key::digest(&token).as_slice())
    .bind(key_name)
    .bind(bootstrap)
    .bind(ttl.as_secs_f64())
    .execute(conn)
    .await?;
    Ok(token)
}

/// The live session of `token`, marked as seen now and with its notice taken (shown once). `None`
/// when there is none: unknown, expired, idle too long, or its credential no longer holds `admin`
/// (a revoked key, a rotated bootstrap token).
pub async fn resume(
    db: &PgPool,
    token: &str,
    idle_timeout: Duration,
    bootstrap: Option<KeyDigest>,
) -> Result<Option<Session>, sqlx::Error> {
    let digest = api_key::digest(token);
    let row: Option<(Option<String>, Option<String>)> = sqlx::query_as(
        "UPDATE console_sessions s SET last_seen_at = now(), notice = NULL \
           FROM (SELECT digest, notice FROM console_sessions WHERE digest = $1 FOR UPDATE) AS before \
          WHERE s.digest = before.digest \
            AND s.expires_at > now() \
            AND s.last_seen_at > now() - make_interval(secs => $2) \
            AND (CASE WHEN s.key_name IS NULL THEN s.bootstrap_digest = $3 \
                      ELSE EXISTS (SELECT 1 FROM api_keys k WHERE k.name = s.key_name \
                                      AND k.revoked_at IS NULL AND 'admin' = ANY (k.scopes)) END) \
        RETURNING s.key_name, before.notice",
    )
    .bind(digest.as_slice())
    .bind(idle_timeout.as_secs_f64())
    .bind(bootstrap.as_ref().map(|d| d.as_slice()))
    .fetch_optional(db)
    .await?;
    Ok(row.map(|(key_name, notice)| Session {
        digest,
        actor_name: key_name.unwrap_or_else(|| BOOTSTRAP.to_string()),
        csrf: csrf_for(token),
        notice,
    }))
}

/// Leaves `notice` for the session's next page.
pub(crate) async fn leave_notice(db: &PgPool, session: &Session, notice: &str) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE console_sessions SET notice = $2 WHERE digest = $1")
        .bind(session.digest.as_slice())
        .bind(notice)
        .execute(db)
        .await?;
    Ok(())
}

/// Ends the session (sign-out).
pub async fn close(conn: &mut PgConnection, session: &Session) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM console_sessions WHERE digest = $1").bind(session.digest.as_slice()).execute(conn).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cookie_is_http_only_strict_and_secure_behind_tls() {
        let mut settings = crate::config::Settings::load(None).unwrap().console;
        let mut headers = HeaderMap::new();
        let plain = cookie("ab", Duration::from_secs(60), &settings, &headers);
        assert_eq!(plain, "cifpool_console=ab; Path=/console; Max-Age=60; HttpOnly; SameSite=Strict");
        headers.insert("x-forwarded-proto", "https".parse().unwrap());
        assert!(cookie("ab", Duration::from_secs(60), &settings, &headers).ends_with("; Secure"));
        settings.secure_cookie = SecureCookie::Never;
        assert!(!cookie("ab", Duration::from_secs(60), &settings, &headers).contains("Secure"));
    }

    #[test]
    fn only_a_well_formed_session_cookie_is_read() {
        let token = new_token();
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, format!("other=1; {COOKIE}={token}").parse().unwrap());
        assert_eq!(token_from(&headers), Some(token.clone()));
        headers.insert(header::COOKIE, format!("{COOKIE}=not-hex").parse().unwrap());
        assert_eq!(token_from(&headers), None);
        assert_ne!(csrf_for(&token), csrf_for(&new_token()));
    }
}
