//! `cifpool pools …`: what an operator does to the pools after the database changed under them.

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;

use crate::audit::Actor;
use crate::cif::{Cif, FenceOutcome};
use crate::config::Settings;

/// `cifpool pools …` (connects to the database directly; the `/admin/pools/…` routes do the same over HTTP).
#[derive(Debug, Subcommand)]
pub enum PoolsCommand {
    /// Fence every pool now: set its available and held codes aside, move its counter on by its
    /// `fence_margin`, and record the database as the one codes are issued from (ends a halt). For a
    /// restore or a rollback the service could not see (a storage snapshot), or a halted service.
    Fence {
        /// Instead of fencing, record the database as it is (a planned switchover that lost nothing):
        /// ends a halt without setting anything aside.
        #[arg(long)]
        accept: bool,
    },
    /// Make the pools agree with the customer system: every code in the list (one per line) is issued
    /// and never handed out again, and each pool's counter moves past the highest. A dry run that
    /// reports what would change unless `--apply`; applying again changes nothing.
    Reconcile {
        /// The list of issued codes; `-` or none: standard input.
        file: Option<PathBuf>,
        /// Commit the changes (refused while any line is not a valid code of a configured pool).
        #[arg(long)]
        apply: bool,
    },
    /// Start a new key epoch for a pool: from its next counter on, codes come from the key derived
    /// with KEY_ID (never one the pool used before); available codes made under earlier keys are
    /// discarded, and the pool is refilled under the new key. For a pool key that may be known outside.
    RotateKey {
        /// The pool (customer type).
        pool: String,
        /// The label the new key is derived with from the master key.
        #[arg(long)]
        key_id: String,
    },
    /// Say which pool, key epoch and counter a code comes from, and where it stands.
    Locate {
        /// The code.
        code: String,
    },
}

/// Runs `command` as the operator at the command line.
pub(super) async fn run_pools(db: &sqlx::PgPool, settings: &Settings, command: PoolsCommand) -> anyhow::Result<()> {
    let actor = Actor::cli();
    let cif = service(db, settings).await?;
    match command {
        PoolsCommand::Fence { accept } => match cif.fence(accept, &actor).await? {
            FenceOutcome::Accepted { changed: true } => {
                eprintln!("recorded this database as the one codes are issued from; nothing was set aside");
            }
            FenceOutcome::Accepted { changed: false } => {
                eprintln!("this database is already the one codes are issued from: nothing to accept");
            }
            FenceOutcome::Fenced(report) => {
                println!("{}", serde_json::to_string(&report)?);
                eprintln!(
                    "fenced {} pools: their codes are set aside and they issue from fresh counters",
                    report.pools.len()
                );
            }
        },
        PoolsCommand::Reconcile { file, apply } => reconcile(&cif, file, apply, &actor).await?,
        PoolsCommand::RotateKey { pool, key_id } => {
            let rotation = cif.rotate_key(&pool, &key_id, &actor).await?;
            println!("{}", serde_json::to_string(&rotation)?);
            let r = &rotation.rotated;
            eprintln!(
                "pool {}: key epoch {} (key_id {}, key check {}) encodes from counter {} on; {} available codes \
                 of earlier keys discarded; refill added {}",
                r.pool,
                r.epoch,
                r.key_id,
                r.key_check,
                r.first_counter,
                r.available_discarded,
                rotation.refill.codes_added
            );
        }
        PoolsCommand::Locate { code } => {
            let located = cif.locate(code.trim()).await?;
            println!("{}", serde_json::to_string(&located)?);
        }
    }
    Ok(())
}

/// The pool operations on `db` as `serve` offers them, for the configured pools (their keys derived
/// from the master key).
async fn service(db: &sqlx::PgPool, settings: &Settings) -> anyhow::Result<Cif> {
    use crate::cif::fence::{FencePolicy, IncarnationGuard};
    let master = crate::config::master_key::resolve_master_key(settings, false)?;
    let pools = crate::cif::Pools::reconcile(db, &settings.pools, &master).await?;
    let policy = FencePolicy::from_settings(settings);
    let upkeep = tokio_util::task::TaskTracker::new();
    Ok(Cif::new(db.clone(), std::sync::Arc::new(pools), upkeep, IncarnationGuard::new(), policy))
}

async fn reconcile(cif: &Cif, file: Option<PathBuf>, apply: bool, actor: &Actor) -> anyhow::Result<()> {
    let list: Box<dyn tokio::io::AsyncBufRead + Unpin + Send> = match file {
        Some(path) if path.as_os_str() != "-" => Box::new(tokio::io::BufReader::new(
            tokio::fs::File::open(&path).await.with_context(|| format!("opening {}", path.display()))?,
        )),
        _ => Box::new(tokio::io::BufReader::new(tokio::io::stdin())),
    };
    // Drawn only on a terminal (indicatif hides it otherwise).
    let bar = indicatif::ProgressBar::new_spinner().with_message("codes read");
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {human_pos} {msg} ({per_sec}, {elapsed})")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    let progress = |n: u64| bar.set_position(n);
    let report = cif.reconcile(list, apply, actor, &progress).await;
    bar.finish_and_clear();
    let report = report?;
    println!("{}", serde_json::to_string(&report)?);
    for p in &report.pools {
        eprintln!(
            "{}: {} listed, {} already issued, {} were available, {} were held, {} set aside, {} unknown; \
             counter {} -> {}",
            p.pool,
            p.listed,
            p.already_issued,
            p.were_available,
            p.were_held,
            p.were_set_aside,
            p.were_unknown,
            p.counter_before,
            p.counter_after
        );
    }
    for line in &report.invalid_examples {
        eprintln!("invalid: {line}");
    }
    if report.invalid > 0 {
        anyhow::bail!("{} of {} lines are not valid codes: nothing applied", report.invalid, report.lines);
    }
    eprintln!(
        "{} in {:.1} s",
        if report.applied { "applied" } else { "dry run: nothing changed (add --apply)" },
        report.duration_ms / 1000.0
    );
    Ok(())
}
