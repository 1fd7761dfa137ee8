//! Notification queue: isolated worker groups over one jobs table.
//!
//! [`Queue`] ([`service`]) is what the API's handlers call: submit one job or a batch, look up,
//! cancel, for one caller.
//!
//! Intake and storage:
//! - [`job`]: a job as a client asks for it.
//! - [`intake`]: what clients may enqueue — validation, backpressure, outcome metrics.
//! - [`batch`]: `POST /v1/notifications/batch`, parsed, checked and copied as the body streams in.
//! - [`enqueue`]: inserts — weighted-fair keys, one job, bulk batches by `COPY`.
//! - [`status`]: a job's statuses, spelled once for Rust and SQL.
//! - [`store`]: the jobs table through the shared [`crate::claim`] contract: the hot path (claim,
//!   fenced finishes, heartbeats), the sweeps (rescue, expiry, erasure, purge) and the job as the API
//!   shows it.
//!
//! Running it:
//! - [`runtime`]: classes, providers and the worker groups one instance runs.
//! - [`policy`]: which group takes which class in which order (shared with the lab and simulator).
//! - [`worker`]: a worker group — claim, send, fenced finish; one drivable step for tests.
//! - [`catch_up`]: how many jobs a group's next claim may take (more while claims are slow).
//! - [`floor`]: where a group's claims start each priority while a walk from its head is slow.
//! - [`finish`]: batched, fenced `sent` finishes (group commit).
//! - [`listen`]: the LISTEN relay that wakes idle claimers.
//! - [`sweep`]: the sweeper — lease rescue, deadline expiry, kept personal data erased, retention purge.
//! - [`stage`]: the stager — scheduled jobs whose time has come become claimable, with fair keys.
//! - [`provider`]: the `Provider` trait, the HTTP provider and the no-op one.
//! - [`budget`]: provider budgets for the whole deployment: concurrency shares, AIMD, rate, pauses.
//! - [`scrub`]: provider error texts without URLs or credentials, bounded, before they are kept.
//! - [`seal`]: recipients and payloads encrypted by the service before they reach the database.
//! - [`privacy`]: a finished job's payload erased and recipient masked, at once or after its class's
//!   `keep_personal_data`.
//!
//! Watching it:
//! - [`stats`]: per-class depth, oldest age and drain rate (gauges, backpressure).
//! - [`analyze`]: the jobs table analyzed when the planner expects far fewer waiting jobs than the
//!   stats round counted, so a burst after a quiet spell is claimed in index order.
//! - [`dlq`]: dead letters: listing, paced replay, retry or discard one.
//! - [`view`]: the queue at a glance for `GET /admin/queue`.
//!
//! Operating it:
//! - [`cancel`]: cancel one job or a batch's unsent jobs; what a batch holds.
//! - [`pause`]: pause and resume a class or a provider for every pod.
//! - [`erase`]: one customer's personal data erased on request.

pub(crate) mod analyze;
pub(crate) mod batch;
pub(crate) mod budget;
pub(crate) mod cancel;
pub mod catch_up;
pub(crate) mod dlq;
pub(crate) mod enqueue;
pub(crate) mod erase;
pub(crate) mod finish;
pub mod floor;
pub(crate) mod intake;
pub(crate) mod job;
pub(crate) mod listen;
pub(crate) mod pause;
pub mod policy;
pub(crate) mod privacy;
pub mod provider;
pub(crate) mod runtime;
pub(crate) mod scrub;
pub(crate) mod seal;
pub(crate) mod service;
pub(crate) mod stage;
pub(crate) mod stats;
pub(crate) mod status;
pub(crate) mod store;
pub(crate) mod sweep;
pub(crate) mod view;
pub(crate) mod worker;

pub use job::NewJob;
pub use service::Queue;
