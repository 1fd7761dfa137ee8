//! What a simulated cell produced: every OTP's life, the summary row, and the CSV and Markdown of a
//! grid of cells.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};

use super::sim::{SimOptions, SimScenario, to_s, to_us};
use cifpool::queue::policy::{GroupPolicy, Strategy};

/// Header of `sim.csv`.
pub const CSV_HEADER: &str = "strategy,scenario,otp_total,otp_served,p50_s,max_s,promo_done,p99_s";

/// One OTP's life, in µs of virtual time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OtpRecord {
    /// Job id (the promo batch holds ids `1..=promo`, so the first OTP is `promo + 1`).
    pub id: i64,
    /// Inserted into the queue.
    pub created_us: u64,
    /// Claimed by a worker, if it was before the horizon.
    pub picked_us: Option<u64>,
    /// Its SMS call ended, if it did before the horizon.
    pub finished_us: Option<u64>,
}

impl OtpRecord {
    /// Creation time, seconds.
    pub fn created_s(&self) -> f64 {
        to_s(self.created_us)
    }
    /// Finished − created, seconds, if served.
    pub fn latency_s(&self) -> Option<f64> {
        self.finished_us.map(|f| to_s(f - self.created_us))
    }
    /// Picked − created, seconds, if picked.
    pub fn pick_wait_s(&self) -> Option<f64> {
        self.picked_us.map(|p| to_s(p - self.created_us))
    }
}

/// One line of `sim.csv`: one (strategy, scenario) cell.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimRow {
    /// Strategy preset.
    pub strategy: Strategy,
    /// Provider conditions.
    pub scenario: SimScenario,
    /// OTPs created.
    pub otp_total: usize,
    /// OTPs whose SMS call ended within the horizon.
    pub otp_served: usize,
    /// Median OTP latency (finished − created) over served OTPs, seconds.
    pub p50_s: Option<f64>,
    /// Largest OTP latency over served OTPs, seconds.
    pub max_s: Option<f64>,
    /// Promo jobs finished within the horizon.
    pub promo_done: usize,
    /// 99th-percentile OTP latency over served OTPs, seconds.
    pub p99_s: Option<f64>,
}

impl SimRow {
    /// The CSV line (no newline), matching [`CSV_HEADER`]; `None` is an empty cell.
    pub fn csv_line(&self) -> String {
        let f = |v: Option<f64>| v.map(|v| format!("{v:.3}")).unwrap_or_default();
        format!(
            "{},{},{},{},{},{},{},{}",
            self.strategy.name(),
            self.scenario.name(),
            self.otp_total,
            self.otp_served,
            f(self.p50_s),
            f(self.max_s),
            self.promo_done,
            f(self.p99_s)
        )
    }
}

/// The full outcome of one cell.
#[derive(Debug, Clone)]
pub struct SimResult {
    /// The summary row.
    pub row: SimRow,
    /// The options it ran with.
    pub options: SimOptions,
    /// The worker groups, straight from [`Strategy::groups`].
    pub groups: Vec<GroupPolicy>,
    /// Every OTP, in creation order.
    pub otps: Vec<OtpRecord>,
    /// Events handled.
    pub events: u64,
    /// Virtual time of the last event handled, seconds.
    pub end_s: f64,
    /// Wall-clock time the cell took.
    pub wall: Duration,
}

impl SimResult {
    /// The OTP created closest to `created_s` (seconds; the earlier one on a tie).
    pub fn otp_nearest(&self, created_s: f64) -> Option<&OtpRecord> {
        let target = to_us(created_s);
        let i = self.otps.partition_point(|o| o.created_us < target);
        let after = self.otps.get(i);
        let before = i.checked_sub(1).and_then(|j| self.otps.get(j));
        match (before, after) {
            (Some(b), Some(a)) => Some(if target - b.created_us <= a.created_us - target { b } else { a }),
            (b, a) => b.or(a),
        }
    }

