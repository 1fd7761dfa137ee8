//! CIF issuance: per-customer-type pools of Feistel-generated codes.
//!
//! - [`pools`]: the runtime pool registry, reconciled with the database at start (format pinning,
//!   code-space overlap checks).
//! - [`service`]: [`Cif`], the operations callers use (reserve, confirm, release, extend, look up)
//!   with their metrics and the refill trigger.
//! - [`store`]: reserve / confirm / release / extend / look up, on the shared [`crate::claim`] contract.
//! - [`coalesce`]: reservations that arrive together share one claim statement.
//! - [`kept`]: the connection lone reservations keep between them.
//! - [`cursor`]: where an instance's reservations start scanning, so a held cleanup horizon does not
//!   make each one read past every code reserved since.
//! - [`refill`]: bounded-batch generation keeping pools above their low watermark.
//! - [`refill_text`]: a refill batch's `COPY` text, encoded one batch ahead.
//! - [`reclaim`]: returns holds whose lease expired (pods that died before confirming).
//! - [`fence`]: never issue again what a restored, recovered or failed-over database forgot.
//! - [`reconcile`]: make the pools agree with the customer system's list of issued codes.
//! - [`stats`]: pool depth for `/v1/pools`, the gauges and the watermark warnings.
//! - [`upkeep`]: when refill, reclaim and the gauges run (schedules, on-demand triggers).

pub(crate) mod coalesce;
pub(crate) mod cursor;
pub(crate) mod epochs;
pub(crate) mod fence;
pub(crate) mod kept;
pub(crate) mod pools;
pub(crate) mod reclaim;
pub(crate) mod reconcile;
pub(crate) mod refill;
pub(crate) mod refill_text;
pub(crate) mod rotate;
pub(crate) mod service;
pub(crate) mod stats;
pub(crate) mod store;
pub(crate) mod upkeep;

pub use crate::claim::Fenced;
pub use pools::{Pool, Pools};
pub use service::{Cif, CifError, FenceOutcome, Rotation};
