//! Key rotation within a pool: a new key epoch (see [`crate::cif::epochs`]) whose key, derived from
//! the master key with a new `key_id`, encodes the pool's counters from its next one on.
//!
//! The codes already generated and still available were made under the old key, so whoever knows
//! that key could tell which numbers come next: they are discarded (they were never handed out, and
//! their counters are never generated again). Codes held at that moment are finished by their
//! holders as usual; one released later goes back to the pool and may still be issued.

use serde::Serialize;
use sqlx::PgPool;

use crate::audit::{self, Actor, Event};
use crate::cif::Pool;

/// Most key epochs a pool may have besides its configured key. A rotation is an incident response, not
/// a routine; and every counter of the current epoch is checked against each earlier epoch (one
/// decryption each), so refill slows down as epochs add up.
pub const MAX_ROTATIONS: i16 = 16;

/// Why a rotation was refused.
#[derive(Debug, thiserror::Error)]
pub enum RotateError {
    /// The new key id is empty, too long, or has spaces or control characters.
    #[error("key_id must be 1 to 64 characters without spaces: {0:?}")]
    InvalidKeyId(String),
    /// The pool already used this key id (as its configured key or an earlier epoch's).
    #[error("pool {pool:?} already used key_id {key_id:?}: a new epoch needs a key id of its own")]
    KeyIdUsed {
        /// The pool.
        pool: String,
        /// The key id asked for.
        key_id: String,
    },
    /// The pool already has [`MAX_ROTATIONS`] key epochs besides its configured key.
    #[error("pool {0:?} has had its key rotated {MAX_ROTATIONS} times, the most a pool may; create a new pool")]
    TooManyRotations(String),
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// What a rotation did.
#[derive(Debug, Clone, Serialize)]
pub struct KeyRotated {
    /// The pool (customer type).
    pub pool: String,
    /// The new epoch's number (the configured key is epoch 0).
    pub epoch: i16,
    /// The key id the new key was derived with.
    pub key_id: String,
    /// Check value of the new key (tells which master key and key id made it, reveals nothing).
    pub key_check: String,
    /// The first counter encoded under the new key.
    pub first_counter: i64,
    /// Available codes made under earlier keys, discarded.
    pub available_discarded: u64,
}

/// Starts a new key epoch for `pool` under `key_id`, recorded as `actor`'s, and has this instance
/// encode under it at once (the others learn of it at their next refill or at a code they cannot find).
pub(crate) async fn rotate(db: &PgPool, pool: &Pool, key_id: &str, actor: &Actor) -> Result<KeyRotated, RotateError> {
    if key_id.is_empty() || key_id.len() > 64 || key_id.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(RotateError::InvalidKeyId(key_id.to_string()));
    }
    let key_check = pool.key_check_for(key_id);
    let mut conn = db.acquire().await?;
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    // The pool's row lock orders this with refill batches: one that commits before sees the old epoch
    // and its codes are discarded below if still available; one after sees the new epoch.
    let (configured, current, next_counter): (String, i16, i64) =
        sqlx::query_as("SELECT key_id, key_epoch, next_counter FROM cif_pools WHERE id = $1 FOR UPDATE")
            .bind(pool.id)
            .fetch_one(&mut *tx)
            .await?;
    let used: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT FROM cif_key_epochs WHERE pool_id = $1 AND key_id = $2)")
            .bind(pool.id)
            .bind(key_id)
            .fetch_one(&mut *tx)
            .await?;
    if used || configured == key_id {
        return Err(RotateError::KeyIdUsed { pool: pool.name().to_string(), key_id: key_id.to_string() });
    }
    if current >= MAX_ROTATIONS {
        return Err(RotateError::TooManyRotations(pool.name().to_string()));
    }
    let epoch = current + 1;
    sqlx::query(
        "INSERT INTO cif_key_epochs (pool_id, epoch, key_id, key_check, first_counter, started_by) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(pool.id)
    .bind(epoch)
    .bind(key_id)
    .bind(&key_check)
    .bind(next_counter)
    .bind(&actor.name)
    .execute(&mut *tx)
    .await?;
    sqlx::query("UPDATE cif_pools SET key_epoch = $2, updated_at = now() WHERE id = $1")
        .bind(pool.id)
        .bind(epoch)
        .execute(&mut *tx)
        .await?;
    let discarded = sqlx::query("DELETE FROM cif_codes WHERE pool_id = $1 AND state = 'available'")
        .bind(pool.id)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    let rotated = KeyRotated {
        pool: pool.name().to_string(),
        epoch,
        key_id: key_id.to_string(),
        key_check,
        first_counter: next_counter,
        available_discarded: discarded,
    };
    let detail = serde_json::json!({
        "epoch": epoch, "key_id": key_id, "key_check": rotated.key_check, "first_counter": next_counter,
        "available_discarded": discarded,
    });
    let event = Event {
        action: audit::action::POOL_KEY_ROTATED,
        pool: Some(pool.name()),
        detail: Some(detail),
        ..Event::default()
    };
    audit::record(&mut tx, actor, &event).await?;
    tx.commit().await?;
    pool.reload_keys(&mut conn).await?;
    tracing::warn!(pool = pool.name(), epoch, key_id, first_counter = next_counter, discarded, actor = %actor.name,
        "new key epoch started");
    Ok(rotated)
}
