//! What holds back the database's cleanup horizon: the oldest transaction that still has a snapshot
//! open in this database, and the oldest row version a replication slot still needs.
//!
//! While either is old, autovacuum cannot remove the dead row versions every claim, finish and refill
//! leaves behind (`notification_jobs`, `cif_codes`), so every index scan wades through more of them: the
//! drain slows and reservations get slower, and both recover only after the holder lets go. An analyst's
//! open `REPEATABLE READ` session, a forgotten `BEGIN` in psql, or a replication slot whose consumer is
//! gone are the usual holders. The gauges make the cause visible before the symptoms are blamed on the
//! service.

use std::time::Duration;

use sqlx::PgPool;

/// How often the horizon is read.
pub(crate) const HORIZON_EVERY: Duration = Duration::from_secs(15);

/// What holds back the cleanup horizon of the service's database, as read now.
#[derive(Debug, Clone, Copy, PartialEq, sqlx::FromRow)]
pub struct Horizon {
    /// Seconds since the oldest transaction that holds a snapshot in this database began (0: none).
    /// Other roles' sessions count only when the service's role may see them (`pg_read_all_stats`).
    pub oldest_snapshot_age_s: f64,
    /// Transactions since the oldest row version a replication slot of this database (or a physical
    /// slot) still needs (0: no slot holds one).
    pub slot_xmin_age: i64,
}

/// Reads the horizon's holders from `pg_stat_activity` and `pg_replication_slots`.
pub async fn read(db: &PgPool) -> Result<Horizon, sqlx::Error> {
    sqlx::query_as(
        "SELECT coalesce((SELECT extract(epoch FROM now() - min(xact_start))::float8 FROM pg_stat_activity \
                           WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid() \
                             AND datname = current_database()), 0) AS oldest_snapshot_age_s, \
                coalesce((SELECT max(greatest(age(xmin), age(catalog_xmin)))::int8 FROM pg_replication_slots \
                           WHERE database = current_database() OR database IS NULL), 0) AS slot_xmin_age",
    )
    .fetch_one(db)
    .await
}

/// Publishes the horizon as `cifpool_db_oldest_snapshot_age_seconds` and
/// `cifpool_db_replication_slot_xmin_age`. Run every [`HORIZON_EVERY`]; a failed read leaves the last
/// values (the readiness probe reports an unreachable database).
pub(crate) async fn probe_horizon(db: PgPool) {
    match read(&db).await {
        Ok(horizon) => {
            metrics::gauge!("cifpool_db_oldest_snapshot_age_seconds").set(horizon.oldest_snapshot_age_s.max(0.0));
            metrics::gauge!("cifpool_db_replication_slot_xmin_age").set(horizon.slot_xmin_age as f64);
        }
        Err(e) => tracing::debug!(error = %e, "reading the cleanup horizon"),
    }
}
