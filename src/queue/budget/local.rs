//! One pod's view of a provider's budget: its share, the sends in flight on it, the rate tokens it
//! holds, a local pause, and the permits sends take. The database side is in `sync`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::SYNC_INTERVAL;
use crate::config::ProviderSettings;

/// This pod's view of one provider's budget.
#[derive(Debug)]
pub struct ProviderBudget {
    pub(super) name: String,
    pub(super) max: u32,
    pub(super) min: u32,
    pub(super) rate: Option<f64>,
    pub(super) timeout: Duration,
    pub(super) state: Mutex<Local>,
    pub(super) freed: Notify,
}

#[derive(Debug, Default)]
pub(super) struct Local {
    /// Sends this pod may have in flight now (its allowed share).
    pub(super) cap: u32,
    /// Sends in flight on this pod.
    pub(super) in_flight: u32,
    /// Send tokens of the rate limit taken from the bucket and not used yet.
    pub(super) tokens: f64,
    /// No new sends before this (a provider's `Retry-After`).
    pub(super) paused_until: Option<Instant>,
    /// The share is trusted until then; `None`: never synced.
    pub(super) valid_until: Option<Instant>,
    /// Successes and overloads seen since the last sync.
    pub(super) successes: u64,
    pub(super) overloads: u64,
    /// A claim found no capacity since the last sync (demand this pod could not serve).
    pub(super) starved: bool,
    /// The last sync failed: the next one restarts the provider at its floor.
    pub(super) stalled: bool,
    /// The deployment-wide limit as last read.
    pub(super) limit: f64,
    /// The most the last sync could have granted this pod: the budget less the other pods' shares.
    pub(super) ceiling: u32,
}

/// What a claim may do with a provider's jobs right now (see [`ProviderBudget::room`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// Paused, or this pod holds no valid share (never synced, cut off from the database): no send
    /// may start for a while, so its jobs are stepped over.
    Closed,
    /// At the deployment's limit as far as this pod can have it (every unit it may hold is in
    /// flight, or the rate's tokens are spent): its jobs are stepped over, since the worker that ends
    /// one of its calls claims the next of them anyway, and waiting would idle workers other flows
    /// can use.
    AtLimit,
    /// Sends that may start now. 0 means this pod's share is full but could grow: a claim stops at
    /// the provider's first job and asks for a larger share at once.
    Free(u32),
}

/// One call's claim on a pod's share; report how the call went, or drop it (neutral).
#[derive(Debug)]
pub struct Permit<'a> {
    budget: &'a ProviderBudget,
}

impl ProviderBudget {
    /// The budget of provider `name` as configured.
    pub fn new(name: &str, settings: &ProviderSettings) -> ProviderBudget {
        let budget = ProviderBudget {
            name: name.to_string(),
            max: settings.max_concurrency,
            min: settings.min_concurrency,
            rate: settings.max_rate_per_second,
            timeout: settings.timeout,
            state: Mutex::new(Local { limit: f64::from(settings.max_concurrency), ..Local::default() }),
            freed: Notify::new(),
        };
        budget.publish(&budget.state.lock().expect("budget lock"));
        budget
    }

    /// The provider's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The provider's budget for the whole deployment (`max_concurrency`).
    pub fn max_concurrency(&self) -> u32 {
        self.max
    }

    fn usable(&self, s: &Local, now: Instant) -> u32 {
        if s.valid_until.is_none_or(|v| now >= v) || s.paused_until.is_some_and(|p| now < p) {
            return 0;
        }
        let free = s.cap.saturating_sub(s.in_flight);
        match self.rate {
            Some(_) => free.min(s.tokens.floor() as u32),
            None => free,
        }
    }

    /// Sends this pod may start right now.
    pub fn available(&self) -> u32 {
        self.usable(&self.state.lock().expect("budget lock"), Instant::now())
    }

    /// What a claim may take of this provider's jobs now.
    pub fn room(&self) -> Room {
        let s = self.state.lock().expect("budget lock");
        let now = Instant::now();
        if s.valid_until.is_none_or(|v| now >= v) || s.paused_until.is_some_and(|p| now < p) {
            return Room::Closed;
        }
        let free = s.cap.saturating_sub(s.in_flight);
        if free == 0 {
            return if s.cap >= s.ceiling { Room::AtLimit } else { Room::Free(0) };
        }
        match self.rate {
            Some(_) if s.tokens < 1.0 => Room::AtLimit,
            Some(_) => Room::Free(free.min(s.tokens.floor() as u32)),
            None => Room::Free(free),
        }
    }

