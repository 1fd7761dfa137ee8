//! `[[pools]]`: one CIF pool per customer type, and the rules a set of pools must keep.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConfigError;
use crate::code::check::CheckScheme;
use crate::code::cipher::Cipher;
use crate::code::format::CodeFormat;

/// `[[pools]]`: one customer type's code pool.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSettings {
    /// Customer type served by this pool (`customer_type` in the API), e.g. `individual`.
    pub name: String,
    /// 0–6 leading digits. Pinned when the pool is created.
    #[serde(default)]
    pub prefix: String,
    /// Scrambled digits per code (6–18). Pinned.
    pub digits: u32,
    /// Check-digit scheme. Pinned.
    #[serde(default)]
    pub check: CheckScheme,
    /// Label mixed into the pool's key derivation: the key of the pool's first key epoch (later epochs
    /// are started by `cifpool pools rotate-key` and recorded in the database). Pinned.
    pub key_id: String,
    /// The keyed permutation: `ff1` (NIST SP 800-38G FF1) or `feistel` (the house construction).
    /// Pinned. Unset: a new pool gets `ff1`, an existing pool keeps the cipher it was created with.
    #[serde(default)]
    pub cipher: Option<Cipher>,
    /// Refill when fewer codes than this are available (default 5,000).
    #[serde(default = "defaults::low_watermark")]
    pub low_watermark: u64,
    /// Codes generated per refill transaction (default 2,000).
    #[serde(default = "defaults::batch_size")]
    pub batch_size: u32,
    /// Upper bound of batches per refill run, so an empty pool does not get one giant insert (default 5).
    #[serde(default = "defaults::max_batches_per_run")]
    pub max_batches_per_run: u32,
    /// How long a reservation holds a code before reclaim may take it back (default 5 minutes).
    #[serde(default = "defaults::lease_ttl", with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// Cron (with seconds) of the scheduled refill check (default every 15 s).
    #[serde(default = "defaults::refill_schedule")]
    pub refill_schedule: String,
    /// Cron (with seconds) of the scheduled reclaim of expired holds (default every 30 s).
    #[serde(default = "defaults::reclaim_schedule")]
    pub reclaim_schedule: String,
    /// How far the counter jumps when the pool is fenced (see [`crate::cif::fence`]): more than the
    /// codes the pool could have generated in the history a restore or failover may lose. Default:
    /// 1,000,000 or a twentieth of the domain, whichever is less.
    #[serde(default)]
    pub fence_margin: Option<u64>,
}

/// The operational fields' defaults: a pool needs only its identity (`name`, `prefix`, `digits`,
/// `check`, `key_id`); these suit a pool serving a few reservations a second and are tuned per pool.
mod defaults {
    use std::time::Duration;

    pub fn low_watermark() -> u64 {
        5_000
    }
    pub fn batch_size() -> u32 {
        2_000
    }
    pub fn max_batches_per_run() -> u32 {
        5
    }
    pub fn lease_ttl() -> Duration {
        Duration::from_secs(300)
    }
    pub fn refill_schedule() -> String {
        "*/15 * * * * *".into()
    }
    pub fn reclaim_schedule() -> String {
        "*/30 * * * * *".into()
    }
}

impl PoolSettings {
    /// The counter jump of a fence: `fence_margin`, else the default of [`Self::default_fence_margin`].
    pub fn fence_margin(&self) -> u64 {
        self.fence_margin.unwrap_or_else(|| Self::default_fence_margin(self.digits))
    }

    /// 1,000,000 or a twentieth of a `digits`-digit domain, whichever is less (the fence's SQL applies
    /// the same rule to pools the configuration does not name).
    pub(crate) fn default_fence_margin(digits: u32) -> u64 {
        (10u64.saturating_pow(digits) / 20).min(1_000_000)
    }

    /// The pool's code format.
    pub fn format(&self) -> Result<CodeFormat, crate::code::format::FormatError> {
        CodeFormat::new(self.prefix.clone(), self.digits, self.check)
    }
}

/// `[[pools]]` rules: names, formats, sizes, schedules, and no two pools whose codes could collide.
pub(super) fn validate(pools: &[PoolSettings]) -> Result<(), ConfigError> {
    let invalid =
        |i: usize, field: &str, message: String| ConfigError::Invalid { key: format!("pools[{i}].{field}"), message };
    let mut formats = Vec::with_capacity(pools.len());
    for (i, pool) in pools.iter().enumerate() {
        let name_ok = !pool.name.is_empty()
            && pool.name.len() <= 64
            && pool.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !name_ok {
            return Err(invalid(i, "name", format!("{:?} must be 1-64 characters of a-z, 0-9, _ or -", pool.name)));
        }
        if pools[..i].iter().any(|p| p.name == pool.name) {
            return Err(invalid(i, "name", format!("pool {:?} is defined twice", pool.name)));
        }
        let format = pool.format().map_err(|e| {
            let field = if matches!(e, crate::code::format::FormatError::Digits { .. }) { "digits" } else { "prefix" };
            invalid(i, field, e.to_string())
        })?;
        if pool.key_id.trim().is_empty() || pool.key_id.len() > 64 {
            return Err(invalid(i, "key_id", "must be 1-64 characters".into()));
        }
        if pool.low_watermark == 0 {
            return Err(invalid(i, "low_watermark", "must be at least 1".into()));
        }
        if !(1..=100_000).contains(&pool.batch_size) {
            return Err(invalid(i, "batch_size", "must be between 1 and 100000".into()));
        }
        if !(1..=10_000).contains(&pool.max_batches_per_run) {
            return Err(invalid(i, "max_batches_per_run", "must be between 1 and 10000".into()));
        }
        if let Some(margin) = pool.fence_margin
            && !(1..=10u64.saturating_pow(pool.digits) / 2).contains(&margin)
        {
            return Err(invalid(i, "fence_margin", "must be between 1 and half the pool's domain".into()));
        }
        if pool.lease_ttl < Duration::from_secs(1) {
            return Err(invalid(i, "lease_ttl", "must be at least 1s".into()));
        }
        for (field, schedule) in
            [("refill_schedule", &pool.refill_schedule), ("reclaim_schedule", &pool.reclaim_schedule)]
        {
            crate::schedule::validate_cron(schedule).map_err(|e| invalid(i, field, e))?;
        }
        // Two pools whose codes have the same length and one prefix starting the other could
        // produce the same string: refuse, since a code must identify its pool.
        if let Some((j, other)) = pools[..i].iter().enumerate().find(|(j, other)| {
            let o: &CodeFormat = &formats[*j];
            o.total_len() == format.total_len()
                && (other.prefix.starts_with(&pool.prefix) || pool.prefix.starts_with(&other.prefix))
        }) {
            return Err(invalid(
                i,
                "prefix",
                format!(
                    "code space of pool {:?} (prefix {:?}, {} characters) overlaps pool {:?} (pools[{j}], prefix {:?}): \
                     give them prefixes where neither starts the other, or different lengths",
                    pool.name,
                    pool.prefix,
                    format.total_len(),
                    other.name,
                    other.prefix
                ),
            ));
        }
        formats.push(format);
    }
    Ok(())
}
