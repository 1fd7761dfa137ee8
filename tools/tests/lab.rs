//! Every cell of the lab, shortened, on the real queue and Postgres, at the defaults and at a second
//! set of parameters: each must keep the shape LAB.md documents.
//!
//! - FIFO serves no OTP while promo is pending, in both scenarios.
//! - Priority serves every OTP: under push-hang each within one push call (plus a margin), since a
//!   worker frees every few hundred milliseconds and the OTP is at the head of the order.
//! - Bulkhead serves every OTP under push-hang, and stalls under sms-slow (its reserved workers
//!   cannot keep up with the OTP rate, and nobody else may help).
//! - Floor + borrow serves every OTP within a second in both scenarios, and promo keeps flowing.
//!
//! The cells run one after another in one test: they measure waits, and two at once would share the
//! machine's cores.

#[path = "../../tests/it/common/cluster.rs"]
mod common;

use cifpool::queue::policy::Strategy;
use cifpool_tools::lab::real::{LabCell, LabOptions, LabScenario, run_cell};
use common::fresh_database;
use indicatif::ProgressBar;

/// The defaults (20 workers, 6 reserved, 10 OTP/s), five seconds a cell. Enough promo that the fast
/// push of sms-slow cannot drain it within the run (~400 promo/s).
fn defaults() -> LabOptions {
    LabOptions { promo: 10_000, otp_start: 1.0, otp_window: 3.0, duration: 5.0, ..LabOptions::default() }
}

/// Twice the workers, more reserved, 2.5 times the OTP rate, another pair of latencies.
fn other() -> LabOptions {
    LabOptions {
        workers: 40,
        reserved: 10,
        otp_rate: 25.0,
        promo: 20_000,
        push_hang_push_ms: 2_000,
        sms_slow_sms_ms: 800,
        otp_start: 1.0,
        otp_window: 3.0,
        duration: 5.0,
        ..LabOptions::default()
    }
}

/// What is wrong with `cell` against the documented shape, if anything.
fn shape_errors(opts: &LabOptions, cell: &LabCell) -> Vec<String> {
    let mut errors = Vec::new();
    let expected = (opts.otp_rate * opts.otp_window).round() as usize;
    let served = cell.waits().len();
    let max = cell.max_s().unwrap_or(f64::INFINITY);
    let push_call = match cell.scenario {
        LabScenario::PushHang => opts.push_hang_push_ms as f64 / 1000.0,
        LabScenario::SmsSlow => opts.sms_slow_push_ms as f64 / 1000.0,
    };
    let mut check = |ok: bool, what: String| {
        if !ok {
            errors.push(what);
        }
    };
    check(cell.otp_total() == expected, format!("{} OTPs injected, {expected} scheduled", cell.otp_total()));
    match (cell.strategy, cell.scenario) {
        (Strategy::Fifo, _) => {
            check(served == 0, format!("FIFO served {served} OTPs ahead of pending promo: {:?}", cell.waits()));
            check(cell.promo_done > 0, "FIFO sent no promo".into());
        }
        (Strategy::Priority, LabScenario::PushHang) => {
            check(served == expected, format!("priority served {served} of {expected} OTPs"));
            check(max <= push_call + 0.5, format!("priority: max OTP wait {max:.3} s, one push call is {push_call} s"));
        }
        (Strategy::Priority, LabScenario::SmsSlow) => {
            check(served == expected, format!("priority served {served} of {expected} OTPs"));
        }
        (Strategy::Bulkhead, LabScenario::PushHang) => {
            check(served == expected, format!("bulkhead served {served} of {expected} OTPs"));
            check(max < 1.0, format!("bulkhead: max OTP wait {max:.3} s"));
        }
        (Strategy::Bulkhead, LabScenario::SmsSlow) => {
            check(
                served > 0 && served < expected,
                format!(
                    "bulkhead served {served} of {expected} OTPs: its reserved workers should serve some, then stall"
                ),
            );
        }
        (Strategy::FloorBorrow, _) => {
            check(served == expected, format!("floor + borrow served {served} of {expected} OTPs"));
            check(max < 1.0, format!("floor + borrow: max OTP wait {max:.3} s"));
            check(cell.promo_done > 0, "floor + borrow sent no promo".into());
        }
    }
    errors
}

#[tokio::test]
async fn every_cell_keeps_its_documented_shape_at_two_sets_of_parameters() {
    let db = fresh_database().await;
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(40).connect(&db.url).await.unwrap();
    let mut failures = Vec::new();
    for (label, opts) in [("defaults", defaults()), ("other", other())] {
        for scenario in LabScenario::ALL {
            for strategy in Strategy::ALL {
                let cell = run_cell(&pool, &opts, strategy, scenario, &ProgressBar::hidden()).await.unwrap();
                println!("{label}: {}", cell.csv_line());
                for error in shape_errors(&opts, &cell) {
                    failures.push(format!("{label}, {} / {}: {error}", strategy.name(), scenario.name()));
                }
            }
        }
    }
    assert!(failures.is_empty(), "cells out of shape:\n{}", failures.join("\n"));
}
