//! Keeping the planner's picture of the jobs table close to what the queue holds.
//!
//! Intake's look for the due front walks a claim index in order and stops at the first due job, but
//! Postgres only plans it that way while its statistics say jobs are waiting. When autovacuum's
//! ANALYZE last ran during a quiet spell (every job finished), the statistics say none wait, and
//! intake adds up every waiting job of a priority to find its front. (Claims had the same trouble:
//! each read every waiting job through the FIFO index and sorted them all to take its batch, 58 ms a
//! claim at 100,000 waiting jobs against 1.9 ms in index order; their plans now price sorting out,
//! see `claim_begin_sql` in `src/queue/store/claiming.rs`.) Autovacuum corrects this only when it
//! next looks at the table, up to a minute later (`autovacuum_naptime`), a setting of the whole
//! cluster.
//!
//! So the stats round, which counts the waiting jobs of every class anyway, also asks the planner
//! how many it expects, and analyzes the table when it expects far fewer than there are. Only the
//! instance that counted asks, and only when its turn has come (at most one ANALYZE per
//! [`ANALYZE_GAP`]), so a planner that stays misled costs no planning in between. The ANALYZE waits
//! no longer than [`ANALYZE_LOCK_WAIT`] for its lock: Postgres cancels an autovacuum that stands in a
//! waiter's way once the wait passes `deadlock_timeout` (a second by default), and this gives up
//! first as long as `deadlock_timeout` is above that wait.
//!
//! None of this is needed for the stats to be right, so a failure here is logged and the round
//! still counts as done.

use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::queue::status::JobStatus;

/// Below this many waiting jobs a class is cheap to claim whatever the plan: no ANALYZE for it.
pub const WORTH_ANALYZING: i64 = 10_000;

/// The planner is misled when it expects fewer than the counted waiting jobs divided by this.
pub const MISLED_BY: f64 = 10.0;

/// Least time between two ANALYZEs by one instance: one costs a few hundred milliseconds of a core on
/// a table of millions of jobs, and if even a fresh one leaves the planner's estimate low (it assumes
/// class and status independent) the queue pays that at most this often.
pub const ANALYZE_GAP: Duration = Duration::from_secs(30);

/// Longest the ANALYZE waits for its lock on the table (an autovacuum of it holds that lock).
pub const ANALYZE_LOCK_WAIT: Duration = Duration::from_millis(100);

/// Longest the ANALYZE may run once it has its lock.
pub const ANALYZE_TIMEOUT: Duration = Duration::from_secs(60);

/// What the planner expected of a class when the table was analyzed for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Misled {
    /// The class whose waiting jobs it underestimated most.
    pub class: String,
    /// Waiting jobs the stats round counted.
    pub counted: i64,
    /// Waiting jobs the planner expected.
    pub expected: f64,
}

/// When this instance last analyzed the table.
#[derive(Debug, Default)]
pub(crate) struct LastAnalyze(Mutex<Option<Instant>>);

impl LastAnalyze {
    /// Whether an ANALYZE may run at `now`: none has run within [`ANALYZE_GAP`] before it.
    fn turn_has_come(&self, now: Instant) -> bool {
        self.0.lock().expect("last analyze lock").is_none_or(|at| now.duration_since(at) >= ANALYZE_GAP)
    }

    /// Records an ANALYZE as run at `now`.
    fn ran(&self, now: Instant) {
        *self.0.lock().expect("last analyze lock") = Some(now);
    }
}

/// The waiting jobs of the classes `$1`, filtered as a claim of those classes filters them.
static WAITING_OF_CLASSES: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT 1 FROM notification_jobs WHERE status IN ({waiting}) AND class = ANY($1)",
        waiting = JobStatus::sql_list(&JobStatus::CLAIMABLE)
    )
});

/// The planner's plan of [`WAITING_OF_CLASSES`], with its row estimate.
static EXPECTED_WAITING: LazyLock<String> =
    LazyLock::new(|| format!("EXPLAIN (FORMAT JSON) {}", WAITING_OF_CLASSES.as_str()));

