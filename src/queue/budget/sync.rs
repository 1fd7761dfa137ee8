//! The budget's side in Postgres: registering a provider, sharing a `Retry-After`, one pod's sync
//! (the deployment-wide AIMD step and its water-filled share, in one transaction), giving the shares
//! back.

use std::time::{Duration, Instant};

use sqlx::PgPool;
use uuid::Uuid;

use super::{DECREASE, ProviderBudget, REGROWTH, SAFETY, STALL, SYNC_INTERVAL, Share, divide};

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
                self.publish(&s);
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
        let others: Vec<Share> =
            others.iter().map(|&(held, want)| Share { held: held.max(0) as u32, want: want.max(0) as u32 }).collect();
        let portion = divide(budget, &others, want);
        let (allowed, ceiling) = (portion.allowed, portion.ceiling);
        // Shrink locally now, before the smaller share is recorded: sends that start while this
        // transaction runs must stay within what it records, or another pod could be given units this
        // pod is still starting sends on. (Growth waits for the commit, in `sync`.) Units still in
        // flight stay recorded as ours until they end, so no other pod can take them.
        let in_flight = {
            let mut s = self.state.lock().expect("budget lock");
            s.cap = s.cap.min(allowed);
            s.in_flight
        };
        let recorded = portion.recorded(in_flight);
        let tokens = match (self.rate, bucket) {
            (Some(rate), Some(available)) if allowed > 0 => {
                let part = rate * SYNC_INTERVAL.as_secs_f64() * 2.0 * f64::from(allowed) / f64::from(budget.max(1));
                available.min(part.ceil().max(1.0))
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
