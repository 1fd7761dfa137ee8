//! The audit trail: who did what to which CIF, pool, dead letter or key, and when.
//!
//! `audit_events` is append-only (triggers refuse UPDATE, DELETE and TRUNCATE). Every row is written by
//! the statement or transaction that makes the change it records: a CIF transition adds its row in the
//! same statement ([`audited`] wraps the transition as a CTE), a refill batch in its own transaction,
//! a key change beside the key row. So a change cannot commit without its row, and a change that rolls
//! back leaves none.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

/// Who acts: the name a row carries as its actor, and the request that carried it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    /// An API key's name, `bootstrap` (the admin token) or `system` (schedules and sweeps).
    pub name: String,
    /// The service's own id of the request that carried the action (a fresh UUID per request, never
    /// the caller's), when it came over HTTP.
    pub request_id: Option<String>,
    /// What the caller sent as `X-Request-Id`, if anything acceptable: its own correlation id, kept
    /// beside the service's and trusted for nothing.
    pub client_request_id: Option<String>,
}

impl Actor {
    /// `name` acting outside any HTTP request (no request ids).
    pub fn named(name: impl Into<String>) -> Actor {
        Actor { name: name.into(), request_id: None, client_request_id: None }
    }

    /// The service itself: scheduled refills and reclaims, the sweeper.
    pub fn system() -> Actor {
        Actor { name: SYSTEM.into(), request_id: None, client_request_id: None }
    }

    /// An operator at the command line (`cifpool keys …`): recorded as `cli` plus the OS user.
    pub fn cli() -> Actor {
        let user = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
        Actor { name: format!("cli:{user}"), request_id: None, client_request_id: None }
    }
}

/// The actor name of the service's own work.
pub(crate) const SYSTEM: &str = "system";

/// The actor name of `security.admin_token`'s bearer.
pub(crate) const BOOTSTRAP: &str = "bootstrap";

/// The actor name of a refused attempt whose credential named nobody (a failed console sign-in).
pub(crate) const ANONYMOUS: &str = "anonymous";

/// Whether `name` is (or could be read as) an actor the service writes itself: `system`, `bootstrap`
/// (the admin token) or `cli:…` (an operator at the command line), in any letter case. No API key may
/// take such a name, or the audit trail could not tell its actions from the service's.
pub(crate) fn is_reserved_actor(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    lower == SYSTEM || lower == ANONYMOUS || lower == BOOTSTRAP || lower.starts_with("cli:")
}

/// What the audited actions are called.
pub mod action {
    /// A code was reserved.
    pub(crate) const CIF_RESERVED: &str = "cif.reserved";
    /// A reservation was served again for a repeated `Idempotency-Key`.
    pub(crate) const CIF_REPLAYED: &str = "cif.replayed";
    /// A code was confirmed: it is a customer's number for good.
    pub(crate) const CIF_CONFIRMED: &str = "cif.confirmed";
    /// A hold was released by its holder.
    pub(crate) const CIF_RELEASED: &str = "cif.released";
    /// A hold's lease was extended.
    pub(crate) const CIF_EXTENDED: &str = "cif.extended";
    /// A hold whose lease expired was taken back (by the schedule or an admin).
    pub(crate) const CIF_RECLAIMED: &str = "cif.reclaimed";
    /// A refill batch generated codes (detail: first_counter, end_counter, codes, skipped, key_epoch,
    /// force).
    pub(crate) const POOL_REFILLED: &str = "pool.refilled";
    /// The pool was fenced: the database was not the one codes were issued from, so its available and
    /// held codes were set aside and its counter moved on (detail: fence, set_aside, counter_from,
    /// counter_to).
    pub(crate) const POOL_FENCED: &str = "pool.fenced";
    /// The pool was reconciled with the customer system's list of issued codes (detail: listed,
    /// already_issued, were_available, were_held, were_set_aside, were_unknown, counter_before,
    /// counter_after).
    pub(crate) const POOL_RECONCILED: &str = "pool.reconciled";
    /// A new key epoch was started for the pool: new codes come from a key derived with a new
    /// `key_id` (detail: epoch, key_id, key_check, first_counter, available_discarded).
    pub(crate) const POOL_KEY_ROTATED: &str = "pool.key_rotated";
    /// An operator accepted a changed database as it is, without fencing (detail: previous, current).
    pub(crate) const INCARNATION_ACCEPTED: &str = "incarnation.accepted";
    /// Dead letters were put back in the queue (detail: filter, pace, count).
    pub(crate) const DLQ_REPLAYED: &str = "dlq.replayed";
    /// An API key was created (detail: scopes, tenants).
    pub(crate) const KEY_CREATED: &str = "key.created";
    /// An API key was revoked.
    pub(crate) const KEY_REVOKED: &str = "key.revoked";
    /// A notification was canceled before it was sent (detail: job, tenant, class).
    pub(crate) const JOB_CANCELED: &str = "job.canceled";
    /// Unsent jobs of a batch were canceled (detail: batch, count; one row per statement).
    pub(crate) const BATCH_CANCELED: &str = "batch.canceled";
    /// A class or a provider was paused for every pod (detail: kind, name).
    pub(crate) const QUEUE_PAUSED: &str = "queue.paused";
    /// A pause was lifted (detail: kind, name).
    pub(crate) const QUEUE_RESUMED: &str = "queue.resumed";
    /// One dead letter was put back in the queue (detail: job, extra attempts).
    pub(crate) const DLQ_RETRIED: &str = "dlq.retried";
    /// One dead letter was discarded (detail: job).
    pub(crate) const DLQ_DISCARDED: &str = "dlq.discarded";
    /// One recipient's personal data was erased on request (detail: tenant, matched, canceled,
    /// discarded, erased, in_flight; never the recipient).
    pub(crate) const PERSONAL_DATA_ERASED: &str = "personal_data.erased";
    /// An admin signed in to the operations console (the actor is the key that signed in).
    pub(crate) const CONSOLE_SIGNED_IN: &str = "console.signed_in";
    /// An admin signed out of the operations console.
    pub(crate) const CONSOLE_SIGNED_OUT: &str = "console.signed_out";
    /// A console sign-in was refused (detail: the client's address and why); the actor is
    /// `anonymous` for an unknown key, else the key that lacked the admin scope.
    pub(crate) const CONSOLE_SIGN_IN_REFUSED: &str = "console.sign_in_refused";
}

