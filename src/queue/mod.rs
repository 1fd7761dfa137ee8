//! Notification queue: isolated worker groups over one jobs table.
//!
//! - [`policy`]: which group takes which class in which order (shared with the lab and simulator).
//! - [`enqueue`]: intake — validation, backpressure, weighted-fair keys, bulk inserts.
//! - [`store`]: the jobs table through the shared [`crate::claim`] contract.
//! - [`finish`]: batched, fenced `sent` finishes (group commit).
//! - [`worker`]: worker groups (claim → send → fenced finish), one drivable step for tests.
//! - [`provider`]: the `Provider` trait, the HTTP provider, adaptive per-provider limits.
//! - [`fake_provider`]: `cifpool fake-provider`, a provider double with latency, errors and hangs.
//! - [`stats`]: per-class depth, oldest age and drain rate (gauges, backpressure).
//! - [`maintenance`]: lease rescue, deadline expiry, stats refresh, running the groups.
//! - [`dlq`]: dead-letter listing and paced replay.

pub mod dlq;
pub mod enqueue;
pub mod fake_provider;
pub mod finish;
pub mod maintenance;
pub mod policy;
pub mod provider;
pub mod stats;
pub mod store;
pub mod worker;
