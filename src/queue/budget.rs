//! Provider budgets that hold for the whole deployment, not per pod.
//!
//! A provider's `max_concurrency` is the number of calls cifpool may have in flight to it across every
//! pod. Postgres is the coordination point: `provider_budgets` holds each provider's deployment-wide
//! state (the adaptive limit, a pause, a token bucket for `max_rate_per_second`), and
//! `provider_shares` one row per pod and provider: the part of the budget that pod may use, under a
//! lease.
//!
//! ```text
//!   provider_budgets (sms)        provider_shares (sms)                 pod-local
//!   limit 20, max 20         ┌──> pod A  share 12  want 40  lease t+30s  ──> 12 sends at once
//!   tokens 37 (rate 50/s)    ├──> pod B  share  8  want 40  lease t+30s  ──>  8 sends at once
//!   paused_until —           └──> pod C  (dead: lease expired, row removed, its 8 go to A and B)
//! ```
//!
//! Every [`SYNC_INTERVAL`] each pod, in one transaction that locks the provider's budget row: reports
//! the successes and overloads it saw (the deployment-wide AIMD step), drops expired shares, and takes
//! its fair part of the budget (water-filling the live pods' wants) but never more than what the other
//! pods' recorded shares leave free. Since every increase is made under that lock against the recorded
//! shares, and a pod never sends more than its share, the sum of calls in flight never exceeds the
//! budget. A pod shrinks its share at once but records no less than it has in flight, so units still
//! in use are never handed to another pod. A pod trusts its share only until its lease minus the
//! provider timeout: a pod cut off from the database stops starting sends before its share can expire
//! and be given away, so even a database stall cannot push the total over the budget.
//!
//! A claim that stops at a job because this pod's share of its provider is full, while the budget
//! could give the pod more, asks for a sync at once ([`crate::queue::runtime::QueueRuntime::ask_for_more`]; at most one per
//! [`EARLY_SYNC_GAP`]) instead of waiting for the next interval: its workers wait on that provider.
//!
//! Pacing: errors cut the deployment's limit by 30 % (at most once a second, whoever sees them), and
//! it grows back by one slot per `limit` successes but never faster than the whole range (floor to
//! `max_concurrency`) in [`REGROWTH`]. A pod that could not reach the database restarts the provider
//! at its floor. So after an outage or a stall the send rate rises over seconds instead of stepping
//! to the maximum. A `Retry-After` from the provider pauses it for every pod until then.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::config::ProviderSettings;

mod sync;

pub use sync::{leave, pause, register, run};

/// How often a pod reconciles its shares with the database.
pub const SYNC_INTERVAL: Duration = Duration::from_millis(200);
/// The least time between two syncs when claims ask for more ([`crate::queue::runtime::QueueRuntime::ask_for_more`]), so
/// a pod whose claims keep stopping does not turn the budget rows into a hot spot.
pub const EARLY_SYNC_GAP: Duration = Duration::from_millis(20);
/// The least time the limit takes to grow from the floor back to `max_concurrency`.
pub const REGROWTH: Duration = Duration::from_secs(10);
/// Multiplicative cut on overload.
const DECREASE: f64 = 0.7;
/// A share is trusted locally until this long before its lease, on top of the provider timeout.
const SAFETY: Duration = Duration::from_secs(1);
/// A sync slower than this means the database stalled.
const STALL: Duration = Duration::from_secs(2);

/// This pod's view of one provider's budget.
#[derive(Debug)]
pub struct ProviderBudget {
    name: String,
    max: u32,
    min: u32,
    rate: Option<f64>,
    timeout: Duration,
    state: Mutex<Local>,
    freed: Notify,
}

#[derive(Debug, Default)]
struct Local {
    /// Sends this pod may have in flight now (its allowed share).
    cap: u32,
    /// Sends in flight on this pod.
    in_flight: u32,
    /// Send tokens of the rate limit taken from the bucket and not used yet.
    tokens: f64,
    /// No new sends before this (a provider's `Retry-After`).
    paused_until: Option<Instant>,
    /// The share is trusted until then; `None`: never synced.
    valid_until: Option<Instant>,
    /// Successes and overloads seen since the last sync.
    successes: u64,
    overloads: u64,
    /// A claim found no capacity since the last sync (demand this pod could not serve).
    starved: bool,
    /// The last sync failed: the next one restarts the provider at its floor.
    stalled: bool,
    /// The deployment-wide limit as last read.
    limit: f64,
    /// The most the last sync could have granted this pod: the budget less the other pods' shares.
    ceiling: u32,
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
    pub fn note_starved(&self) {
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
        self.publish(&s);
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
        self.publish(&s);
        drop(s);
        self.freed.notify_waiters();
    }

    /// Stops new sends on this pod until `until` (the rest of the deployment learns it from the
    /// database: see [`pause`]).
    pub fn pause_locally(&self, until: Instant) {
        let mut s = self.state.lock().expect("budget lock");
        s.paused_until = Some(s.paused_until.map_or(until, |p| p.max(until)));
        self.publish(&s);
    }

    fn publish(&self, s: &Local) {
        let p = self.name.clone();
        metrics::gauge!("cifpool_provider_deployment_limit", "provider" => p.clone()).set(s.limit.floor());
        metrics::gauge!("cifpool_provider_pod_share", "provider" => p.clone()).set(f64::from(s.cap));
        metrics::gauge!("cifpool_provider_pod_in_flight", "provider" => p.clone()).set(f64::from(s.in_flight));
        let at_floor = if s.limit <= f64::from(self.min) { 1.0 } else { 0.0 };
        metrics::gauge!("cifpool_provider_limit_at_floor", "provider" => p.clone()).set(at_floor);
        let paused = s.paused_until.is_some_and(|u| u > Instant::now());
        metrics::gauge!("cifpool_provider_paused", "provider" => p).set(if paused { 1.0 } else { 0.0 });
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

/// Splits `budget` among `wants` (water-filling): everyone gets what they want if it all fits,
/// otherwise the smallest wants are met and the rest share equally (remainders to the first).
pub fn water_fill(budget: u32, wants: &[u32]) -> Vec<u32> {
    let mut out = vec![0u32; wants.len()];
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| (wants[i], i));
    let mut left = budget;
    for (n, &i) in order.iter().enumerate() {
        let remaining = (order.len() - n) as u32;
        let fair = left / remaining;
        out[i] = wants[i].min(fair);
        left -= out[i];
    }
    // Integer division leaves up to `remaining - 1` units: hand them to those still short.
    for &i in order.iter().rev() {
        if left == 0 {
            break;
        }
        let extra = (wants[i] - out[i]).min(left);
        out[i] += extra;
        left -= extra;
    }
    out
}
