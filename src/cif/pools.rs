//! The pools this instance serves, built from configuration and reconciled with `cif_pools`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64};

use sqlx::PgPool;

use crate::code::format::{CodeFormat, PoolCodec};
use crate::config::PoolSettings;
use crate::keys::MasterKey;

/// Why the configured pools cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// A pinned field differs from what the pool was created with.
    #[error(
        "pool {pool:?}: {field} is pinned to {stored} since the pool was created, but this instance has \
         {configured}; keep it, or create a new pool (with a new name) for the new format or key. (A pool \
         that has never generated a code, next_counter = 0, may be dropped with DELETE FROM cif_pools WHERE \
         name = '{pool}' AND next_counter = 0 once no instance runs the old setting.)"
    )]
    Pinned {
        /// Pool name.
        pool: String,
        /// `prefix`, `digits`, `check`, `key_id` or `key` (the key check value: another master key).
        field: &'static str,
        /// Value in the database.
        stored: String,
        /// Value in the configuration.
        configured: String,
    },
    /// A configured pool's codes could collide with those a retired pool already issued.
    #[error(
        "pool {pool:?} (prefix {prefix:?}) overlaps the code space of pool {other:?} (prefix {other_prefix:?}), \
         which is no longer configured but has issued codes"
    )]
    OverlapsRetired {
        /// Configured pool.
        pool: String,
        /// Its prefix.
        prefix: String,
        /// Retired pool.
        other: String,
        /// Its prefix.
        other_prefix: String,
    },
    /// The master key (or key derivation) no longer reproduces codes the pool already generated.
    #[error(
        "pool {0:?}: the configured master key does not reproduce the codes this pool already generated \
         (counter {1} is stored as {2}, the key gives {3}); is CIFPOOL_MASTER_KEY / security.master_key_file \
         the key this database was filled with?"
    )]
    WrongKey(String, i64, String, String),
    /// Invalid format (should have been caught by config validation).
    #[error("pool {0:?}: {1}")]
    Format(String, String),
    /// Database trouble.
    #[error("reconciling pools with the database: {0}")]
    Database(#[from] sqlx::Error),
}

/// One served pool: its settings, database id and codec (format + keyed permutation).
pub struct Pool {
    /// `cif_pools.id`.
    pub id: i16,
    /// Configuration.
    pub settings: PoolSettings,
    /// Encodes counters to codes and back.
    pub codec: PoolCodec,
    /// The key check value of this instance's pool key (see [`crate::keys::PoolKey::check_value`]),
    /// pinned in `cif_pools.key_check`; refill advances the counter only while the row still holds it.
    pub key_check: String,
    /// Whether the last depth check found the pool under its watermark (for crossing warnings).
    pub(crate) low: AtomicBool,
    /// Unix millis of the last post-claim depth check (rate limit).
    pub(crate) last_depth_check_ms: AtomicI64,
    /// Unix millis of the last refill started because a claim found the pool empty (rate limit).
    pub(crate) last_empty_refill_ms: AtomicI64,
    /// Whether this instance has a refill of the pool queued or running (one at a time is enough: a
    /// second would only learn from the advisory lock that the first is busy).
    pub(crate) refilling: AtomicBool,
    /// The shared-statement reservations of this pool, started at the first reservation.
    pub(crate) coalescer: std::sync::OnceLock<crate::cif::coalesce::Coalescer>,
}

impl Pool {
    /// Customer type / pool name.
    pub fn name(&self) -> &str {
        &self.settings.name
    }
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("id", &self.id).field("name", &self.settings.name).finish_non_exhaustive()
    }
}

/// All pools of this instance.
#[derive(Debug, Default)]
pub struct Pools {
    list: Vec<Arc<Pool>>,
    by_name: HashMap<String, Arc<Pool>>,
}

#[derive(sqlx::FromRow)]
struct PoolRow {
    id: i16,
    name: String,
    prefix: String,
    digits: i16,
    check_scheme: String,
    key_id: String,
    key_check: Option<String>,
}

