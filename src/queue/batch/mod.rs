//! `POST /v1/notifications/batch` as a streaming intake: the body is parsed as it arrives and its jobs
//! are copied into Postgres in chunks while the rest is still coming, so parse and copy overlap and a
//! request holds a few chunks of memory, not its body.
//!
//! - [`body`]: the HTTP body as a blocking reader for the parser's thread.
//! - [`parse`]: the request object, one job at a time.
//! - [`rules`]: each job checked as it arrives; checks that need a default sent after `jobs` wait for
//!   the end.
//! - [`rows`]: checked jobs as staging rows, in chunks over a bounded channel.
//! - [`insert`]: the staging table, the batch's row, the fair keys and the one insert into
//!   `notification_jobs`.
//!
//! Everything happens in one transaction: a bad job at index 499,999, a body cut off, a class shed by
//! backpressure or any database error rolls it all back, leaving nothing behind.

pub(crate) mod body;
pub(crate) mod insert;
pub(crate) mod parse;
pub(crate) mod rows;
pub(crate) mod rules;

use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::mpsc;

use crate::auth::Caller;
pub use crate::queue::batch::body::ByteStream;
use crate::queue::intake::{BatchSubmitted, SubmitError, delay_or_shed};
use crate::queue::runtime::QueueRuntime;
use crate::queue::stats::QueueStats;

/// Chunks waiting between the parser and the copy: the parser blocks when they are all full, so a
/// request holds at most this many plus the two being filled and copied.
const CHUNKS_IN_FLIGHT: usize = 2;

/// Reads `body` as a batch request of `caller` and stores it: validation as the jobs arrive (the
/// first bad one refuses the batch, named by its index), then admission per class (one shed class
/// refuses the batch; a deferred class defers it all by the longest delay), then the insert, all in one
/// transaction.
pub async fn submit(
    db: &PgPool,
    rt: &Arc<QueueRuntime>,
    stats: &QueueStats,
    caller: &Caller,
    body: ByteStream,
) -> Result<BatchSubmitted, SubmitError> {
    // Taken here, on the request's span: the parser's thread has none.
    let traceparent = crate::telemetry::traces::current_traceparent();
    let mut tx = db.begin().await?;
    insert::open(&mut tx).await?;
    let (chunks, mut arrived) = mpsc::channel::<String>(CHUNKS_IN_FLIGHT);
    let parser = {
        let (rt, caller, runtime) = (rt.clone(), caller.clone(), tokio::runtime::Handle::current());
        tokio::task::spawn_blocking(move || {
            let reader = body::BodyReader::new(body, runtime, rt.settings.batch_min_bytes_per_second);
            parse::run(reader, &rt, rules::Rules::new(&rt, &caller), rows::Rows::new(chunks))
        })
    };
    while let Some(chunk) = arrived.recv().await {
        // On an error the parser finds the channel closed at its next chunk and stops; its result no
        // longer matters, and waiting for it could mean waiting for the client.
        insert::copy_chunk(&mut tx, chunk).await?;
    }
    let parsed = match parser.await {
        Ok(parsed) => parsed?,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    };
    let total = parsed.jobs;
    let mut delay = std::time::Duration::ZERO;
    // Every tenant of the batch is judged with every class it holds, as if all its jobs were that
    // tenant's: a batch is admitted as a whole.
    for (class, jobs) in &parsed.verdict.per_class {
        for tenant in &parsed.verdict.tenants {
            delay = delay.max(delay_or_shed(rt, stats, class, tenant, *jobs)?);
        }
    }
    let stored = insert::insert(&mut tx, rt, &parsed, delay, &caller.name, traceparent).await?;
    tx.commit().await?;
    for (class, n) in &stored.per_class {
        metrics::counter!("cifpool_queue_enqueued_total", "class" => class.clone()).increment(*n);
    }
    let accepted: u64 = stored.per_class.values().sum();
    Ok(BatchSubmitted { accepted, duplicates: total - accepted, batch_id: stored.batch_id })
}
