//! `cifpool bench refill`: codes per second of `refill()` filling an empty pool (keyed Feistel +
//! `COPY`, batches of 10,000, each in a transaction that advances the pool's counter), against, in
//! the same run and on the same table:
//! - a naive baseline: one autocommit `INSERT` per code (code computed per row), run for
//!   `naive_rows` rows only and extrapolated to the full count;
//! - a raw `COPY` of the same rows (same counters and codes, computed beforehand, untimed) as one
//!   statement: the floor for getting these rows into this table.
//!
//! Every phase starts from an empty table (truncated when it holds only bench rows, else the pool's
//! rows deleted and the table vacuumed) after a `CHECKPOINT` (when permitted), so no phase pays for the
//! previous one's dirty pages. The pool's counter is reset: the database is scratch. An untimed `COPY`
//! of the same rows runs first, so that no measured phase pays for creating WAL segment files.
//!
//! The refill and the raw `COPY` also report where the CPU went (this process, which encodes the codes,
//! and Postgres) and the server's CPU per row written.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::cpu::{CpuSplit, CpuWatch, micros_each};
use super::report::{BenchReport, Machine, table as text_table, thousands};
use super::{BenchArgs, bench_pool};
use cifpool::cif::Pool;
use cifpool::internals::refill::{RefillOptions, refill};

/// Name of the bench pool.
pub const POOL: &str = "bench_refill";
/// Codes per refill batch (the 10,000).
pub const BATCH: u64 = 10_000;

/// Parameters of a `refill` run.
#[derive(Debug, Clone, Serialize)]
pub struct RefillBenchOptions {
    /// Codes to generate into the empty pool.
    pub codes: u64,
    /// Rows of the naive baseline.
    pub naive_rows: u64,
    /// The bench pool's cipher.
    pub cipher: cifpool::code::Cipher,
    /// Draw progress bars.
    #[serde(skip)]
    pub progress: bool,
}

impl RefillBenchOptions {
    /// From the command line.
    pub fn from_args(args: &BenchArgs) -> RefillBenchOptions {
        RefillBenchOptions {
            codes: args.refill_codes,
            naive_rows: args.naive_rows,
            cipher: args.refill_cipher,
            progress: !args.no_progress,
        }
    }
}

/// One way of filling the table.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// Rows written.
    pub rows: u64,
    /// Wall time.
    pub seconds: f64,
    /// Rows per second.
    pub codes_per_s: f64,
    /// CPU during the phase (refill and the raw `COPY` only): on a small machine the server's one
    /// backend writing the rows is what bounds both.
    pub cpu: Option<CpuSplit>,
}

impl Phase {
    fn new(rows: u64, elapsed: Duration) -> Phase {
        let seconds = elapsed.as_secs_f64();
        Phase { rows, seconds, codes_per_s: rows as f64 / seconds, cpu: None }
    }

    /// Microseconds of Postgres CPU per row written, when the phase's CPU was watched.
    fn postgres_us_per_row(&self) -> Option<f64> {
        self.cpu.and_then(|c| micros_each(c.postgres_cores, self.codes_per_s))
    }
}

/// Figures of a `refill` run.
#[derive(Debug, Clone, Serialize)]
pub struct RefillResults {
    /// `refill()` with `force`, batch 10,000 × ceil(codes / 10,000) batches.
    pub refill: Phase,
    /// Batches committed.
    pub refill_batches: u32,
    /// One autocommit INSERT per code, `naive_rows` rows.
    pub naive_insert: Phase,
    /// The naive rate extrapolated to `codes` rows, seconds.
    pub naive_extrapolated_seconds: f64,
    /// One COPY of the same rows.
    pub copy: Phase,
    /// Computing the same codes alone (permutation + check digit + text), untimed in `copy`.
    pub encode_only: Phase,
    /// refill codes/s ÷ COPY codes/s (1.0 = as fast as a raw COPY).
    pub refill_over_copy: f64,
    /// refill codes/s ÷ naive codes/s.
    pub refill_over_naive: f64,
}

/// Runs the benchmark on the scratch database behind `connect`.
pub async fn run(connect: &PgConnectOptions, opts: &RefillBenchOptions) -> anyhow::Result<BenchReport<RefillResults>> {
    let db = PgPoolOptions::new().max_connections(3).connect_with(connect.clone()).await?;
    let result = measure(&db, opts).await;
    let machine = Machine::probe(&db).await;
    db.close().await;
    let (results, mut notes) = result?;
    let batches = opts.codes.div_ceil(BATCH);
    notes.push(format!(
        "naive INSERT ran {} rows; its time for {} rows is extrapolated linearly",
        opts.naive_rows, opts.codes
    ));
    let parameters = serde_json::json!({
        "codes": opts.codes,
        "batch_size": BATCH.min(opts.codes),
        "batches": batches,
        "naive_rows": opts.naive_rows,
        "pool": { "name": POOL, "digits": 9, "check": "damm", "prefix": "8", "cipher": opts.cipher },
        "order": ["warm-up copy (untimed)", "naive_insert", "refill", "copy"],
    });
    Ok(BenchReport { target: "refill".into(), parameters, machine: machine?, results, notes })
}

