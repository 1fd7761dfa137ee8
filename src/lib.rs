//! cifpool: customer numbers (CIF) that are unique forever and unpredictable, issued from Postgres
//! pools pre-filled by a keyed Feistel permutation; and, beside it, a notification queue whose worker
//! groups keep OTPs on time whatever the bulk traffic does.
//!
//! **Domains**
//! - [`cif`]: CIF pools — reserve / confirm / release / extend, refill, reclaim, depth gauges.
//! - [`queue`]: the notification queue — intake, worker groups, providers and their limits, retries,
//!   dead letters, the sweeper.
//! - [`auth`]: API keys (scopes, tenants) and who a request acts as.
//! - [`audit`]: the append-only trail of every CIF transition and admin action.
//!
//! **Shared machinery**
//! - [`claim`]: every `FOR UPDATE SKIP LOCKED` statement: claim with a lease and a fencing token,
//!   fenced finishes, lease sweeps, bounded batch transitions.
//! - [`code`]: the pure keyed Feistel permutation, check digits and the code format.
//! - [`keys`]: the master key and the per-pool keys derived from it (where the master key comes from is
//!   configuration: `config::master_key`).
//! - [`schedule`]: cron schedules of the maintenance jobs.
//! - [`supervise`]: every background task under one supervisor: named, restarted after a failure,
//!   readiness while one is down, the process stopped when one keeps failing.
//! - [`sql_catalog`]: every statement assembled from parts, in its final text (`docs/SQL.md`).
//! - [`validate`]: text and JSON checks shared by the API's inputs.
//!
//! **Shell**
//! - [`config`]: typed settings, layered defaults → file → `CIFPOOL_<SECTION>__<KEY>` env.
//! - [`db`]: the database (external or the embedded cluster), connection pool, migrations, readiness.
//! - [`startup`]: [`startup::Application`], settings turned into a running service.
//! - [`http`]: the router ([`http::app`]), `serve`, and the problem+json error type.
//! - [`console`]: the operations console at `/console` (server-rendered pages for admins).
//! - [`state`]: the state every handler and background job shares.
//! - [`telemetry`]: logs (with one access line per request), OTLP traces, the Prometheus recorder and
//!   the process, database-pool and build gauges.
//! - [`cli`]: the `cifpool` command line (serve, migrate, config check, codes, keygen, dlq, …).
//!
//! **Tools** live in their own crate, `tools/` (`cifpool-tools`): benchmarks against raw SQL and the
//! peers, the send-flow lab on the real queue, the real-scale simulator and their charts. They drive
//! this crate through its public API and [`startup::Application::spawn`].
//!
//! **Public surface.** Modules are crate-private unless a caller outside needs them: the service
//! ([`startup`], [`http::app`], [`state`]), the services it offers ([`cif::Cif`], [`queue::Queue`]),
//! configuration, keys, the pure [`code`] and the embedded database. What the integration tests and
//! the tools drive below the services (one refill, one sweep, one worker step, the raw statements)
//! is re-exported by [`internals`], in one place, rather than by opening the modules it lives in.
//! The maps in these module comments name crate-private modules too: `cargo doc
//! --document-private-items` renders their links.

// The module maps above and in each module are written for whoever reads the code; they link the
// crate-private modules they describe.
#![allow(rustdoc::private_intra_doc_links)]

pub mod audit;
pub mod auth;
pub mod cif;
pub(crate) mod claim;
pub mod cli;
pub mod code;
pub mod config;
pub(crate) mod console;
pub mod db;
pub mod http;
pub mod internals;
pub mod keys;
pub mod queue;
pub(crate) mod schedule;
pub mod sql_catalog;
pub mod startup;
pub mod state;
mod statements;
pub mod supervise;
pub mod telemetry;
pub(crate) mod validate;
