//! The maintenance sweeps over `notification_jobs`: leases that expired handed back (or the job
//! dead-lettered when its attempts ran out), jobs past their deadline expired, finished jobs and dead
//! letters past their retention purged, kept personal data erased once its time is up. Each works in bounded batches that skip locked rows.

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::time::Duration;

use sqlx::PgPool;

use super::{CLAIMABLE, JOBS, SENDING};
use crate::claim::Pick;
use crate::queue::privacy;
use crate::queue::status::JobStatus;

static RESCUE: LazyLock<String> = LazyLock::new(|| {
    // A job whose every attempt killed or hung its worker must not loop forever: dead-letter it.
    JOBS.sweep_sql(
        &SENDING,
        &format!(
            "CASE WHEN t.attempts >= t.max_attempts THEN {dead} ELSE {retrying} END",
            dead = JobStatus::Dead.sql(),
            retrying = JobStatus::Retrying.sql()
        ),
        "TRUE",
        "run_after = now(), last_error = 'lease expired: worker lost during send', \
         finished_at = CASE WHEN t.attempts >= t.max_attempts THEN clock_timestamp() END",
        "",
        "t.id",
    )
});

/// Jobs whose worker died mid-send (lease expired) go back to the queue; returns how many.
pub async fn rescue_expired_leases(db: &PgPool, batch: i64) -> Result<u64, sqlx::Error> {
    let mut total = 0;
    loop {
        let ids: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(RESCUE.as_str())).bind(batch).fetch_all(db).await?;
        total += ids.len() as u64;
        if (ids.len() as i64) < batch {
            return Ok(total);
        }
    }
}

static EXPIRE_OVERDUE: LazyLock<String> = LazyLock::new(|| {
    JOBS.update_picked_sql(
        &Pick { from: &CLAIMABLE, filter: "deadline IS NOT NULL AND deadline < now()", order_by: Some("deadline") },
        &format!(
            "status = {expired}, finished_at = clock_timestamp(), \
             last_error = coalesce(t.last_error, 'deadline passed before it could be sent'), {erase}",
            expired = JobStatus::Expired.sql(),
            erase = privacy::ERASE_ON_FINISH
        ),
        "t.class",
    )
});

/// Waiting jobs past their deadline become `expired` (never sent late), up to `batch` of them;
/// returns how many per class.
pub async fn expire_overdue(db: &PgPool, batch: i64) -> Result<BTreeMap<String, u64>, sqlx::Error> {
    let classes: Vec<String> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(EXPIRE_OVERDUE.as_str())).bind(batch).fetch_all(db).await?;
    let mut per_class = BTreeMap::new();
    for class in classes {
        *per_class.entry(class).or_default() += 1;
    }
    Ok(per_class)
}

/// Which finished jobs a purge deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purge {
    /// Sent, expired, canceled and discarded jobs (`queue.retention`).
    Finished,
    /// Dead letters (`queue.dead_letter_retention`).
    DeadLetters,
}

fn purge_sql(states: &[JobStatus]) -> String {
    JOBS.delete_picked_sql(&Pick {
        from: &JobStatus::sql_list(states),
        filter: "class = $3 AND finished_at < now() - $2::float8 * interval '1 second'",
        order_by: None,
    })
}

static PURGE_FINISHED: LazyLock<String> = LazyLock::new(|| purge_sql(&JobStatus::FINISHED));
static PURGE_DEAD: LazyLock<String> = LazyLock::new(|| purge_sql(&[JobStatus::Dead]));

/// Deletes finished jobs older than `retention`, class by class through the `(class, finished_at)`
/// index, in statements of up to `batch` rows and at most `max_rows` per call (so one call is never one
/// huge transaction); returns how many. The classes are read from that index (a skip scan: one index
/// probe per class), so jobs of a class no longer configured are purged too.
///
/// A single statement without the class could not range-scan that index, and `batch` per sweep capped
/// the purge rate below what the queue can send (10,000 per 5 s sweep is 2,000 jobs/s).
pub async fn purge_finished(
    db: &PgPool,
    which: Purge,
    retention: Duration,
    batch: i64,
    max_rows: u64,
) -> Result<u64, sqlx::Error> {
    let sql = match which {
        Purge::Finished => PURGE_FINISHED.as_str(),
        Purge::DeadLetters => PURGE_DEAD.as_str(),
    };
    let classes: Vec<String> = sqlx::query_scalar(
        "WITH RECURSIVE c AS ( \
            SELECT min(class) AS class FROM notification_jobs WHERE finished_at IS NOT NULL \
            UNION ALL \
            SELECT (SELECT min(class) FROM notification_jobs WHERE finished_at IS NOT NULL AND class > c.class) \
            FROM c WHERE c.class IS NOT NULL) \
         SELECT class FROM c WHERE class IS NOT NULL",
    )
    .fetch_all(db)
    .await?;
    let mut total = 0;
    for class in classes {
        loop {
            let done = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(batch)
                .bind(retention.as_secs_f64())
                .bind(&class)
                .execute(db)
                .await?
                .rows_affected();
            total += done;
            if (done as i64) < batch || total >= max_rows {
                break;
            }
        }
        if total >= max_rows {
            break;
        }
    }
    Ok(total)
}

static ERASE_DUE: LazyLock<String> = LazyLock::new(|| {
    JOBS.update_picked_sql(
        &Pick {
            from: &JobStatus::sql_list(&JobStatus::FINISHED),
            filter: "personal_data_erase_at < now()",
            order_by: Some("personal_data_erase_at"),
        },
        "payload = NULL, sealed = NULL, recipient = notification_masked(recipient), personal_data_erase_at = NULL",
        "t.id",
    )
});

/// Erases the kept payload and recipient of finished jobs whose keeping time has passed, in statements
/// of up to `batch` rows; returns how many.
pub async fn erase_due(db: &PgPool, batch: i64) -> Result<u64, sqlx::Error> {
    let mut total = 0;
    loop {
        let done = sqlx::query(sqlx::AssertSqlSafe(ERASE_DUE.as_str())).bind(batch).execute(db).await?.rows_affected();
        total += done;
        if (done as i64) < batch {
            return Ok(total);
        }
    }
}

crate::statements::statements_of!(RESCUE, EXPIRE_OVERDUE, PURGE_FINISHED, PURGE_DEAD, ERASE_DUE);
