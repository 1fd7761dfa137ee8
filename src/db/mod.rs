//! Database access: the connection pool, migrations, and the readiness probe.
//!
//! - [`open`]: [`Database`], the service's database (external, or the embedded cluster) and scratch
//!   databases beside it.
//! - [`embedded`]: a private Postgres cluster run from the installed binaries.

pub mod embedded;
pub(crate) mod open;

pub use open::Database;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use secrecy::ExposeSecret;
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::cif::fence::IncarnationGuard;
use crate::config::DatabaseSettings;

/// Migrations compiled into the binary from `migrations/`.
pub(crate) static MIGRATOR: Migrator = sqlx::migrate!("./migrations");

/// The newest migration version this binary knows.
pub fn latest_migration() -> i64 {
    MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
}

/// Connection options from `database.url`.
pub fn options_from_url(url: &secrecy::SecretString) -> Result<PgConnectOptions, sqlx::Error> {
    url.expose_secret().parse()
}

/// Connections idle at least this long are pinged before they are handed out (see [`pool`]).
const PING_IF_IDLE_FOR: Duration = Duration::from_millis(100);

/// After a connection of the pool fails its ping, every connection is pinged for this long.
const PING_ALL_AFTER_A_FAILURE_FOR: Duration = Duration::from_secs(10);

/// Whether the pool's connections are to be trusted without a ping: a failed ping is evidence that the
/// server went away, and every other connection is then suspect, however recently it was used. Idle
/// time alone does not tell: the pool resets a connection's idle clock in places that make no round
/// trip (its upkeep puts idle connections back into the queue), and after a failover a connection to
/// the dead server was seen handed out with 83 ms of idle time.
#[derive(Debug)]
struct ConnectionTrust {
    since: Instant,
    /// Milliseconds after `since` until which every connection is pinged; 0 before any failure.
    suspect_until_ms: AtomicU64,
}

impl ConnectionTrust {
    fn new() -> Self {
        Self { since: Instant::now(), suspect_until_ms: AtomicU64::new(0) }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether a connection idle for `idle_for` must be pinged before use.
    fn must_ping(&self, idle_for: Duration) -> bool {
        idle_for >= PING_IF_IDLE_FOR || self.now_ms() < self.suspect_until_ms.load(Ordering::Relaxed)
    }

    /// A connection failed its ping: suspect every other one for a while.
    fn failed(&self) {
        let until = self.now_ms().saturating_add(PING_ALL_AFTER_A_FAILURE_FOR.as_millis() as u64);
        self.suspect_until_ms.fetch_max(until, Ordering::Relaxed);
    }
}

/// Builds the pool. Connections are opened lazily, so a service whose database is down still starts
/// serving `/healthz` and reports `/readyz` 503 rather than crash-looping. Every new connection is
/// checked by `incarnation` (once armed) before it serves anything: after a failover, the first
/// statement on the promoted server runs only once the pools are fenced.
pub fn pool(settings: &DatabaseSettings, options: PgConnectOptions, incarnation: &Arc<IncarnationGuard>) -> PgPool {
    let incarnation = incarnation.clone();
    let trust = Arc::new(ConnectionTrust::new());
    let statement_timeout = settings.statement_timeout.as_millis().to_string();
    let options = options.application_name("cifpool").options([("statement_timeout", statement_timeout.as_str())]);
    PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .min_connections(settings.min_connections)
        .acquire_timeout(settings.acquire_timeout)
        // A connection that sat idle through a database restart is dead; test it before reuse. One
        // handed back moments ago is not tested (the test is a round trip to the server on every
        // request) unless another connection has just failed its test: then the server went away,
        // and every connection is tested until none has failed for a while.
        .test_before_acquire(false)
        .before_acquire(move |conn, meta| {
            let trust = trust.clone();
            Box::pin(async move {
                if trust.must_ping(meta.idle_for) {
                    sqlx::Connection::ping(conn).await.inspect_err(|_| trust.failed())?;
                }
                Ok(true)
            })
        })
        .idle_timeout(Some(Duration::from_secs(300)))
        .after_connect(move |conn, _| {
            let incarnation = incarnation.clone();
            Box::pin(async move { incarnation.check(conn).await.map(drop) })
        })
        .connect_lazy_with(options)
}

/// Applies pending migrations (serialised across instances by sqlx's advisory lock), on a connection
/// without the request statement timeout: a migration may legitimately take longer.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    let mut conn = pool.acquire().await?;
    sqlx::query("SET statement_timeout = 0").execute(&mut *conn).await?;
    let result = MIGRATOR.run(&mut *conn).await;
    // Put the pool's setting back before the connection is reused.
    sqlx::query("RESET statement_timeout").execute(&mut *conn).await?;
    result
}