async fn measure(db: &PgPool, opts: &RefillBenchOptions) -> anyhow::Result<(RefillResults, Vec<String>)> {
    let mut notes = Vec::new();
    let batch = BATCH.min(opts.codes);
    let batches = opts.codes.div_ceil(batch);
    let mut settings = bench_pool(POOL, "8", batch as u32, batches.min(10_000) as u32);
    settings.cipher = Some(opts.cipher);
    let pools = cifpool::cif::Pools::reconcile(db, &[settings], &cifpool::keys::MasterKey::generate()).await?;
    let pool = pools.get(POOL).cloned().context("bench pool missing")?;
    anyhow::ensure!(pool.codec.capacity() >= opts.codes, "the bench pool's domain is smaller than --refill-codes");

    // The raw COPY's rows, encoded once: for the warm-up and for the measured COPY.
    let started = Instant::now();
    let mut text = String::with_capacity(opts.codes as usize * 24);
    for counter in 0..opts.codes {
        let code = pool.codec.encode(counter);
        let _ = writeln!(text, "{}\t{counter}\t{code}", pool.id);
    }
    let encode_only = Phase::new(opts.codes, started.elapsed());

    // Warm-up, untimed: the same rows COPYed once. On a fresh data directory the first phase that
    // writes this much WAL also creates the segment files it goes into (each zero-filled) that the
    // phases after it get back recycled; measured, that made whichever of refill() and the COPY ran
    // first look ~12 % slower and cost ~0.4 µs more Postgres CPU a row. After this, both write into
    // recycled segments.
    empty(db, &pool, &mut notes).await?;
    copy_rows(db, &text, opts.codes, None).await?;

    // Naive: one autocommit INSERT per code, computing each code as it goes.
    empty(db, &pool, &mut notes).await?;
    let naive = {
        let bar = super::bar(opts.progress, "naive INSERT", opts.naive_rows, "rows");
        let mut conn = db.acquire().await?;
        let started = Instant::now();
        for counter in 0..opts.naive_rows {
            let code = pool.codec.encode(counter);
            sqlx::query("INSERT INTO cif_codes (pool_id, counter, code) VALUES ($1, $2, $3)")
                .bind(pool.id)
                .bind(counter as i64)
                .bind(code)
                .execute(&mut *conn)
                .await?;
            if counter.is_multiple_of(256) {
                bar.set_position(counter);
            }
        }
        let phase = Phase::new(opts.naive_rows, started.elapsed());
        bar.set_position(opts.naive_rows);
        bar.finish();
        phase
    };

    // refill(): Feistel + COPY in batches of 10,000, one transaction each.
    empty(db, &pool, &mut notes).await?;
    let (refill_phase, refill_batches) = {
        let bar = super::bar(opts.progress, "refill()", opts.codes, "codes");
        let watcher = watch_counter(db.clone(), pool.clone(), bar.clone());
        let cpu = CpuWatch::start();
        let started = Instant::now();
        let summary = refill(db, &pool, RefillOptions { force: true, ..Default::default() }).await?;
        let elapsed = started.elapsed();
        let cpu = cpu.finish().await;
        watcher.abort();
        bar.set_position(summary.codes_added);
        bar.finish();
        anyhow::ensure!(
            summary.codes_added == opts.codes,
            "refill added {} codes, expected {} ({:?})",
            summary.codes_added,
            opts.codes,
            summary.outcome
        );
        (Phase { cpu, ..Phase::new(summary.codes_added, elapsed) }, summary.batches)
    };

    // Raw COPY of the same rows.
    empty(db, &pool, &mut notes).await?;
    let bar = super::bar(opts.progress, "one COPY", text.len() as u64, "bytes");
    let copy = copy_rows(db, &text, opts.codes, Some(&bar)).await?;
    bar.finish();

    let results = RefillResults {
        naive_extrapolated_seconds: opts.codes as f64 / naive.codes_per_s,
        refill_over_copy: refill_phase.codes_per_s / copy.codes_per_s,
        refill_over_naive: refill_phase.codes_per_s / naive.codes_per_s,
        refill: refill_phase,
        refill_batches,
        naive_insert: naive,
        copy,
        encode_only,
    };
    Ok((results, notes))
}

