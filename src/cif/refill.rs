//! Refill: keep each pool above its low watermark, in bounded batches.
//!
//! A run takes a session advisory lock for the pool (one refill per pool across all instances; a
//! second caller returns `busy` at once instead of queueing; a run cut short closes its connection, so
//! the lock never stays behind on a pooled one), measures the deficit below the
//! watermark and adds `ceil(deficit / batch_size)` batches, at most `max_batches_per_run`. Each batch
//! is one transaction: advance `cif_pools.next_counter` (row lock, so even without the advisory
//! lock two refills could never take the same counters), compute the codes in the service (the key
//! never reaches the database), `COPY` them in and add a `pool.refilled` audit row naming the
//! counters. Batches commit without waiting for the disk; the run's last write waits for all of them.
//! A crash mid-run loses at most the batches not yet on disk, whose counter advances roll back with
//! them: no counter is ever issued twice.

use std::time::Instant;

use serde::Serialize;
use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres};
use tracing::Instrument;

use crate::audit::{self, Actor, Event};
use crate::cif::Pool;
use crate::cif::refill_text::BatchText;

/// Advisory-lock class for refills (high 32 bits of the lock key; the pool id is the low bits).
const REFILL_LOCK_CLASS: i64 = 0x6369_6672; // "cifr"

/// How a refill run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RefillOutcome {
    /// Codes were added.
    Refilled,
    /// The pool was at or above its watermark: nothing to do.
    AboveWatermark,
    /// Another refill of this pool holds the lock.
    Busy,
    /// The pool's domain is used up (every counter generated).
    Exhausted,
    /// The pool's row no longer holds the format and key check this instance generates with (someone
    /// changed it under a running instance): generating here could repeat codes, so nothing was added.
    Refused,
    /// Issuance is halted: the database is not the one codes were issued from, and an operator has
    /// not fenced or accepted it yet (`database.on_incarnation_change = "halt"`).
    Halted,
}

impl RefillOutcome {
    /// The metric label, the same word as in the JSON summary.
    pub fn label(self) -> &'static str {
        match self {
            RefillOutcome::Refilled => "refilled",
            RefillOutcome::AboveWatermark => "above_watermark",
            RefillOutcome::Busy => "busy",
            RefillOutcome::Exhausted => "exhausted",
            RefillOutcome::Refused => "refused",
            RefillOutcome::Halted => "halted",
        }
    }
}

/// What a run did (returned by the admin endpoint, logged by the schedule).
#[derive(Debug, Clone, Serialize)]
pub struct RefillSummary {
    /// Pool name.
    pub pool: String,
    /// Outcome.
    pub outcome: RefillOutcome,
    /// Codes generated.
    pub codes_added: u64,
    /// Transactions committed.
    pub batches: u32,
    /// Available codes before the run (counted up to the watermark).
    pub available_before: u64,
    /// Wall time of the run.
    pub duration_ms: f64,
}

/// Options of one run.
#[derive(Debug, Clone)]
pub struct RefillOptions {
    /// Add `max_batches_per_run` batches even above the watermark (ops pre-filling before a campaign).
    pub force: bool,
    /// Who asked: each batch's `pool.refilled` audit row carries it (`system` for the schedules).
    pub actor: Actor,
}

impl Default for RefillOptions {
    fn default() -> Self {
        RefillOptions { force: false, actor: Actor::system() }
    }
}

/// The pool's session advisory lock, with the connection holding it. Unless [`RefillLock::release`]
/// completes, dropping it (an error, or the run's future dropped by a request timeout or a client that
/// went away) closes that connection instead of returning it to the pool: the server frees a session
/// lock with its session, so the lock can never outlive the run on a pooled connection.
struct RefillLock {
    conn: Option<PoolConnection<Postgres>>,
    key: i64,
}

