//! Discrete-event simulation of worker groups draining one notification queue, in virtual time.
//!
//! It answers the brief's part 2 at its real scale (1,200 workers, 60 reserved, a 500,000-job promo
//! batch, OTPs at 200/s) in well under a second per cell, and it schedules with the **same policy code**
//! as the real workers: groups come from [`Strategy::groups`], eligibility from [`GroupPolicy::takes`]
//! and order from [`GroupPolicy::sort_key`]. Nothing here re-states an ordering rule.
//!
//! # Model
//!
//! - Two classes: `otp` (priority 0, sent through the SMS provider) and `promo` (priority 2, push
//!   provider); `otp` is the urgent class the reserved workers serve.
//! - Every worker of every group is idle at t = 0. At t = 0 the promo batch is inserted at once and
//!   the idle workers claim from it; only then do OTPs start arriving, at a fixed rate, for a window
//!   starting at `otp_start_s` (so with the default `otp_start_s = 0` the first OTP stands at position
//!   500,001 behind a batch that already holds every worker, as in the brief).
//! - A claimed job holds its worker for its provider's call: the provider's latency, or the timeout if
//!   the provider is slower (or hangs). The worker is free at the end of the call and claims again.
//! - An idle worker of group `g` takes, among the waiting jobs of the classes `g.takes`, the one with
//!   the smallest `g.sort_key`. Jobs wait in one FIFO per class; since keys grow with `id` within a
//!   class (one tenant: `fair_key = id`), comparing the heads of those FIFOs is the same as scanning
//!   every waiting job, and it keeps 500,000 jobs cheap.
//! - Events (OTP arrivals, call ends) sit in a binary heap keyed by integer microseconds. At equal
//!   times arrivals are handled before call ends, and call ends in the order the calls started; after
//!   every event idle workers claim, groups in the order [`Strategy::groups`] lists them (so when a
//!   reserved and a shared worker are both idle, the reserved one takes the OTP).
//! - The run stops at the horizon (`horizon_s`); an OTP whose call has not ended by then is unserved.
//!
//! # Metrics
//!
//! Per OTP: created, picked (claimed), finished (call ended). *Latency* = finished − created: what
//! the user waits for the SMS, which is what the brief's "2 s push timeout + 0.15 s SMS = 2.15 s"
//! counts. *Pick wait* = picked − created: the time spent queued (the brief's bulkhead figure, 1,700
//! queued / 30 per s ≈ 57 s, is a pick wait).

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::queue::policy::{GroupPolicy, JobKey, Strategy};

pub use super::plot::write_png;

/// The urgent class (SMS provider, priority 0).
pub const OTP: &str = "otp";
/// The bulk class (push provider, priority 2).
pub const PROMO: &str = "promo";
/// The OTP deadline of the brief, in seconds.
pub const DEADLINE_S: f64 = 15.0;
/// Header of `sim.csv`.
pub const CSV_HEADER: &str = "strategy,scenario,otp_total,otp_served,p50_s,max_s,promo_done,p99_s";

const US_PER_S: f64 = 1_000_000.0;

/// Provider conditions of a simulated run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SimScenario {
    /// Both providers answer in the healthy latency (150 ms).
    Healthy,
    /// The push provider hangs: each push call holds its worker for the whole provider timeout (2 s).
    PushSlow,
    /// The SMS provider itself is slow: each SMS call takes the slow latency (2 s); push is healthy.
    SmsSlow,
    /// Push hangs and someone raised the push timeout to 30 s: each push call holds a worker 30 s.
    #[value(name = "push-timeout-30s")]
    #[serde(rename = "push-timeout-30s")]
    PushTimeout30s,
}

impl SimScenario {
    /// All four, in the order of the brief.
    pub const ALL: [SimScenario; 4] =
        [SimScenario::Healthy, SimScenario::PushSlow, SimScenario::SmsSlow, SimScenario::PushTimeout30s];