/// The statement `statement` (whose `RETURNING` rows are the CTE `done`) followed, in the same
/// statement, by `insert` (an [`insert_from`] reading `done`), answering `SELECT {result} FROM done`.
pub fn audited(statement: &str, insert: &str, result: &str) -> String {
    format!("WITH done AS ({statement}), audit AS ({insert}) SELECT {result} FROM done")
}

/// The SQL expressions of one audit row's columns; unset ones are `NULL`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Columns<'a> {
    /// The actor's name.
    pub actor: &'a str,
    /// The service's request id.
    pub request_id: &'a str,
    /// The caller's own request id.
    pub client_request_id: &'a str,
    /// The pool's name.
    pub pool: &'a str,
    /// The code.
    pub cif: &'a str,
    /// The holder (pod) named by the request or recorded on the hold.
    pub holder: &'a str,
    /// The caller's reference for the customer.
    pub customer_ref: &'a str,
    /// A `jsonb` value with the rest.
    pub detail: &'a str,
}

impl Default for Columns<'_> {
    fn default() -> Self {
        Columns {
            actor: "NULL",
            request_id: "NULL",
            client_request_id: "NULL",
            pool: "NULL",
            cif: "NULL",
            holder: "NULL",
            customer_ref: "NULL",
            detail: "NULL",
        }
    }
}

/// `INSERT INTO audit_events … SELECT '{action}', {columns} FROM {from}`: one row per row of `from`.
pub(crate) fn insert_from(action: &str, columns: &Columns<'_>, from: &str) -> String {
    let Columns { actor, request_id, client_request_id, pool, cif, holder, customer_ref, detail } = columns;
    format!(
        "INSERT INTO audit_events (action, actor, request_id, client_request_id, pool, cif, holder, customer_ref, \
         detail) SELECT '{action}', {actor}, {request_id}, {client_request_id}, {pool}, {cif}, {holder}, \
         {customer_ref}, {detail} FROM {from}"
    )
}

/// One event, for the actions that write their row as a statement of their own transaction.
#[derive(Debug, Clone, Default)]
pub struct Event<'a> {
    /// One of [`action`].
    pub action: &'a str,
    /// The pool concerned.
    pub pool: Option<&'a str>,
    /// The code concerned.
    pub cif: Option<&'a str>,
    /// The rest, as JSON.
    pub detail: Option<serde_json::Value>,
}

/// Appends `event` by `actor` on `conn` (the transaction making the change).
pub async fn record(conn: &mut sqlx::PgConnection, actor: &Actor, event: &Event<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO audit_events (action, actor, request_id, client_request_id, pool, cif, detail) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(event.action)
    .bind(&actor.name)
    .bind(&actor.request_id)
    .bind(&actor.client_request_id)
    .bind(event.pool)
    .bind(event.cif)
    .bind(&event.detail)
    .execute(conn)
    .await?;
    Ok(())
}

/// One row of the trail.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct AuditEvent {
    /// Position in the trail (increasing); the paging cursor.
    pub id: i64,
    /// When the change was written.
    pub at: DateTime<Utc>,
    /// One of [`action`].
    pub action: String,
    /// Key name, `bootstrap` or `system`.
    pub actor: String,
    /// The service's id of the request that made the change (as in its `X-Request-Id` answer and
    /// the access log).
    pub request_id: Option<String>,
    /// What that request's caller sent as `X-Request-Id`, if anything.
    pub client_request_id: Option<String>,
    /// Pool concerned.
    pub pool: Option<String>,
    /// Code concerned.
    pub cif: Option<String>,
    /// Holder (pod) named on the hold or by the request.
    pub holder: Option<String>,
    /// The caller's reference for the customer (confirmations).
    pub customer_ref: Option<String>,
    /// The rest of what the action has to say.
    pub detail: Option<serde_json::Value>,
}

