//! The pools this instance serves, built from configuration and reconciled with `cif_pools`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64};
use std::sync::{Arc, RwLock};

use sqlx::{PgConnection, PgPool};

use crate::cif::epochs::{KeyEpoch, KeyEpochs};
use crate::code::cipher::Cipher;
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
        /// `prefix`, `digits`, `check`, `cipher`, `key_id` or `key` (the key check value: another master key).
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
    /// Where this instance's reservations start scanning (see [`crate::cif::cursor`]).
    pub(crate) cursor: crate::cif::cursor::ReserveCursor,
    /// The shared-statement reservations of this pool, started at the first reservation.
    pub(crate) coalescer: std::sync::OnceLock<crate::cif::coalesce::Coalescer>,
    /// The pool's keys over time, as this instance last read them (see [`crate::cif::epochs`]).
    keys: RwLock<Arc<KeyEpochs>>,
    /// Derives the keys of epochs started after this instance read them.
    master: MasterKey,
}

impl Pool {
    /// Customer type / pool name.
    pub fn name(&self) -> &str {
        &self.settings.name
    }

    /// The pool's key epochs as this instance knows them: the last one encodes new counters.
    pub fn keys(&self) -> Arc<KeyEpochs> {
        self.keys.read().expect("keys lock").clone()
    }

    /// The check value of the key this pool derives for `key_id` (stored with a new key epoch).
    pub(crate) fn key_check_for(&self, key_id: &str) -> String {
        self.master.derive_pool_key(&self.settings.name, key_id).check_value()
    }

    /// Reads the pool's key epochs again when the database has started one this instance does not
    /// know (another instance rotated the key); whether anything changed.
    pub(crate) async fn reload_keys(&self, conn: &mut PgConnection) -> Result<bool, sqlx::Error> {
        let stored: i16 = sqlx::query_scalar("SELECT key_epoch FROM cif_pools WHERE id = $1")
            .bind(self.id)
            .fetch_one(&mut *conn)
            .await?;
        if stored == self.keys().current().number {
            return Ok(false);
        }
        let epoch0 = self.keys().all()[0].clone();
        match load_epochs(conn, self.id, &self.settings.name, epoch0, &self.master).await {
            Ok(keys) => {
                tracing::info!(pool = self.name(), epoch = keys.current().number, key_id = %keys.current().key_id,
                    "learned of a new key epoch");
                *self.keys.write().expect("keys lock") = Arc::new(keys);
                Ok(true)
            }
            Err(ReconcileError::Database(e)) => Err(e),
            Err(e) => {
                // Only an instance with another master key could have started it, and such an
                // instance is refused at start; keep issuing under what is known.
                tracing::error!(pool = self.name(), error = %e, "a new key epoch cannot be derived here");
                Ok(false)
            }
        }
    }
}