    /// Kebab-case name (`push-timeout-30s`).
    pub fn name(self) -> &'static str {
        match self {
            SimScenario::Healthy => "healthy",
            SimScenario::PushSlow => "push-slow",
            SimScenario::SmsSlow => "sms-slow",
            SimScenario::PushTimeout30s => "push-timeout-30s",
        }
    }

    /// One line saying what each provider does, for titles and tables.
    pub fn describe(self, opts: &SimOptions) -> String {
        let h = fmt_s(opts.healthy_latency_s);
        match self {
            SimScenario::Healthy => format!("SMS {h}, push {h}"),
            SimScenario::PushSlow => format!("SMS {h}, push hangs (held {} timeout)", fmt_s(opts.timeout_s)),
            SimScenario::SmsSlow => format!("SMS {}, push {h}", fmt_s(opts.slow_latency_s.min(opts.timeout_s))),
            SimScenario::PushTimeout30s => {
                format!("SMS {h}, push hangs (timeout raised to {})", fmt_s(opts.raised_timeout_s))
            }
        }
    }

    /// (SMS, push) providers of this scenario.
    fn providers(self, opts: &SimOptions) -> (Provider, Provider) {
        let healthy = Provider { latency_s: Some(opts.healthy_latency_s), timeout_s: opts.timeout_s };
        let hung = |timeout_s| Provider { latency_s: None, timeout_s };
        match self {
            SimScenario::Healthy => (healthy, healthy),
            SimScenario::PushSlow => (healthy, hung(opts.timeout_s)),
            SimScenario::SmsSlow => (Provider { latency_s: Some(opts.slow_latency_s), ..healthy }, healthy),
            SimScenario::PushTimeout30s => (healthy, hung(opts.raised_timeout_s)),
        }
    }
}

fn fmt_s(s: f64) -> String {
    if s < 1.0 { format!("{:.0} ms", s * 1000.0) } else { format!("{s} s") }
}

/// A provider: answers after `latency_s`, or never (`None`); the caller gives up after `timeout_s`.
#[derive(Debug, Clone, Copy)]
struct Provider {
    latency_s: Option<f64>,
    timeout_s: f64,
}

impl Provider {
    /// How long one call holds a worker, in µs (at least 1).
    fn hold_us(self) -> u64 {
        let s = self.latency_s.map_or(self.timeout_s, |l| l.min(self.timeout_s));
        to_us(s).max(1)
    }
}

fn to_us(s: f64) -> u64 {
    (s * US_PER_S).round().max(0.0) as u64
}

fn to_s(us: u64) -> f64 {
    us as f64 / US_PER_S
}

/// Parameters of a simulation; [`Default`] is the brief's real scale.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimOptions {
    /// Workers in all, reserved ones included.
    pub workers: usize,
    /// Workers that serve only OTPs (the bulkhead / the floor); ignored by `fifo` and `priority`.
    pub reserved: usize,
    /// Promo jobs inserted at t = 0.
    pub promo: usize,
    /// OTP arrivals per second.
    pub otp_rate: f64,
    /// When the first OTP arrives, seconds after the batch insert.
    pub otp_start_s: f64,
    /// How long OTPs keep arriving, seconds.
    pub otp_window_s: f64,
    /// Latency of a healthy provider call, seconds.
    pub healthy_latency_s: f64,
    /// Provider call timeout, seconds.
    pub timeout_s: f64,
    /// Latency of the slow SMS provider in `sms-slow`, seconds (capped by the timeout).
    pub slow_latency_s: f64,
    /// The raised push timeout of `push-timeout-30s`, seconds.
    pub raised_timeout_s: f64,
    /// Virtual time at which the run stops; OTPs not finished by then are unserved.
    pub horizon_s: f64,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            workers: 1200,
            reserved: 60,
            promo: 500_000,
            otp_rate: 200.0,
            otp_start_s: 0.0,
            otp_window_s: 30.0,
            healthy_latency_s: 0.150,
            timeout_s: 2.0,
            slow_latency_s: 2.0,
            raised_timeout_s: 30.0,
            horizon_s: 2000.0,
        }
    }
}

