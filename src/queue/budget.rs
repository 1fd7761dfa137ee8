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
//! could give the pod more, asks for a sync at once ([`QueueRuntime::ask_for_more`]; at most one per
//! [`EARLY_SYNC_GAP`]) instead of waiting for the next interval: its workers wait on that provider.
//!
//! Pacing: errors cut the deployment's limit by 30 % (at most once a second, whoever sees them), and
//! it grows back by one slot per `limit` successes but never faster than the whole range (floor to
//! `max_concurrency`) in [`REGROWTH`]. A pod that could not reach the database restarts the provider
//! at its floor. So after an outage or a stall the send rate rises over seconds instead of stepping
//! to the maximum. A `Retry-After` from the provider pauses it for every pod until then.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::config::ProviderSettings;
use crate::queue::runtime::QueueRuntime;

/// How often a pod reconciles its shares with the database.
pub const SYNC_INTERVAL: Duration = Duration::from_millis(200);
/// The least time between two syncs when claims ask for more ([`QueueRuntime::ask_for_more`]), so
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

/// Records a provider's `Retry-After` for the whole deployment.
pub async fn pause(db: &PgPool, provider: &str, retry_after: Duration) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE provider_budgets SET paused_until = greatest(coalesce(paused_until, now()), \
                now() + $2::float8 * interval '1 second') WHERE provider = $1",
    )
    .bind(provider)
    .bind(retry_after.as_secs_f64())
    .execute(db)
    .await?;
    Ok(())
}

/// Registers a provider's configuration in `provider_budgets` at start. Every pod should configure a
/// provider alike; the last pod to start sets the figures, and a lowered maximum caps the current limit.
pub async fn register(db: &PgPool, budget: &ProviderBudget) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO provider_budgets AS b (provider, max_concurrency, min_concurrency, rate_per_second, limit_now, tokens) \
         VALUES ($1, $2, $3, $4, $2, $4) \
         ON CONFLICT (provider) DO UPDATE SET max_concurrency = EXCLUDED.max_concurrency, \
             min_concurrency = EXCLUDED.min_concurrency, rate_per_second = EXCLUDED.rate_per_second, \
             limit_now = least(greatest(b.limit_now, EXCLUDED.min_concurrency), EXCLUDED.max_concurrency), \
             tokens = CASE WHEN EXCLUDED.rate_per_second IS NULL THEN NULL \
                           ELSE least(coalesce(b.tokens, EXCLUDED.rate_per_second), greatest(EXCLUDED.rate_per_second, 1)) END",
    )
    .bind(&budget.name)
    .bind(budget.max as i32)
    .bind(budget.min as i32)
    .bind(budget.rate)
    .execute(db)
    .await?;
    Ok(())
}

/// What one sync granted.
struct Grant {
    allowed: u32,
    ceiling: u32,
    tokens: f64,
    limit: f64,
    paused_for: Option<Duration>,
}

impl ProviderBudget {
    /// One reconciliation with the database (see the module documentation). `potential` is the most
    /// this pod could use: its workers that may send through this provider.
    pub async fn sync(&self, db: &PgPool, member: Uuid, lease: Duration, potential: u32) -> Result<(), sqlx::Error> {
        let started = Instant::now();
        let (successes, overloads, stalled, want, lapsed) = {
            let mut s = self.state.lock().expect("budget lock");
            // The share ran out before this sync: the pod could not reach the database for a while.
            let lapsed = s.valid_until.is_some_and(|v| started >= v);
            let busy = s.cap > 0 && s.in_flight * 4 >= s.cap * 3;
            let want = if s.starved || busy {
                potential
            } else {
                // Idle: shrink towards what is in use, keeping one unit for the next message.
                s.in_flight.max(s.cap / 2).max(1).min(potential)
            };
            let taken = (s.successes, s.overloads, s.stalled, want, lapsed);
            s.successes = 0;
            s.overloads = 0;
            s.starved = false;
            taken
        };
        match self.sync_tx(db, member, lease, (successes, overloads, stalled), want).await {
            Ok(grant) => {
                let mut s = self.state.lock().expect("budget lock");
                s.cap = grant.allowed;
                s.tokens += grant.tokens;
                s.limit = grant.limit;
                s.ceiling = grant.ceiling;
                // A stall (a lapsed share, or this very sync hanging) restarts the provider at its
                // floor at the next sync, so the backlog that built up drains at a rising rate.
                s.stalled = lapsed || started.elapsed() > STALL;
                if s.stalled {
                    tracing::warn!(provider = %self.name, "database stall: restarting the provider at its floor");
                }
                s.valid_until = (started + lease).checked_sub(self.timeout + SAFETY);
                if let Some(d) = grant.paused_for {
                    let until = Instant::now() + d;
                    s.paused_until = Some(s.paused_until.map_or(until, |p| p.max(until)));
                }
                self.publish(&s);
                drop(s);
                self.freed.notify_waiters();
                Ok(())
            }
            Err(e) => {
                let mut s = self.state.lock().expect("budget lock");
                s.successes += successes;
                s.overloads += overloads;
                s.stalled = true;
                Err(e)
            }
        }
    }

