//! The database incarnation fence: never issue again a code that might already have been handed out,
//! when the database goes back in time under the service.
//!
//! A restored dump, a point-in-time recovery, a promoted asynchronous standby or a copied database
//! holds the pools as they were at some earlier moment: codes handed out since then are back among the
//! available ones, and the counters would generate them again. The service records the identity of
//! the database it issues from (`cif_database_identity()`: cluster, WAL timeline, database and pool
//! tables) and compares it with the live one at start, on every new connection (before the connection
//! serves anything) and every `database.incarnation_check_interval`. When it changed:
//! - `database.on_incarnation_change = "fence"` (the default): every pool is fenced in one
//!   transaction: its available and held codes are set aside in `cif_fenced_codes` (kept for the
//!   audit, never issued), its idempotency records are dropped, its counter jumps ahead by the pool's
//!   `fence_margin`, a `pool.fenced` audit row is written per pool, and the new identity is recorded.
//!   Issuance resumes from the fresh counters.
//! - `"halt"`: the change is recorded as pending and every instance refuses reservations and refills
//!   until an operator fences (`cifpool pools fence`) or accepts the database as it is
//!   (`cifpool pools fence --accept`, for a switchover that lost nothing).
//!
//! A storage snapshot rolled back in place keeps every identity the database can show: that is not
//! detectable here, and is what reconciling with the bank's customer system is for.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use serde::Serialize;
use serde_json::Value;
use sqlx::{Acquire, PgConnection, PgPool};

use crate::audit::{self, Actor, Event};
use crate::config::{OnIncarnationChange, Settings};

/// Advisory lock that serialises checks and fences across instances.
const FENCE_LOCK: i64 = 0x6369_6670_6665_6e63;

/// What a fence does to each pool and when it acts; from the configuration.
#[derive(Debug, Clone)]
pub(crate) struct FencePolicy {
    /// Fence at once, or wait for an operator.
    pub on_change: OnIncarnationChange,
    /// Configured pools and how far each one's counter jumps (pools in the database but not in the
    /// configuration jump by the default margin of their digits).
    pub margins: Vec<(String, i64)>,
}

impl FencePolicy {
    /// The policy of `settings`.
    pub(crate) fn from_settings(settings: &Settings) -> FencePolicy {
        FencePolicy {
            on_change: settings.database.on_incarnation_change,
            margins: settings.pools.iter().map(|p| (p.name.clone(), p.fence_margin() as i64)).collect(),
        }
    }
}

/// What a check found.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Checked {
    /// The database is the one the service has been issuing from.
    Same,
    /// No identity was recorded yet (a new database, or the first start of this version): recorded.
    Recorded,
    /// It changed and every pool was fenced.
    Fenced(FenceReport),
    /// It changed and issuance waits for an operator.
    Halted,
}

/// What a fence did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FenceReport {
    /// `cif_fences.id`.
    pub fence: i64,
    /// The identity recorded before.
    pub previous: Value,
    /// The identity found.
    pub current: Value,
    /// Per pool.
    pub pools: Vec<PoolFenced>,
}

/// One pool's part of a fence.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolFenced {
    /// Pool name.
    pub pool: String,
    /// Available and held codes set aside.
    pub set_aside: i64,
    /// The counter before and after the jump: counters in between are never generated.
    pub counter_from: i64,
    /// See `counter_from`.
    pub counter_to: i64,
}

/// This instance's side of the fence: armed once migrations have run (the check needs their
/// function and table), consulted by every new connection, and holding whether issuance is halted.
#[derive(Debug, Default)]
pub struct IncarnationGuard {
    policy: OnceLock<FencePolicy>,
    halted: AtomicBool,
}

impl IncarnationGuard {
    /// A guard that checks nothing until [`IncarnationGuard::arm`].
    pub fn new() -> Arc<IncarnationGuard> {
        Arc::new(IncarnationGuard::default())
    }

    /// Starts checking with `policy` and runs the first check on `db`.
    pub(crate) async fn arm(&self, db: &PgPool, policy: FencePolicy) -> Result<Checked, sqlx::Error> {
        let _ = self.policy.set(policy);
        let mut conn = db.acquire().await?;
        self.check(&mut conn).await
    }

    /// Whether reservations and refills are refused until an operator acts.
    pub fn halted(&self) -> bool {
        self.halted.load(Ordering::Relaxed)
    }

    /// Checks on `conn` (a fresh connection, or one taken for the periodic check) and acts on a
    /// change; does nothing before [`IncarnationGuard::arm`].
    pub async fn check(&self, conn: &mut PgConnection) -> Result<Checked, sqlx::Error> {
        let Some(policy) = self.policy.get() else { return Ok(Checked::Same) };
        let checked = check(conn, policy).await?;
        self.note(&checked);
        Ok(checked)
    }

