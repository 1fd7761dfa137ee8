//! Reservations of one pool that arrive together share one claim statement, as a group commit: a
//! flusher takes every reservation that queued while its previous statement ran (up to
//! [`MOST_PER_STATEMENT`]), claims that many codes at once ([`store::reserve_many`]), and hands each
//! request its own code, token and audit row. Under load that turns N statements into one, and while
//! two statements already run a flusher holds its batch a moment to let it grow ([`ENOUGH_RUNNING`]);
//! alone, a request waits for nobody (it claims by itself, on the connection the previous lone claim
//! kept: [`crate::cif::kept`], or the flusher takes what is there and goes).
//!
//! Reservations with an idempotency key keep their own transaction ([`store::reserve`]): the key's
//! insert must commit or roll back with its claim. If a shared statement fails, each of its requests
//! is told to retry alone, so one bad moment is never many requests' error.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{Mutex, Notify, mpsc, oneshot};

use crate::cif::Pool;
use crate::cif::kept::{KeptConnection, LINGER, Lent};
use crate::cif::store::{self, Request, Reservation};

/// Most reservations one statement claims for (the statement's cost grows with it; 64 covers the
/// request concurrency one pod sees).
pub(crate) const MOST_PER_STATEMENT: usize = store::MOST_PER_SHARED_CLAIM;

/// Shared statements of one pool in flight at once on this instance: while one runs, the next batch
/// gathers and another flusher can already send it. Four rather than two kept the p99 of a fixed
/// 1,000 reservations/s under 10 ms (a request waits less for a free flusher).
const FLUSHERS: usize = 4;

/// Claim statements of the pool running at which a flusher holds its batch back (taking more
/// requests as they come) until one of them ends or [`HOLD_AT_MOST`] has passed. Without the hold,
/// every free flusher sent what had just queued: 16 clients' requests went out 2.3 to a statement,
/// each statement paying its fixed cost on the server; held, 4.3 to a statement, and the server spent
/// 22-33 % less CPU per reservation.
const ENOUGH_RUNNING: usize = 2;

/// Longest a flusher holds its first request back while [`ENOUGH_RUNNING`] statements run: the
/// flushers beyond the first two still bound a request's wait when a statement is slow.
const HOLD_AT_MOST: Duration = Duration::from_millis(1);

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
    running: Arc<Running>,
    /// The connection lone claims keep between them.
    kept: Arc<KeptConnection>,
}

/// Claim statements of a pool running now on this instance (shared or alone), and a signal each
/// time one ends.
#[derive(Default)]
struct Running {
    count: AtomicUsize,
    ended: Notify,
}

impl Running {
    fn now(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    fn start(&self) {
        self.count.fetch_add(1, Ordering::AcqRel);
    }

    /// Starts one only if none runs (a claim alone); whether it did.
    fn start_if_none(&self) -> bool {
        self.count.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    fn end(&self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
        self.ended.notify_waiters();
    }
}

impl Coalescer {
    /// Starts the flushers of `pool` on the current runtime. They are the pool's own helpers rather
    /// than supervised tasks: they end when the pool is dropped, and should they fail, a request
    /// hears [`Shared::RetryAlone`] and claims by itself.
    pub fn start(db: PgPool, pool: Weak<Pool>) -> Coalescer {
        let (queue, waiting) = mpsc::unbounded_channel();
        let waiting = Arc::new(Mutex::new(waiting));
        let running = Arc::new(Running::default());
        for _ in 0..FLUSHERS {
            tokio::spawn(flush(db.clone(), pool.clone(), waiting.clone(), running.clone()));
        }
        Coalescer { queue, running, kept: KeptConnection::start() }
    }

    /// A claim alone, if no claim statement of the pool is running: then a request has nobody to share
    /// with and claims by itself, without the hop to a flusher. The slot is the pool's until the
    /// returned guard is dropped, which also happens when the request is cancelled mid-claim (a client
    /// that went away, a request timeout): a slot kept by a cancelled request would send every later
    /// request through the flushers.
    pub fn alone(&self) -> Option<Alone<'_>> {
        // `then`, not `then_some`: an `Alone` built and dropped on the way to `None` would give back a
        // slot it never took.
        self.running.start_if_none().then(|| Alone { running: &self.running, kept: &self.kept })
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
pub(crate) struct Alone<'a> {
    running: &'a Running,
    kept: &'a KeptConnection,
}

impl Alone<'_> {
    /// The connection the previous lone claim kept, else one from `db`.
    pub async fn connection(&self, db: &PgPool) -> Result<Lent, sqlx::Error> {
        self.kept.lend(db).await
    }

    /// Keeps `lent` for the next lone claim (see [`KeptConnection`]).
    pub fn keep(&self, lent: Lent) {
        self.kept.keep(lent);
    }
}

impl Drop for Alone<'_> {
    fn drop(&mut self) {
        self.running.end();
    }
}

