//! Worker groups: claim (through the policy's SQL), send (through the provider's limit), finish
//! (fenced). Retries go back through the queue: a worker never sleeps on a failed job. The claim loops
//! and the shutdown drain that run a group are in [`running`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use sqlx::PgPool;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::claim::{Fenced, PickSizes};
use crate::queue::budget::Room;
use crate::queue::finish::Finisher;
use crate::queue::floor::{ClaimFloors, Start};
use crate::queue::policy::GroupPolicy;
use crate::queue::provider::{Message, SendError};
use crate::queue::runtime::QueueRuntime;
use crate::queue::status::JobStatus;
use crate::queue::store::{self, ClaimClass, Claimed, ClaimedJob};
use crate::supervise::Supervisor;

mod running;

/// Claim loops per group (see [`WorkerGroup::start`]).
pub const CLAIM_LOOPS: usize = 2;

/// What one step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Nothing claimable for this group.
    Idle,
    /// Delivered.
    Sent(i64),
    /// Transient failure; back in the queue after a backoff.
    Retrying(i64),
    /// Permanent failure or attempts exhausted.
    Dead(i64),
    /// Deadline passed; not sent.
    Expired(i64),
    /// Our lease was lost before we finished (another worker owns the job now).
    LeaseLost(i64),
    /// The provider asked to be left alone for a while: the job waits, its attempt given back.
    Throttled(i64),
}

/// Delay before attempt `attempt + 1`: exponential from `base`, capped, with full jitter.
pub fn backoff(base: Duration, cap: Duration, attempt: i32) -> Duration {
    let exp = base.as_secs_f64() * 2f64.powi((attempt - 1).clamp(0, 30));
    let ceiling = exp.min(cap.as_secs_f64());
    Duration::from_secs_f64(rand::rng().random_range(0.0..=ceiling))
}

/// Starts, under `tasks`, every worker group of [`QueueRuntime::group_policies`], the NOTIFY relay
/// that wakes their idle claimers and the provider budget sync (unless `queue.workers_enabled` is
/// off); each ends at the supervisor's stop, a group handing back the sends that outlive `grace`.
pub fn start_all(runtime: &Arc<QueueRuntime>, db: &PgPool, grace: Duration, tasks: &mut Supervisor) {
    if !runtime.settings.workers_enabled {
        return;
    }
    for policy in runtime.group_policies() {
        tracing::info!(group = %policy.name, size = policy.size, classes = ?policy.classes, order = ?policy.order,
            "starting worker group");
        WorkerGroup::new(policy, db.clone(), runtime.clone()).start(tasks, grace);
    }
    let (rt, db_) = (runtime.clone(), db.clone());
    tasks.keep_running("new-job relay", move |stop| crate::queue::listen::relay(db_.clone(), rt.clone(), stop));
    let (rt, db_) = (runtime.clone(), db.clone());
    let sync_grace = grace + Duration::from_secs(1);
    tasks.keep_running("provider budget sync", move |stop| {
        crate::queue::budget::run(db_.clone(), rt.clone(), sync_grace, stop)
    });
}

/// One worker group: up to `policy.size` sends at once, of the classes its policy takes, claimed in
/// its policy's order.
pub struct WorkerGroup {
    /// Which classes it takes, in which order, with how many workers.
    pub policy: GroupPolicy,
    /// The claim's pick sizes, up to its largest catch-up claim ([`crate::queue::catch_up`]);
    /// `claim_sql` has a pair for each.
    claim_sizes: PickSizes,
    /// For each of those sizes, the claim statement when a tenant cap can bind and when none can.
    claim_sql: Vec<(String, String)>,
    db: PgPool,
    runtime: Arc<QueueRuntime>,
    workers: Arc<Semaphore>,
    finisher: Finisher,
    /// Jobs being sent by the group's workers, to hand back if shutdown outlasts the grace.
    in_flight: std::sync::Mutex<BTreeMap<i64, ClaimedJob>>,
    /// Where its claims start each priority (shared by its claim loops).
    floors: std::sync::Mutex<ClaimFloors>,
}

impl WorkerGroup {
    /// A group running `policy` on `db` (starts its finish flusher: call within a tokio runtime).
    pub fn new(policy: GroupPolicy, db: PgPool, runtime: Arc<QueueRuntime>) -> Arc<WorkerGroup> {
        let claim_sizes = PickSizes::up_to(runtime.settings.claim_limits().largest());
        let commit = runtime.settings.claim_commit();
        let claim_sql = claim_sizes
            .sizes()
            .iter()
            .map(|&size| {
                (store::claim_sql(&policy, true, size, commit), store::claim_sql(&policy, false, size, commit))
            })
            .collect();
        let workers = Arc::new(Semaphore::new(policy.size));
        let finisher = Finisher::start(db.clone());
        Arc::new(WorkerGroup {
            policy,
            claim_sizes,
            claim_sql,
            db,
            runtime,
            workers,
            finisher,
            in_flight: Default::default(),
            floors: Default::default(),
        })
    }

