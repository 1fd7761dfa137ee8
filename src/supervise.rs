//! Every background task of a process under one [`Supervisor`]: each is started with a name, so
//! "what runs here?" has one answer ([`Supervisor::names`]); a loop that panics or returns before
//! its stop is started again after a back-off and counted in `cifpool_task_restarts_total{task}`;
//! while a task is down [`Liveness`] says so (readiness reads it); and a task that keeps failing is
//! given up, which [`Supervisor::first_failure`] reports so the process can stop and exit non-zero
//! (its orchestrator then starts a fresh pod, which is louder and safer than a pod limping on).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::{Id, JoinSet};
use tokio_util::sync::CancellationToken;

/// When a failed task is started again, and when it is given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartPolicy {
    /// First wait before a restart; doubled after each failure in a row, up to `max_backoff`.
    pub first_backoff: Duration,
    /// Longest wait before a restart.
    pub max_backoff: Duration,
    /// Failures in a row after which the task is given up.
    pub give_up_after: u32,
}

impl Default for RestartPolicy {
    /// 100 ms doubling to 10 s, given up at the tenth failure in a row: about 43 s of back-offs, long
    /// enough to ride out a passing cause, short enough that a pod that cannot do its work is
    /// replaced within a minute.
    fn default() -> RestartPolicy {
        RestartPolicy {
            first_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            give_up_after: 10,
        }
    }
}

/// A run that lasted this long resets the back-off and the failure count: the failures were not in a row.
const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// How many copies of each supervised task are running now, by name (a task given up stays at 0).
#[derive(Debug, Default)]
pub struct Liveness {
    running: Mutex<BTreeMap<String, usize>>,
}

impl Liveness {
    /// Records that `task` is expected to run (with none running yet).
    pub fn expect(&self, task: &str) {
        self.running.lock().expect("liveness lock").entry(task.to_string()).or_insert(0);
    }

    fn add(&self, task: &str, delta: isize) {
        let mut running = self.running.lock().expect("liveness lock");
        let n = running.entry(task.to_string()).or_insert(0);
        *n = n.saturating_add_signed(delta);
    }

    /// The expected tasks with no copy running now (sorted by name).
    pub fn down(&self) -> Vec<String> {
        let running = self.running.lock().expect("liveness lock");
        running.iter().filter(|(_, n)| **n == 0).map(|(name, _)| name.clone()).collect()
    }
}

/// Runs `make()` as a task until `stop`; each time it panics, or returns while `stop` is not asked
/// for, logs and counts it, waits a back-off and starts a fresh one. After
/// `policy.give_up_after` failures in a row it gives up and returns why. `liveness` counts the task
/// as running while a copy runs.
pub(crate) async fn supervised<F, Fut>(
    task: String,
    liveness: &Liveness,
    stop: CancellationToken,
    policy: RestartPolicy,
    make: F,
) -> Result<(), String>
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    liveness.expect(&task);
    // At 0 from the start, so that an alert's increase() counts the first restart too.
    metrics::counter!("cifpool_task_restarts_total", "task" => task.clone()).increment(0);
    let mut backoff = policy.first_backoff;
    let mut failures = 0u32;
    loop {
        liveness.add(&task, 1);
        let started = tokio::time::Instant::now();
        // Aborted with its supervisor (a killed instance, an aborted lab cell): never left running.
        let ended = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(make())).await;
        liveness.add(&task, -1);
        if stop.is_cancelled() {
            return Ok(());
        }
        let how = match ended {
            Ok(()) => "returned before its stop".to_string(),
            Err(e) if e.is_panic() => format!("panicked: {}", panic_message(e.into_panic())),
            Err(_) => return Ok(()), // cancelled by a runtime that is shutting down
        };
        if started.elapsed() >= HEALTHY_RUN {
            backoff = policy.first_backoff;
            failures = 0;
        }
        failures += 1;
        metrics::counter!("cifpool_task_restarts_total", "task" => task.clone()).increment(1);
        if failures >= policy.give_up_after {
            tracing::error!(task, failures, how, "background task keeps failing; giving it up");
            return Err(format!("failed {failures} times in a row, the last time {how}"));
        }
        tracing::error!(task, how, restart_in = ?backoff, "background task failed; restarting it");
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(policy.max_backoff);
    }
}

/// Runs `round` every `period` (the first at once) until `stop`. A round handles its own errors (a
/// database outage skips rounds, it does not end the loop); a round under way when `stop` comes
/// finishes first. The one shape of every periodic task.
pub async fn every<F, Fut>(period: Duration, stop: CancellationToken, round: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        round().await;
    }
}