impl RefillLock {
    /// Takes the lock of `pool` if no other session holds it.
    async fn try_take(db: &PgPool, pool: &Pool) -> Result<Option<RefillLock>, sqlx::Error> {
        let key = (REFILL_LOCK_CLASS << 32) | i64::from(pool.id);
        let mut lock = RefillLock { conn: Some(db.acquire().await?), key };
        let locked: bool =
            sqlx::query_scalar("SELECT pg_try_advisory_lock($1)").bind(key).fetch_one(lock.conn()).await?;
        if !locked {
            // Nothing held: the connection may go back to the pool.
            lock.conn.take();
        }
        Ok(locked.then_some(lock))
    }

    fn conn(&mut self) -> &mut PgConnection {
        self.conn.as_mut().expect("a held lock has its connection")
    }

    /// Unlocks and returns the connection to the pool.
    async fn release(mut self) -> Result<(), sqlx::Error> {
        let key = self.key;
        sqlx::query("SELECT pg_advisory_unlock($1)").bind(key).execute(self.conn()).await?;
        self.conn.take();
        Ok(())
    }
}

impl Drop for RefillLock {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            drop(conn.detach());
        }
    }
}

/// Runs one refill of `pool`.
pub async fn refill(db: &PgPool, pool: &Pool, opts: RefillOptions) -> Result<RefillSummary, sqlx::Error> {
    let started = Instant::now();
    let mut summary = RefillSummary {
        pool: pool.name().to_string(),
        outcome: RefillOutcome::Busy,
        codes_added: 0,
        batches: 0,
        available_before: 0,
        duration_ms: 0.0,
    };
    if let Some(mut lock) = RefillLock::try_take(db, pool).await? {
        run_locked(lock.conn(), pool, opts, &mut summary).await?;
        // Also after a refusal that followed added batches: this commit is the one that waits for the
        // log to reach disk, so the run's codes are durable when it returns.
        if summary.codes_added > 0 || !matches!(summary.outcome, RefillOutcome::Refused | RefillOutcome::Halted) {
            record_run(lock.conn(), pool.id, summary.codes_added).await?;
        }
        lock.release().await?;
    }
    summary.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
    if summary.codes_added > 0 {
        metrics::counter!("cifpool_refill_codes_total", "pool" => pool.name().to_string())
            .increment(summary.codes_added);
    }
    metrics::counter!("cifpool_refill_runs_total", "pool" => pool.name().to_string(),
        "outcome" => summary.outcome.label())
    .increment(1);
    Ok(summary)
}

/// Notes on the pool's row when a refill last ran and what it added (the console's Pools page).
async fn record_run(conn: &mut PgConnection, pool_id: i16, added: u64) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE cif_pools SET last_refill_at = now(), last_refill_added = $2 WHERE id = $1")
        .bind(pool_id)
        .bind(added as i64)
        .execute(conn)
        .await?;
    Ok(())
}

/// Available codes of `pool`, counting no further than `limit` (cheap on a deep pool).
pub(crate) async fn available_up_to(conn: &mut PgConnection, pool_id: i16, limit: u64) -> Result<u64, sqlx::Error> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM cif_codes WHERE pool_id = $1 AND state = 'available' LIMIT $2) AS a",
    )
    .bind(pool_id)
    .bind(limit as i64)
    .fetch_one(conn)
    .await?;
    Ok(n as u64)
}