    /// Latency (finished − created, seconds) of the OTP created closest to `created_s`; `None` if it
    /// was not served within the horizon (or there are no OTPs).
    pub fn latency_at(&self, created_s: f64) -> Option<f64> {
        self.otp_nearest(created_s).and_then(OtpRecord::latency_s)
    }

    /// Pick wait (picked − created, seconds) of the OTP created closest to `created_s`.
    pub fn pick_wait_at(&self, created_s: f64) -> Option<f64> {
        self.otp_nearest(created_s).and_then(OtpRecord::pick_wait_s)
    }

    /// `(created_s, latency_s)` of served OTPs, at most `max_points` of them (evenly spaced in creation
    /// order; every point when `max_points` is 0 or larger than the count).
    pub fn curve(&self, max_points: usize) -> Vec<(f64, f64)> {
        let served: Vec<(f64, f64)> =
            self.otps.iter().filter_map(|o| o.latency_s().map(|l| (o.created_s(), l))).collect();
        downsample(served, max_points)
    }

    /// Served OTPs binned by creation time (`bin_s` wide, from `otp_start_s`): `(bin centre, min
    /// latency, max latency)` per non-empty bin, seconds. A chart of thousands of zig-zagging points is
    /// unreadable; the envelope shows the worst case per bin and the spread.
    pub fn envelope(&self, bin_s: f64) -> Vec<(f64, f64, f64)> {
        let start = self.options.otp_start_s;
        let mut out: Vec<(f64, f64, f64)> = Vec::new();
        let mut cur: Option<(i64, f64, f64)> = None;
        let centre = |b: i64| start + (b as f64 + 0.5) * bin_s;
        for o in &self.otps {
            let Some(l) = o.latency_s() else { continue };
            let b = ((o.created_s() - start) / bin_s).floor() as i64;
            cur = match cur {
                Some((cb, lo, hi)) if cb == b => Some((cb, lo.min(l), hi.max(l))),
                Some((cb, lo, hi)) => {
                    out.push((centre(cb), lo, hi));
                    Some((b, l, l))
                }
                None => Some((b, l, l)),
            };
        }
        if let Some((cb, lo, hi)) = cur {
            out.push((centre(cb), lo, hi));
        }
        out
    }

    /// `(created_s, horizon − created_s)` of unserved OTPs: a lower bound of what they wait.
    pub fn unserved_curve(&self, max_points: usize) -> Vec<(f64, f64)> {
        let h = self.options.horizon_s;
        let v: Vec<(f64, f64)> =
            self.otps.iter().filter(|o| o.finished_us.is_none()).map(|o| (o.created_s(), h - o.created_s())).collect();
        downsample(v, max_points)
    }
}

fn downsample(v: Vec<(f64, f64)>, max_points: usize) -> Vec<(f64, f64)> {
    if max_points == 0 || v.len() <= max_points {
        return v;
    }
    let step = v.len() as f64 / max_points as f64;
    let mut out: Vec<(f64, f64)> = (0..max_points).map(|i| v[(i as f64 * step) as usize]).collect();
    if out.last() != v.last() {
        out.push(*v.last().expect("non-empty"));
    }
    out
}

/// Write `dir/sim.csv` (creating `dir`): [`CSV_HEADER`] then one line per row. Returns the file's path.
pub fn write_csv(dir: &Path, rows: &[SimRow]) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join("sim.csv");
    let mut text = String::from(CSV_HEADER);
    text.push('\n');
    for r in rows {
        text.push_str(&r.csv_line());
        text.push('\n');
    }
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// The rows as a Markdown table (for docs and the terminal).
pub fn markdown_table(rows: &[SimRow]) -> String {
    let f = |v: Option<f64>| v.map(|v| format!("{v:.2}")).unwrap_or_else(|| "—".into());
    let mut s = String::from(
        "| strategy | scenario | OTP served | p50 (s) | p99 (s) | max (s) | promo done |\n|---|---|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} / {} | {} | {} | {} | {} |",
            r.strategy.name(),
            r.scenario.name(),
            r.otp_served,
            r.otp_total,
            f(r.p50_s),
            f(r.p99_s),
            f(r.max_s),
            r.promo_done
        );
    }
    s
}