/// One `COPY` of `text` (`rows` lines) as a single statement, timed, with the CPU it took.
async fn copy_rows(db: &PgPool, text: &str, rows: u64, bar: Option<&indicatif::ProgressBar>) -> anyhow::Result<Phase> {
    let mut conn = db.acquire().await?;
    // One statement of 1,000,000 rows may outlast the service's per-statement cap.
    sqlx::query("SET statement_timeout = 0").execute(&mut *conn).await?;
    let cpu = CpuWatch::start();
    let started = Instant::now();
    let mut copy = conn.copy_in_raw("COPY cif_codes (pool_id, counter, code) FROM STDIN").await?;
    for chunk in text.as_bytes().chunks(1 << 20) {
        copy.send(chunk).await?;
        if let Some(bar) = bar {
            bar.inc(chunk.len() as u64);
        }
    }
    let written = copy.finish().await?;
    let elapsed = started.elapsed();
    let cpu = cpu.finish().await;
    anyhow::ensure!(written == rows, "COPY wrote {written} rows, expected {rows}");
    Ok(Phase { cpu, ..Phase::new(written, elapsed) })
}

/// Shows refill progress from the committed `next_counter` (a plain read: not blocked by the row lock).
fn watch_counter(db: PgPool, pool: Arc<Pool>, bar: indicatif::ProgressBar) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(250)).await;
            if let Ok(n) = sqlx::query_scalar::<_, i64>("SELECT next_counter FROM cif_pools WHERE id = $1")
                .bind(pool.id)
                .fetch_one(&db)
                .await
            {
                bar.set_position(n as u64);
            }
        }
    })
}

/// Empties the pool's rows and resets its counter (scratch database), then checkpoints.
async fn empty(db: &PgPool, pool: &Pool, notes: &mut Vec<String>) -> anyhow::Result<()> {
    let others: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM cif_codes WHERE pool_id <> $1)")
        .bind(pool.id)
        .fetch_one(db)
        .await?;
    if others {
        sqlx::query("DELETE FROM cif_codes WHERE pool_id = $1").bind(pool.id).execute(db).await?;
        sqlx::raw_sql("VACUUM cif_codes").execute(db).await?;
        let note = "cif_codes held other pools' rows: phases started from DELETE + VACUUM, not TRUNCATE".to_string();
        if !notes.contains(&note) {
            notes.push(note);
        }
    } else {
        sqlx::raw_sql("TRUNCATE cif_codes").execute(db).await?;
    }
    sqlx::query("UPDATE cif_pools SET next_counter = 0 WHERE id = $1").bind(pool.id).execute(db).await?;
    if let Err(e) = sqlx::raw_sql("CHECKPOINT").execute(db).await {
        let note = format!("CHECKPOINT before each phase not permitted ({e}); phases may share checkpoint cost");
        if !notes.contains(&note) {
            notes.push(note);
        }
    }
    Ok(())
}

/// The summary table of a report.
pub fn table(report: &BenchReport<RefillResults>) -> String {
    let r = &report.results;
    let row = |name: &str, p: &Phase, extra: String| {
        vec![name.to_string(), thousands(p.rows as f64), format!("{:.2}", p.seconds), thousands(p.codes_per_s), extra]
    };
    let rows = vec![
        row("refill()", &r.refill, format!("{:.2}× COPY", r.refill_over_copy)),
        row("one COPY", &r.copy, "1.00× COPY".into()),
        row(
            "naive INSERT",
            &r.naive_insert,
            format!("{:.0} s for {} (extrapolated)", r.naive_extrapolated_seconds, thousands(r.refill.rows as f64)),
        ),
        row("encode only", &r.encode_only, "permutation + check digit + text".into()),
    ];
    let mut out = format!(
        "refill: filling an empty pool, {} batches of {}\n",
        r.refill_batches,
        thousands(report.parameters["batch_size"].as_f64().unwrap_or(0.0))
    );
    out.push_str(&text_table(&["method", "rows", "seconds", "codes/s", ""], &rows));
    out.push_str(&format!("\nrefill is {:.1}× the naive INSERT rate", r.refill_over_naive));
    let watched: Vec<(String, CpuSplit)> = [("refill()", &r.refill), ("one COPY", &r.copy)]
        .into_iter()
        .filter_map(|(name, p)| p.cpu.map(|c| (name.to_string(), c)))
        .collect();
    if !watched.is_empty() {
        out.push_str("\nwhere the CPU went (cores busy on average; bench = this process, which encodes the codes):\n");
        out.push_str(&super::cpu::table("bench", "-", &watched));
    }
    if let (Some(refill), Some(copy)) = (r.refill.postgres_us_per_row(), r.copy.postgres_us_per_row()) {
        out.push_str(&format!("\nPostgres CPU µs per row: refill() {refill:.1}, one COPY {copy:.1}"));
    }
    for note in &report.notes {
        out.push_str(&format!("\nnote: {note}"));
    }
    out
}
