//! Where the master key comes from: the environment, a key file, or (with the embedded database
//! only) a development key generated once beside its data directory.

use std::path::{Path, PathBuf};

use super::Settings;
use crate::keys::MasterKey;

/// Finds the master key: `CIFPOOL_MASTER_KEY` (hex), then `security.master_key_file`; with the embedded
/// database only (a dev set-up), a key generated once into the data directory's parent, which
/// `may_generate = false` (offline tools) only reads. Never logged.
pub(crate) fn resolve_master_key(settings: &Settings, may_generate: bool) -> anyhow::Result<MasterKey> {
    use anyhow::Context;
    if let Ok(hex) = std::env::var("CIFPOOL_MASTER_KEY") {
        return MasterKey::from_hex(&hex).context("CIFPOOL_MASTER_KEY");
    }
    if let Some(path) = &settings.security.master_key_file {
        return MasterKey::load_file(path).with_context(|| format!("security.master_key_file ({})", path.display()));
    }
    if settings.database.url.is_some() {
        anyhow::bail!(
            "no master key: set CIFPOOL_MASTER_KEY (64 hex digits, e.g. from `cifpool keygen`) or \
             security.master_key_file; a generated dev key is only used with the embedded database"
        );
    }
    let path = dev_key_path(settings);
    if !may_generate {
        return MasterKey::load_file(&path)
            .with_context(|| format!("no master key configured and no dev key at {}", path.display()));
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let (key, generated) =
        MasterKey::load_or_generate_dev(&path).with_context(|| format!("dev master key {}", path.display()))?;
    if generated {
        tracing::warn!(
            path = %path.display(),
            "GENERATED A NEW DEV MASTER KEY. Every code this instance issues depends on it: losing it makes \
             issued codes unverifiable and changing it re-maps every pool. Use CIFPOOL_MASTER_KEY or \
             security.master_key_file for anything but local development, and back the key up."
        );
    } else {
        tracing::warn!(path = %path.display(), "using the generated dev master key (not for production)");
    }
    Ok(key)
}

/// Where the dev key lives: beside the embedded cluster's data directory.
pub(crate) fn dev_key_path(settings: &Settings) -> PathBuf {
    let dir = &settings.database.data_dir;
    dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).join("master.key")
}
