//! `cifpool pools …`: what an operator does to the pools after the database changed under them.

use clap::Subcommand;

use crate::audit::Actor;
use crate::cif::fence::{self, FencePolicy};
use crate::config::Settings;

/// `cifpool pools …` (connects to the database directly; `/admin/fence` does the same over HTTP).
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
}

/// Runs `command` as the operator at the command line.
pub(super) async fn run_pools(db: &sqlx::PgPool, settings: &Settings, command: PoolsCommand) -> anyhow::Result<()> {
    let actor = Actor::cli();
    match command {
        PoolsCommand::Fence { accept: true } => {
            if fence::accept(db, &actor).await? {
                eprintln!("recorded this database as the one codes are issued from; nothing was set aside");
            } else {
                eprintln!("this database is already the one codes are issued from: nothing to accept");
            }
        }
        PoolsCommand::Fence { accept: false } => {
            let report = fence::fence_now(db, &FencePolicy::from_settings(settings), &actor).await?;
            println!("{}", serde_json::to_string(&report)?);
            eprintln!(
                "fenced {} pools: their codes are set aside and they issue from fresh counters",
                report.pools.len()
            );
        }
    }
    Ok(())
}
