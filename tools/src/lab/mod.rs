//! The notification-queue lab.
//!
//! - [`real`]: `cifpool-tools lab` — the send-flow isolation experiment, scaled down, on the real queue (real worker
//!   groups, claim SQL and Postgres; fake providers over HTTP).
//! - [`sim`]: `cifpool-tools lab --simulate` — a discrete-event simulation in virtual time at production
//!   scale (1,200 workers, a 500,000-job promo batch), running the same [`cifpool::queue::policy`] code.
//! - [`sim_results`]: what a simulated cell produced, as CSV and Markdown.
//! - [`plot`]: the PNG charts of both (embedded font, no system fonts needed).

pub mod plot;
pub mod real;
pub mod sim;
pub mod sim_results;