    /// Records what a check (this instance's or an operator's) found.
    pub fn note(&self, checked: &Checked) {
        let halted = matches!(checked, Checked::Halted);
        metrics::gauge!("cifpool_issuance_halted").set(if halted { 1.0 } else { 0.0 });
        if self.halted.swap(halted, Ordering::Relaxed) != halted && !halted {
            tracing::warn!("issuance resumed: the database's identity is recorded again");
        }
        match checked {
            Checked::Fenced(report) => {
                tracing::error!(fence = report.fence, previous = %report.previous, current = %report.current,
                    pools = ?report.pools, "the database is not the one codes were issued from (restore, recovery, \
                    failover or copy): every pool was fenced and issues from fresh counters");
            }
            Checked::Halted => tracing::error!(
                "the database is not the one codes were issued from (restore, recovery, failover or copy): \
                 reservations and refills are refused until an operator runs `cifpool pools fence`"
            ),
            Checked::Recorded => tracing::info!("recorded the identity of the database codes are issued from"),
            Checked::Same => {}
        }
    }
}

/// The check: one statement while nothing changed; on a change, under the fence lock, the policy's
/// action.
async fn check(conn: &mut PgConnection, policy: &FencePolicy) -> Result<Checked, sqlx::Error> {
    let quick: Option<(bool, bool)> =
        sqlx::query_as("SELECT identity = cif_database_identity(), halted_for IS NOT NULL FROM cif_incarnation")
            .fetch_optional(&mut *conn)
            .await?;
    if quick == Some((true, false)) {
        return Ok(Checked::Same);
    }
    let mut tx = locked(conn).await?;
    let live: Value = sqlx::query_scalar("SELECT cif_database_identity()").fetch_one(&mut *tx).await?;
    let recorded: Option<(Value, Option<Value>)> =
        sqlx::query_as("SELECT identity, halted_for FROM cif_incarnation FOR UPDATE").fetch_optional(&mut *tx).await?;
    let checked = match recorded {
        None => {
            sqlx::query("INSERT INTO cif_incarnation (identity) VALUES ($1)").bind(&live).execute(&mut *tx).await?;
            Checked::Recorded
        }
        Some((identity, None)) if identity == live => Checked::Same,
        Some((previous, _)) => match policy.on_change {
            OnIncarnationChange::Halt => {
                sqlx::query(
                    "UPDATE cif_incarnation SET halted_for = $1, halted_at = coalesce(halted_at, now()) \
                     WHERE halted_for IS DISTINCT FROM $1 OR halted_at IS NULL",
                )
                .bind(&live)
                .execute(&mut *tx)
                .await?;
                Checked::Halted
            }
            OnIncarnationChange::Fence => {
                Checked::Fenced(fence_in(&mut tx, policy, previous, live, &Actor::system()).await?)
            }
        },
    };
    tx.commit().await?;
    Ok(checked)
}

/// A transaction holding the fence lock, without the request statement timeout (a fence moves a
/// pool's whole working set).
async fn locked(conn: &mut PgConnection) -> Result<sqlx::Transaction<'_, sqlx::Postgres>, sqlx::Error> {
    let mut tx = conn.begin().await?;
    sqlx::query("SET LOCAL statement_timeout = 0").execute(&mut *tx).await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)").bind(FENCE_LOCK).execute(&mut *tx).await?;
    Ok(tx)
}

/// Fences every pool now, whatever the identity says (an operator's `cifpool pools fence`, e.g.
/// after a storage snapshot rollback the check cannot see), and records the live identity.
pub(crate) async fn fence_now(db: &PgPool, policy: &FencePolicy, actor: &Actor) -> Result<FenceReport, sqlx::Error> {
    let mut conn = db.acquire().await?;
    let mut tx = locked(&mut conn).await?;
    let live: Value = sqlx::query_scalar("SELECT cif_database_identity()").fetch_one(&mut *tx).await?;
    let previous: Option<Value> =
        sqlx::query_scalar("SELECT identity FROM cif_incarnation FOR UPDATE").fetch_optional(&mut *tx).await?;
    let report = fence_in(&mut tx, policy, previous.unwrap_or(Value::Null), live, actor).await?;
    tx.commit().await?;
    Ok(report)
}

/// Records the live identity as the one issued from, without fencing (an operator who knows nothing
/// was lost, as after a planned switchover to a synchronous standby); audited. Returns whether
/// anything changed.
pub async fn accept(db: &PgPool, actor: &Actor) -> Result<bool, sqlx::Error> {
    let mut conn = db.acquire().await?;
    let mut tx = locked(&mut conn).await?;
    let live: Value = sqlx::query_scalar("SELECT cif_database_identity()").fetch_one(&mut *tx).await?;
    let recorded: Option<(Value, Option<Value>)> =
        sqlx::query_as("SELECT identity, halted_for FROM cif_incarnation FOR UPDATE").fetch_optional(&mut *tx).await?;
    if matches!(&recorded, Some((identity, None)) if *identity == live) {
        return Ok(false);
    }
    let previous = recorded.map_or(Value::Null, |(identity, _)| identity);
    sqlx::query("INSERT INTO cif_fences (previous, current, outcome, actor) VALUES ($1, $2, 'accepted', $3)")
        .bind(&previous)
        .bind(&live)
        .bind(&actor.name)
        .execute(&mut *tx)
        .await?;
    record_identity(&mut tx, &live).await?;
    let detail = serde_json::json!({ "previous": previous, "current": live });
    let event = Event { action: audit::action::INCARNATION_ACCEPTED, detail: Some(detail), ..Event::default() };
    audit::record(&mut tx, actor, &event).await?;
    tx.commit().await?;
    Ok(true)
}