impl SimOptions {
    /// Number of OTPs the run creates (`otp_rate × otp_window_s`, rounded).
    pub fn otp_total(&self) -> usize {
        if self.otp_rate > 0.0 && self.otp_window_s > 0.0 {
            (self.otp_rate * self.otp_window_s).round() as usize
        } else {
            0
        }
    }

    /// Creation time of OTP number `k` (0-based), µs.
    fn otp_created_us(&self, k: usize) -> u64 {
        to_us(self.otp_start_s + k as f64 / self.otp_rate)
    }
}

/// The simulator's command-line options (flattened into `cifpool lab --simulate`).
///
/// Every flag carries a `sim-` prefix so it cannot clash with the real lab's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Simulated workers in all, reserved ones included.
    #[arg(id = "sim_workers", long = "sim-workers", default_value_t = 1200)]
    pub workers: usize,
    /// Simulated workers reserved for OTPs (bulkhead / floor-borrow).
    #[arg(id = "sim_reserved", long = "sim-reserved", default_value_t = 60)]
    pub reserved: usize,
    /// Promo jobs inserted at t = 0.
    #[arg(id = "sim_promo", long = "sim-promo", default_value_t = 500_000)]
    pub promo: usize,
    /// OTP arrivals per second.
    #[arg(id = "sim_otp_rate", long = "sim-otp-rate", default_value_t = 200.0)]
    pub otp_rate: f64,
    /// Seconds after the batch insert at which OTPs start arriving.
    #[arg(id = "sim_otp_start", long = "sim-otp-start", default_value_t = 0.0)]
    pub otp_start: f64,
    /// Seconds during which OTPs arrive.
    #[arg(id = "sim_otp_window", long = "sim-otp-window", default_value_t = 30.0)]
    pub otp_window: f64,
    /// Healthy provider latency, seconds.
    #[arg(id = "sim_healthy_latency", long = "sim-healthy-latency", default_value_t = 0.150)]
    pub healthy_latency: f64,
    /// Provider timeout, seconds.
    #[arg(id = "sim_timeout", long = "sim-timeout", default_value_t = 2.0)]
    pub timeout: f64,
    /// SMS latency in the `sms-slow` scenario, seconds.
    #[arg(id = "sim_slow_latency", long = "sim-slow-latency", default_value_t = 2.0)]
    pub slow_latency: f64,
    /// Push timeout in the `push-timeout-30s` scenario, seconds.
    #[arg(id = "sim_raised_timeout", long = "sim-raised-timeout", default_value_t = 30.0)]
    pub raised_timeout: f64,
    /// Virtual seconds after which the run stops (OTPs not sent by then are unserved).
    #[arg(id = "sim_horizon", long = "sim-horizon", default_value_t = 2000.0)]
    pub horizon: f64,
    /// Strategies to simulate (comma-separated).
    #[arg(id = "sim_strategy", long = "sim-strategy", value_enum, value_delimiter = ',', default_values_t = Strategy::ALL)]
    pub strategies: Vec<Strategy>,
    /// Scenarios to simulate (comma-separated).
    #[arg(id = "sim_scenario", long = "sim-scenario", value_enum, value_delimiter = ',', default_values_t = SimScenario::ALL)]
    pub scenarios: Vec<SimScenario>,
}

impl SimArgs {
    /// The [`SimOptions`] these flags describe.
    pub fn options(&self) -> SimOptions {
        SimOptions {
            workers: self.workers,
            reserved: self.reserved,
            promo: self.promo,
            otp_rate: self.otp_rate,
            otp_start_s: self.otp_start,
            otp_window_s: self.otp_window,
            healthy_latency_s: self.healthy_latency,
            timeout_s: self.timeout,
            slow_latency_s: self.slow_latency,
            raised_timeout_s: self.raised_timeout,
            horizon_s: self.horizon,
        }
    }
}

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

    /// Largest pick wait over picked OTPs, seconds.
    pub fn max_pick_wait_s(&self) -> Option<f64> {
        self.otps.iter().filter_map(OtpRecord::pick_wait_s).reduce(f64::max)
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

/// A waiting job.
#[derive(Debug, Clone, Copy)]
struct Job {
    id: i64,
    /// Index into the OTP records, or `u32::MAX` for a promo.
    otp: u32,
}

const NOT_OTP: u32 = u32::MAX;

/// An event. In the heap it sits under `(µs, rank, seq)`: arrivals (rank 0) before call ends
/// (rank 1) at the same µs, then in the order they were scheduled (`seq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// OTP number `k` is inserted.
    Arrive(u32),
    /// A call of class `class` by a worker of group `group` ends.
    Finish { group: u16, class: u8, otp: u32 },
}

