//! A worker group at work: its claim loops, which take free workers and claim jobs for them, and its
//! shutdown, which waits for the sends in flight and hands back what outlives the grace period.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{CLAIM_LOOPS, WorkerGroup};
use crate::claim::Fenced;
use crate::queue::store::{self, Claimed, ClaimedJob};
use crate::supervise::Supervisor;

impl WorkerGroup {
    /// Starts the group under `tasks`: its claim loops (several, so one claim's round trip and
    /// commit overlap another's instead of leaving the workers idle between them), each kept running
    /// on its own, and, at the stop, the drain that waits up to `grace` for the sends in flight.
    pub fn start(self: &Arc<Self>, tasks: &mut Supervisor, grace: Duration) {
        let loop_name = format!("claim loop of group {}", self.policy.name);
        for _ in 0..CLAIM_LOOPS {
            let group = self.clone();
            tasks.keep_running(loop_name.clone(), move |stop| group.clone().claim_loop(stop));
        }
        let drain = self.clone().drain_at(tasks.stop().clone(), grace);
        tasks.run_once(format!("shutdown drain of group {}", self.policy.name), drain);
    }

    /// After `stop`: waits up to `grace` for every worker to be free, then hands back what is still
    /// being sent. (Once this waits for all the permits, a claim loop gets none: the semaphore is fair.)
    async fn drain_at(self: Arc<Self>, stop: CancellationToken, grace: Duration) {
        stop.cancelled().await;
        let all = self.policy.size as u32;
        if tokio::time::timeout(grace, self.workers.acquire_many(all)).await.is_err() {
            self.hand_back().await;
        }
    }

    /// One claim loop of [`WorkerGroup::start`]: takes free workers (up to a claim batch, or more
    /// after a slow full claim: [`crate::queue::catch_up`]), claims that many jobs, hands each to a task that sends
    /// and finishes it.
    async fn claim_loop(self: Arc<Self>, stop: CancellationToken) {
        let poll = self.runtime.settings.poll_interval;
        let limits = self.runtime.settings.claim_limits();
        let mut limit = limits.batch;
        loop {
            let first = tokio::select! {
                _ = stop.cancelled() => break,
                p = self.workers.clone().acquire_owned() => p.expect("semaphore never closed"),
            };
            let mut permits = vec![first];
            while permits.len() < limit {
                match self.workers.clone().try_acquire_owned() {
                    Ok(p) => permits.push(p),
                    Err(_) => break,
                }
            }
            // Every provider of the group is at its limit: a claim would take nothing, so wait for
            // one of them to end a call instead of polling.
            let (classes, at_limit) = self.claimable_classes();
            if classes.is_empty() && !at_limit.is_empty() {
                drop(permits);
                self.wait_for_room(&at_limit, &stop).await;
                continue;
            }
            let Claimed { jobs, stopped_at, lasted, .. } = match self.claim_in_order(permits.len()).await {
                Ok(claimed) => claimed,
                Err(e) => {
                    tracing::warn!(group = %self.policy.name, error = %e, "claim failed");
                    Claimed::default()
                }
            };
            limit = limits.next(permits.len(), jobs.len(), lasted);
            if let (true, Some(class)) = (jobs.is_empty(), stopped_at) {
                // The head of the order waits for its provider: so do the workers.
                drop(permits);
                if let Some(class) = self.runtime.classes.get(&class) {
                    self.wait_for_room(&[class.provider.name.as_str()], &stop).await;
                }
                continue;
            }
            if jobs.is_empty() {
                drop(permits);
                let wake = self.runtime.wake.notified();
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = wake => {}
                    _ = tokio::time::sleep(poll) => {}
                }
                continue;
            }
            for (job, permit) in jobs.into_iter().zip(permits.drain(..)) {
                let group = self.clone();
                group.in_flight.lock().expect("in-flight lock").insert(job.id, job.clone());
                tokio::spawn(async move {
                    let id = job.id;
                    if let Err(e) = group.process(job).await {
                        // The lease will expire and the sweep hands the job back: nothing is lost.
                        tracing::warn!(job = id, error = %e, "finishing a job failed");
                    }
                    group.in_flight.lock().expect("in-flight lock").remove(&id);
                    drop(permit);
                });
            }
        }
    }

    /// Shutdown outlasted the grace period: put the jobs still being sent back in the queue now, so
    /// another instance takes them at once instead of after their lease. (A send that did reach the
    /// provider is then delivered twice, which the idempotency key makes harmless.)
    async fn hand_back(&self) {
        let jobs: Vec<ClaimedJob> =
            std::mem::take(&mut *self.in_flight.lock().expect("in-flight lock")).into_values().collect();
        let mut handed = 0;
        for job in &jobs {
            match store::mark_retry(&self.db, job, Duration::ZERO, "handed back at shutdown").await {
                Ok(Fenced::Done) => handed += 1,
                Ok(Fenced::LeaseLost) => {}
                Err(e) => tracing::warn!(job = job.id, error = %e, "hand-back failed; the lease will expire instead"),
            }
        }
        tracing::warn!(group = %self.policy.name, handed, "sends outlived the shutdown grace period: handed back");
    }
}
