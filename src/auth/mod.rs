//! Identity: API keys with scopes and tenants, and who a request acts as.
//!
//! - [`scope`]: the permissions a key may hold.
//! - [`api_key`]: the secret's format and digest; creating, listing and revoking keys.
//! - [`authenticator`]: bearer secret → [`Caller`], cached per pod for a few seconds.
//!
//! Every `/v1` and `/admin` route names the one scope it needs (see [`crate::http::auth`]); the
//! bootstrap `security.admin_token` authenticates as `bootstrap` with the `admin` scope.

pub(crate) mod api_key;
pub(crate) mod authenticator;
pub(crate) mod scope;

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use anyhow::Context;
use sqlx::PgPool;

pub use authenticator::{Authenticator, Caller};
pub use scope::Scope;

use crate::audit::Actor;
use crate::config::Settings;

/// Where the development key is written: beside the embedded cluster's data directory.
pub(crate) fn dev_api_key_path(settings: &Settings) -> PathBuf {
    crate::config::master_key::dev_key_path(settings).with_file_name("dev-api-key")
}

/// Local development only (the embedded database): when the database holds no active key, creates
/// one with every scope and writes it to [`dev_api_key_path`] (mode 0600). Returns the file when a
/// key was made. Never called with an external database.
pub async fn ensure_dev_key(db: &PgPool, settings: &Settings) -> anyhow::Result<Option<PathBuf>> {
    anyhow::ensure!(settings.database.url.is_none(), "a development key is only made for the embedded database");
    if api_key::any_active(db).await? {
        return Ok(None);
    }
    let scopes: Vec<String> = Scope::ALL.iter().map(|s| s.as_str().to_string()).collect();
    let mut new = api_key::NewKey { name: "dev".into(), scopes, tenants: None };
    let created = match api_key::create(db, &Actor::system(), &new).await {
        Err(api_key::KeyError::Duplicate(_)) => {
            new.name = format!("dev-{}", chrono::Utc::now().timestamp());
            api_key::create(db, &Actor::system(), &new).await
        }
        other => other,
    }
    .context("creating the development API key")?;
    let path = dev_api_key_path(settings);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("writing {}", path.display()))?;
    writeln!(file, "{}", created.key)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", path.display()))?;
    // An existing file keeps its mode on open: make sure it is the owner's alone.
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .with_context(|| format!("restricting {}", path.display()))?;
    Ok(Some(path))
}