/// Which rows a search returns; unset fields match everything.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct AuditQuery {
    /// Only events of this code.
    #[serde(default)]
    pub cif: Option<String>,
    /// Only events carrying this customer reference.
    #[serde(default)]
    pub customer_ref: Option<String>,
    /// Only events by this actor.
    #[serde(default)]
    pub actor: Option<String>,
    /// Only events of this action, e.g. `cif.confirmed`.
    #[serde(default)]
    pub action: Option<String>,
    /// Only events at or after this time.
    #[serde(default)]
    pub since: Option<DateTime<Utc>>,
    /// Only events before this time.
    #[serde(default)]
    pub until: Option<DateTime<Utc>>,
    /// Only events older than this id (the `next_cursor` of the previous page).
    #[serde(default)]
    pub cursor: Option<i64>,
    /// Page size, 1 to [`MAX_PAGE`] (default 100).
    #[serde(default)]
    pub limit: Option<i64>,
}

/// Largest page of a search.
pub(crate) const MAX_PAGE: i64 = 1000;

impl AuditQuery {
    /// Filter values go to SQL as text: bounded, no control characters.
    pub fn validate(&self) -> Result<(), String> {
        for (field, value) in
            [("cif", &self.cif), ("customer_ref", &self.customer_ref), ("actor", &self.actor), ("action", &self.action)]
        {
            if let Some(v) = value {
                crate::validate::text(field, v, 200)?;
            }
        }
        if let Some(limit) = self.limit
            && !(1..=MAX_PAGE).contains(&limit)
        {
            return Err(format!("limit must be between 1 and {MAX_PAGE}"));
        }
        if let (Some(since), Some(until)) = (self.since, self.until)
            && since > until
        {
            return Err("since must not be after until".into());
        }
        Ok(())
    }
}

/// A page of the trail, newest first.
#[derive(Debug, Clone, Serialize)]
pub struct AuditPage {
    /// The events.
    pub events: Vec<AuditEvent>,
    /// Pass as `cursor` for the next (older) page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<i64>,
}

/// The trail as admins read it (the API and the console).
#[derive(Clone)]
pub struct AuditTrail {
    db: PgPool,
}

impl AuditTrail {
    /// The trail kept in `db`.
    pub fn new(db: PgPool) -> AuditTrail {
        AuditTrail { db }
    }

    /// One page of the events `q` selects, newest first.
    pub async fn search(&self, q: &AuditQuery) -> Result<AuditPage, sqlx::Error> {
        search(&self.db, q).await
    }
}

/// Searches the trail, newest first, one page at a time.
pub async fn search(db: &PgPool, q: &AuditQuery) -> Result<AuditPage, sqlx::Error> {
    let limit = q.limit.unwrap_or(100).clamp(1, MAX_PAGE);
    let mut events: Vec<AuditEvent> = sqlx::query_as(
        "SELECT id, at, action, actor, request_id, client_request_id, pool, cif, holder, customer_ref, detail FROM audit_events \
         WHERE ($1::text IS NULL OR cif = $1) AND ($2::text IS NULL OR customer_ref = $2) \
           AND ($3::text IS NULL OR actor = $3) AND ($4::text IS NULL OR action = $4) \
           AND ($5::timestamptz IS NULL OR at >= $5) AND ($6::timestamptz IS NULL OR at < $6) \
           AND ($7::int8 IS NULL OR id < $7) \
         ORDER BY id DESC LIMIT $8",
    )
    .bind(&q.cif)
    .bind(&q.customer_ref)
    .bind(&q.actor)
    .bind(&q.action)
    .bind(q.since)
    .bind(q.until)
    .bind(q.cursor)
    .bind(limit + 1)
    .fetch_all(db)
    .await?;
    let next_cursor = if events.len() as i64 > limit {
        events.truncate(limit as usize);
        events.last().map(|e| e.id)
    } else {
        None
    };
    Ok(AuditPage { events, next_cursor })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audited_statements_insert_from_the_change_itself() {
        let insert =
            insert_from(action::CIF_RELEASED, &Columns { actor: "$5", cif: "done.code", ..Columns::default() }, "done");
        let sql = audited("UPDATE cif_codes SET state = 'available' RETURNING code", &insert, "code");
        assert_eq!(
            sql,
            "WITH done AS (UPDATE cif_codes SET state = 'available' RETURNING code), audit AS (INSERT INTO \
             audit_events (action, actor, request_id, client_request_id, pool, cif, holder, customer_ref, \
             detail) SELECT 'cif.released', $5, NULL, NULL, NULL, done.code, NULL, NULL, NULL FROM done) SELECT \
             code FROM done"
        );
    }
}
