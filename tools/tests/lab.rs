//! A shortened cell of the lab on the real queue: FIFO starves OTPs behind promo, floor + borrow serves
//! them within a second.

#[path = "../../tests/common/cluster.rs"]
mod common;

use cifpool::queue::policy::Strategy;
use cifpool_tools::lab::real::{LabOptions, LabScenario, run_cell};
use common::fresh_database;
use indicatif::ProgressBar;

fn short() -> LabOptions {
    LabOptions { promo: 2_000, otp_start: 1.0, otp_window: 3.0, duration: 5.0, ..LabOptions::default() }
}

async fn lab_pool(url: &str) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new().max_connections(40).connect(url).await.unwrap()
}

#[tokio::test]
async fn fifo_serves_no_otp_while_promo_is_pending() {
    let db = fresh_database().await;
    let pool = lab_pool(&db.url).await;
    let cell = run_cell(&pool, &short(), Strategy::Fifo, LabScenario::PushHang, &ProgressBar::hidden()).await.unwrap();
    assert_eq!(cell.otp_total(), 30);
    assert!(cell.promo_done < 2_000, "promo still pending at the end ({} sent)", cell.promo_done);
    assert_eq!(cell.waits().len(), 0, "FIFO picked an OTP ahead of pending promo: {:?}", cell.waits());
}

#[tokio::test]
async fn floor_borrow_serves_every_otp_within_a_second_in_both_scenarios() {
    let db = fresh_database().await;
    let pool = lab_pool(&db.url).await;
    for scenario in LabScenario::ALL {
        let cell = run_cell(&pool, &short(), Strategy::FloorBorrow, scenario, &ProgressBar::hidden()).await.unwrap();
        assert_eq!(cell.waits().len(), cell.otp_total(), "{scenario:?}: every OTP picked");
        let max = cell.max_s().unwrap();
        assert!(max < 1.0, "{scenario:?}: max OTP wait {max:.3} s");
        assert!(cell.promo_done > 0, "{scenario:?}: promo kept flowing");
    }
}
