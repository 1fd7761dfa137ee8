//! API keys: the secret's format and digest, and creating, listing, finding and revoking them.
//!
//! A key is `cfp_` followed by 64 hex digits (256 random bits); the prefix lets secret scanners flag a
//! leaked one. Postgres keeps only its SHA-256 digest: a database dump cannot be replayed as a key.
//! A key is shown once, in the answer that creates it.

use chrono::{DateTime, Utc};
use rand::TryRngCore;
use rand::rngs::OsRng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::PgPool;

use crate::audit::{self, Actor, Event};
use crate::auth::scope::{Scope, ScopeSet};

/// What every key starts with.
pub const PREFIX: &str = "cfp_";
/// Longest key name.
pub(crate) const MAX_NAME: usize = 64;
/// Most tenants one key may be bound to.
pub(crate) const MAX_TENANTS: usize = 1000;

/// SHA-256 of a presented secret: what the database stores and the cache is keyed by.
pub(crate) type KeyDigest = [u8; 32];

/// The digest of `secret`.
pub fn digest(secret: &str) -> KeyDigest {
    Sha256::digest(secret.as_bytes()).into()
}

/// A fresh secret: the prefix and 32 bytes from the operating system's CSPRNG, in hex.
pub fn generate_secret() -> String {
    let mut bytes = [0u8; 32];
    OsRng.try_fill_bytes(&mut bytes).expect("operating system random source failed while generating an API key");
    format!("{PREFIX}{}", hex::encode(bytes))
}

/// A key as the service knows it (never the secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct ApiKey {
    /// Unique, forever (a revoked key's name is not reused): the actor of its audit rows.
    pub name: String,
    /// What it may do.
    #[sqlx(try_from = "Vec<String>")]
    pub scopes: Scopes,
    /// The only tenants it may enqueue for and read jobs of; `None`: any (a trusted service).
    pub tenants: Option<Vec<String>>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// The actor that created it.
    pub created_by: String,
    /// Last time a pod saw it used (updated at most once a minute per pod).
    pub last_used_at: Option<DateTime<Utc>>,
    /// When it was revoked; a revoked key authenticates nothing.
    pub revoked_at: Option<DateTime<Utc>>,
}

/// The scopes of a key, as stored (`text[]`) and shown (names).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Scopes(pub Vec<Scope>);

impl TryFrom<Vec<String>> for Scopes {
    type Error = String;

    fn try_from(names: Vec<String>) -> Result<Self, Self::Error> {
        names
            .iter()
            .map(|n| Scope::parse(n).ok_or_else(|| format!("unknown scope {n:?}")))
            .collect::<Result<_, _>>()
            .map(Scopes)
    }
}

impl Scopes {
    /// As a bit set, for checks on the request path.
    pub fn set(&self) -> ScopeSet {
        self.0.iter().copied().collect()
    }
}

/// `POST /admin/keys` and `cifpool keys create`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewKey {
    /// 1 to 64 characters of `A-Z a-z 0-9 . _ : -`.
    pub name: String,
    /// Scope names, at least one.
    pub scopes: Vec<String>,
    /// Tenants the key is bound to; absent for a trusted service that names any tenant.
    #[serde(default)]
    pub tenants: Option<Vec<String>>,
}

/// Why a key could not be created or revoked.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The request breaks a rule (422).
    #[error("{0}")]
    Invalid(String),
    /// A key of that name exists, or existed and was revoked (409).
    #[error("a key named {0:?} already exists (names are never reused, even after revocation)")]
    Duplicate(String),
    /// No key of that name (404).
    #[error("no key named {0:?}")]
    NotFound(String),
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl NewKey {
    /// Checks the name, scopes and tenants; returns the parsed scopes (sorted, no repeats).
    pub fn validate(&self) -> Result<Vec<Scope>, KeyError> {
        let name_ok = (1..=MAX_NAME).contains(&self.name.len())
            && self.name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
        if !name_ok {
            return Err(KeyError::Invalid(format!(
                "name must be 1 to {MAX_NAME} characters of A-Z, a-z, 0-9, '.', '_', ':' or '-'"
            )));
        }
        if crate::audit::is_reserved_actor(&self.name) {
            return Err(KeyError::Invalid(format!(
                "name {:?} is reserved: the audit trail uses system, anonymous, bootstrap and cli:… itself",
                self.name
            )));
        }
        if self.scopes.is_empty() {
            return Err(KeyError::Invalid("scopes must name at least one scope".into()));
        }
        let mut scopes = Vec::new();
        for s in &self.scopes {
            let scope = Scope::parse(s).ok_or_else(|| {
                let known: Vec<&str> = Scope::ALL.iter().map(|s| s.as_str()).collect();
                KeyError::Invalid(format!("unknown scope {s:?}; known scopes: {}", known.join(", ")))
            })?;
            scopes.push(scope);
        }
        scopes.sort_unstable();
        scopes.dedup();
        if let Some(tenants) = &self.tenants {
            if tenants.is_empty() || tenants.len() > MAX_TENANTS {
                return Err(KeyError::Invalid(format!(
                    "tenants, when given, must list 1 to {MAX_TENANTS} tenants (leave it out for any tenant)"
                )));
            }
            for t in tenants {
                crate::validate::text("tenants[]", t, crate::validate::MAX_LABEL).map_err(KeyError::Invalid)?;
            }
        }
        Ok(scopes)
    }
}

