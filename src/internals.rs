//! The seams below the services that the integration tests and the tools crate (benchmarks, the
//! lab, the simulator) drive directly: one refill or reclaim, one sweep or staging pass, one worker
//! step, the raw statements a benchmark races, the stand-in provider. A caller of the service uses
//! [`crate::cif::Cif`], [`crate::queue::Queue`] and the HTTP API instead: what is re-exported here
//! follows the code and makes no promise of stability.
//!
//! Each module is named after the one it opens, so a test reads `refill::refill(…)` or
//! `queue_store::claim(…)` whatever the service's own layout.

/// Bounded-batch generation of a pool's codes, run once by hand (the schedule and triggers run it
/// in the service).
pub mod refill {
    pub use crate::cif::refill::{RefillOptions, RefillOutcome, RefillSummary, refill};
}

/// Returning holds whose lease expired, run once by hand.
pub mod reclaim {
    pub use crate::cif::reclaim::reclaim;
}

/// The reservation statement as the service runs it, for the benchmark that races it raw; the
/// connection lone reservations keep, for its test.
pub mod reservations {
    pub use crate::cif::kept::{KeptConnection, LINGER as KEPT_CONNECTION_LINGER, Lent};
    pub use crate::cif::store::{Request, Reserved, reserve_many, reserve_sql};
}

/// When refill runs: the trigger a reservation fires when it finds a pool empty.
pub mod upkeep {
    pub use crate::cif::upkeep::on_empty;
}

/// Whether the database is the one codes were issued from (a fresh guard for a hand-built pool).
pub mod fence {
    pub use crate::cif::fence::IncarnationGuard;
}

/// The jobs table's hot path and sweeps, one statement at a time.
pub mod queue_store {
    pub use crate::claim::{Commit, PickSizes};
    pub use crate::queue::store::{
        ClaimClass, Claimed, ClaimedJob, Purge, claim, claim_begin_sql, claim_sql, erase_due, expire_overdue,
        mark_sent, mark_sent_many, purge_finished, rescue_expired_leases,
    };
}

/// Admission of one job: validation and backpressure, without inserting it.
pub mod intake {
    pub use crate::queue::intake::{Admission, admit, payload_of};
}

/// Inserting jobs below intake's checks (the lab's and the benchmarks' bulk loads).
pub mod enqueue {
    pub use crate::queue::enqueue::*;
}

/// The streamed batch intake and the size of the `COPY` chunks it writes.
pub mod batch {
    pub use crate::queue::batch::rows::CHUNK_BYTES;
    pub use crate::queue::batch::{ByteStream, submit};
}

/// Scheduled jobs made claimable, one pass.
pub mod stage {
    pub use crate::queue::stage::promote_due;
}

/// Worker groups, started or stepped one claim at a time.
pub mod worker {
    pub use crate::queue::worker::{CLAIM_LOOPS, Outcome, WorkerGroup, start_all};
}

/// Per-class depth as backpressure reads it, refreshed by hand.
pub mod stats {
    pub use crate::queue::analyze::{MISLED_BY, Misled, WORTH_ANALYZING, expected_waiting, misled};
    pub use crate::queue::stats::{ClassStats, QueueStats, Refreshed, STATS_LOCK};
}

/// A provider's deployment-wide budget as one pod holds it.
pub mod budget {
    pub use crate::queue::budget::{ProviderBudget, Room};
}

/// Classes, providers and worker groups of one instance, built with given providers.
pub mod runtime {
    pub use crate::queue::runtime::QueueRuntime;
}

/// Recipients and payloads sealed before they reach the database.
pub mod seal {
    pub use crate::queue::seal::Seal;
}

/// API keys in the database, below the authenticator's cache.
pub mod api_key {
    pub use crate::auth::api_key::{NewKey, PREFIX, create, digest, find, generate_secret, revoke};
}

/// The stand-in SMS/push gateway of `cifpool fake-provider`, in-process.
pub mod fake_provider {
    pub use crate::cli::fake_provider::{FakeBehaviour, FakeProvider, serve};
}

/// The database's cleanup horizon, read once.
pub mod horizon {
    pub use crate::telemetry::horizon::read;
}
