//! The notification-queue lab.
//!
//! - [`real`]: `cifpool lab` — the brief's scaled-down experiment on the real queue (real worker
//!   groups, claim SQL and Postgres; fake providers over HTTP).
//! - [`sim`]: `cifpool lab --simulate` — a discrete-event simulation in virtual time at the brief's real
//!   scale (1,200 workers, a 500,000-job promo batch), running the same [`crate::queue::policy`] code.
//! - [`plot`]: the PNG charts of both (embedded font, no system fonts needed).

pub mod plot;
pub mod real;
pub mod sim;
