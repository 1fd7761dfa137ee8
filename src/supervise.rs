//! Supervised background loops: a loop that panics is started again after a back-off, counted in
//! `cifpool_task_restarts_total{task}`, and while it is down [`Liveness`] says so (readiness reads it).
//! A loop that returns has finished its work (its stop was asked for) and is not restarted; a
//! supervisor that is aborted aborts its loop.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// First wait before a restart; doubled after each panic in a row, up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Longest wait before a restart.
pub const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// A run that lasted this long resets the back-off: the panics were not in a row.
const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// How many copies of each supervised loop are running now, by name.
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

    /// The expected tasks with no copy running now.
    pub fn down(&self) -> Vec<String> {
        let running = self.running.lock().expect("liveness lock");
        running.iter().filter(|(_, n)| **n == 0).map(|(name, _)| name.clone()).collect()
    }
}

/// Runs `make()` as a task until it returns or `stop`; each time it panics, logs it, counts it,
/// waits a back-off and starts a fresh one. `liveness` counts it as running while a copy runs.
pub async fn supervised<F, Fut>(task: String, liveness: &Liveness, stop: CancellationToken, make: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    liveness.expect(&task);
    let mut backoff = FIRST_BACKOFF;
    loop {
        liveness.add(&task, 1);
        let started = tokio::time::Instant::now();
        // Aborted with its supervisor (a killed instance, an aborted lab cell): never left running.
        let ended = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(make())).await;
        liveness.add(&task, -1);
        let Err(e) = ended else { return };
        if !e.is_panic() || stop.is_cancelled() {
            return;
        }
        if started.elapsed() >= HEALTHY_RUN {
            backoff = FIRST_BACKOFF;
        }
        metrics::counter!("cifpool_task_restarts_total", "task" => task.clone()).increment(1);
        tracing::error!(task, restart_in = ?backoff, "background task panicked; restarting it");
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_panicking_loop_is_restarted_and_counted_down_meanwhile() {
        let liveness = Arc::new(Liveness::default());
        let runs = Arc::new(AtomicUsize::new(0));
        let stop = CancellationToken::new();
        let (release, released) = tokio::sync::watch::channel(false);
        let supervisor = {
            let (liveness, runs, stop) = (liveness.clone(), runs.clone(), stop.clone());
            tokio::spawn(async move {
                supervised("claim loop".into(), &liveness, stop, move || {
                    let runs = runs.clone();
                    let mut released = released.clone();
                    async move {
                        // The first two runs panic; the third waits to be released, then ends.
                        if runs.fetch_add(1, Ordering::SeqCst) < 2 {
                            panic!("injected");
                        }
                        let _ = released.wait_for(|r| *r).await;
                    }
                })
                .await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(liveness.down(), vec!["claim loop".to_string()], "down during the back-off");
        tokio::time::sleep(FIRST_BACKOFF * 3 + Duration::from_millis(50)).await;
        assert_eq!(runs.load(Ordering::SeqCst), 3, "restarted twice, the second wait doubled");
        assert!(liveness.down().is_empty(), "running again");
        release.send(true).unwrap();
        supervisor.await.unwrap();
        assert_eq!(runs.load(Ordering::SeqCst), 3, "a loop that returns is not restarted");
        assert_eq!(liveness.down(), vec!["claim loop".to_string()]);
    }
}
