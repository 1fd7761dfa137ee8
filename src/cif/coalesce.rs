//! Reservations of one pool that arrive together share one claim statement, as a group commit: a
//! flusher takes every reservation that queued while its previous statement ran (up to
//! [`MOST_PER_STATEMENT`]), claims that many codes at once ([`store::reserve_many`]), and hands each
//! request its own code, token and audit row. Under load that turns N statements into one; alone, a
//! request waits for nobody (the flusher takes what is there and goes).
//!
//! Reservations with an idempotency key keep their own transaction ([`store::reserve`]): the key's
//! insert must commit or roll back with its claim. If a shared statement fails, each of its requests
//! is told to retry alone, so one bad moment is never many requests' error.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};
use tokio::sync::{Mutex, mpsc, oneshot};

use crate::cif::Pool;
use crate::cif::store::{self, Request, Reservation};

/// Most reservations one statement claims for (the statement's cost grows with it; 64 covers the
/// request concurrency one pod sees).
pub(crate) const MOST_PER_STATEMENT: usize = store::MOST_PER_SHARED_CLAIM;

/// Shared statements of one pool in flight at once on this instance: while one runs, the next batch
/// gathers and another flusher can already send it. Four rather than two kept the p99 of a fixed
/// 1,000 reservations/s under 10 ms (a request waits less for a free flusher) at the same throughput.
const FLUSHERS: usize = 4;

/// What a shared claim gave one request.
#[derive(Debug)]
pub enum Shared {
    /// Its own new hold.
    Reserved(Reservation),
    /// The pool had no code left for it.
    Empty,
    /// The shared statement failed (or the flushers are gone): reserve alone.
    RetryAlone,
}

struct Waiting {
    request: Request,
    reply: oneshot::Sender<Shared>,
}

/// The queue of a pool's waiting reservations and its flushers (which end when the pool is dropped).
pub(crate) struct Coalescer {
    queue: mpsc::UnboundedSender<Waiting>,
    /// Claim statements of this pool running now (shared or alone).
    busy: Arc<AtomicUsize>,
}

impl Coalescer {
    /// Starts the flushers of `pool` on the current runtime. They are the pool's own helpers rather
    /// than supervised tasks: they end when the pool is dropped, and should they fail, a request
    /// hears [`Shared::RetryAlone`] and claims by itself.
    pub fn start(db: PgPool, pool: Weak<Pool>) -> Coalescer {
        let (queue, waiting) = mpsc::unbounded_channel();
        let waiting = Arc::new(Mutex::new(waiting));
        let busy = Arc::new(AtomicUsize::new(0));
        for _ in 0..FLUSHERS {
            tokio::spawn(flush(db.clone(), pool.clone(), waiting.clone(), busy.clone()));
        }
        Coalescer { queue, busy }
    }

    /// A claim alone, if no claim statement of the pool is running: then a request has nobody to share
    /// with and claims by itself, without the hop to a flusher. The slot is the pool's until the
    /// returned guard is dropped, which also happens when the request is cancelled mid-claim (a client
    /// that went away, a request timeout): a slot kept by a cancelled request would send every later
    /// request through the flushers.
    pub fn alone(&self) -> Option<Alone<'_>> {
        // `then`, not `then_some`: an `Alone` built and dropped on the way to `None` would give back a
        // slot it never took.
        self.busy.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok().then(|| Alone(&self.busy))
    }

    /// Reserves through the next shared statement.
    pub async fn reserve(&self, request: Request) -> Shared {
        let (reply, answer) = oneshot::channel();
        if self.queue.send(Waiting { request, reply }).is_err() {
            return Shared::RetryAlone;
        }
        answer.await.unwrap_or(Shared::RetryAlone)
    }
}

/// A claim statement running alone (see [`Coalescer::alone`]); gives its slot back when dropped.
pub(crate) struct Alone<'a>(&'a AtomicUsize);

impl Drop for Alone<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Longest a flusher keeps one connection through back-to-back statements before handing it back
/// to the pool (whose lifetime and health checks see a connection only when it comes back).
const KEEP_CONNECTION_AT_MOST: Duration = Duration::from_secs(1);

/// How long a flusher that has just claimed waits for more requests with its connection kept.
const LINGER: Duration = Duration::from_millis(5);

