//! The connection a pool's lone reservations keep between them.
//!
//! A reservation that finds no other claim of its pool running claims by itself (see
//! [`crate::cif::coalesce`]). Taking a pooled connection for that one statement and handing it back
//! costs a round trip of its own: sqlx checks every connection handed back to its pool with one, not
//! configurable. At one request at a time that check ran beside the next request's statement and made
//! each claim ~0.2 ms slower (the claim through the pool against the same claim on one connection).
//! So a lone claim keeps its connection here for the next one; a connection unused for [`LINGER`] goes
//! back to the pool (a task looks every [`LINGER`], so within twice that of its last claim), and one
//! kept for [`KEEP_AT_MOST`] is handed back and a fresh one taken ([`Lent::reuse_or_take`], the rule
//! the flushers' connections follow too), so a steady trickle of requests neither holds a connection
//! for ever nor skips the pool's health checks for long.

use std::sync::{Arc, Weak};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio::sync::Notify;
use tokio::time::Instant;

/// How long a kept connection (a lone claim's, or a flusher's) waits for the next claim before it goes
/// back to the pool.
pub const LINGER: Duration = Duration::from_millis(5);

/// Longest one connection is kept across claims, counted from when it was taken from the pool.
pub const KEEP_AT_MOST: Duration = Duration::from_secs(1);

/// At most one connection, kept between lone claims of one pool; lone claims run one at a time, so
/// it has one user at a time.
pub struct KeptConnection {
    slot: std::sync::Mutex<Option<Kept>>,
    /// Wakes the task that hands an unused connection back.
    put: Arc<Notify>,
}

struct Kept {
    lent: Lent,
    /// When its last claim ended.
    used: Instant,
}

/// A connection kept across claims (or fresh from the pool), for the next claim.
pub struct Lent {
    /// The connection.
    pub conn: PoolConnection<Postgres>,
    /// When it was taken from the pool.
    taken: Instant,
}

impl Lent {
    /// `kept` if it was taken from the pool less than [`KEEP_AT_MOST`] ago, else (handing it back) a
    /// connection from `db`.
    pub(crate) async fn reuse_or_take(kept: Option<Lent>, db: &PgPool) -> Result<Lent, sqlx::Error> {
        match kept.filter(|k| k.taken.elapsed() < KEEP_AT_MOST) {
            Some(kept) => Ok(kept),
            None => Ok(Lent { conn: db.acquire().await?, taken: Instant::now() }),
        }
    }
}

impl KeptConnection {
    /// An empty keeper, with its task that hands an unused connection back (it ends when the keeper
    /// is dropped).
    pub fn start() -> Arc<KeptConnection> {
        let kept = Arc::new(KeptConnection { slot: std::sync::Mutex::new(None), put: Arc::new(Notify::new()) });
        tokio::spawn(hand_back_unused(Arc::downgrade(&kept), kept.put.clone()));
        kept
    }

    /// The kept connection, else one from `db` (see [`Lent::reuse_or_take`]).
    pub async fn lend(&self, db: &PgPool) -> Result<Lent, sqlx::Error> {
        let kept = self.slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        Lent::reuse_or_take(kept.map(|k| k.lent), db).await
    }

    /// Keeps `lent` for the next lone claim. Only after a claim that succeeded: a connection whose
    /// statement failed goes back to the pool, which checks it.
    pub fn keep(&self, lent: Lent) {
        let previous = self.slot.lock().unwrap_or_else(|e| e.into_inner()).replace(Kept { lent, used: Instant::now() });
        drop(previous);
        self.put.notify_one();
    }

    /// Hands the kept connection back if no claim has used it for `idle`; whether none is kept now.
    fn hand_back_if_unused_for(&self, idle: Duration) -> bool {
        let mut slot = self.slot.lock().unwrap_or_else(|e| e.into_inner());
        if slot.as_ref().is_some_and(|k| k.used.elapsed() < idle) {
            return false;
        }
        // Dropped once the lock is let go: handing it back spawns the pool's check.
        let handed_back = slot.take();
        drop(slot);
        drop(handed_back);
        true
    }
}

impl Drop for KeptConnection {
    fn drop(&mut self) {
        // Lets the task see that the keeper is gone and end.
        self.put.notify_one();
    }
}

/// Whenever a connection is kept, checks every [`LINGER`] whether it is still used, and hands it
/// back to the pool once it is not.
async fn hand_back_unused(kept: Weak<KeptConnection>, put: Arc<Notify>) {
    loop {
        put.notified().await;
        loop {
            tokio::time::sleep(LINGER).await;
            let Some(kept) = kept.upgrade() else { return };
            if kept.hand_back_if_unused_for(LINGER) {
                break;
            }
        }
    }
}
