//! Discrete-event simulation of worker groups draining one notification queue, in virtual time.
//!
//! It runs the send-flow experiment at production scale (1,200 workers, 60 reserved, a 500,000-job promo
//! batch, OTPs at 200/s) in well under a second per cell, and it schedules with the **same policy code**
//! as the real workers: groups come from [`Strategy::groups`], eligibility from [`GroupPolicy::takes`]
//! and order from [`GroupPolicy::compare`]. Nothing here re-states an ordering rule.
//!
//! # Model
//!
//! - Two classes: `otp` (sent through the SMS provider) and `promo` (push provider), with the
//!   priorities the queue configuration gives them (0 and 2 by default); `otp` is the urgent class the reserved workers serve.
//! - Every worker of every group is idle at t = 0. At t = 0 the promo batch is inserted at once and
//!   the idle workers claim from it; only then do OTPs start arriving, at a fixed rate, for a window
//!   starting at `otp_start_s` (so with the default `otp_start_s = 0` the first OTP stands at position
//!   500,001 behind a batch that already holds every worker).
//! - A claimed job holds its worker for its provider's call: the provider's latency, or the timeout if
//!   the provider is slower (or hangs). The worker is free at the end of the call and claims again.
//! - An idle worker of group `g` takes, among the waiting jobs of the classes `g.takes`, the one with
//!   the one `g.compare` puts first. Jobs wait in one FIFO per class; since keys grow with `id` within a
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
//! the user waits for the SMS, which is what "2 s push timeout + 0.15 s SMS = 2.15 s" counts.
//! *Pick wait* = picked − created: the time spent queued (a bulkhead's figure, 1,700
//! queued / 30 per s ≈ 57 s, is a pick wait).

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, VecDeque};
use std::time::Instant;

use anyhow::Context as _;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

use cifpool::config::QueueSettings;
use cifpool::queue::policy::{JobKey, Strategy};

pub use super::plot::write_png;
pub use super::sim_results::{CSV_HEADER, OtpRecord, SimResult, SimRow, markdown_table, write_csv};

/// The urgent class (SMS provider).
pub const OTP: &str = "otp";
/// The bulk class (push provider).
pub const PROMO: &str = "promo";
/// The OTP deadline, in seconds (the `otp` class's default `deadline`).
pub const DEADLINE_S: f64 = 15.0;

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
    /// All four, from healthy to the worst.
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

pub(super) fn to_us(s: f64) -> u64 {
    (s * US_PER_S).round().max(0.0) as u64
}

pub(super) fn to_s(us: u64) -> f64 {
    us as f64 / US_PER_S
}