/// [`migrate`], retried while the database is unreachable, for up to `limit`: a pod that starts
/// before its database (or during a failover) waits instead of crash-looping.
pub(crate) async fn migrate_when_reachable(pool: &PgPool, limit: Duration) -> Result<(), sqlx::migrate::MigrateError> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut pause = Duration::from_millis(200);
    loop {
        match migrate(pool).await {
            Err(sqlx::migrate::MigrateError::Execute(e)) if is_connectivity_error(&e) => {
                if tokio::time::Instant::now() + pause > deadline {
                    return Err(sqlx::migrate::MigrateError::Execute(e));
                }
                tracing::warn!(error = %e, retry_in = ?pause, "database not reachable yet");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(5));
            }
            other => return other,
        }
    }
}

/// True when the error means "the database is not reachable right now" rather than a bad query.
pub(crate) fn is_connectivity_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) | sqlx::Error::Tls(_) => true,
        sqlx::Error::WorkerCrashed => true,
        // admin_shutdown, crash_shutdown, cannot_connect_now, query_canceled (statement_timeout)
        sqlx::Error::Database(db) => matches!(db.code().as_deref(), Some("57P01" | "57P02" | "57P03" | "57014")),
        _ => false,
    }
}

/// What `/readyz` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Reachable and at the schema version this binary expects.
    Ready,
    /// Reachable, but migrations are missing or failed.
    SchemaBehind {
        /// Applied version (0 when none).
        applied: i64,
        /// Version this binary needs.
        expected: i64,
    },
    /// Not reachable within the timeout.
    Unreachable(String),
}

/// Checks the database within `limit`.
pub async fn readiness(pool: &PgPool, limit: Duration) -> Readiness {
    let expected = latest_migration();
    let probe =
        sqlx::query_scalar::<_, Option<i64>>("SELECT max(version) FROM _sqlx_migrations WHERE success").fetch_one(pool);
    match tokio::time::timeout(limit, probe).await {
        Err(_) => Readiness::Unreachable(format!("no answer within {limit:?}")),
        Ok(Ok(applied)) => {
            let applied = applied.unwrap_or(0);
            if applied >= expected { Readiness::Ready } else { Readiness::SchemaBehind { applied, expected } }
        }
        // The migrations table does not exist yet: reachable, schema missing.
        Ok(Err(sqlx::Error::Database(e))) if e.code().as_deref() == Some("42P01") => {
            Readiness::SchemaBehind { applied: 0, expected }
        }
        Ok(Err(e)) => Readiness::Unreachable(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recently_used_connection_is_trusted_until_another_fails_its_ping() {
        let trust = ConnectionTrust::new();
        assert!(!trust.must_ping(Duration::from_millis(5)));
        assert!(trust.must_ping(PING_IF_IDLE_FOR));
        trust.failed();
        assert!(trust.must_ping(Duration::ZERO), "after a failure every connection is pinged");
        trust.suspect_until_ms.store(trust.now_ms(), Ordering::Relaxed);
        assert!(!trust.must_ping(Duration::from_millis(5)), "the suspicion ends");
    }
}