/// One flusher: takes what is waiting (holding the queue only while it gathers), claims for all of
/// it, answers each. Ends when the pool (and with it the queue's sender) is gone.
///
/// Under load it keeps its connection from one statement to the next (up to
/// [`crate::cif::kept::KEEP_AT_MOST`]): every connection handed back to the pool costs a round trip to the
/// server (the pool checks it on return), one per statement of a few reservations. It hands the
/// connection back when no request came within [`LINGER`], so an idle pool holds none.
async fn flush(
    db: PgPool,
    pool: Weak<Pool>,
    waiting: Arc<Mutex<mpsc::UnboundedReceiver<Waiting>>>,
    running: Arc<Running>,
) {
    let mut batch: Vec<Waiting> = Vec::with_capacity(MOST_PER_STATEMENT);
    let mut kept: Option<Lent> = None;
    loop {
        // Under load the next requests come within a moment; past that, the connection would only
        // sit idle outside the pool.
        match gather(&waiting, &mut batch, &running, kept.is_some().then_some(LINGER)).await {
            Gathered::Closed => return,
            Gathered::Idle => {
                kept = None;
                continue;
            }
            Gathered::Ready => {}
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
        running.start();
        let claimed = async {
            let mut lent = Lent::reuse_or_take(kept.take(), &db).await?;
            let held = store::reserve_many(&mut lent.conn, &pool, &requests).await?;
            Ok::<_, sqlx::Error>((held, lent))
        }
        .await;
        running.end();
        match claimed {
            Ok((held, lent)) => {
                // Kept only after a statement that ended well: one that failed may have left the
                // connection in any state, and dropping it lets the pool check or close it.
                kept = Some(lent);
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

/// What [`gather`] ended with.
#[derive(Debug, PartialEq, Eq)]
enum Gathered {
    /// Requests are in the batch: claim for them.
    Ready,
    /// None came within the linger; the batch is empty.
    Idle,
    /// The queue is gone with its pool.
    Closed,
}

/// Waits for a first request (at most `linger`, if given) and takes what is waiting into `batch`,
/// holding the queue while it does. While [`ENOUGH_RUNNING`] claim statements run, it goes on taking
/// requests as they come until one of those statements ends, the batch is full or the first request
/// has waited [`HOLD_AT_MOST`]. Cancel-safe: a request is taken only when it is added to the batch.
async fn gather(
    waiting: &Mutex<mpsc::UnboundedReceiver<Waiting>>,
    batch: &mut Vec<Waiting>,
    running: &Running,
    linger: Option<Duration>,
) -> Gathered {
    let first = async {
        let mut queue = waiting.lock().await;
        let first = queue.recv().await;
        (queue, first)
    };
    let (mut queue, first) = match linger {
        Some(linger) => match tokio::time::timeout(linger, first).await {
            Ok(got) => got,
            Err(_) => return Gathered::Idle,
        },
        None => first.await,
    };
    let Some(first) = first else { return Gathered::Closed };
    batch.push(first);
    let hold_until = tokio::time::Instant::now() + HOLD_AT_MOST;
    loop {
        while batch.len() < MOST_PER_STATEMENT {
            match queue.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        if batch.len() >= MOST_PER_STATEMENT {
            return Gathered::Ready;
        }
        let ended = running.ended.notified();
        tokio::pin!(ended);
        // Registered before the count is read, so a statement that ends in between still wakes it.
        ended.as_mut().enable();
        if running.now() < ENOUGH_RUNNING {
            return Gathered::Ready;
        }
        tokio::select! {
            () = &mut ended => return Gathered::Ready,
            () = tokio::time::sleep_until(hold_until) => return Gathered::Ready,
            next = queue.recv() => match next {
                Some(next) => batch.push(next),
                None => return Gathered::Ready,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coalescer() -> Coalescer {
        let (queue, _waiting) = mpsc::unbounded_channel();
        Coalescer { queue, running: Arc::new(Running::default()), kept: KeptConnection::start() }
    }

    #[tokio::test]
    async fn one_claim_alone_at_a_time_and_its_slot_comes_back_when_dropped() {
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

    type Queue = (mpsc::UnboundedSender<Waiting>, Mutex<mpsc::UnboundedReceiver<Waiting>>);

    /// A queue of waiting requests: its sender and what the flushers hold.
    fn queue() -> Queue {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, Mutex::new(rx))
    }

    /// A reservation request whose requester still waits.
    fn waiting() -> Waiting {
        let (reply, _answer) = oneshot::channel();
        Waiting { request: Request { holder: None, actor: crate::audit::Actor::system() }, reply }
    }

    /// A queue with one request in it while `statements` claim statements run.
    fn one_waiting_while(statements: usize) -> (Queue, Running) {
        let (tx, rx) = queue();
        let running = Running::default();
        (0..statements).for_each(|_| running.start());
        tx.send(waiting()).unwrap();
        ((tx, rx), running)
    }

    #[tokio::test(start_paused = true)]
    async fn with_two_statements_running_a_batch_takes_what_comes_until_one_ends() {
        let ((tx, waiting_queue), running) = one_waiting_while(ENOUGH_RUNNING);
        let mut batch = Vec::new();
        let gathered = {
            let gathering = gather(&waiting_queue, &mut batch, &running, None);
            tokio::pin!(gathering);
            assert!(futures_util::poll!(gathering.as_mut()).is_pending(), "held back while two statements run");
            tx.send(waiting()).unwrap();
            tx.send(waiting()).unwrap();
            assert!(futures_util::poll!(gathering.as_mut()).is_pending());
            running.end();
            gathering.await
        };
        assert_eq!(gathered, Gathered::Ready);
        assert_eq!(batch.len(), 3, "the requests that came while it was held share its statement");
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_batch_goes_once_its_first_request_has_waited_the_longest_hold() {
        let ((_tx, waiting_queue), running) = one_waiting_while(ENOUGH_RUNNING);
        let mut batch = Vec::new();
        let started = tokio::time::Instant::now();
        assert_eq!(gather(&waiting_queue, &mut batch, &running, None).await, Gathered::Ready);
        assert_eq!(started.elapsed(), HOLD_AT_MOST, "no statement ended: it waited the hold out, no longer");
        assert_eq!(batch.len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn with_fewer_statements_running_a_batch_goes_at_once() {
        let ((tx, waiting_queue), running) = one_waiting_while(ENOUGH_RUNNING - 1);
        tx.send(waiting()).unwrap();
        let mut batch = Vec::new();
        let first_poll = {
            let gathering = gather(&waiting_queue, &mut batch, &running, None);
            tokio::pin!(gathering);
            futures_util::poll!(gathering.as_mut())
        };
        assert_eq!(first_poll, std::task::Poll::Ready(Gathered::Ready));
        assert_eq!(batch.len(), 2, "what had queued, nothing held");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lingering_flusher_is_told_when_nothing_came() {
        let (tx, waiting_queue) = queue();
        let running = Running::default();
        let mut batch = Vec::new();
        assert_eq!(gather(&waiting_queue, &mut batch, &running, Some(LINGER)).await, Gathered::Idle);
        assert!(batch.is_empty());
        drop(tx);
        assert_eq!(gather(&waiting_queue, &mut batch, &running, None).await, Gathered::Closed);
    }
}