impl Pools {
    /// Creates missing pools, refuses changed pinned fields, and derives each pool's key.
    pub async fn reconcile(
        db: &PgPool,
        configured: &[PoolSettings],
        master: &MasterKey,
    ) -> Result<Pools, ReconcileError> {
        let mut pools = Pools::default();
        for settings in configured {
            let format = settings.format().map_err(|e| ReconcileError::Format(settings.name.clone(), e.to_string()))?;
            let key = master.derive_pool_key(&settings.name, &settings.key_id);
            let key_check = key.check_value();
            let codec = PoolCodec::new(format, &key)
                .map_err(|e| ReconcileError::Format(settings.name.clone(), e.to_string()))?;
            // The first instance to start creates the pool, and its format and key check are pinned from
            // that moment: two instances starting together with different settings cannot both win.
            let created: Option<PoolRow> = sqlx::query_as(
                "INSERT INTO cif_pools (name, prefix, digits, check_scheme, key_id, key_check) \
                 VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (name) DO NOTHING \
                 RETURNING id, name, prefix, digits, check_scheme, key_id, key_check",
            )
            .bind(&settings.name)
            .bind(&settings.prefix)
            .bind(settings.digits as i16)
            .bind(settings.check.name())
            .bind(&settings.key_id)
            .bind(&key_check)
            .fetch_optional(db)
            .await?;
            let mut row = match created {
                Some(row) => row,
                None => sqlx::query_as(
                    "SELECT id, name, prefix, digits, check_scheme, key_id, key_check FROM cif_pools WHERE name = $1",
                )
                .bind(&settings.name)
                .fetch_one(db)
                .await?,
            };
            let differences = [
                ("prefix", row.prefix.clone(), settings.prefix.clone()),
                ("digits", row.digits.to_string(), settings.digits.to_string()),
                ("check", row.check_scheme.clone(), settings.check.name().to_string()),
                ("key_id", row.key_id.clone(), settings.key_id.clone()),
            ];
            if let Some((field, stored, configured)) = differences.into_iter().find(|(_, s, c)| s != c) {
                return Err(ReconcileError::Pinned { pool: settings.name.clone(), field, stored, configured });
            }
            // A stored code is a key check value that costs nothing to keep: a different master key
            // would silently produce different codes and mis-decode existing ones, so refuse to start.
            let sample: Option<(i64, String)> = sqlx::query_as(
                "(SELECT counter, code FROM cif_codes WHERE pool_id = $1 LIMIT 1) \
                 UNION ALL (SELECT counter, code FROM cif_issued WHERE pool_id = $1 LIMIT 1) LIMIT 1",
            )
            .bind(row.id)
            .fetch_optional(db)
            .await?;
            if let Some((counter, stored)) = sample {
                let derived = codec.encode(counter as u64);
                if derived != stored {
                    return Err(ReconcileError::WrongKey(settings.name.clone(), counter, stored, derived));
                }
            }
            if row.key_check.is_none() {
                // A pool created before key checks were stored: pin this instance's, now that its codes
                // (if any) proved the key; of several instances doing this at once, the first one wins.
                row = sqlx::query_as(
                    "UPDATE cif_pools SET key_check = coalesce(key_check, $2), updated_at = now() WHERE id = $1 \
                     RETURNING id, name, prefix, digits, check_scheme, key_id, key_check",
                )
                .bind(row.id)
                .bind(&key_check)
                .fetch_one(db)
                .await?;
            }
            if row.key_check.as_deref() != Some(key_check.as_str()) {
                return Err(ReconcileError::Pinned {
                    pool: settings.name.clone(),
                    field: "key",
                    stored: format!("key check {}", row.key_check.unwrap_or_default()),
                    configured: format!(
                        "key check {key_check} (another master key: is CIFPOOL_MASTER_KEY / \
                         security.master_key_file the key this pool was created with?)"
                    ),
                });
            }
            let pool = Arc::new(Pool {
                id: row.id,
                settings: settings.clone(),
                codec,
                key_check,
                low: AtomicBool::new(false),
                last_depth_check_ms: AtomicI64::new(0),
                last_empty_refill_ms: AtomicI64::new(0),
                refilling: AtomicBool::new(false),
                coalescer: std::sync::OnceLock::new(),
            });
            pools.by_name.insert(settings.name.clone(), pool.clone());
            pools.list.push(pool);
        }
        pools.check_retired_overlaps(db).await?;
        Ok(pools)
    }

    async fn check_retired_overlaps(&self, db: &PgPool) -> Result<(), ReconcileError> {
        let retired: Vec<PoolRow> = sqlx::query_as(
            "SELECT id, name, prefix, digits, check_scheme, key_id, key_check FROM cif_pools \
                 WHERE next_counter > 0 AND NOT (name = ANY($1))",
        )
        .bind(self.list.iter().map(|p| p.settings.name.clone()).collect::<Vec<_>>())
        .fetch_all(db)
        .await?;
        for old in retired {
            let Ok(check) = old.check_scheme.parse() else { continue };
            let Ok(old_format) = CodeFormat::new(old.prefix.clone(), old.digits as u32, check) else { continue };
            for pool in &self.list {
                let format = pool.codec.format();
                if format.total_len() == old_format.total_len()
                    && (format.prefix().starts_with(&old.prefix) || old.prefix.starts_with(format.prefix()))
                {
                    return Err(ReconcileError::OverlapsRetired {
                        pool: pool.settings.name.clone(),
                        prefix: format.prefix().to_string(),
                        other: old.name,
                        other_prefix: old.prefix,
                    });
                }
            }
        }
        Ok(())
    }

    /// The pool serving `customer_type`.
    pub fn get(&self, customer_type: &str) -> Option<&Arc<Pool>> {
        self.by_name.get(customer_type)
    }

    /// The pool whose code space contains `code` (by length and prefix; spaces never overlap).
    pub(crate) fn for_code(&self, code: &str) -> Option<&Arc<Pool>> {
        self.list.iter().find(|p| {
            let format = p.codec.format();
            code.len() == format.total_len() && code.starts_with(format.prefix())
        })
    }

    /// All pools, in configuration order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Pool>> {
        self.list.iter()
    }

    /// Names, for error messages.
    pub fn names(&self) -> Vec<&str> {
        self.list.iter().map(|p| p.name()).collect()
    }
}