    async fn sync_tx(
        &self,
        db: &PgPool,
        member: Uuid,
        lease: Duration,
        (successes, overloads, stalled): (u64, u64, bool),
        want: u32,
    ) -> Result<Grant, sqlx::Error> {
        let mut tx = db.begin().await?;
        // The AIMD step and the token refill, with the provider's row locked until commit: every pod's
        // sync of this provider is serialised, so shares are always taken against a current view.
        let (limit, paused_secs, bucket): (f64, Option<f64>, Option<f64>) = sqlx::query_as(
            "UPDATE provider_budgets SET \
                limit_now = CASE \
                    WHEN $2 THEN min_concurrency \
                    WHEN $3 > 0 AND (last_cut_at IS NULL OR last_cut_at < now() - interval '1 second') \
                        THEN greatest(min_concurrency, limit_now * $6) \
                    ELSE least(max_concurrency, limit_now + least($4 / greatest(limit_now, 1), \
                         (max_concurrency - min_concurrency) * extract(epoch FROM now() - grown_at) / $5)) END, \
                last_cut_at = CASE WHEN $2 OR ($3 > 0 AND (last_cut_at IS NULL OR last_cut_at < now() - interval '1 second')) \
                                   THEN now() ELSE last_cut_at END, \
                grown_at = now(), \
                tokens = CASE WHEN rate_per_second IS NULL THEN NULL ELSE least(greatest(rate_per_second, 1), \
                         coalesce(tokens, 0) + rate_per_second * extract(epoch FROM now() - tokens_at)) END, \
                tokens_at = now() \
             WHERE provider = $1 \
             RETURNING limit_now, extract(epoch FROM paused_until - now())::float8, tokens",
        )
        .bind(&self.name)
        .bind(stalled)
        .bind(overloads as i64)
        .bind(successes as f64)
        .bind(REGROWTH.as_secs_f64())
        .bind(DECREASE)
        .fetch_one(&mut *tx)
        .await?;
        if overloads > 0 || stalled {
            tracing::debug!(provider = %self.name, limit, overloads, stalled, "provider budget after feedback");
        }
        sqlx::query("DELETE FROM provider_shares WHERE provider = $1 AND lease_expires_at < now() AND member <> $2")
            .bind(&self.name)
            .bind(member)
            .execute(&mut *tx)
            .await?;
        let others: Vec<(i32, i32)> =
            sqlx::query_as("SELECT share, want FROM provider_shares WHERE provider = $1 AND member <> $2")
                .bind(&self.name)
                .bind(member)
                .fetch_all(&mut *tx)
                .await?;
        let paused_for = paused_secs.filter(|s| *s > 0.0).map(Duration::from_secs_f64);
        let budget = if paused_for.is_some() { 0 } else { limit.floor().max(0.0) as u32 };
        let mut wants: Vec<u32> = others.iter().map(|(_, w)| (*w).max(0) as u32).collect();
        wants.push(want);
        let target = *water_fill(budget, &wants).last().expect("mine is in");
        let others_hold: u32 = others.iter().map(|(s, _)| (*s).max(0) as u32).sum();
        let ceiling = budget.saturating_sub(others_hold);
        let allowed = target.min(ceiling);
        // Shrink locally now, before the smaller share is recorded: sends that start while this
        // transaction runs must stay within what it records, or another pod could be given units this
        // pod is still starting sends on. (Growth waits for the commit, in `sync`.) Units still in
        // flight stay recorded as ours until they end, so no other pod can take them.
        let in_flight = {
            let mut s = self.state.lock().expect("budget lock");
            s.cap = s.cap.min(allowed);
            s.in_flight
        };
        let recorded = allowed.max(in_flight);
        let tokens = match (self.rate, bucket) {
            (Some(rate), Some(available)) if allowed > 0 => {
                let portion = rate * SYNC_INTERVAL.as_secs_f64() * 2.0 * f64::from(allowed) / f64::from(budget.max(1));
                available.min(portion.ceil().max(1.0))
            }
            _ => 0.0,
        };
        if tokens > 0.0 {
            sqlx::query("UPDATE provider_budgets SET tokens = tokens - $2 WHERE provider = $1")
                .bind(&self.name)
                .bind(tokens)
                .execute(&mut *tx)
                .await?;
        }
        sqlx::query(
            "INSERT INTO provider_shares (provider, member, share, want, lease_expires_at) \
             VALUES ($1, $2, $3, $4, now() + $5::float8 * interval '1 second') \
             ON CONFLICT (provider, member) DO UPDATE SET share = EXCLUDED.share, want = EXCLUDED.want, \
                 lease_expires_at = EXCLUDED.lease_expires_at",
        )
        .bind(&self.name)
        .bind(member)
        .bind(recorded as i32)
        .bind(want as i32)
        .bind(lease.as_secs_f64())
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Grant { allowed, ceiling, tokens, limit, paused_for })
    }

    /// Calls in flight on this pod.
    pub fn in_flight(&self) -> u32 {
        self.state.lock().expect("budget lock").in_flight
    }
}

