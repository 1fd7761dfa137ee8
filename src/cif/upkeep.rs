//! Keeping pools served: when refill, reclaim and the depth gauges run. On their cron schedules, on
//! demand (admin), at once when a claim finds a pool empty, and after claims (a depth check at most
//! once a second per pool and instance).

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use sqlx::PgPool;
use tokio_cron_scheduler::JobScheduler;
use tokio_util::task::TaskTracker;

use crate::cif::refill::{self, RefillOptions, RefillSummary};
use crate::cif::{Pool, Pools, reclaim, stats};

/// Minimum spacing of post-claim depth checks per pool and instance.
const DEPTH_CHECK_INTERVAL_MS: i64 = 1000;
/// Minimum spacing of refills started by claims that found the pool empty, per pool and instance: an
/// empty pool answers every reservation 503, and each must not start a refill (and take a connection)
/// of its own.
const EMPTY_REFILL_INTERVAL_MS: i64 = 200;
/// How often the pool gauges are refreshed.
pub(crate) const GAUGE_INTERVAL: Duration = Duration::from_secs(10);

/// Runs one refill of `pool` and logs what it added.
pub(crate) async fn run_refill(db: &PgPool, pool: &Pool, opts: RefillOptions) -> Result<RefillSummary, sqlx::Error> {
    let summary = refill::refill(db, pool, opts).await?;
    if summary.codes_added > 0 {
        tracing::info!(
            pool = pool.name(),
            added = summary.codes_added,
            batches = summary.batches,
            ms = summary.duration_ms,
            "refilled pool"
        );
    }
    Ok(summary)
}

/// Runs a refill someone asked for (an admin request, a console button) on its own task in `runs`
/// and waits for it: a request timeout or a client that goes away leaves the run to finish (and
/// release the pool's lock) instead of cutting it short. The outer error is the task's panic.
pub(crate) async fn refill_requested(
    db: &PgPool,
    runs: &TaskTracker,
    pool: Arc<Pool>,
    opts: RefillOptions,
) -> Result<Result<RefillSummary, sqlx::Error>, tokio::task::JoinError> {
    let db = db.clone();
    runs.spawn(async move { run_refill(&db, &pool, opts).await }).await
}

/// Whether `interval_ms` has passed since `last` (unix millis), claiming the turn if so: of many
/// callers at once, one gets it.
fn take_turn(last: &AtomicI64, interval_ms: i64) -> bool {
    let now = chrono::Utc::now().timestamp_millis();
    let then = last.load(Ordering::Relaxed);
    now - then >= interval_ms && last.compare_exchange(then, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
}

/// Clears [`Pool::refilling`] when the refill task ends, however it ends.
struct RefillingFlag(Arc<Pool>);

impl Drop for RefillingFlag {
    fn drop(&mut self) {
        self.0.refilling.store(false, Ordering::Release);
    }
}

/// Starts a refill of `pool` unless this instance already has one queued or running.
fn spawn_refill(db: &PgPool, pool: &Arc<Pool>, runs: &TaskTracker) {
    if pool.refilling.swap(true, Ordering::AcqRel) {
        return;
    }
    let (db, flag) = (db.clone(), RefillingFlag(pool.clone()));
    runs.spawn(async move {
        let pool = &flag.0;
        if let Err(e) = run_refill(&db, pool, RefillOptions::default()).await {
            tracing::warn!(pool = pool.name(), error = %e, "refill failed");
        }
    });
}

/// A claim found the pool empty: refill now, unless this instance started one in the last
/// [`EMPTY_REFILL_INTERVAL_MS`] or has one running (across instances the advisory lock collapses them).
pub fn on_empty(db: &PgPool, pool: &Arc<Pool>, runs: &TaskTracker) {
    stats::note_depth(pool, 0);
    if take_turn(&pool.last_empty_refill_ms, EMPTY_REFILL_INTERVAL_MS) {
        spawn_refill(db, pool, runs);
    }
}

/// After a successful claim: at most once a second per pool, check the depth and refill if low.
pub(crate) fn after_claim(db: &PgPool, pool: &Arc<Pool>, runs: &TaskTracker) {
    if !take_turn(&pool.last_depth_check_ms, DEPTH_CHECK_INTERVAL_MS) {
        return;
    }
    let (db, pool, tracker) = (db.clone(), pool.clone(), runs.clone());
    runs.spawn(async move {
        let Ok(mut conn) = db.acquire().await else { return };
        let Ok(available) = refill::available_up_to(&mut conn, pool.id, pool.settings.low_watermark).await else {
            return;
        };
        drop(conn);
        stats::note_depth(&pool, available);
        if available < pool.settings.low_watermark {
            spawn_refill(&db, &pool, &tracker);
        }
    });
}

/// Registers each pool's refill and reclaim schedules, their runs tracked by `runs`.
pub async fn schedule(
    scheduler: &JobScheduler,
    db: &PgPool,
    pools: &Arc<Pools>,
    runs: &TaskTracker,
) -> anyhow::Result<()> {
    for pool in pools.iter() {
        let (db_, p) = (db.clone(), pool.clone());
        crate::schedule::add(scheduler, &pool.settings.refill_schedule, runs, move || {
            let (db, p) = (db_.clone(), p.clone());
            async move {
                if let Err(e) = run_refill(&db, &p, RefillOptions::default()).await {
                    tracing::warn!(pool = p.name(), error = %e, "scheduled refill failed");
                }
            }
        })
        .await?;
        let (db_, pools, id) = (db.clone(), pools.clone(), pool.id);
        crate::schedule::add(scheduler, &pool.settings.reclaim_schedule, runs, move || {
            let (db, pools) = (db_.clone(), pools.clone());
            async move {
                if let Err(e) = reclaim::reclaim(&db, &pools, Some(id), &crate::audit::Actor::system()).await {
                    tracing::warn!(error = %e, "scheduled reclaim failed");
                }
            }
        })
        .await?;
    }
    Ok(())
}

/// Refreshes the pool gauges from the database; run every [`GAUGE_INTERVAL`].
pub(crate) async fn refresh_gauges(db: PgPool, pools: Arc<Pools>) {
    if let Err(e) = stats::refresh(&db, &pools).await {
        tracing::debug!(error = %e, "pool gauges: database unavailable");
    }
}
