//! The stager: scheduled jobs whose time has come become `pending`. A job enqueued for later (a
//! `run_at`, deferred intake, a paced replay) waits as `scheduled`, outside the claim indexes; each
//! instance, every [`STAGE_INTERVAL`], moves the due ones to `pending` in bounded transactions that
//! skip rows another instance is moving, and gives them fair keys then, from their tenants' clocks as
//! they stand at that moment: a campaign scheduled yesterday queues behind what other tenants sent
//! since, not ahead of it.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use sqlx::PgPool;

use crate::claim::Pick;
use crate::queue::enqueue::{RunsByPriority, reserve_keys_of_runs};
use crate::queue::runtime::QueueRuntime;
use crate::queue::status::JobStatus;
use crate::queue::store::JOBS;

/// How often each instance looks for due scheduled jobs: the most a scheduled job waits past its time
/// before it can be claimed.
pub(crate) const STAGE_INTERVAL: Duration = Duration::from_secs(1);
/// Jobs moved per transaction.
const STAGE_BATCH: i64 = 5_000;

/// Locks up to `$1` due scheduled jobs, earliest first (the `notification_jobs_scheduled` index).
static PICK_DUE: LazyLock<String> = LazyLock::new(|| {
    JOBS.lock_picked_sql(
        &Pick { from: &JobStatus::Scheduled.sql(), filter: "run_after <= now()", order_by: Some("run_after, id") },
        "t.id, t.priority, t.tenant",
    )
});

/// Moves every due scheduled job to `pending` with a fresh fair key; returns how many.
pub async fn promote_due(db: &PgPool, rt: &QueueRuntime) -> Result<u64, sqlx::Error> {
    let mut total = 0u64;
    loop {
        let moved = promote_batch(db, rt).await?;
        total += moved;
        if moved < STAGE_BATCH as u64 {
            if total > 0 {
                // Wake idle claimers now rather than at their next poll.
                sqlx::query("SELECT pg_notify('cifpool_jobs', '')").execute(db).await?;
            }
            return Ok(total);
        }
    }
}

async fn promote_batch(db: &PgPool, rt: &QueueRuntime) -> Result<u64, sqlx::Error> {
    let mut tx = db.begin().await?;
    let due: Vec<(i64, i16, String)> =
        sqlx::query_as(sqlx::AssertSqlSafe(PICK_DUE.as_str())).bind(STAGE_BATCH).fetch_all(&mut *tx).await?;
    if due.is_empty() {
        return Ok(0);
    }
    // A contiguous run of keys per (priority, tenant), in the order the jobs came due.
    let mut grouped = RunsByPriority::new();
    for (i, (_, priority, tenant)) in due.iter().enumerate() {
        grouped.entry(*priority).or_default().entry(tenant.as_str()).or_default().push(i);
    }
    let keys: Vec<f64> =
        reserve_keys_of_runs(&mut tx, rt, due.len(), &grouped, |_| 1).await?.into_iter().map(|k| k.0).collect();
    let ids: Vec<i64> = due.iter().map(|d| d.0).collect();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE notification_jobs AS t SET status = {pending}, fair_key = u.k \
         FROM unnest($1::int8[], $2::float8[]) AS u(id, k) WHERE t.id = u.id",
        pending = JobStatus::Pending.sql()
    )))
    .bind(&ids)
    .bind(&keys)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(ids.len() as u64)
}

/// Promotes the due jobs, logging a failure (the next round tries again); run every [`STAGE_INTERVAL`].
pub(crate) async fn stage_round(db: PgPool, runtime: Arc<QueueRuntime>) {
    match promote_due(&db, &runtime).await {
        Ok(0) => {}
        Ok(n) => tracing::debug!(jobs = n, "scheduled jobs are due"),
        Err(e) => tracing::warn!(error = %e, "staging scheduled jobs failed"),
    }
}

crate::statements::statements_of!(PICK_DUE);