async fn record_identity(conn: &mut PgConnection, live: &Value) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO cif_incarnation (identity) VALUES ($1) ON CONFLICT (only_row) DO UPDATE \
         SET identity = $1, recorded_at = now(), halted_for = NULL, halted_at = NULL",
    )
    .bind(live)
    .execute(conn)
    .await?;
    Ok(())
}

/// The fence itself, in the caller's transaction (which holds the fence lock).
async fn fence_in(
    tx: &mut PgConnection,
    policy: &FencePolicy,
    previous: Value,
    current: Value,
    actor: &Actor,
) -> Result<FenceReport, sqlx::Error> {
    metrics::counter!("cifpool_database_fences_total").increment(1);
    let fence: i64 = sqlx::query_scalar(
        "INSERT INTO cif_fences (previous, current, outcome, actor) VALUES ($1, $2, 'fenced', $3) RETURNING id",
    )
    .bind(&previous)
    .bind(&current)
    .bind(&actor.name)
    .fetch_one(&mut *tx)
    .await?;
    // The pool rows first: a refill under way holds its pool's row until it commits, so once these
    // are locked every code generated from an old counter is in the table the next statement reads.
    sqlx::query("SELECT id FROM cif_pools ORDER BY id FOR UPDATE").execute(&mut *tx).await?;
    let set_aside: Vec<(i16, i64)> = sqlx::query_as(
        "WITH gone AS (DELETE FROM cif_codes RETURNING pool_id, counter, code, state, holder), \
              kept AS (INSERT INTO cif_fenced_codes (fence_id, pool_id, counter, code, state, holder) \
                       SELECT $1, pool_id, counter, code, state, holder FROM gone ON CONFLICT DO NOTHING) \
         SELECT pool_id, count(*) FROM gone GROUP BY pool_id",
    )
    .bind(fence)
    .fetch_all(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM cif_idempotency").execute(&mut *tx).await?;
    let (names, margins): (Vec<String>, Vec<i64>) = policy.margins.iter().cloned().unzip();
    // A pool the configuration does not name jumps by the default margin of its digits.
    let jumped: Vec<(i16, String, i64, i64)> = sqlx::query_as(
        "UPDATE cif_pools AS p SET next_counter = LEAST(old.next_counter + coalesce(m.margin, \
                LEAST(1000000, (10::numeric ^ old.digits)::int8 / 20)), (10::numeric ^ old.digits)::int8), \
                updated_at = now() \
         FROM cif_pools AS old LEFT JOIN unnest($1::text[], $2::int8[]) AS m(name, margin) ON m.name = old.name \
         WHERE p.id = old.id \
         RETURNING p.id, p.name, old.next_counter, p.next_counter",
    )
    .bind(&names)
    .bind(&margins)
    .fetch_all(&mut *tx)
    .await?;
    let mut pools = Vec::new();
    for (id, name, counter_from, counter_to) in jumped {
        let set_aside = set_aside.iter().find(|(pool, _)| *pool == id).map_or(0, |(_, n)| *n);
        let detail = serde_json::json!({
            "fence": fence, "set_aside": set_aside, "counter_from": counter_from, "counter_to": counter_to,
        });
        let event =
            Event { action: audit::action::POOL_FENCED, pool: Some(&name), detail: Some(detail), ..Event::default() };
        audit::record(&mut *tx, actor, &event).await?;
        pools.push(PoolFenced { pool: name, set_aside, counter_from, counter_to });
    }
    pools.sort_by(|a, b| a.pool.cmp(&b.pool));
    sqlx::query("UPDATE cif_fences SET detail = $2 WHERE id = $1")
        .bind(fence)
        .bind(serde_json::to_value(&pools).unwrap_or_default())
        .execute(&mut *tx)
        .await?;
    record_identity(&mut *tx, &current).await?;
    Ok(FenceReport { fence, previous, current, pools })
}

/// Checks that the database is still the one codes were issued from (see [`IncarnationGuard::check`]);
/// run every `database.incarnation_check_interval`: a restore into the same database under running
/// instances keeps their connections, and this is what notices it. A failed check is retried at the
/// next one.
pub(crate) async fn check_incarnation(db: PgPool, guard: Arc<IncarnationGuard>) {
    let checked = async {
        let mut conn = db.acquire().await?;
        guard.check(&mut conn).await
    };
    if let Err(e) = checked.await {
        tracing::debug!(error = %e, "database identity check failed; retried at the next interval");
    }
}
