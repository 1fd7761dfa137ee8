//! cifpool: customer numbers (CIF) that are unique forever and unpredictable, issued from Postgres
//! pools pre-filled by a keyed Feistel permutation; and, beside it, a notification queue whose worker
//! groups keep OTPs on time whatever the bulk traffic does.
//!
//! Layout:
//! - [`cif`]: CIF pools — reserve/confirm/release, refill, reclaim, depth gauges.
//! - [`claim`]: the SKIP LOCKED claim/lease/fenced-finish/sweep contract shared by pools and queue.
//! - [`code`]: the pure keyed Feistel permutation, check digits and code format; [`keys`]: key derivation.
//! - [`schedule`]: cron schedules of the maintenance jobs.
//! - [`bench`]: `cifpool bench` — reservations and refill measured against raw SQL on the same cluster.
//! - [`cli`]: the `cifpool` command line (serve, migrate, config check, …).
//! - [`config`]: typed settings, layered defaults → file → `CIFPOOL_<SECTION>__<KEY>` env.
//! - [`startup`]: wiring a [`config::Settings`] into a running [`startup::Application`].
//! - [`db`]: connection pool, migrations, readiness; [`db::embedded`] runs a private Postgres cluster.
//! - [`http`]: the router ([`http::app`]), `serve`, and the problem+json error type.
//! - [`state`]: the state every handler and job shares.
//! - [`telemetry`]: logs and the Prometheus recorder.

pub mod bench;
pub mod cif;
pub mod claim;
pub mod cli;
pub mod code;
pub mod config;
pub mod db;
pub mod http;
pub mod keys;
pub mod lab;
pub mod queue;
pub mod schedule;
pub mod startup;
pub mod state;
pub mod telemetry;
pub mod validate;