/// Gives back this pod's shares (at shutdown, once its sends have ended).
pub async fn leave(db: &PgPool, member: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM provider_shares WHERE member = $1").bind(member).execute(db).await?;
    Ok(())
}

/// Keeps this pod's shares of every provider current until `stop`, then, once its sends have ended
/// (or after `grace`), gives them back. It syncs on a connection of its own, so a busy pool (every
/// worker finishing at once after a stall) cannot delay a sync into looking like a stall.
pub async fn run(db: PgPool, runtime: std::sync::Arc<QueueRuntime>, grace: Duration, stop: CancellationToken) {
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(5))
        .test_before_acquire(true)
        .connect_lazy_with(db.connect_options().as_ref().clone());
    for handle in runtime.providers.values() {
        if let Err(e) = register(&db, &handle.budget).await {
            tracing::warn!(provider = handle.name, error = %e, "registering the provider budget failed; syncs retry");
        }
    }
    let mut tick = tokio::time::interval(SYNC_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_sync: Option<Instant> = None;
    loop {
        let ticked = tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => true,
            _ = runtime.share_wanted.notified() => {
                if let Some(wait) = last_sync.and_then(|at| EARLY_SYNC_GAP.checked_sub(at.elapsed())) {
                    tokio::time::sleep(wait).await;
                }
                false
            }
        };
        last_sync = Some(Instant::now());
        runtime.sync_budgets(&db).await;
        if !ticked {
            continue;
        }
        if let Err(e) = runtime.refresh_pauses(&db).await {
            tracing::debug!(error = %e, "reading the queue pauses failed; the last ones read stay in force");
        }
    }
    // Keep syncing (the shares stay valid) while the sends of this pod drain, then leave.
    let deadline = Instant::now() + grace;
    while runtime.providers.values().any(|h| h.budget.in_flight() > 0) && Instant::now() < deadline {
        tick.tick().await;
        runtime.sync_budgets(&db).await;
    }
    if let Err(e) = leave(&db, runtime.member).await {
        tracing::debug!(error = %e, "could not give back the provider shares; they expire with their lease");
    }
}