    /// The classes a claim of this group may take now, each with its provider's room, and the
    /// providers whose jobs are stepped over because they are at the deployment's limit.
    fn claimable_classes(&self) -> (Vec<ClaimClass>, Vec<&str>) {
        let mut classes = Vec::new();
        let mut at_limit = Vec::new();
        for name in &self.policy.classes {
            let Some(class) = self.runtime.classes.get(name) else { continue };
            if !self.runtime.claimable(name) {
                continue;
            }
            let budget = &class.provider.budget;
            let free = match budget.room() {
                Room::Closed => continue,
                Room::AtLimit => {
                    at_limit.push(class.provider.name.as_str());
                    continue;
                }
                Room::Free(n) => n,
            };
            classes.push(ClaimClass {
                name: name.clone(),
                priority: class.settings.priority,
                tenant_cap: class.settings.tenant_inflight_cap.min(i32::MAX as u32) as i32,
                cap_binds: store::cap_can_bind(class.settings.tenant_inflight_cap, budget.max_concurrency()),
                provider: class.provider.name.clone(),
                free: free.min(i32::MAX as u32) as i32,
            });
        }
        (classes, at_limit)
    }

    /// Claims up to `n` jobs in the group's order, stopping at the first job whose provider has no
    /// room for it (see [`store::claim_sql`]). Providers that held the claim up are asked for a
    /// larger share at once; [`Claimed::stopped_at`] names the class to wait on.
    // At debug: idle workers poll, and a span per empty poll would drown the traces that matter.
    #[tracing::instrument(name = "claim", level = "debug", skip_all, fields(group = %self.policy.name, wanted = n))]
    pub async fn claim_in_order(&self, n: usize) -> Result<Claimed, sqlx::Error> {
        let (classes, at_limit) = self.claimable_classes();
        // Jobs stepped over at a limit are still demand this pod could not serve: its next sync asks
        // for a fair share of that provider.
        for provider in at_limit {
            if let Some(handle) = self.runtime.providers.get(provider) {
                handle.budget.note_starved();
            }
        }
        if classes.is_empty() || n == 0 {
            return Ok(Claimed::default());
        }
        // No more than the providers have room for in all: a claim locks every row it picks, and rows
        // it locks beyond what it can take only make other claimers step over them.
        let mut room = BTreeMap::new();
        for c in &classes {
            room.insert(c.provider.as_str(), c.free as usize);
        }
        let limit = n.min(room.values().sum());
        if limit == 0 {
            // Every share is full but could grow: the head of the order waits for one of them.
            let first = classes[0].name.clone();
            for provider in room.keys() {
                self.runtime.ask_for_more(provider);
            }
            return Ok(Claimed { stopped_at: Some(first), ..Claimed::default() });
        }
        let lease = self.runtime.settings.lease;
        let (capped, uncapped) = &self.claim_sql[self.claim_sizes.index_for(limit)];
        let sql = if classes.iter().any(|c| c.cap_binds) { capped } else { uncapped };
        let started = Instant::now();
        let start = self.floors.lock().expect("floors lock").start(started);
        let from_head = BTreeMap::new();
        let floors = match &start {
            Start::Head => &from_head,
            Start::Floors(floors) => floors,
        };
        let claimed = store::claim(&self.db, sql, limit, lease, &classes, floors, &self.runtime.seal).await;
        // Timed with the opening of its rows (a failed claim too). A group's claims run one after
        // another where a tenant cap can bind (the class's claim lock): their time per second is how
        // close its claiming is to its ceiling.
        let lasted = started.elapsed();
        let group = self.policy.name.clone();
        metrics::histogram!("cifpool_queue_claim_duration_seconds", "group" => group.clone())
            .record(lasted.as_secs_f64());
        let mut claimed = claimed?;
        claimed.lasted = lasted;
        self.floors.lock().expect("floors lock").record(&start, started, lasted, claimed.jobs.len(), &claimed.starts);
        if matches!(start, Start::Floors(_)) {
            metrics::counter!("cifpool_queue_claims_from_floors_total", "group" => group.clone()).increment(1);
        }
        metrics::histogram!("cifpool_queue_claim_size", "group" => group).record(claimed.jobs.len() as f64);
        // A row nobody can read must not hold up the rest of its batch, nor come back after its lease.
        for job in std::mem::take(&mut claimed.unreadable) {
            tracing::warn!(job = job.id, error = %job.error, "claimed job cannot be read: dead-lettered");
            metrics::counter!("cifpool_queue_unreadable_total").increment(1);
            if let Err(e) = store::mark_unreadable(&self.db, &job).await {
                tracing::warn!(job = job.id, error = %e, "dead-lettering an unreadable job failed; its lease will expire");
            }
        }
        if let Some(class) = claimed.stopped_at.as_ref().and_then(|c| self.runtime.classes.get(c)) {
            self.runtime.ask_for_more(&class.provider.name);
        }
        Ok(claimed)
    }

