//! Dead letters: list them, and replay them at a bounded rate (a replay that opened every job at once
//! would be the retry storm that killed the provider in the first place).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

/// Which dead jobs.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
pub struct DlqFilter {
    /// Only this class.
    #[serde(default)]
    pub class: Option<String>,
    /// Only this tenant.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Only jobs whose last error contains this text.
    #[serde(default)]
    pub error: Option<String>,
}

/// A dead job as listed.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadJob {
    /// Id.
    pub id: i64,
    /// Class.
    pub class: String,
    /// Tenant.
    pub tenant: String,
    /// Attempts made.
    pub attempts: i32,
    /// Why it died.
    pub last_error: Option<String>,
    /// Enqueued.
    pub created_at: DateTime<Utc>,
    /// Died.
    pub finished_at: Option<DateTime<Utc>>,
}

impl DlqFilter {
    /// Filter values are compared in SQL: no control characters (Postgres text cannot hold NUL).
    pub fn validate(&self) -> Result<(), String> {
        for (field, value) in [("class", &self.class), ("tenant", &self.tenant), ("error", &self.error)] {
            if let Some(v) = value {
                crate::validate::text(field, v, 512)?;
            }
        }
        Ok(())
    }
}

/// Slowest replay rate accepted: one job every ~17 minutes.
pub const MIN_RATE_PER_SEC: f64 = 0.001;
/// Fastest replay rate accepted.
pub const MAX_RATE_PER_SEC: f64 = 100_000.0;
/// Most extra attempts a replay may grant.
pub const MAX_EXTRA_ATTEMPTS: i32 = 100;
/// Most jobs one replay may touch.
pub const MAX_REPLAY: i64 = 1_000_000;

impl Replay {
    /// Bounds that keep the spacing arithmetic and attempt counts in range.
    pub fn validate(&self) -> Result<(), String> {
        self.filter.validate()?;
        if !(MIN_RATE_PER_SEC..=MAX_RATE_PER_SEC).contains(&self.rate_per_sec) {
            return Err(format!("rate_per_sec must be between {MIN_RATE_PER_SEC} and {MAX_RATE_PER_SEC}"));
        }
        if !(1..=MAX_REPLAY).contains(&self.max) {
            return Err(format!("max must be between 1 and {MAX_REPLAY}"));
        }
        if !(1..=MAX_EXTRA_ATTEMPTS).contains(&self.extra_attempts) {
            return Err(format!("extra_attempts must be between 1 and {MAX_EXTRA_ATTEMPTS}"));
        }
        Ok(())
    }
}

const FILTER: &str = "status = 'dead' AND ($1::text IS NULL OR class = $1) AND ($2::text IS NULL OR tenant = $2) \
                      AND ($3::text IS NULL OR strpos(coalesce(last_error, ''), $3) > 0)";

/// Lists up to `limit` dead jobs, oldest first.
pub async fn list(db: &PgPool, filter: &DlqFilter, limit: i64) -> Result<Vec<DeadJob>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, class, tenant, attempts, last_error, created_at, finished_at FROM notification_jobs \
         WHERE {FILTER} ORDER BY id LIMIT $4"
    )))
    .bind(&filter.class)
    .bind(&filter.tenant)
    .bind(&filter.error)
    .bind(limit)
    .fetch_all(db)
    .await
}

/// Replay request.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Replay {
    /// Which jobs.
    #[serde(flatten)]
    pub filter: DlqFilter,
    /// At most this many jobs.
    pub max: i64,
    /// Jobs per second they become due at (spread with `run_after`).
    pub rate_per_sec: f64,
    /// Extra attempts granted to each (default 1).
    #[serde(default = "one")]
    pub extra_attempts: i32,
}

fn one() -> i32 {
    1
}

/// Puts matching dead jobs back in the queue, due one every `1 / rate_per_sec` seconds, each allowed
/// `extra_attempts` more attempts. Returns how many.
pub async fn replay(db: &PgPool, req: &Replay) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(sqlx::AssertSqlSafe(format!(
        "WITH locked AS ( \
            SELECT id FROM notification_jobs WHERE {FILTER} ORDER BY id LIMIT $4 FOR UPDATE SKIP LOCKED), \
         picked AS (SELECT id, row_number() OVER (ORDER BY id) - 1 AS n FROM locked) \
         UPDATE notification_jobs AS t SET status = 'pending', finished_at = NULL, \
                max_attempts = t.attempts + $5, run_after = now() + picked.n / $6::float8 * interval '1 second' \
         FROM picked WHERE t.id = picked.id"
    )))
    .bind(&req.filter.class)
    .bind(&req.filter.tenant)
    .bind(&req.filter.error)
    .bind(req.max)
    .bind(req.extra_attempts)
    .bind(req.rate_per_sec)
    .execute(db)
    .await?;
    Ok(done.rows_affected())
}