async fn run_locked(
    conn: &mut PgConnection,
    pool: &Pool,
    opts: RefillOptions,
    summary: &mut RefillSummary,
) -> Result<(), sqlx::Error> {
    let s = &pool.settings;
    let batch = u64::from(s.batch_size);
    let available = available_up_to(conn, pool.id, s.low_watermark).await?;
    summary.available_before = available;
    let batches = if opts.force {
        s.max_batches_per_run
    } else if available >= s.low_watermark {
        summary.outcome = RefillOutcome::AboveWatermark;
        return Ok(());
    } else {
        (s.low_watermark - available).div_ceil(batch).min(u64::from(s.max_batches_per_run)) as u32
    };
    let domain = pool.codec.capacity() as i64;
    summary.outcome = RefillOutcome::Refilled;
    let mut text = BatchText::new(pool.id, pool.keys());
    let mut n = 0;
    // At most one re-read of the key epochs per run: if the pool's epoch still differs after it (an
    // epoch this instance cannot derive), the run stops instead of asking again and again.
    let mut relearned = false;
    while n < batches {
        let span = tracing::info_span!("refill batch", pool = pool.name(), codes = tracing::field::Empty);
        let last = n + 1 == batches;
        let added = add_batch(conn, pool, &opts, batch, domain, &mut text, last).instrument(span.clone()).await?;
        n += 1;
        match added {
            Batch::NewKeyEpoch if !relearned => {
                // Another instance rotated the key: learn the new epoch, then take this batch again.
                relearned = true;
                pool.reload_keys(conn).await?;
                text = BatchText::new(pool.id, pool.keys());
                n -= 1;
            }
            Batch::NewKeyEpoch => {
                summary.outcome = RefillOutcome::Refused;
                tracing::error!(
                    pool = pool.name(),
                    "refill refused: the pool's key epoch is not one this instance can read"
                );
                break;
            }
            Batch::Refused => {
                summary.outcome = RefillOutcome::Refused;
                tracing::error!(
                    pool = pool.name(),
                    "refill refused: the pool's stored format or key check is not this instance's; restart the \
                     instance to see which setting differs"
                );
                break;
            }
            Batch::Halted => {
                if summary.codes_added == 0 {
                    summary.outcome = RefillOutcome::Halted;
                }
                tracing::warn!(pool = pool.name(), "refill skipped: issuance is halted until an operator fences");
                break;
            }
            Batch::Exhausted => {
                if summary.codes_added == 0 {
                    summary.outcome = RefillOutcome::Exhausted;
                }
                tracing::error!(pool = pool.name(), "pool domain exhausted: every counter has been generated");
                break;
            }
            Batch::Added { end, codes } => {
                span.record("codes", codes);
                summary.codes_added += codes;
                summary.batches += 1;
                if end >= domain {
                    tracing::error!(pool = pool.name(), "pool domain exhausted after this batch");
                    break;
                }
            }
        }
    }
    Ok(())
}

/// What one refill batch did.
enum Batch {
    /// The counters up to `end` were taken and `codes` codes added for them (a counter whose code
    /// an earlier key epoch made gets none).
    Added { end: i64, codes: u64 },
    /// The pool has a key epoch this instance has not read: nothing added.
    NewKeyEpoch,
    /// The pool row holds another format or key check: nothing added.
    Refused,
    /// No counter is left in the pool's domain.
    Exhausted,
    /// Issuance is halted until an operator fences or accepts the database.
    Halted,
}

