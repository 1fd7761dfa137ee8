//! Turning a bearer secret into a [`Caller`], with a per-pod cache.
//!
//! A look-up is a SHA-256 and a cache probe; the database is asked at most once per [`CACHE_TTL`] per
//! key and pod, which is also the longest a revoked key keeps working on a pod that has seen it.
//! Secrets that name no key are remembered apart, in a cache of their own: a flood of made-up secrets
//! evicts only other made-up secrets, never a real key, so it cannot turn every real request into a
//! database look-up. Both caches are bounded and evict one entry at a time.
//!
//! A client address that has used up its failed attempts is served only for keys this pod already
//! knows ([`LookUp::KnownKeysOnly`]): guesses from it cost no look-up, while the real callers behind
//! the same address (pods behind one egress NAT, a proxy without `trusted_proxies`) keep working.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use secrecy::{ExposeSecret, SecretString};
use sqlx::PgPool;
use subtle::ConstantTimeEq;
use tokio_util::task::TaskTracker;

use crate::audit::Actor;
use crate::auth::api_key::{self, ApiKey, CreatedKey, KeyDigest, KeyError, NewKey};
use crate::auth::scope::{Scope, ScopeSet};

/// How long a pod trusts what it read about a key.
pub(crate) const CACHE_TTL: Duration = Duration::from_secs(5);
/// How often a pod records that a key was used.
pub(crate) const TOUCH_INTERVAL: Duration = Duration::from_secs(60);
/// Keys each cache holds (the one of real keys, the one of secrets that name none).
const MAX_ENTRIES: usize = 10_000;
use crate::audit::BOOTSTRAP;

/// Who a request acts as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The key's name (`bootstrap` for the admin token): the actor of audit rows.
    pub name: Arc<str>,
    /// What it may do.
    pub scopes: ScopeSet,
    /// The only tenants it may act for; `None`: any.
    pub tenants: Option<Arc<[String]>>,
}

impl Caller {
    /// Whether the caller holds `scope`.
    pub fn has(&self, scope: Scope) -> bool {
        self.scopes.contains(scope)
    }

    /// Whether the caller may enqueue for, and read the jobs of, `tenant`.
    pub(crate) fn may_act_for(&self, tenant: &str) -> bool {
        self.tenants.as_ref().is_none_or(|ts| ts.iter().any(|t| t == tenant))
    }

    /// The tenant a job names implicitly: the caller's, when it is bound to exactly one.
    pub(crate) fn only_tenant(&self) -> Option<&str> {
        match self.tenants.as_deref() {
            Some([only]) => Some(only),
            _ => None,
        }
    }
}

/// Why a request is not authenticated (401).
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// No usable `Authorization: Bearer` header, or a secret no key has, or a revoked key.
    #[error("missing, unknown or revoked API key")]
    Unauthenticated,
    /// A secret this pod does not know as a key, when only known keys may be served (429).
    #[error("only keys this instance already knows are served to this address")]
    LookUpRefused,
    /// The key could not be looked up.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Which secrets may cost a database look-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LookUp {
    /// Any secret of the key format this pod has no fresh answer for.
    Any,
    /// Only a secret this pod has already read as a key (its cached entry may have gone stale, and
    /// is read again): a guess from an address over its failed-attempt budget costs nothing.
    KnownKeysOnly,
}

#[derive(Clone)]
struct Cached {
    caller: Option<Caller>,
    fetched: Instant,
}

/// Authenticates bearer secrets against `api_keys` and the bootstrap admin token.
pub struct Authenticator {
    db: PgPool,
    bootstrap: Option<SecretString>,
    /// Digests that name a key (revoked ones too).
    keys: quick_cache::sync::Cache<KeyDigest, Cached>,
    /// Digests that name no key.
    strangers: quick_cache::sync::Cache<KeyDigest, Instant>,
    touched: Mutex<HashMap<Arc<str>, Instant>>,
    /// Where the last-use writes run (shutdown waits for them before the database closes).
    upkeep: TaskTracker,
    enforce: bool,
}

impl Authenticator {
    /// Checks keys in `db`; `bootstrap` is `security.admin_token` (an `admin`-scoped caller); the
    /// writes of a key's last use run on `upkeep`, which shutdown waits for before closing `db`.
    pub fn new(db: PgPool, bootstrap: Option<SecretString>, upkeep: TaskTracker) -> Authenticator {
        Authenticator::with_capacity(db, bootstrap, upkeep, MAX_ENTRIES)
    }

    /// Like [`Authenticator::new`] with caches of `entries` each (tests fill them quickly).
    pub fn with_capacity(
        db: PgPool,
        bootstrap: Option<SecretString>,
        upkeep: TaskTracker,
        entries: usize,
    ) -> Authenticator {
        Authenticator {
            db,
            upkeep,
            bootstrap,
            keys: quick_cache::sync::Cache::new(entries),
            strangers: quick_cache::sync::Cache::new(entries),
            touched: Mutex::default(),
            enforce: true,
        }
    }

