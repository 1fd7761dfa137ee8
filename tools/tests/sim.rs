//! The simulator reproduces the brief's part-2 arithmetic at real scale (1,200 workers, 60 reserved,
//! 500,000 promo jobs, OTPs at 200/s for 30 s), within 5 %.

use std::sync::OnceLock;
use std::time::Instant;

use cifpool::queue::policy::Strategy;
use cifpool_tools::lab::sim::{
    CSV_HEADER, DEADLINE_S, SimOptions, SimResult, SimScenario, run_all, simulate, write_csv, write_png,
};

/// Every cell at the defaults, simulated once for all the tests of this file.
fn grid() -> &'static [SimResult] {
    static GRID: OnceLock<Vec<SimResult>> = OnceLock::new();
    GRID.get_or_init(|| {
        let t = Instant::now();
        let all = run_all(&SimOptions::default(), &Strategy::ALL, &SimScenario::ALL, false);
        eprintln!("real-scale grid: {} cells in {:.2?}", all.len(), t.elapsed());
        all
    })
}

fn cell(strategy: Strategy, scenario: SimScenario) -> &'static SimResult {
    grid().iter().find(|r| r.row.strategy == strategy && r.row.scenario == scenario).expect("cell simulated")
}

#[track_caller]
fn assert_within_5pct(what: &str, measured: Option<f64>, brief: f64) {
    let m = measured.unwrap_or_else(|| panic!("{what}: no value (no OTP served), brief says {brief} s"));
    let err = (m - brief).abs() / brief;
    assert!(err <= 0.05, "{what}: measured {m:.3} s, brief {brief} s ({:.1} % off)", err * 100.0);
    eprintln!("{what}: measured {m:.3} s, brief {brief} s ({:+.1} %)", (m - brief) / brief * 100.0);
}

#[test]
fn fifo_healthy_waits_for_the_whole_batch() {
    // 500,000 / 8,000 per s = 62.5 s. The first OTP is picked by the wave that takes the last promos
    // (t = 62.40 s) and its SMS ends 0.15 s later.
    let r = cell(Strategy::Fifo, SimScenario::Healthy);
    assert_within_5pct("fifo/healthy max OTP latency", r.row.max_s, 62.5);
    assert_eq!(r.row.otp_served, r.row.otp_total, "every OTP is eventually sent");
}

#[test]
fn fifo_push_slow_waits_fourteen_minutes() {
    // 1,200 workers each held 2 s by push drain 600/s: 500,000 / 600 = 833 s.
    let r = cell(Strategy::Fifo, SimScenario::PushSlow);
    assert_within_5pct("fifo/push-slow max OTP latency", r.row.max_s, 833.3);
}

#[test]
fn priority_push_slow_waits_for_one_push_wave() {
    // All 1,200 workers start 2 s push calls at t = 0; an OTP waits for the wave to end, then 0.15 s SMS.
    let r = cell(Strategy::Priority, SimScenario::PushSlow);
    assert_within_5pct("priority/push-slow max OTP latency", r.row.max_s, 2.15);
}

#[test]
fn priority_push_timeout_30s_ties_otp_to_the_push_timeout() {
    let r = cell(Strategy::Priority, SimScenario::PushTimeout30s);
    assert_within_5pct("priority/push-timeout-30s max OTP latency", r.row.max_s, 30.15);
}

#[test]
fn bulkhead_sms_slow_backs_up_behind_the_reserved_workers() {
    // 60 reserved workers × 2 s SMS drain 30/s while 200/s arrive; after 10 s about 1,700 OTPs are
    // queued and a new OTP waits ~1,700 / 30 ≈ 57 s *to be picked*. The brief's figure is a queue wait
    // (it does not add the OTP's own 2 s SMS call), so we compare the PICK WAIT of the OTP created
    // closest to 10 s into the slowdown (the slowdown covers the whole run, so t = otp_start + 10 s).
    // Its latency (picked + 2 s SMS) is reported too, and must exceed the pick wait by exactly 2 s.
    let r = cell(Strategy::Bulkhead, SimScenario::SmsSlow);
    let at = SimOptions::default().otp_start_s + 10.0;
    let wait = r.pick_wait_at(at);
    assert_within_5pct("bulkhead/sms-slow pick wait of the OTP created at 10 s", wait, 1700.0 / 30.0);
    let latency = r.latency_at(at).expect("served within the horizon");
    assert!((latency - wait.unwrap() - 2.0).abs() < 1e-9, "latency {latency} = pick wait + 2 s SMS");
    eprintln!("bulkhead/sms-slow latency of the OTP created at 10 s: {latency:.3} s");
    // Meanwhile the other 1,140 workers drained the whole promo batch: they idle while OTPs queue.
    assert_eq!(r.row.promo_done, 500_000, "bulk workers finish the batch");
}

