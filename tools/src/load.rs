//! Open-loop load at a fixed rate, the one load generator of the benchmarks and the lab.
//!
//! Call `i` starts at `origin + i / rate` whatever the earlier calls are doing, so a slow service shows
//! up as latency and as calls in flight, never as a lower offered rate (a closed loop would wait for
//! each answer and so measure less load than it claims). Latency is measured from the scheduled
//! instant, so time spent behind a late scheduler counts too.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// When and how often calls start.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// Calls per second.
    pub rate: f64,
    /// Instant of call 0.
    pub origin: Instant,
    /// Calls to make in all; `None` until the stop token fires.
    pub calls: Option<u64>,
}

impl Schedule {
    /// `rate` calls per second for `length`, starting a few milliseconds from now.
    pub fn for_duration(rate: f64, length: Duration) -> Schedule {
        Schedule {
            rate,
            origin: Instant::now() + Duration::from_millis(5),
            calls: Some((rate * length.as_secs_f64()).round() as u64),
        }
    }
}

/// What the calls of one run returned.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// Calls started.
    pub started: u64,
    /// Latency of each successful call, µs from its scheduled instant.
    pub latencies_us: Vec<u64>,
    /// Failed calls by the label the call gave (an HTTP status, `transport`, …).
    pub errors: BTreeMap<String, u64>,
    /// Successful calls finished in each second after the origin.
    pub per_second: Vec<u64>,
    /// Most calls in flight at once.
    pub max_in_flight: usize,
}

impl Tally {
    /// Successful calls.
    pub fn ok(&self) -> u64 {
        self.latencies_us.len() as u64
    }

    /// Failed calls.
    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Records one call's outcome; `since_origin` places a success in its second.
    pub fn record(&mut self, outcome: Result<(), String>, latency: Duration, since_origin: Duration) {
        match outcome {
            Ok(()) => {
                self.latencies_us.push(latency.as_micros() as u64);
                let second = since_origin.as_secs() as usize;
                if self.per_second.len() <= second {
                    self.per_second.resize(second + 1, 0);
                }
                self.per_second[second] += 1;
            }
            Err(label) => *self.errors.entry(label).or_default() += 1,
        }
    }

    /// Folds `other` into this tally.
    pub fn merge(&mut self, other: Tally) {
        self.started += other.started;
        self.latencies_us.extend(other.latencies_us);
        for (k, v) in other.errors {
            *self.errors.entry(k).or_default() += v;
        }
        if self.per_second.len() < other.per_second.len() {
            self.per_second.resize(other.per_second.len(), 0);
        }
        for (i, v) in other.per_second.into_iter().enumerate() {
            self.per_second[i] += v;
        }
        self.max_in_flight = self.max_in_flight.max(other.max_in_flight);
    }
}

/// Runs `call(i)` on `schedule` until its call count is reached or `stop` fires, then waits for the
/// calls in flight. `succeeded` counts successes as they happen (for progress bars).
pub async fn fixed_rate<F, Fut>(
    schedule: Schedule,
    stop: CancellationToken,
    succeeded: Arc<AtomicU64>,
    call: F,
) -> Tally
where
    F: Fn(u64) -> Fut,
    Fut: Future<Output = Result<(), String>> + Send + 'static,
{
    let period = Duration::from_secs_f64(1.0 / schedule.rate.max(1e-6));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let max_in_flight = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let mut all = Tally::default();
    let mut i = 0u64;
    while schedule.calls.is_none_or(|n| i < n) {
        let at = schedule.origin + period.mul_f64(i as f64);
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep_until(at) => {}
        }
        let work = call(i);
        let (in_flight, max_in_flight, succeeded) = (in_flight.clone(), max_in_flight.clone(), succeeded.clone());
        let origin = schedule.origin;
        tasks.spawn(async move {
            let now = in_flight.fetch_add(1, Ordering::Relaxed) + 1;
            max_in_flight.fetch_max(now, Ordering::Relaxed);
            let outcome = work.await;
            in_flight.fetch_sub(1, Ordering::Relaxed);
            let end = Instant::now();
            if outcome.is_ok() {
                succeeded.fetch_add(1, Ordering::Relaxed);
            }
            let mut tally = Tally::default();
            tally.record(outcome, end - at, end - origin);
            tally
        });
        all.started += 1;
        i += 1;
        // Reap finished calls as we go so the set stays small.
        while let Some(done) = tasks.try_join_next() {
            if let Ok(t) = done {
                all.merge(t);
            }
        }
    }
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(t) => all.merge(t),
            Err(_) => *all.errors.entry("panic".into()).or_default() += 1,
        }
    }
    all.max_in_flight = max_in_flight.load(Ordering::Relaxed);
    all
}

/// POSTs a JSON body and reads the answer (so the connection goes back to the pool): `Ok` on
/// `expected`, else the status (or `transport`) prefixed with `what`.
pub async fn post_json(
    client: &reqwest::Client,
    url: &str,
    body: impl Into<reqwest::Body>,
    expected: u16,
    what: &str,
) -> Result<(), String> {
    match client.post(url).header("content-type", "application/json").body(body).send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let _ = resp.bytes().await;
            if status == expected { Ok(()) } else { Err(format!("{what}{status}")) }
        }
        Err(_) => Err(format!("{what}transport")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn calls_start_on_schedule_and_are_tallied() {
        let schedule = Schedule { rate: 10.0, origin: Instant::now(), calls: Some(25) };
        let done = Arc::new(AtomicU64::new(0));
        let tally = fixed_rate(schedule, CancellationToken::new(), done.clone(), |i| async move {
            tokio::time::sleep(Duration::from_millis(250)).await;
            if i % 5 == 4 { Err("500".to_string()) } else { Ok(()) }
        })
        .await;
        assert_eq!((tally.started, tally.ok(), tally.failed()), (25, 20, 5));
        assert_eq!(done.load(Ordering::Relaxed), 20);
        assert!(tally.latencies_us.iter().all(|&us| (250_000..260_000).contains(&us)), "{:?}", tally.latencies_us);
        // 10 calls/s, each 250 ms: 3 overlap at any moment.
        assert_eq!(tally.max_in_flight, 3);
        assert_eq!(tally.per_second.iter().sum::<u64>(), 20);
    }

    #[tokio::test(start_paused = true)]
    async fn stop_ends_an_unbounded_schedule() {
        let stop = CancellationToken::new();
        let schedule = Schedule { rate: 100.0, origin: Instant::now(), calls: None };
        let stopper = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1005)).await;
            stopper.cancel();
        });
        let tally = fixed_rate(schedule, stop, Arc::default(), |_| async { Ok(()) }).await;
        assert_eq!(tally.started, 101, "calls at 0, 10, …, 1000 ms");
    }
}