    /// Lets every request through as an all-scopes caller named `unauthenticated`. Only for measuring
    /// what authentication costs (`cifpool-tools bench reserve`); no configuration reaches it.
    pub(crate) fn disabled(db: PgPool) -> Authenticator {
        Authenticator { enforce: false, ..Authenticator::new(db, None, TaskTracker::new()) }
    }

    /// The caller `secret` (the bearer token as presented) authenticates, if any.
    pub async fn authenticate(&self, secret: Option<&str>) -> Result<Caller, AuthError> {
        self.authenticate_with(secret, LookUp::Any).await
    }

    /// [`Authenticator::authenticate`], looking up in the database only what `look_up` allows.
    pub(crate) async fn authenticate_with(&self, secret: Option<&str>, look_up: LookUp) -> Result<Caller, AuthError> {
        if !self.enforce {
            return Ok(Caller {
                name: "unauthenticated".into(),
                scopes: Scope::ALL.into_iter().collect(),
                tenants: None,
            });
        }
        let secret = secret.filter(|s| !s.is_empty()).ok_or(AuthError::Unauthenticated)?;
        if let Some(token) = &self.bootstrap {
            // Fixed-size digests compared in constant time hide the token's content and length.
            let given = api_key::digest(secret);
            if bool::from(given.ct_eq(&api_key::digest(token.expose_secret()))) {
                return Ok(Caller {
                    name: BOOTSTRAP.into(),
                    scopes: [Scope::Admin].into_iter().collect(),
                    tenants: None,
                });
            }
        }
        if !secret.starts_with(api_key::PREFIX) {
            return Err(AuthError::Unauthenticated);
        }
        let digest = api_key::digest(secret);
        let caller = match self.cached(&digest) {
            Some(hit) => hit,
            None if look_up == LookUp::KnownKeysOnly && self.keys.peek(&digest).is_none() => {
                return Err(AuthError::LookUpRefused);
            }
            None => self.fetch(digest).await?,
        };
        let caller = caller.ok_or(AuthError::Unauthenticated)?;
        self.touch(&caller);
        Ok(caller)
    }

    fn cached(&self, digest: &KeyDigest) -> Option<Option<Caller>> {
        if let Some(hit) = self.keys.get(digest).filter(|c| c.fetched.elapsed() < CACHE_TTL) {
            return Some(hit.caller);
        }
        self.strangers.get(digest).filter(|at| at.elapsed() < CACHE_TTL).map(|_| None)
    }

    async fn fetch(&self, digest: KeyDigest) -> Result<Option<Caller>, sqlx::Error> {
        let key = api_key::find(&self.db, &digest).await?;
        let key_found = key.is_some();
        let caller = key.filter(|k| k.revoked_at.is_none()).map(|k| Caller {
            name: k.name.into(),
            scopes: k.scopes.set(),
            tenants: k.tenants.map(Into::into),
        });
        metrics::counter!("cifpool_auth_key_lookups_total", "found" => if key_found { "yes" } else { "no" })
            .increment(1);
        if key_found {
            self.keys.insert(digest, Cached { caller: caller.clone(), fetched: Instant::now() });
        } else {
            self.strangers.insert(digest, Instant::now());
        }
        Ok(caller)
    }

    /// Records the key's use in the background, at most once per [`TOUCH_INTERVAL`] on this pod.
    fn touch(&self, caller: &Caller) {
        {
            let mut touched = self.touched.lock().expect("touch lock");
            match touched.get(&caller.name) {
                Some(at) if at.elapsed() < TOUCH_INTERVAL => return,
                _ => {
                    touched.insert(caller.name.clone(), Instant::now());
                }
            }
        }
        let (db, name) = (self.db.clone(), caller.name.clone());
        self.upkeep.spawn(async move {
            if let Err(e) = api_key::touch(&db, &name).await {
                tracing::debug!(key = %name, error = %e, "could not record the key's last use");
            }
        });
    }
}

/// The keys themselves, as an admin manages them (the API and the console).
impl Authenticator {
    /// Creates a key for `new`'s scopes and tenants; the answer carries its secret, this once.
    pub async fn create_key(&self, actor: &Actor, new: &NewKey) -> Result<CreatedKey, KeyError> {
        api_key::create(&self.db, actor, new).await
    }

    /// Every key, revoked ones too, without secrets.
    pub async fn keys(&self) -> Result<Vec<ApiKey>, sqlx::Error> {
        api_key::list(&self.db).await
    }

    /// Revokes key `name`; pods stop accepting it within the cache's lifetime.
    pub async fn revoke_key(&self, actor: &Actor, name: &str) -> Result<(), KeyError> {
        api_key::revoke(&self.db, actor, name).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_bound_callers_act_only_for_their_tenants() {
        let any = Caller { name: "svc".into(), scopes: ScopeSet::default(), tenants: None };
        assert!(any.may_act_for("bank") && any.only_tenant().is_none());
        let one = Caller { tenants: Some(vec!["bank".to_string()].into()), ..any.clone() };
        assert!(one.may_act_for("bank") && !one.may_act_for("shop"));
        assert_eq!(one.only_tenant(), Some("bank"));
        let two = Caller { tenants: Some(vec!["a".to_string(), "b".to_string()].into()), ..any };
        assert!(two.only_tenant().is_none() && two.may_act_for("b"));
    }
}
