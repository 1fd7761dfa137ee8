//! Reconcile the pools with the bank's system of record: every number the customer system holds is
//! issued here, none is ever handed out again, and each pool's counter moves past the highest one.
//!
//! What a restore or a storage rollback forgot, the customer system still knows. Its list (one code per
//! line, optionally followed by a comma or tab and the customer's reference, kept on rows this adds) is
//! decoded to pool and counter (the permutation's inverse), copied into a temporary table, and
//! compared with the pools set-wise in one transaction that holds every pool's row (refills wait):
//! - already in `cif_issued`: nothing to do;
//! - in `cif_codes` (available, or held by an onboarding now: that hold is lost): moved to `cif_issued`;
//! - anywhere else (set aside by a fence, skipped, generated in a lost history, or ahead of the counter):
//!   added to `cif_issued`;
//! - the counter moves to one past the highest listed counter when it is not past it already.
//!
//! A dry run (the default) runs the same statements and rolls them back, so its report is exactly what
//! applying would do. Applying twice changes nothing the second time. Each pool that changed gets a
//! `pool.reconciled` audit row with the counts. Issued rows it adds carry holder `reconcile` and the
//! listed customer reference, if any (a row already issued keeps its own).

use std::time::Instant;

use serde::Serialize;
use sqlx::{Acquire, PgPool, Row};
use tokio::io::{AsyncBufRead, AsyncBufReadExt};

use crate::audit::{self, Actor, Event};
use crate::cif::Pools;

/// Rows sent to the server per `COPY` message.
const COPY_CHUNK: usize = 50_000;
/// Invalid lines quoted in a report.
const INVALID_QUOTED: usize = 20;
/// Longest line read as a code (longer ones are invalid; a code has at most 26 characters).
const MAX_LINE: usize = 64;
/// Longest customer reference, as the confirm endpoint takes it.
const MAX_CUSTOMER_REF: usize = 200;

/// What a reconcile found and did (or, in a dry run, would do).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReconcileReport {
    /// Whether the changes were committed (false: a dry run, rolled back).
    pub applied: bool,
    /// Non-empty lines read.
    pub lines: u64,
    /// Lines that are no code of a configured pool (nothing is applied while there are any).
    pub invalid: u64,
    /// The first invalid lines, with what is wrong.
    pub invalid_examples: Vec<String>,
    /// Codes listed more than once (counted once).
    pub duplicates: u64,
    /// Per pool with listed codes.
    pub pools: Vec<PoolReconciled>,
    /// Wall time.
    pub duration_ms: f64,
}

/// One pool's part of a reconcile.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct PoolReconciled {
    /// Pool name.
    pub pool: String,
    /// Distinct codes listed.
    pub listed: u64,
    /// Already issued here.
    pub already_issued: u64,
    /// Were available: now issued.
    pub were_available: u64,
    /// Were held by an onboarding: now issued (that hold's confirm will answer 409).
    pub were_held: u64,
    /// Had been set aside by a fence: now issued.
    pub were_set_aside: u64,
    /// In no table (a lost history, a skipped range, ahead of the counter): now issued.
    pub were_unknown: u64,
    /// The pool's counter before.
    pub counter_before: i64,
    /// And after (past every listed code).
    pub counter_after: i64,
}