    /// Notes that a claim wanted capacity it did not have: the next sync asks for more.
    pub(crate) fn note_starved(&self) {
        self.state.lock().expect("budget lock").starved = true;
    }

    /// Resolves at the next change that may free capacity (a call ending, a sync). Create it before
    /// checking [`ProviderBudget::available`] so a change in between is not missed.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }

    /// A permit if this pod may start a send now.
    pub fn try_acquire(&self) -> Option<Permit<'_>> {
        let mut s = self.state.lock().expect("budget lock");
        if self.usable(&s, Instant::now()) == 0 {
            s.starved = true;
            return None;
        }
        s.in_flight += 1;
        if self.rate.is_some() {
            s.tokens -= 1.0;
        }
        self.publish_in_flight(&s);
        Some(Permit { budget: self })
    }

    /// Waits for a permit.
    pub async fn acquire(&self) -> Permit<'_> {
        loop {
            let changed = self.changed();
            if let Some(p) = self.try_acquire() {
                return p;
            }
            // A sync may grant capacity without any call ending: do not wait longer than one.
            tokio::select! {
                _ = changed => {}
                _ = tokio::time::sleep(SYNC_INTERVAL) => {}
            }
        }
    }

    fn release(&self, outcome: Option<bool>) {
        let mut s = self.state.lock().expect("budget lock");
        s.in_flight = s.in_flight.saturating_sub(1);
        match outcome {
            Some(true) => s.successes += 1,
            Some(false) => s.overloads += 1,
            None => {}
        }
        self.publish_in_flight(&s);
        drop(s);
        self.freed.notify_waiters();
    }

    /// Stops new sends on this pod until `until` (the rest of the deployment learns it from the
    /// database: see [`pause`]).
    pub(crate) fn pause_locally(&self, until: Instant) {
        let mut s = self.state.lock().expect("budget lock");
        s.paused_until = Some(s.paused_until.map_or(until, |p| p.max(until)));
        self.publish(&s);
    }

    /// Sets the provider's gauges. Sends change only the calls in flight ([`Self::publish_in_flight`]);
    /// the rest changes at a sync or a pause, which publish all of them (a pause that ends shows at
    /// the next sync).
    pub(super) fn publish(&self, s: &Local) {
        let p = self.name.clone();
        metrics::gauge!("cifpool_provider_deployment_limit", "provider" => p.clone()).set(s.limit.floor());
        metrics::gauge!("cifpool_provider_pod_share", "provider" => p.clone()).set(f64::from(s.cap));
        metrics::gauge!("cifpool_provider_pod_in_flight", "provider" => p.clone()).set(f64::from(s.in_flight));
        let at_floor = if s.limit <= f64::from(self.min) { 1.0 } else { 0.0 };
        metrics::gauge!("cifpool_provider_limit_at_floor", "provider" => p.clone()).set(at_floor);
        let paused = s.paused_until.is_some_and(|u| u > Instant::now());
        metrics::gauge!("cifpool_provider_paused", "provider" => p).set(if paused { 1.0 } else { 0.0 });
    }

    /// Sets the one gauge a send changes, under the budget's lock that every worker of the provider
    /// takes twice a send. Publishing all five there, each a registry look-up, cost the service
    /// 9–16 % more CPU a drained job (`cifpool-tools bench queue`, three pairs).
    fn publish_in_flight(&self, s: &Local) {
        metrics::gauge!("cifpool_provider_pod_in_flight", "provider" => self.name.clone()).set(f64::from(s.in_flight));
    }
}

impl Permit<'_> {
    /// The call succeeded: counts toward the deployment's regrowth.
    pub fn success(self) {
        self.finish(Some(true));
    }

    /// The provider timed out or failed server-side: counts toward a deployment-wide cut.
    pub fn overload(self) {
        self.finish(Some(false));
    }

    fn finish(self, outcome: Option<bool>) {
        self.budget.release(outcome);
        std::mem::forget(self);
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.budget.release(None);
    }
}