#[test]
fn floor_borrow_meets_the_deadline_in_every_scenario() {
    for sc in SimScenario::ALL {
        let r = cell(Strategy::FloorBorrow, sc);
        assert_eq!(r.row.otp_served, r.row.otp_total, "floor-borrow/{}: every OTP served", sc.name());
        let max = r.row.max_s.expect("served");
        assert!(max <= DEADLINE_S, "floor-borrow/{}: max OTP latency {max:.3} s > {DEADLINE_S} s", sc.name());
        eprintln!("floor-borrow/{}: max OTP latency {max:.3} s", sc.name());
    }
}

#[test]
fn doubling_a_fifo_pool_only_halves_the_wait() {
    // Mistake 1 of the brief: 2,400 workers still leave ~31 s.
    let opts = SimOptions { workers: 2400, ..SimOptions::default() };
    let r = simulate(&opts, Strategy::Fifo, SimScenario::Healthy);
    assert_within_5pct("fifo/healthy with 2,400 workers max OTP latency", r.row.max_s, 31.25);
}

#[test]
fn fifo_push_timeout_30s_serves_no_otp_within_the_horizon() {
    // 1,200 workers × 30 s drain 40 promo/s: the batch alone takes 12,500 s > the 2,000 s horizon.
    let r = cell(Strategy::Fifo, SimScenario::PushTimeout30s);
    assert_eq!(r.row.otp_served, 0, "no OTP sent within the horizon");
    assert_eq!((r.row.p50_s, r.row.max_s, r.row.p99_s), (None, None, None));
    assert_eq!(r.row.promo_done, 1200 * (2000 / 30), "66 full waves of 1,200 promos by t = 2,000 s");
}

#[test]
fn the_grid_runs_in_seconds() {
    let wall: f64 = grid().iter().map(|r| r.wall.as_secs_f64()).sum();
    assert!(wall < 30.0, "16 real-scale cells took {wall:.1} s");
}

#[test]
fn csv_and_png_are_written() {
    let dir = tempfile::tempdir().expect("temp dir");
    let rows: Vec<_> = grid().iter().map(|r| r.row.clone()).collect();
    let csv = write_csv(dir.path(), &rows).expect("csv written");
    assert_eq!(csv, dir.path().join("sim.csv"));
    let text = std::fs::read_to_string(&csv).expect("csv readable");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], CSV_HEADER);
    assert_eq!(lines[0], "strategy,scenario,otp_total,otp_served,p50_s,max_s,promo_done,p99_s");
    assert_eq!(lines.len(), 1 + Strategy::ALL.len() * SimScenario::ALL.len(), "one row per cell:\n{text}");
    assert!(lines.iter().skip(1).all(|l| l.split(',').count() == 8), "8 cells per row:\n{text}");
    assert!(lines.contains(&"fifo,push-timeout-30s,6000,0,,,79200,"), "None is an empty cell:\n{text}");

    let png = write_png(dir.path(), grid()).expect("png written");
    assert_eq!(png, dir.path().join("sim.png"));
    let bytes = std::fs::read(&png).expect("png readable");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "PNG magic bytes");
    assert!(bytes.len() > 10_000, "a real chart, not an empty image ({} bytes)", bytes.len());
}

/// Regenerates `docs/sim.png` and prints the table for `docs/LAB.md`:
/// `cargo test --release -p cifpool-tools --test sim -- --ignored --nocapture regenerate_docs`.
#[test]
#[ignore = "writes into docs/; run by hand to refresh the documented results"]
fn regenerate_docs() {
    let t = Instant::now();
    let results = run_all(&SimOptions::default(), &Strategy::ALL, &SimScenario::ALL, true);
    let wall = t.elapsed();
    let docs = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs");
    write_png(&docs, &results).expect("png");
    let rows: Vec<_> = results.iter().map(|r| r.row.clone()).collect();
    println!("{}", cifpool_tools::lab::sim::markdown_table(&rows));
    let b = cell_of(&results, Strategy::Bulkhead, SimScenario::SmsSlow);
    println!(
        "bulkhead/sms-slow OTP created at 10 s: pick wait {:.2} s, latency {:.2} s",
        b.pick_wait_at(10.0).unwrap(),
        b.latency_at(10.0).unwrap()
    );
    println!("grid wall time: {wall:.2?}");
    for r in &results {
        println!(
            "{}/{}: {} events, {:.0} ms",
            r.row.strategy.name(),
            r.row.scenario.name(),
            r.events,
            r.wall.as_millis()
        );
    }
}

fn cell_of(results: &[SimResult], strategy: Strategy, scenario: SimScenario) -> &SimResult {
    results.iter().find(|r| r.row.strategy == strategy && r.row.scenario == scenario).expect("cell")
}