/// One class as the simulator sees it.
struct Class {
    name: &'static str,
    priority: i16,
    hold_us: u64,
}

/// Compare two policy sort keys (total order: keys never hold NaN here).
fn key_cmp(a: &(i16, f64, i64), b: &(i16, f64, i64)) -> Ordering {
    a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2))
}

/// Simulate one (strategy, scenario) cell.
pub fn simulate(opts: &SimOptions, strategy: Strategy, scenario: SimScenario) -> SimResult {
    simulate_with(opts, strategy, scenario, &ProgressBar::hidden())
}

/// [`simulate`], reporting jobs finished to `bar`.
pub fn simulate_with(opts: &SimOptions, strategy: Strategy, scenario: SimScenario, bar: &ProgressBar) -> SimResult {
    let started = Instant::now();
    let (sms, push) = scenario.providers(opts);
    let classes = [
        Class { name: OTP, priority: 0, hold_us: sms.hold_us() },
        Class { name: PROMO, priority: 2, hold_us: push.hold_us() },
    ];
    let all: Vec<String> = classes.iter().map(|c| c.name.to_string()).collect();
    let urgent = vec![OTP.to_string()];
    let groups = strategy.groups(opts.workers, opts.reserved, &urgent, &all);
    // takes[g][c]: asked once per group and class, straight from the policy.
    let takes: Vec<Vec<bool>> = groups.iter().map(|g| classes.iter().map(|c| g.takes(c.name)).collect()).collect();
    let mut idle: Vec<usize> = groups.iter().map(|g| g.size).collect();
    let horizon_us = to_us(opts.horizon_s);

    let otp_total = opts.otp_total();
    assert!(otp_total < NOT_OTP as usize, "too many OTPs for one run");
    let first_otp_id = opts.promo as i64 + 1;
    let mut otps: Vec<OtpRecord> = (0..otp_total)
        .map(|k| OtpRecord {
            id: first_otp_id + k as i64,
            created_us: opts.otp_created_us(k),
            picked_us: None,
            finished_us: None,
        })
        .collect();

    let mut queues: [VecDeque<Job>; 2] = [VecDeque::new(), VecDeque::new()];
    queues[1] = (1..=opts.promo as i64).map(|id| Job { id, otp: NOT_OTP }).collect();

    let mut heap: BinaryHeap<Reverse<(u64, u8, u64, Event)>> = BinaryHeap::with_capacity(opts.workers + otp_total);
    let mut seq: u64 = 0;
    let mut promo_done = 0usize;
    let mut done = 0u64;
    let mut events = 0u64;
    let mut now: u64 = 0;

    // Idle workers claim, group by group, while something they may take is waiting.
    let mut dispatch = |now: u64,
                        idle: &mut [usize],
                        queues: &mut [VecDeque<Job>; 2],
                        heap: &mut BinaryHeap<Reverse<(u64, u8, u64, Event)>>,
                        otps: &mut [OtpRecord]| {
        for (g, group) in groups.iter().enumerate() {
            while idle[g] > 0 {
                let mut best: Option<(usize, (i16, f64, i64))> = None;
                for (c, class) in classes.iter().enumerate() {
                    let Some(head) = queues[c].front().filter(|_| takes[g][c]) else { continue };
                    let key =
                        group.sort_key(&JobKey { id: head.id, priority: class.priority, fair_key: head.id as f64 });
                    if best.as_ref().is_none_or(|(_, b)| key_cmp(&key, b) == Ordering::Less) {
                        best = Some((c, key));
                    }
                }
                let Some((c, _)) = best else { break };
                let job = queues[c].pop_front().expect("head exists");
                idle[g] -= 1;
                if job.otp != NOT_OTP {
                    otps[job.otp as usize].picked_us = Some(now);
                }
                let ev = Event::Finish { group: g as u16, class: c as u8, otp: job.otp };
                heap.push(Reverse((now + classes[c].hold_us, 1, seq, ev)));
                seq += 1;
            }
        }
    };

    // t = 0: the batch is in, every worker claims; OTPs come after.
    dispatch(0, &mut idle, &mut queues, &mut heap, &mut otps);
    for (k, o) in otps.iter().enumerate() {
        heap.push(Reverse((o.created_us, 0, k as u64, Event::Arrive(k as u32))));
    }

    while let Some(Reverse((t, _, _, ev))) = heap.pop() {
        if t > horizon_us {
            break;
        }
        now = t;
        events += 1;
        match ev {
            Event::Arrive(k) => queues[0].push_back(Job { id: otps[k as usize].id, otp: k }),
            Event::Finish { group, class: _, otp } => {
                idle[group as usize] += 1;
                done += 1;
                if otp == NOT_OTP {
                    promo_done += 1;
                } else {
                    otps[otp as usize].finished_us = Some(t);
                }
                if done.is_multiple_of(8192) {
                    bar.set_position(done);
                    bar.set_message(format!("t = {:.0} s", to_s(t)));
                }
            }
        }
        dispatch(now, &mut idle, &mut queues, &mut heap, &mut otps);
    }
    bar.set_position(done);

    let mut lat: Vec<f64> = otps.iter().filter_map(OtpRecord::latency_s).collect();
    lat.sort_by(f64::total_cmp);
    let row = SimRow {
        strategy,
        scenario,
        otp_total,
        otp_served: lat.len(),
        p50_s: percentile(&lat, 0.50),
        max_s: lat.last().copied(),
        promo_done,
        p99_s: percentile(&lat, 0.99),
    };
    SimResult { row, options: opts.clone(), groups, otps, events, end_s: to_s(now), wall: started.elapsed() }
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

/// Simulate every (strategy, scenario) cell, strategies outermost, in the order given. With
/// `progress`, one bar per cell on stderr (jobs finished out of promo + OTP).
pub fn run_all(
    opts: &SimOptions,
    strategies: &[Strategy],
    scenarios: &[SimScenario],
    progress: bool,
) -> Vec<SimResult> {
    let multi = MultiProgress::with_draw_target(if progress {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    });
    let style =
        ProgressStyle::with_template("{prefix:>32} [{bar:30.cyan/blue}] {human_pos:>7}/{human_len:7} jobs {msg}")
            .expect("valid template")
            .progress_chars("=> ");
    let total = (opts.promo + opts.otp_total()) as u64;
    let mut out = Vec::with_capacity(strategies.len() * scenarios.len());
    for &strategy in strategies {
        for &scenario in scenarios {
            let bar = multi.add(ProgressBar::new(total));
            bar.set_style(style.clone());
            bar.set_prefix(format!("{} / {}", strategy.name(), scenario.name()));
            let r = simulate_with(opts, strategy, scenario, &bar);
            let unserved = r.row.otp_total - r.row.otp_served;
            let tail = if unserved > 0 { format!(", {unserved} OTP unserved") } else { String::new() };
            let msg = format!("{:.0} s virtual in {} ms{tail}", r.end_s, r.wall.as_millis());
            if (r.row.promo_done + r.row.otp_served) as u64 == total {
                bar.finish_with_message(msg);
            } else {
                // Stopped at the horizon: keep the bar where it stopped.
                bar.abandon_with_message(format!("{msg} (stopped at the horizon)"));
            }
            out.push(r);
        }
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
