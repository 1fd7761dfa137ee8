//! Erasing one customer's personal data on request. Sealed recipients cannot be searched in SQL (the
//! table holds ciphertext and a masked form shared by many numbers), so the erasure reads every job
//! still holding personal data (waiting, kept by its class, or dead), opens each as a worker would,
//! and erases the recipient's: a waiting job is canceled, a dead letter discarded, a finished one
//! keeps its row with payload and sealed data gone and recipient masked. A job being sent right now is
//! left to its worker (it is erased as it finishes) and counted, so the operator can run it again.
//!
//! Nothing is changed without `apply`; the run writes one `personal_data.erased` audit row with the
//! counts, never the recipient.

use serde::Serialize;
use sqlx::{PgPool, Row};

use crate::audit::{self, Actor, Event};
use crate::queue::seal::Seal;
use crate::queue::status::JobStatus;

/// Rows read per page of the scan.
const PAGE: i64 = 5_000;

/// What an erasure found and did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Erasure {
    /// Jobs holding personal data that were read.
    pub scanned: u64,
    /// Of them, the recipient's.
    pub matched: u64,
    /// Waiting jobs canceled.
    pub canceled: u64,
    /// Dead letters discarded.
    pub discarded: u64,
    /// Finished jobs whose kept data was erased.
    pub erased: u64,
    /// Jobs of the recipient being sent right now: erased by their worker as they finish; run again to
    /// be sure.
    pub in_flight: u64,
    /// Rows whose sealed data did not open (another master key, or changed): not matched, not changed.
    pub unreadable: u64,
    /// Whether the changes were made (without `--apply` nothing is).
    pub applied: bool,
}

/// Erases what the service holds of `recipient` (of `tenant`'s jobs only, if given); with `apply`
/// off, only counts.
pub(crate) async fn erase_recipient(
    db: &PgPool,
    seal: &Seal,
    recipient: &str,
    tenant: Option<&str>,
    apply: bool,
    actor: &Actor,
) -> Result<Erasure, sqlx::Error> {
    let recipient = recipient.trim();
    let mut report = Erasure::default();
    let mut matched: Vec<i64> = Vec::new();
    let mut after = 0_i64;
    loop {
        let rows = sqlx::query(
            "SELECT id, recipient, sealed, sealed_with, status FROM notification_jobs \
             WHERE id > $1 AND (sealed IS NOT NULL OR payload IS NOT NULL) AND ($2::text IS NULL OR tenant = $2) \
             ORDER BY id LIMIT $3",
        )
        .bind(after)
        .bind(tenant)
        .bind(PAGE)
        .fetch_all(db)
        .await?;
        for row in &rows {
            report.scanned += 1;
            let id: i64 = row.get("id");
            after = id;
            let theirs = match row.get::<Option<&[u8]>, _>("sealed") {
                Some(sealed) => {
                    match seal.open(row.get::<Option<&str>, _>("sealed_with").unwrap_or_default(), sealed) {
                        Ok(opened) => opened.recipient == recipient,
                        Err(_) => {
                            report.unreadable += 1;
                            false
                        }
                    }
                }
                None => row.get::<&str, _>("recipient") == recipient,
            };
            if theirs {
                report.matched += 1;
                if row.get::<&str, _>("status") == JobStatus::Sending.as_str() {
                    report.in_flight += 1;
                } else {
                    matched.push(id);
                }
            }
        }
        if (rows.len() as i64) < PAGE {
            break;
        }
    }
    if !apply || matched.is_empty() {
        return Ok(report);
    }
    let mut tx = db.begin().await?;
    let changed =
        sqlx::query(sqlx::AssertSqlSafe(ERASE.as_str())).bind(&matched).bind(&actor.name).fetch_all(&mut *tx).await?;
    for row in &changed {
        match row.get::<&str, _>("was") {
            s if s == JobStatus::Dead.as_str() => report.discarded += 1,
            s if JobStatus::FINISHED.iter().any(|f| f.as_str() == s) => report.erased += 1,
            _ => report.canceled += 1,
        }
    }
    // A job that began sending between the scan and the erase is left to its worker.
    report.in_flight += matched.len() as u64 - changed.len() as u64;
    report.applied = true;
    let detail = serde_json::json!({
        "tenant": tenant, "matched": report.matched, "canceled": report.canceled,
        "discarded": report.discarded, "erased": report.erased, "in_flight": report.in_flight,
    });
    let event = Event { action: audit::action::PERSONAL_DATA_ERASED, detail: Some(detail), ..Event::default() };
    audit::record(&mut tx, actor, &event).await?;
    tx.commit().await?;
    Ok(report)
}

/// Erases jobs `$1` that no worker holds: waiting ones are canceled (by actor `$2`), dead letters
/// discarded, finished ones keep their status; returns each job's status before.
static ERASE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let finished = JobStatus::sql_list(&JobStatus::FINISHED);
    format!(
        "WITH target AS (SELECT id, status AS was FROM notification_jobs \
                         WHERE id = ANY($1) AND status <> {sending} FOR UPDATE) \
         UPDATE notification_jobs j SET \
             status = CASE WHEN t.was = {dead} THEN {discarded} WHEN t.was IN ({finished}) THEN t.was \
                           ELSE {canceled} END, \
             finished_at = coalesce(j.finished_at, clock_timestamp()), \
             last_error = CASE WHEN t.was IN ({waiting}) THEN 'canceled by ' || $2 || ': personal data erased on request' \
                               ELSE j.last_error END, \
             payload = NULL, sealed = NULL, recipient = notification_masked(j.recipient), \
             personal_data_erase_at = NULL \
         FROM target t WHERE j.id = t.id RETURNING t.was",
        sending = JobStatus::Sending.sql(),
        dead = JobStatus::Dead.sql(),
        discarded = JobStatus::Discarded.sql(),
        canceled = JobStatus::Canceled.sql(),
        waiting = JobStatus::sql_list(&JobStatus::CANCELABLE),
    )
});
