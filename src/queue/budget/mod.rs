//! Provider budgets that hold for the whole deployment, not per pod.
//!
//! A provider's `max_concurrency` is the number of calls cifpool may have in flight to it across every
//! pod. Postgres is the coordination point: `provider_budgets` holds each provider's deployment-wide
//! state (the adaptive limit, a pause, a token bucket for `max_rate_per_second`), and
//! `provider_shares` one row per pod and provider: the part of the budget that pod may use, under a
//! lease.
//!
//! ```text
//!   provider_budgets (sms)        provider_shares (sms)                 pod-local
//!   limit 20, max 20         ┌──> pod A  share 12  want 40  lease t+30s  ──> 12 sends at once
//!   tokens 37 (rate 50/s)    ├──> pod B  share  8  want 40  lease t+30s  ──>  8 sends at once
//!   paused_until —           └──> pod C  (dead: lease expired, row removed, its 8 go to A and B)
//! ```
//!
//! Every [`SYNC_INTERVAL`] each pod, in one transaction that locks the provider's budget row: reports
//! the successes and overloads it saw (the deployment-wide AIMD step), drops expired shares, and takes
//! its fair part of the budget (water-filling the live pods' wants) but never more than what the other
//! pods' recorded shares leave free. Since every increase is made under that lock against the recorded
//! shares, and a pod never sends more than its share, the sum of calls in flight never exceeds the
//! budget. A pod shrinks its share at once but records no less than it has in flight, so units still
//! in use are never handed to another pod. A pod trusts its share only until its lease minus the
//! provider timeout: a pod cut off from the database stops starting sends before its share can expire
//! and be given away, so even a database stall cannot push the total over the budget.
//!
//! Apart, by responsibility: `local` (this pod's share, sends in flight, permits), `share` (the
//! arithmetic of one sync, `divide` and `water_fill`, whose tests play random syncs, sends and
//! limit changes against the argument above), `sync` (the statements) and `task` (the loop).
//!
//! A claim that stops at a job because this pod's share of its provider is full, while the budget
//! could give the pod more, asks for a sync at once ([`crate::queue::runtime::QueueRuntime::ask_for_more`]; at most one per
//! [`EARLY_SYNC_GAP`]) instead of waiting for the next interval: its workers wait on that provider.
//!
//! Pacing: errors cut the deployment's limit by 30 % (at most once a second, whoever sees them), and
//! it grows back by one slot per `limit` successes but never faster than the whole range (floor to
//! `max_concurrency`) in [`REGROWTH`]. A pod that could not reach the database restarts the provider
//! at its floor. So after an outage or a stall the send rate rises over seconds instead of stepping
//! to the maximum. A `Retry-After` from the provider pauses it for every pod until then.

use std::time::Duration;

mod local;
mod share;
mod sync;
mod task;

pub use local::{ProviderBudget, Room};
pub(crate) use share::{Share, divide};
pub use sync::{leave, pause, register};
pub use task::run;

/// How often a pod reconciles its shares with the database.
pub(crate) const SYNC_INTERVAL: Duration = Duration::from_millis(200);
/// The least time between two syncs when claims ask for more ([`crate::queue::runtime::QueueRuntime::ask_for_more`]), so
/// a pod whose claims keep stopping does not turn the budget rows into a hot spot.
pub(crate) const EARLY_SYNC_GAP: Duration = Duration::from_millis(20);
/// The least time the limit takes to grow from the floor back to `max_concurrency`.
pub(crate) const REGROWTH: Duration = Duration::from_secs(10);
/// Multiplicative cut on overload.
const DECREASE: f64 = 0.7;
/// A share is trusted locally until this long before its lease, on top of the provider timeout.
const SAFETY: Duration = Duration::from_secs(1);
/// A sync slower than this means the database stalled.
const STALL: Duration = Duration::from_secs(2);