/// A created key: its record and, this once, its secret.
#[derive(Debug, Clone, Serialize)]
pub struct CreatedKey {
    /// The key's name.
    pub name: String,
    /// The secret to put in `Authorization: Bearer …`; not retrievable later.
    pub key: String,
    /// Its scopes.
    pub scopes: Vec<Scope>,
    /// Its tenants, if bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenants: Option<Vec<String>>,
}

/// Creates a key for `new` by `actor`, with its audit row in the same transaction.
pub async fn create(db: &PgPool, actor: &Actor, new: &NewKey) -> Result<CreatedKey, KeyError> {
    let scopes = new.validate()?;
    let mut tenants = new.tenants.clone();
    if let Some(t) = &mut tenants {
        t.sort_unstable();
        t.dedup();
    }
    let secret = generate_secret();
    let names: Vec<&str> = scopes.iter().map(|s| s.as_str()).collect();
    let mut tx = db.begin().await?;
    let inserted = sqlx::query(
        "INSERT INTO api_keys (name, digest, scopes, tenants, created_by) VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (name) DO NOTHING",
    )
    .bind(&new.name)
    .bind(digest(&secret).as_slice())
    .bind(&names)
    .bind(&tenants)
    .bind(&actor.name)
    .execute(&mut *tx)
    .await?;
    if inserted.rows_affected() == 0 {
        return Err(KeyError::Duplicate(new.name.clone()));
    }
    let detail = serde_json::json!({ "name": new.name, "scopes": names, "tenants": tenants });
    audit::record(
        &mut tx,
        actor,
        &Event { action: audit::action::KEY_CREATED, detail: Some(detail), ..Event::default() },
    )
    .await?;
    tx.commit().await?;
    Ok(CreatedKey { name: new.name.clone(), key: secret, scopes, tenants })
}

const COLUMNS: &str = "name, scopes, tenants, created_at, created_by, last_used_at, revoked_at";

/// Every key, revoked ones included, by name.
pub async fn list(db: &PgPool) -> Result<Vec<ApiKey>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT {COLUMNS} FROM api_keys ORDER BY name"))).fetch_all(db).await
}

/// The key whose secret has `digest`, revoked or not.
pub async fn find(db: &PgPool, digest: &KeyDigest) -> Result<Option<ApiKey>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT {COLUMNS} FROM api_keys WHERE digest = $1")))
        .bind(digest.as_slice())
        .fetch_optional(db)
        .await
}

/// Whether any key that is not revoked exists (the development key is made only when none does).
pub(crate) async fn any_active(db: &PgPool) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM api_keys WHERE revoked_at IS NULL)").fetch_one(db).await
}

/// Revokes the key `name` (again is fine: the first revocation time stays), with its audit row.
/// Every pod stops accepting it within its cache lifetime.
pub async fn revoke(db: &PgPool, actor: &Actor, name: &str) -> Result<(), KeyError> {
    let mut tx = db.begin().await?;
    let found = sqlx::query("UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE name = $1")
        .bind(name)
        .execute(&mut *tx)
        .await?;
    if found.rows_affected() == 0 {
        return Err(KeyError::NotFound(name.to_string()));
    }
    let detail = serde_json::json!({ "name": name });
    audit::record(
        &mut tx,
        actor,
        &Event { action: audit::action::KEY_REVOKED, detail: Some(detail), ..Event::default() },
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Notes that `name` was used now (callers rate-limit this to once a minute).
pub(crate) async fn touch(db: &PgPool, name: &str) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE api_keys SET last_used_at = now() WHERE name = $1").bind(name).execute(db).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_prefixed_random_and_digested() {
        let a = generate_secret();
        let b = generate_secret();
        assert!(a.starts_with(PREFIX) && a.len() == PREFIX.len() + 64, "{a}");
        assert_ne!(a, b);
        assert_eq!(digest(&a), digest(&a.clone()));
        assert_ne!(digest(&a), digest(&b));
    }

    #[test]
    fn new_keys_are_checked() {
        let key = |name: &str, scopes: &[&str], tenants: Option<Vec<&str>>| NewKey {
            name: name.into(),
            scopes: scopes.iter().map(|s| s.to_string()).collect(),
            tenants: tenants.map(|t| t.into_iter().map(String::from).collect()),
        };
        assert_eq!(
            key("onboarding-1", &["cif:read", "cif:reserve", "cif:read"], None).validate().unwrap(),
            [Scope::CifReserve, Scope::CifRead]
        );
        assert!(key("", &["admin"], None).validate().is_err());
        assert!(key(&"x".repeat(65), &["admin"], None).validate().is_err());
        assert!(key("has space", &["admin"], None).validate().is_err());
        assert!(key("k", &[], None).validate().is_err());
        assert!(key("k", &["cif:write"], None).validate().is_err());
        for reserved in ["system", "bootstrap", "System", "BOOTSTRAP", "cli:root", "CLI:ops"] {
            let error = key(reserved, &["admin"], None).validate().unwrap_err().to_string();
            assert!(error.contains("reserved"), "{reserved}: {error}");
        }
        assert!(key("systems", &["admin"], None).validate().is_ok(), "only the names themselves");
        assert!(key("k", &["notify:send"], Some(vec![])).validate().is_err());
        assert!(key("k", &["notify:send"], Some(vec!["bank\n"])).validate().is_err());
        assert!(key("k", &["notify:send"], Some(vec!["bank"])).validate().is_ok());
    }
}