/// Why a reconcile did not run.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// The list could not be read.
    #[error("reading the list: {0}")]
    Read(#[from] std::io::Error),
    /// The list holds no code at all: a wrong file or an empty body, never what a bank means.
    #[error("the list is empty: give one code per line")]
    Empty,
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Reconciles `pools` with the codes in `list` (one per line; blank lines ignored), committing only
/// with `apply` and when every line is valid. `progress` is told how many lines have been read.
pub async fn reconcile(
    db: &PgPool,
    pools: &Pools,
    list: impl AsyncBufRead + Unpin,
    apply: bool,
    actor: &Actor,
    progress: &(dyn Fn(u64) + Send + Sync),
) -> Result<ReconcileReport, ReconcileError> {
    let started = Instant::now();
    let mut report = ReconcileReport::default();
    let mut conn = db.acquire().await?;
    let mut tx = conn.begin().await?;
    sqlx::query("SET LOCAL statement_timeout = 0").execute(&mut *tx).await?;
    // Codes of a key epoch another instance started must be read under its key.
    for pool in pools.iter() {
        pool.reload_keys(&mut tx).await?;
    }
    sqlx::query(
        "CREATE TEMP TABLE reconcile_input (pool_id int2, counter int8, code text, customer_ref text) ON COMMIT DROP",
    )
    .execute(&mut *tx)
    .await?;

    let mut copy = tx.copy_in_raw("COPY reconcile_input (pool_id, counter, code, customer_ref) FROM STDIN").await?;
    let mut text = String::with_capacity(COPY_CHUNK * 32);
    let mut rows = 0usize;
    let mut lines = list.lines();
    while let Some(line) = lines.next_line().await? {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        report.lines += 1;
        if report.lines.is_multiple_of(100_000) {
            progress(report.lines);
        }
        match parse(pools, line) {
            Ok(Listed { pool_id, counter, code, customer_ref }) => {
                use std::fmt::Write;
                // COPY's text format: a backslash is its escape; a reference holds no control character.
                let customer_ref = customer_ref.map_or_else(|| "\\N".to_string(), |r| r.replace('\\', "\\\\"));
                let _ = writeln!(text, "{pool_id}\t{counter}\t{code}\t{customer_ref}");
                rows += 1;
                if rows == COPY_CHUNK {
                    copy.send(text.as_bytes()).await?;
                    text.clear();
                    rows = 0;
                }
            }
            Err(why) => {
                report.invalid += 1;
                if report.invalid_examples.len() < INVALID_QUOTED {
                    let shown: String = line.chars().take(MAX_LINE).collect();
                    report.invalid_examples.push(format!("line {}: {shown:?}: {why}", report.lines));
                }
            }
        }
    }
    if !text.is_empty() {
        copy.send(text.as_bytes()).await?;
    }
    copy.finish().await?;
    progress(report.lines);
    if report.lines == 0 {
        return Err(ReconcileError::Empty);
    }

    sqlx::query(
        "CREATE TEMP TABLE reconcile_listed ON COMMIT DROP AS \
         SELECT DISTINCT ON (pool_id, counter) pool_id, counter, code, customer_ref FROM reconcile_input \
         ORDER BY pool_id, counter, customer_ref",
    )
    .execute(&mut *tx)
    .await?;
    sqlx::query("ALTER TABLE reconcile_listed ADD PRIMARY KEY (pool_id, counter)").execute(&mut *tx).await?;
    sqlx::query("ANALYZE reconcile_listed").execute(&mut *tx).await?;
    let distinct: i64 = sqlx::query_scalar("SELECT count(*) FROM reconcile_listed").fetch_one(&mut *tx).await?;
    report.duplicates = report.lines - report.invalid - distinct as u64;

    // Every pool's row: a refill under way finishes first, and none starts until this commits.
    sqlx::query("SELECT id FROM cif_pools ORDER BY id FOR UPDATE").execute(&mut *tx).await?;
    let mut by_pool: std::collections::BTreeMap<i16, PoolReconciled> = std::collections::BTreeMap::new();
    for row in
        sqlx::query("SELECT pool_id, count(*) AS n FROM reconcile_listed GROUP BY pool_id").fetch_all(&mut *tx).await?
    {
        let entry = by_pool.entry(row.get("pool_id")).or_default();
        entry.listed = row.get::<i64, _>("n") as u64;
    }
    // Codes still in the pool (available or held) become issued.
    for row in sqlx::query(
        "WITH moved AS ( \
            DELETE FROM cif_codes c USING reconcile_listed l \
            WHERE c.pool_id = l.pool_id AND c.counter = l.counter \
            RETURNING c.pool_id, c.counter, c.code, c.state), \
         issued AS ( \
            INSERT INTO cif_issued (pool_id, counter, code, customer_ref, holder, lease_token, reserved_at) \
            SELECT m.pool_id, m.counter, m.code, l.customer_ref, 'reconcile', gen_random_uuid(), now() \
            FROM moved m JOIN reconcile_listed l USING (pool_id, counter)) \
         SELECT pool_id, state, count(*) AS n FROM moved GROUP BY pool_id, state",
    )
    .fetch_all(&mut *tx)
    .await?
    {
        let entry = by_pool.entry(row.get("pool_id")).or_default();
        let n = row.get::<i64, _>("n") as u64;
        if row.get::<String, _>("state") == "reserved" {
            entry.were_held += n;
        } else {
            entry.were_available += n;
        }
    }
    // The rest that is not issued yet: set aside by a fence, or in no table at all.
    for row in sqlx::query(
        "WITH missing AS ( \
            SELECT l.pool_id, l.counter, l.code, l.customer_ref FROM reconcile_listed l \
            WHERE NOT EXISTS (SELECT FROM cif_issued i WHERE i.pool_id = l.pool_id AND i.counter = l.counter)), \
         issued AS ( \
            INSERT INTO cif_issued (pool_id, counter, code, customer_ref, holder, lease_token, reserved_at) \
            SELECT pool_id, counter, code, customer_ref, 'reconcile', gen_random_uuid(), now() FROM missing) \
         SELECT m.pool_id, f.counter IS NOT NULL AS set_aside, count(*) AS n \
         FROM missing m LEFT JOIN cif_fenced_codes f ON f.pool_id = m.pool_id AND f.counter = m.counter \
         GROUP BY 1, 2",
    )
    .fetch_all(&mut *tx)
    .await?
    {
        let entry = by_pool.entry(row.get("pool_id")).or_default();
        let n = row.get::<i64, _>("n") as u64;
        if row.get::<bool, _>("set_aside") {
            entry.were_set_aside += n;
        } else {
            entry.were_unknown += n;
        }
    }
    // Counters move past the highest listed code.
    for row in sqlx::query(
        "UPDATE cif_pools AS p SET next_counter = GREATEST(old.next_counter, m.top + 1), updated_at = now() \
         FROM cif_pools AS old, (SELECT pool_id, max(counter) AS top FROM reconcile_listed GROUP BY pool_id) AS m \
         WHERE p.id = old.id AND p.id = m.pool_id \
         RETURNING p.id, p.name, old.next_counter AS before, p.next_counter AS after",
    )
    .fetch_all(&mut *tx)
    .await?
    {
        let entry = by_pool.entry(row.get("id")).or_default();
        entry.pool = row.get("name");
        entry.counter_before = row.get("before");
        entry.counter_after = row.get("after");
    }
    for entry in by_pool.values_mut() {
        let changed = entry.were_available + entry.were_held + entry.were_set_aside + entry.were_unknown;
        entry.already_issued = entry.listed - changed;
        if changed > 0 || entry.counter_after != entry.counter_before {
            let detail = serde_json::to_value(&*entry).unwrap_or_default();
            let event = Event {
                action: audit::action::POOL_RECONCILED,
                pool: Some(&entry.pool),
                detail: Some(detail),
                ..Event::default()
            };
            audit::record(&mut tx, actor, &event).await?;
        }
    }
    report.pools = by_pool.into_values().collect();
    report.applied = apply && report.invalid == 0;
    if report.applied {
        tx.commit().await?;
    } else {
        tx.rollback().await?;
    }
    report.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
    Ok(report)
}

/// One valid line of the list.
struct Listed<'a> {
    pool_id: i16,
    counter: u64,
    code: &'a str,
    customer_ref: Option<&'a str>,
}

/// `line` (trimmed, not empty) as a code of a configured pool and an optional customer reference, or
/// why it is not one.
fn parse<'a>(pools: &Pools, line: &'a str) -> Result<Listed<'a>, String> {
    let (code, customer_ref) = match line.split_once([',', '\t']) {
        Some((code, rest)) => (code.trim(), Some(rest.trim()).filter(|r| !r.is_empty())),
        None => (line, None),
    };
    if let Some(r) = customer_ref {
        crate::validate::text("customer_ref", r, MAX_CUSTOMER_REF)?;
    }
    let (pool_id, counter) = decode(pools, code)?;
    Ok(Listed { pool_id, counter, code, customer_ref })
}

/// The pool id and counter of `code`, or why it is none of a configured pool's.
fn decode(pools: &Pools, code: &str) -> Result<(i16, u64), String> {
    if code.len() > MAX_LINE {
        return Err("longer than any code".into());
    }
    let pool = pools.for_code(code).ok_or("not the length and prefix of any pool's codes")?;
    let located = pool.keys().locate(code).map_err(|e| e.to_string())?;
    let located = located.ok_or("a well-formed code that none of the pool's keys makes")?;
    Ok((pool.id, located.counter))
}
