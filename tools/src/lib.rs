//! cifpool-tools: the measurement tools of cifpool, kept out of the service binary.
//!
//! - [`bench`]: `cifpool-tools bench <target>` — reservations against the raw SQL claim, refill
//!   against a raw `COPY`, the queue's intake and drain, and a long mixed soak.
//! - [`lab`]: `cifpool-tools lab` — the send-flow isolation experiment on the real queue, and
//!   (`--simulate`) at production scale in virtual time, with charts.
//! - [`load`]: the fixed-rate (open-loop) load generator every benchmark and the lab use.
//! - [`stats`]: the one percentile function.
//! - [`cli`]: the command line.
//!
//! Everything here drives the service through its public API: the real
//! [`cifpool::startup::Application`] in-process, the real worker groups and claim SQL, the same
//! [`cifpool::queue::policy`] code in the simulator.

pub mod bench;
pub mod cli;
pub mod lab;
pub mod load;
pub mod stats;