    /// Records a claim into the group's floors as its claim loops do after each claim (see
    /// [`ClaimFloors::record`]): how tests put the group's next claims at their floors without
    /// holding a snapshot through ten thousand claimed jobs.
    pub fn record_claim(
        &self,
        start: &Start,
        at: Instant,
        lasted: Duration,
        taken: usize,
        starts: &BTreeMap<i16, f64>,
    ) {
        self.floors.lock().expect("floors lock").record(start, at, lasted, taken, starts);
    }

    /// Claims up to `n` jobs (see [`WorkerGroup::claim_in_order`]).
    pub async fn claim(&self, n: usize) -> Result<Vec<ClaimedJob>, sqlx::Error> {
        Ok(self.claim_in_order(n).await?.jobs)
    }

    /// Waits until one of `providers` may have room (a call ended, a sync), or `stop`, or a poll
    /// interval: the claim found them full (at their limit, or a share still to grow).
    async fn wait_for_room(&self, providers: &[&str], stop: &CancellationToken) {
        let mut waits = Vec::new();
        for &name in providers {
            if let Some(handle) = self.runtime.providers.get(name) {
                let mut changed = Box::pin(handle.budget.changed());
                changed.as_mut().enable();
                waits.push(changed);
            }
        }
        // Checked after the waits are registered, so a change in between is not missed.
        let has_room = |name: &&str| {
            self.runtime.providers.get(*name).is_some_and(|h| matches!(h.budget.room(), Room::Free(n) if n > 0))
        };
        if waits.is_empty() || providers.iter().any(has_room) {
            return;
        }
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = futures_util::future::select_all(waits) => {}
            _ = tokio::time::sleep(self.runtime.settings.poll_interval) => {}
        }
    }

    /// One step: claim one job, send it, finish it. What tests drive instead of the loop.
    pub async fn try_execute_next(&self) -> Result<Outcome, sqlx::Error> {
        match self.claim(1).await?.pop() {
            Some(job) => self.process(job).await,
            None => Ok(Outcome::Idle),
        }
    }

    /// Sends a claimed job and records the result, fenced by its token, in a `send` span that continues
    /// the trace of the request that enqueued the job (when traces are on).
    pub async fn process(&self, job: ClaimedJob) -> Result<Outcome, sqlx::Error> {
        let span = tracing::info_span!("send", job = job.id, class = %job.class, attempt = job.attempt);
        if let Some(traceparent) = &job.traceparent {
            crate::telemetry::traces::continue_from_traceparent(&span, traceparent);
        }
        self.send_and_finish(job).instrument(span).await
    }

    async fn send_and_finish(&self, job: ClaimedJob) -> Result<Outcome, sqlx::Error> {
        let class = self.runtime.classes.get(&job.class).expect("claimed only configured classes");
        let labels = [("class", job.class.clone()), ("group", self.policy.name.clone())];
        if job.attempt == 1 {
            let wait = (job.picked_at - job.created_at).to_std().unwrap_or_default();
            metrics::histogram!("cifpool_queue_wait_seconds", "class" => job.class.clone()).record(wait.as_secs_f64());
        }
        // Another group of this instance may have taken the last provider slot since the claim: wait
        // for one with the heartbeat running, then check the deadline (never send late). A heartbeat
        // that ends here found the lease lost: another worker owns the job now, so do not send it.
        let permit = {
            let acquire = class.provider.budget.acquire();
            let heartbeat = self.heartbeat(&job);
            tokio::pin!(acquire);
            tokio::select! {
                p = &mut acquire => p,
                _ = heartbeat => return Ok(fenced_or(Fenced::LeaseLost, job.id, Outcome::Idle)),
            }
        };
        if job.deadline.is_some_and(|d| d <= chrono::Utc::now()) {
            drop(permit);
            let fenced =
                store::mark_final(&self.db, &job, JobStatus::Expired, "deadline passed before sending").await?;
            return Ok(self.counted(fenced, &job, "cifpool_queue_expired_total", Outcome::Expired(job.id)));
        }
        let in_flight = metrics::gauge!("cifpool_queue_in_flight", &labels);
        in_flight.increment(1.0);
        let message = Message::from(&job);
        let started = Instant::now();
        let result = {
            let send = class.provider.provider.send(&message);
            let heartbeat = self.heartbeat(&job);
            tokio::pin!(send);
            tokio::select! {
                r = &mut send => r,
                _ = heartbeat => send.await,
            }
        };
        in_flight.decrement(1.0);
        let outcome_label = match &result {
            Ok(_) => "ok",
            Err(SendError::Timeout(_)) => "timeout",
            Err(SendError::Transient(_)) => "transient",
            Err(SendError::Permanent(_)) => "permanent",
            Err(SendError::Throttled(_)) => "throttled",
        };
        metrics::histogram!("cifpool_provider_duration_seconds", "provider" => class.provider.name.clone(),
            "outcome" => outcome_label)
        .record(started.elapsed().as_secs_f64());
        match result {
            Ok(delivery) => {
                permit.success();
                let fenced = self.finisher.sent(&job, &class.provider.name, delivery.provider_ref.as_deref()).await?;
                if fenced == Fenced::Done {
                    metrics::counter!("cifpool_queue_sent_total", "class" => job.class.clone()).increment(1);
                }
                Ok(fenced_or(fenced, job.id, Outcome::Sent(job.id)))
            }
            Err(SendError::Permanent(e)) => {
                drop(permit);
                self.dead(&job, &e).await
            }
            Err(SendError::Throttled(wait)) => {
                // Pause here at once, and for every pod through the database; the job waits out the
                // pause without spending an attempt.
                class.provider.budget.pause_locally(std::time::Instant::now() + wait);
                drop(permit);
                if let Err(e) = crate::queue::budget::pause(&self.db, &class.provider.name, wait).await {
                    tracing::warn!(provider = %class.provider.name, error = %e, "could not share the provider's pause");
                }
                tracing::warn!(provider = %class.provider.name, ?wait, "provider asked to retry later: paused");
                let error = SendError::Throttled(wait).to_string();
                let fenced = store::mark_throttled(&self.db, &job, wait, &error).await?;
                Ok(self.counted(fenced, &job, "cifpool_queue_throttled_total", Outcome::Throttled(job.id)))
            }
            Err(e) => {
                if e.is_overload() {
                    permit.overload();
                }
                let error = e.to_string();
                if job.attempt >= job.max_attempts {
                    return self
                        .dead(&job, &format!("{error} (attempt {} of {})", job.attempt, job.max_attempts))
                        .await;
                }
                let delay = backoff(class.settings.backoff_base, class.settings.backoff_cap, job.attempt);
                if job.deadline.is_some_and(|d| chrono::Utc::now() + delay >= d) {
                    let fenced = store::mark_final(&self.db, &job, JobStatus::Expired, &error).await?;
                    return Ok(self.counted(fenced, &job, "cifpool_queue_expired_total", Outcome::Expired(job.id)));
                }
                let fenced = store::mark_retry(&self.db, &job, delay, &error).await?;
                Ok(self.counted(fenced, &job, "cifpool_queue_retries_total", Outcome::Retrying(job.id)))
            }
        }
    }

    async fn dead(&self, job: &ClaimedJob, error: &str) -> Result<Outcome, sqlx::Error> {
        let fenced = store::mark_final(&self.db, job, JobStatus::Dead, error).await?;
        if fenced == Fenced::Done {
            let error = crate::queue::scrub::scrub_job_error(error, &job.recipient);
            tracing::warn!(job = job.id, class = %job.class, error, "job dead-lettered");
        }
        Ok(self.counted(fenced, job, "cifpool_queue_dead_total", Outcome::Dead(job.id)))
    }

    /// Counts an outcome only when our fenced write took effect (a lost lease is counted apart).
    fn counted(&self, fenced: Fenced, job: &ClaimedJob, counter: &'static str, done: Outcome) -> Outcome {
        if fenced == Fenced::Done {
            metrics::counter!(counter, "class" => job.class.clone()).increment(1);
        }
        fenced_or(fenced, job.id, done)
    }

    /// Extends the lease every third of its length; returns (ending the select) only if the lease
    /// was lost, after which the send is simply awaited and its finish will be refused by the fence.
    async fn heartbeat(&self, job: &ClaimedJob) {
        let lease = self.runtime.settings.lease;
        loop {
            tokio::time::sleep(lease / 3).await;
            match store::heartbeat(&self.db, job, lease).await {
                Ok(Some(_)) => {}
                Ok(None) => {
                    tracing::warn!(job = job.id, "lease lost during a long send");
                    return;
                }
                Err(e) => tracing::warn!(job = job.id, error = %e, "heartbeat failed"),
            }
        }
    }
}

fn fenced_or(fenced: Fenced, id: i64, done: Outcome) -> Outcome {
    match fenced {
        Fenced::Done => done,
        Fenced::LeaseLost => {
            metrics::counter!("cifpool_queue_lease_lost_total").increment(1);
            Outcome::LeaseLost(id)
        }
    }
}