/// Epoch 0 (`epoch0`, the configured key) and every epoch recorded for pool `pool_id`, each key
/// derived from `master` and checked against the check value stored with it.
async fn load_epochs(
    conn: &mut PgConnection,
    pool_id: i16,
    pool_name: &str,
    epoch0: KeyEpoch,
    master: &MasterKey,
) -> Result<KeyEpochs, ReconcileError> {
    let rows: Vec<(i16, String, String, i64)> = sqlx::query_as(
        "SELECT epoch, key_id, key_check, first_counter FROM cif_key_epochs WHERE pool_id = $1 ORDER BY epoch",
    )
    .bind(pool_id)
    .fetch_all(&mut *conn)
    .await?;
    let (format, cipher) = (epoch0.codec.format().clone(), epoch0.codec.permutation().cipher());
    let mut epochs = vec![epoch0];
    for (number, key_id, key_check, first_counter) in rows {
        let key = master.derive_pool_key(pool_name, &key_id);
        if key.check_value() != key_check {
            return Err(ReconcileError::Pinned {
                pool: pool_name.to_string(),
                field: "key",
                stored: format!("key check {key_check} for key epoch {number} ({key_id})"),
                configured: format!("key check {} (another master key?)", key.check_value()),
            });
        }
        let codec = PoolCodec::with_cipher(format.clone(), cipher, &key, pool_name)
            .map_err(|e| ReconcileError::Format(pool_name.to_string(), e.to_string()))?;
        epochs.push(KeyEpoch { number, key_id, first_counter: first_counter as u64, codec });
    }
    Ok(KeyEpochs::new(epochs))
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
    cipher: String,
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
            // The first instance to start creates the pool, and its format, cipher and key check are
            // pinned from that moment: two instances starting together with different settings cannot
            // both win. A new pool without a configured cipher gets FF1.
            let created: Option<PoolRow> = sqlx::query_as(
                "INSERT INTO cif_pools (name, prefix, digits, check_scheme, cipher, key_id, key_check) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (name) DO NOTHING \
                 RETURNING id, name, prefix, digits, check_scheme, cipher, key_id, key_check",
            )
            .bind(&settings.name)
            .bind(&settings.prefix)
            .bind(settings.digits as i16)
            .bind(settings.check.name())
            .bind(settings.cipher.unwrap_or(Cipher::Ff1).name())
            .bind(&settings.key_id)
            .bind(&key_check)
            .fetch_optional(db)
            .await?;
            let mut row = match created {
                Some(row) => row,
                None => {
                    sqlx::query_as(
                        "SELECT id, name, prefix, digits, check_scheme, cipher, key_id, key_check FROM cif_pools \
                     WHERE name = $1",
                    )
                    .bind(&settings.name)
                    .fetch_one(db)
                    .await?
                }
            };
            let configured_cipher = settings.cipher.map_or_else(|| row.cipher.clone(), |c| c.name().to_string());
            let differences = [
                ("prefix", row.prefix.clone(), settings.prefix.clone()),
                ("digits", row.digits.to_string(), settings.digits.to_string()),
                ("check", row.check_scheme.clone(), settings.check.name().to_string()),
                ("cipher", row.cipher.clone(), configured_cipher),
                ("key_id", row.key_id.clone(), settings.key_id.clone()),
            ];
            if let Some((field, stored, configured)) = differences.into_iter().find(|(_, s, c)| s != c) {
                return Err(ReconcileError::Pinned { pool: settings.name.clone(), field, stored, configured });
            }
            let cipher: Cipher =
                row.cipher.parse().map_err(|e: String| ReconcileError::Format(settings.name.clone(), e))?;
            let codec = PoolCodec::with_cipher(format, cipher, &key, &settings.name)
                .map_err(|e| ReconcileError::Format(settings.name.clone(), e.to_string()))?;
            // A stored code is a key check value that costs nothing to keep: a different master key
            // would silently produce different codes and mis-decode existing ones, so refuse to start.
            let sample: Option<(i64, String)> = sqlx::query_as(
                "(SELECT counter, code FROM cif_codes WHERE pool_id = $1 LIMIT 1) \
                 UNION ALL (SELECT counter, code FROM cif_issued WHERE pool_id = $1 LIMIT 1) LIMIT 1",
            )
            .bind(row.id)
            .fetch_optional(db)
            .await?;
            let epoch0 =
                KeyEpoch { number: 0, key_id: settings.key_id.clone(), first_counter: 0, codec: codec.clone() };
            let keys = load_epochs(&mut *db.acquire().await?, row.id, &settings.name, epoch0, master).await?;
            if let Some((counter, stored)) = sample {
                let derived = keys.encode(counter as u64).unwrap_or_default();
                if derived != stored {
                    return Err(ReconcileError::WrongKey(settings.name.clone(), counter, stored, derived));
                }
            }
            if row.key_check.is_none() {
                // A pool created before key checks were stored: pin this instance's, now that its codes
                // (if any) proved the key; of several instances doing this at once, the first one wins.
                row = sqlx::query_as(
                    "UPDATE cif_pools SET key_check = coalesce(key_check, $2), updated_at = now() WHERE id = $1 \
                     RETURNING id, name, prefix, digits, check_scheme, cipher, key_id, key_check",
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
                keys: RwLock::new(Arc::new(keys)),
                master: master.clone(),
                key_check,
                low: AtomicBool::new(false),
                last_depth_check_ms: AtomicI64::new(0),
                last_empty_refill_ms: AtomicI64::new(0),
                refilling: AtomicBool::new(false),
                cursor: Default::default(),
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
            "SELECT id, name, prefix, digits, check_scheme, cipher, key_id, key_check FROM cif_pools \
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