/// The planner's row estimate for the waiting jobs of `class`.
pub async fn expected_waiting(db: &PgPool, class: &str) -> Result<f64, sqlx::Error> {
    let plan: serde_json::Value =
        sqlx::query_scalar(sqlx::AssertSqlSafe(EXPECTED_WAITING.as_str())).bind(vec![class]).fetch_one(db).await?;
    Ok(plan[0]["Plan"]["Plan Rows"].as_f64().unwrap_or(0.0))
}

/// The class, among `counted` (waiting jobs per class), whose waiting jobs the planner underestimates
/// past [`MISLED_BY`], counting only classes with at least [`WORTH_ANALYZING`] of them.
pub async fn misled(db: &PgPool, counted: &[(String, i64)]) -> Result<Option<Misled>, sqlx::Error> {
    let mut worst: Option<(f64, Misled)> = None;
    for (class, n) in counted.iter().filter(|(_, n)| *n >= WORTH_ANALYZING) {
        let expected = expected_waiting(db, class).await?;
        let ratio = *n as f64 / expected.max(1.0);
        if ratio > MISLED_BY && worst.as_ref().is_none_or(|(worst_ratio, _)| ratio > *worst_ratio) {
            worst = Some((ratio, Misled { class: class.clone(), counted: *n, expected }));
        }
    }
    Ok(worst.map(|(_, found)| found))
}

/// Analyzes `notification_jobs` when this instance's turn has come (no ANALYZE by it within
/// [`ANALYZE_GAP`]) and the planner underestimates some class's waiting jobs (see [`misled`]).
/// Returns what misled it when the table was analyzed. An ANALYZE that could not get its lock in
/// time does not use up the turn: the next round tries again. A database error is logged, never
/// returned: the stats themselves were already published.
pub(crate) async fn analyze_if_misled(db: &PgPool, last: &LastAnalyze, counted: &[(String, i64)]) -> Option<Misled> {
    if !last.turn_has_come(Instant::now()) || counted.iter().all(|(_, n)| *n < WORTH_ANALYZING) {
        return None;
    }
    match try_analyze(db, last, counted).await {
        Ok(found) => found,
        Err(e) => {
            // Wait a whole turn before trying again, not warn every round.
            last.ran(Instant::now());
            tracing::warn!(error = %e, "queue stats: could not check or refresh the planner's statistics of notification_jobs");
            None
        }
    }
}

async fn try_analyze(
    db: &PgPool,
    last: &LastAnalyze,
    counted: &[(String, i64)],
) -> Result<Option<Misled>, sqlx::Error> {
    let Some(found) = misled(db, counted).await? else {
        return Ok(None);
    };
    let started = Instant::now();
    let mut tx = db.begin().await?;
    // The pool's statement timeout is sized for claims; ANALYZE samples a fixed number of rows but
    // reads them from wherever they lie in the table, so give it room (it blocks no reader or writer).
    sqlx::query("SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)")
        .bind(format!("{}ms", ANALYZE_LOCK_WAIT.as_millis()))
        .bind(format!("{}ms", ANALYZE_TIMEOUT.as_millis()))
        .execute(&mut *tx)
        .await?;
    match sqlx::query("ANALYZE notification_jobs").execute(&mut *tx).await {
        Ok(_) => {
            last.ran(started);
            tx.commit().await?;
        }
        // 55P03 lock_not_available: an autovacuum holds the table; it analyzes too, or the next round will.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {
            tracing::debug!(class = %found.class, "queue stats: the jobs table is busy, ANALYZE left to the next round");
            return Ok(None);
        }
        Err(e) => return Err(e),
    }
    metrics::counter!("cifpool_queue_jobs_analyzed_total").increment(1);
    tracing::info!(
        class = %found.class,
        counted = found.counted,
        expected = found.expected,
        took_ms = started.elapsed().as_millis() as u64,
        "queue stats: the planner expected far fewer waiting jobs than there are; analyzed notification_jobs"
    );
    Ok(Some(found))
}

crate::statements::statements_of!(WAITING_OF_CLASSES);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_analyze_per_gap() {
        let last = LastAnalyze::default();
        let t0 = Instant::now();
        assert!(last.turn_has_come(t0));
        assert!(last.turn_has_come(t0), "looking does not use up the turn");
        last.ran(t0);
        assert!(!last.turn_has_come(t0 + ANALYZE_GAP - Duration::from_millis(1)));
        assert!(last.turn_has_come(t0 + ANALYZE_GAP));
    }
}