/// Parameters of a simulation; each default is the flag's default, the production scale (1,200
/// workers, 60 reserved, a 500,000-job promo batch, OTPs at 200/s for 30 s). Every flag carries a
/// `sim-` prefix so it cannot clash with the real lab's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct SimOptions {
    /// Simulated workers in all, reserved ones included.
    #[arg(id = "sim_workers", long = "sim-workers", default_value_t = 1200)]
    pub workers: usize,
    /// Simulated workers that serve only OTPs (the bulkhead / the floor); ignored by `fifo` and `priority`.
    #[arg(id = "sim_reserved", long = "sim-reserved", default_value_t = 60)]
    pub reserved: usize,
    /// Promo jobs inserted at t = 0.
    #[arg(id = "sim_promo", long = "sim-promo", default_value_t = 500_000)]
    pub promo: usize,
    /// OTP arrivals per second.
    #[arg(id = "sim_otp_rate", long = "sim-otp-rate", default_value_t = 200.0)]
    pub otp_rate: f64,
    /// When the first OTP arrives, seconds after the batch insert.
    #[arg(id = "sim_otp_start", long = "sim-otp-start", default_value_t = 0.0)]
    pub otp_start_s: f64,
    /// How long OTPs keep arriving, seconds.
    #[arg(id = "sim_otp_window", long = "sim-otp-window", default_value_t = 30.0)]
    pub otp_window_s: f64,
    /// Latency of a healthy provider call, seconds.
    #[arg(id = "sim_healthy_latency", long = "sim-healthy-latency", default_value_t = 0.150)]
    pub healthy_latency_s: f64,
    /// Provider call timeout, seconds.
    #[arg(id = "sim_timeout", long = "sim-timeout", default_value_t = 2.0)]
    pub timeout_s: f64,
    /// Latency of the slow SMS provider in `sms-slow`, seconds (capped by the timeout).
    #[arg(id = "sim_slow_latency", long = "sim-slow-latency", default_value_t = 2.0)]
    pub slow_latency_s: f64,
    /// The raised push timeout of `push-timeout-30s`, seconds.
    #[arg(id = "sim_raised_timeout", long = "sim-raised-timeout", default_value_t = 30.0)]
    pub raised_timeout_s: f64,
    /// Virtual seconds after which the run stops; OTPs not finished by then are unserved.
    #[arg(id = "sim_horizon", long = "sim-horizon", default_value_t = 2000.0)]
    pub horizon_s: f64,
    /// Priority of the `otp` class, from the queue configuration (compiled-in defaults unless
    /// [`SimOptions::with_priorities_from`] is given another).
    #[arg(skip = configured_priority(&default_queue(), OTP).expect("the default configuration has otp"))]
    pub otp_priority: i16,
    /// Priority of the `promo` class, from the queue configuration.
    #[arg(skip = configured_priority(&default_queue(), PROMO).expect("the default configuration has promo"))]
    pub promo_priority: i16,
}

impl Default for SimOptions {
    fn default() -> Self {
        crate::cli::parse_defaults()
    }
}

fn default_queue() -> QueueSettings {
    cifpool::config::Settings::load_with_env(None, Vec::new()).expect("the compiled-in defaults are valid").queue
}

fn configured_priority(queue: &QueueSettings, class: &str) -> anyhow::Result<i16> {
    queue
        .classes
        .iter()
        .find(|c| c.name == class)
        .map(|c| c.priority)
        .with_context(|| format!("the simulator needs a queue class named {class:?}"))
}

impl SimOptions {
    /// Takes the `otp` and `promo` priorities from `queue` (the simulator schedules by the same
    /// priorities as the configured service).
    pub fn with_priorities_from(mut self, queue: &QueueSettings) -> anyhow::Result<SimOptions> {
        self.otp_priority = configured_priority(queue, OTP)?;
        self.promo_priority = configured_priority(queue, PROMO)?;
        Ok(self)
    }

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

/// Simulate one (strategy, scenario) cell.
pub fn simulate(opts: &SimOptions, strategy: Strategy, scenario: SimScenario) -> SimResult {
    simulate_with(opts, strategy, scenario, &ProgressBar::hidden())
}

/// [`simulate`], reporting jobs finished to `bar`.
pub fn simulate_with(opts: &SimOptions, strategy: Strategy, scenario: SimScenario, bar: &ProgressBar) -> SimResult {
    let started = Instant::now();
    let (sms, push) = scenario.providers(opts);
    let classes = [
        Class { name: OTP, priority: opts.otp_priority, hold_us: sms.hold_us() },
        Class { name: PROMO, priority: opts.promo_priority, hold_us: push.hold_us() },
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
                let mut best: Option<(usize, JobKey)> = None;
                for (c, class) in classes.iter().enumerate() {
                    let Some(head) = queues[c].front().filter(|_| takes[g][c]) else { continue };
                    let key = JobKey { id: head.id, priority: class.priority, fair_key: head.id as f64 };
                    if best.as_ref().is_none_or(|(_, b)| group.compare(&key, b) == Ordering::Less) {
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
        p50_s: crate::stats::percentile(&lat, 0.50),
        max_s: lat.last().copied(),
        promo_done,
        p99_s: crate::stats::percentile(&lat, 0.99),
    };
    SimResult { row, options: opts.clone(), groups, otps, events, end_s: to_s(now), wall: started.elapsed() }
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