/// One refill transaction: advances the pool's counter by up to `batch`, copies the codes of those
/// counters in, and records the audit event. Unless it is the `last` of its run, the next batch's
/// codes are encoded while this one's `COPY` runs.
async fn add_batch(
    conn: &mut PgConnection,
    pool: &Pool,
    opts: &RefillOptions,
    batch: u64,
    domain: i64,
    text: &mut BatchText,
    last: bool,
) -> Result<Batch, sqlx::Error> {
    let s = &pool.settings;
    // The batch's commit does not wait for its WAL to reach disk (the run's last write, `record_run`,
    // does, and with it every batch before). Safe because the log is one sequence: a crash can lose
    // only batches after the last flushed commit, each with its own counter advance, so their
    // counters are taken again; and any reservation or confirmation of one of their codes commits
    // after the batch, so flushing it flushes the batch first. Sent with the BEGIN, in one round trip.
    let mut tx = conn.begin_with("BEGIN; SET LOCAL synchronous_commit = off").await?;
    // Take the next counters (row-locked); near the end of the domain, what is left. Only while the
    // row still holds this instance's format and key check: counters advanced under another
    // permutation would not be what the rest of the deployment decodes.
    // Nor while issuance is halted for a changed database (see crate::cif::fence).
    // The lock is FOR NO KEY UPDATE, held until the batch commits: it orders refills, key rotations,
    // fences and reconciles of the pool (they conflict with it), but never a confirmation. While
    // cif_issued had a foreign key to the pool (until migration 27), each confirmation took this row
    // FOR KEY SHARE, and FOR UPDATE here made every confirmation of the pool wait out the batch's COPY
    // (120 ms waits under a steady load).
    let (pinned, epoch, halted, range): (bool, i16, bool, Option<(i64, i64)>) = {
        let (pinned, epoch, halted, start, end): (bool, i16, bool, Option<i64>, Option<i64>) = sqlx::query_as(
            "WITH old AS ( \
                SELECT next_counter, key_epoch, (prefix, digits, check_scheme, cipher, key_id, key_check) \
                       IS NOT DISTINCT FROM ($4::text, $5::int2, $6::text, $9::text, $7::text, $8::text) AS pinned, \
                       EXISTS (SELECT FROM cif_incarnation WHERE halted_for IS NOT NULL) AS halted \
                FROM cif_pools WHERE id = $1 FOR NO KEY UPDATE), \
             advanced AS ( \
                UPDATE cif_pools AS p SET next_counter = LEAST(old.next_counter + $2, $3), updated_at = now() \
                FROM old WHERE p.id = $1 AND old.pinned AND old.key_epoch = $10 AND NOT old.halted \
                  AND old.next_counter < $3 \
                RETURNING old.next_counter AS start, p.next_counter AS end_counter) \
             SELECT old.pinned, old.key_epoch, old.halted, advanced.start, advanced.end_counter \
               FROM old LEFT JOIN advanced ON true",
        )
        .bind(pool.id)
        .bind(batch as i64)
        .bind(domain)
        .bind(&s.prefix)
        .bind(s.digits as i16)
        .bind(s.check.name())
        .bind(&s.key_id)
        .bind(&pool.key_check)
        .bind(pool.codec.permutation().cipher().name())
        .bind(text.epoch())
        .fetch_one(&mut *tx)
        .await?;
        (pinned, epoch, halted, start.zip(end))
    };
    if !pinned {
        return Ok(Batch::Refused);
    }
    if epoch != text.epoch() {
        return Ok(Batch::NewKeyEpoch);
    }
    if halted {
        return Ok(Batch::Halted);
    }
    let Some((start, end)) = range else {
        return Ok(Batch::Exhausted);
    };
    let rows = text.text(start..end).await;
    let mut copy = tx.copy_in_raw("COPY cif_codes (pool_id, counter, code) FROM STDIN").await?;
    copy.send(rows.text.as_bytes()).await?;
    // The next batch is encoded only once this one's rows are on their way: started before the
    // `COPY`, the encoding thread woke up beside this task and the backend on two cores and held the
    // `COPY`'s start back ~4.5 ms a batch at the median; now it overlaps the server's work on them.
    if !last && end < domain {
        text.encode_ahead(end..(end + batch as i64).min(domain));
    }
    copy.finish().await?;
    let skipped = (end - start) as u64 - rows.codes;
    let detail = serde_json::json!({
        "first_counter": start, "end_counter": end, "codes": rows.codes, "skipped": skipped,
        "key_epoch": epoch, "force": opts.force,
    });
    let event = Event {
        action: audit::action::POOL_REFILLED,
        pool: Some(pool.name()),
        detail: Some(detail),
        ..Default::default()
    };
    audit::record(&mut tx, &opts.actor, &event).await?;
    tx.commit().await?;
    Ok(Batch::Added { end, codes: rows.codes })
}