/// One flusher: takes what is waiting (holding the queue only while it gathers), claims for all of
/// it, answers each. Ends when the pool (and with it the queue's sender) is gone.
///
/// Under load it keeps its connection from one statement to the next (up to
/// [`KEEP_CONNECTION_AT_MOST`]): every connection handed back to the pool costs a round trip to the
/// server (the pool checks it on return), one per statement of a few reservations. It hands the
/// connection back when no request came within [`LINGER`], so an idle pool holds none.
async fn flush(
    db: PgPool,
    pool: Weak<Pool>,
    waiting: Arc<Mutex<mpsc::UnboundedReceiver<Waiting>>>,
    busy: Arc<AtomicUsize>,
) {
    let mut batch: Vec<Waiting> = Vec::with_capacity(MOST_PER_STATEMENT);
    let mut kept: Option<(PoolConnection<Postgres>, Instant)> = None;
    loop {
        let more = if kept.is_some() {
            // Under load the next requests come within a moment; past that, the connection would
            // only sit idle outside the pool.
            match tokio::time::timeout(LINGER, gather(&waiting, &mut batch)).await {
                Ok(more) => more,
                Err(_) => {
                    kept = None;
                    gather(&waiting, &mut batch).await
                }
            }
        } else {
            gather(&waiting, &mut batch).await
        };
        if !more {
            return;
        }
        let Some(pool) = pool.upgrade() else { return };
        // A request whose client went away no longer waits: claiming for it would strand a code
        // until reclaim.
        batch.retain(|w| !w.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        let requests: Vec<Request> = batch.iter().map(|w| w.request.clone()).collect();
        metrics::histogram!("cifpool_reservation_batch_size", "pool" => pool.name().to_string())
            .record(requests.len() as f64);
        busy.fetch_add(1, Ordering::AcqRel);
        let claimed = async {
            let (mut conn, since) = match kept.take().filter(|(_, since)| since.elapsed() < KEEP_CONNECTION_AT_MOST) {
                Some(kept) => kept,
                None => (db.acquire().await?, Instant::now()),
            };
            let held = store::reserve_many(&mut conn, &pool, &requests).await?;
            Ok::<_, sqlx::Error>((held, conn, since))
        }
        .await;
        busy.fetch_sub(1, Ordering::AcqRel);
        match claimed {
            Ok((held, conn, since)) => {
                // Kept only after a statement that ended well: one that failed may have left the
                // connection in any state, and dropping it lets the pool check or close it.
                kept = Some((conn, since));
                for (w, reservation) in batch.drain(..).zip(held) {
                    let answer = reservation.map_or(Shared::Empty, Shared::Reserved);
                    if let Err(Shared::Reserved(r)) = w.reply.send(answer) {
                        // The client left while the statement ran: the hold lapses at its lease.
                        tracing::debug!(cif = %r.cif, "reservation's requester left; reclaim returns it");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(pool = pool.name(), error = %e, n = batch.len(), "shared claim failed; each retries alone");
                for w in batch.drain(..) {
                    let _ = w.reply.send(Shared::RetryAlone);
                }
            }
        }
    }
}

/// Waits for requests and takes what is waiting into `batch` (holding the queue only while it does);
/// false once the queue is gone with its pool. Cancel-safe: a request is taken only when it is
/// added to the batch.
async fn gather(waiting: &Mutex<mpsc::UnboundedReceiver<Waiting>>, batch: &mut Vec<Waiting>) -> bool {
    let mut queue = waiting.lock().await;
    match queue.recv().await {
        Some(first) => batch.push(first),
        None => return false,
    }
    while batch.len() < MOST_PER_STATEMENT {
        match queue.try_recv() {
            Ok(next) => batch.push(next),
            Err(_) => break,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coalescer() -> Coalescer {
        let (queue, _waiting) = mpsc::unbounded_channel();
        Coalescer { queue, busy: Arc::new(AtomicUsize::new(0)) }
    }

    #[test]
    fn one_claim_alone_at_a_time_and_its_slot_comes_back_when_dropped() {
        let coalescer = coalescer();
        let first = coalescer.alone().expect("nothing runs yet");
        assert!(coalescer.alone().is_none(), "a second request shares instead");
        drop(first);
        assert!(coalescer.alone().is_some());
    }

    #[tokio::test]
    async fn a_cancelled_claim_gives_its_slot_back() {
        let coalescer = coalescer();
        let claim = async {
            let _alone = coalescer.alone().expect("nothing runs yet");
            std::future::pending::<()>().await;
        };
        // The request is dropped mid-claim, as when its client goes away or it times out.
        assert!(tokio::time::timeout(std::time::Duration::from_millis(10), claim).await.is_err());
        assert!(coalescer.alone().is_some(), "the slot was given back");
    }
}