/// Why a task that should run until the stop ended before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    /// The task's name as it was started.
    pub task: String,
    /// What happened, in words for the log.
    pub how: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "background task `{}` {}", self.task, self.how)
    }
}

/// The background tasks of one process (or one lab run), each named, all ended by one stop.
pub struct Supervisor {
    tasks: JoinSet<Result<(), String>>,
    names: HashMap<Id, String>,
    started: Vec<String>,
    liveness: Arc<Liveness>,
    stop: CancellationToken,
    policy: RestartPolicy,
}

impl Supervisor {
    /// A supervisor whose tasks report to `liveness`, end when `stop` is cancelled and restart by the
    /// default [`RestartPolicy`].
    pub fn new(liveness: Arc<Liveness>, stop: CancellationToken) -> Supervisor {
        let policy = RestartPolicy::default();
        Supervisor { tasks: JoinSet::new(), names: HashMap::new(), started: Vec::new(), liveness, stop, policy }
    }

    /// The same, restarting by `policy`.
    pub(crate) fn with_policy(mut self, policy: RestartPolicy) -> Supervisor {
        self.policy = policy;
        self
    }

    /// The token that ends every task of this supervisor.
    pub fn stop(&self) -> &CancellationToken {
        &self.stop
    }

    /// Where the tasks' running copies are counted.
    pub fn liveness(&self) -> &Arc<Liveness> {
        &self.liveness
    }

    /// Keeps `make()` running until the stop, started again after a panic or an early return
    /// (see [`supervised`]); it takes the stop token.
    pub(crate) fn keep_running<F, Fut>(&mut self, name: impl Into<String>, make: F)
    where
        F: Fn(CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let name = name.into();
        let (liveness, stop, policy) = (self.liveness.clone(), self.stop.clone(), self.policy);
        let task = name.clone();
        self.add(name, async move {
            let make = || make(stop.clone());
            supervised(task, &liveness, stop.clone(), policy, make).await
        });
    }

    /// Runs `round()` every `period` until the stop, kept running like [`Supervisor::keep_running`].
    pub fn every<F, Fut>(&mut self, name: impl Into<String>, period: Duration, round: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let round = Arc::new(round);
        self.keep_running(name, move |stop| {
            let round = round.clone();
            async move { every(period, stop, || round()).await }
        });
    }

    /// Runs `task`, which ends by itself after the stop (a worker group drains its sends first) and
    /// cannot be started again: its end before the stop is a failure.
    pub(crate) fn run_once(&mut self, name: impl Into<String>, task: impl Future<Output = ()> + Send + 'static) {
        self.add(name.into(), async move {
            task.await;
            Ok(())
        });
    }

    fn add(&mut self, name: String, task: impl Future<Output = Result<(), String>> + Send + 'static) {
        let id = self.tasks.spawn(task).id();
        self.names.insert(id, name.clone());
        self.started.push(name);
    }

    /// The names of the tasks started, in the order they were started (a name repeats for each copy).
    pub fn names(&self) -> &[String] {
        &self.started
    }

    /// Waits for the first task to end before the stop (given up, panicked or returned) and says
    /// which and how; pending for as long as every task runs. Safe to cancel.
    pub(crate) async fn first_failure(&mut self) -> Failure {
        loop {
            let Some(ended) = self.tasks.join_next_with_id().await else {
                return std::future::pending().await;
            };
            let (id, how) = match ended {
                Ok((id, Ok(()))) => (id, "ended before the service stopped".to_string()),
                Ok((id, Err(given_up))) => (id, given_up),
                Err(e) => {
                    let id = e.id();
                    let how = match e.try_into_panic() {
                        Ok(payload) => format!("panicked: {}", panic_message(payload)),
                        Err(_) => "was cancelled".into(),
                    };
                    (id, how)
                }
            };
            let task = self.names.remove(&id).unwrap_or_else(|| "unnamed".into());
            if self.stop.is_cancelled() {
                continue;
            }
            return Failure { task, how };
        }
    }

    /// After the stop: waits up to `limit` for every task to end, then aborts the ones still running
    /// (and waits for them to go); says whether all ended in time.
    pub async fn drain(mut self, limit: Duration) -> bool {
        let in_time =
            tokio::time::timeout(limit, async { while self.tasks.join_next().await.is_some() {} }).await.is_ok();
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
        in_time
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

#[cfg(test)]
mod tests;
