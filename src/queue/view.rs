//! The queue at a glance (`GET /admin/queue`): per class what waits, what is scheduled, in flight,
//! retrying and dead, the oldest waiting age, the drain rate and whether it is paused; per provider its
//! deployment-wide budget, what the pods hold of it, this pod's calls in flight and whether it is paused.
//! Each count reads one of the partial indexes, never the finished history.

use std::collections::BTreeMap;

use serde::Serialize;
use sqlx::PgPool;

use crate::queue::pause::PauseKind;
use crate::queue::runtime::QueueRuntime;
use crate::queue::stats::QueueStats;

/// One class at a glance: its jobs by state, how long the oldest due one has waited, its drain rate.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ClassView {
    /// The class's name.
    pub class: String,
    /// Jobs waiting to be claimed for a first attempt (`pending`).
    pub pending: i64,
    /// Jobs waiting for a later time (`scheduled`: a `run_at`, deferred intake, a paced replay).
    pub scheduled: i64,
    /// Jobs being sent.
    pub in_flight: i64,
    /// Jobs waiting out a backoff after a transient failure.
    pub retrying: i64,
    /// Dead letters.
    pub dead: i64,
    /// Seconds since the longest-waiting due job (pending or retrying) became due (0 with none).
    pub oldest_waiting_age_s: f64,
    /// Jobs leaving the queue per second (sent, expired, dead or canceled) over the last 30 s, as this
    /// pod's last stats refresh saw it: the rate intake backpressure predicts waits with.
    pub drain_per_s: f64,
    /// Whether the class is paused.
    pub paused: bool,
}

/// One provider at a glance: its deployment-wide limit and what the pods hold of it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ProviderView {
    /// The provider's name.
    pub provider: String,
    /// `max_concurrency`: calls in flight allowed for the whole deployment.
    pub max_concurrency: i32,
    /// The adaptive limit now, deployment-wide.
    pub limit: f64,
    /// What the live pods hold of it.
    pub shares: i64,
    /// Calls this pod has in flight.
    pub in_flight_here: u32,
    /// `max_rate_per_second`, if set.
    pub max_rate_per_second: Option<f64>,
    /// Whether an operator paused it.
    pub paused: bool,
    /// Seconds left of a `Retry-After` pause, if any.
    pub retry_after_s: Option<f64>,
}

/// `GET /admin/queue`: every configured class and provider.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct QueueView {
    /// Configured classes, by name.
    pub classes: Vec<ClassView>,
    /// Configured providers, by name.
    pub providers: Vec<ProviderView>,
}

/// A provider's budget row with the live pods' shares summed.
#[derive(sqlx::FromRow)]
struct BudgetRow {
    provider: String,
    max_concurrency: i32,
    limit_now: f64,
    rate_per_second: Option<f64>,
    retry_after_s: Option<f64>,
    shares: i64,
}

/// Reads the view: the per-state counts from the partial indexes, the drain rates from `stats`, the
/// budgets from `provider_budgets` with the live shares summed, the pauses as this pod last read them.
pub async fn read(db: &PgPool, rt: &QueueRuntime, stats: &QueueStats) -> Result<QueueView, sqlx::Error> {
    let waiting: Vec<(String, i64, i64, i64, f64)> = sqlx::query_as(
        "SELECT class, \
                count(*) FILTER (WHERE status = 'pending'), \
                count(*) FILTER (WHERE status = 'scheduled'), \
                count(*) FILTER (WHERE status = 'failed-retrying'), \
                coalesce(extract(epoch FROM now() - min(greatest(created_at, run_after)) FILTER (WHERE run_after <= now()))::float8, 0) \
         FROM notification_jobs WHERE status IN ('scheduled', 'pending', 'failed-retrying') GROUP BY class",
    )
    .fetch_all(db)
    .await?;
    let sending: Vec<(String, i64)> = sqlx::query_as(
        "SELECT class, count(*) FROM notification_jobs \
         WHERE lease_expires_at IS NOT NULL AND status = 'sending' GROUP BY class",
    )
    .fetch_all(db)
    .await?;
    let dead: Vec<(String, i64)> =
        sqlx::query_as("SELECT class, count(*) FROM notification_jobs WHERE status = 'dead' GROUP BY class")
            .fetch_all(db)
            .await?;
    let pauses = rt.pauses();
    let find = |v: &[(String, i64)], c: &str| v.iter().find(|r| r.0 == c).map_or(0, |r| r.1);
    let classes = rt
        .classes
        .keys()
        .map(|c| {
            let w = waiting.iter().find(|r| &r.0 == c);
            ClassView {
                class: c.clone(),
                pending: w.map_or(0, |r| r.1),
                scheduled: w.map_or(0, |r| r.2),
                retrying: w.map_or(0, |r| r.3),
                oldest_waiting_age_s: w.map_or(0.0, |r| r.4.max(0.0)),
                in_flight: find(&sending, c),
                dead: find(&dead, c),
                drain_per_s: stats.get(c).map_or(0.0, |s| s.drain_per_s),
                paused: pauses.is_paused(PauseKind::Class, c),
            }
        })
        .collect();
    let budgets: Vec<BudgetRow> = sqlx::query_as(
        "SELECT b.provider, b.max_concurrency, b.limit_now, b.rate_per_second, \
                extract(epoch FROM b.paused_until - now())::float8 AS retry_after_s, \
                coalesce((SELECT sum(share) FROM provider_shares s \
                          WHERE s.provider = b.provider AND s.lease_expires_at > now()), 0)::int8 AS shares \
         FROM provider_budgets b",
    )
    .fetch_all(db)
    .await?;
    let budgets: BTreeMap<&str, _> = budgets.iter().map(|b| (b.provider.as_str(), b)).collect();
    let providers = rt
        .providers
        .values()
        .map(|h| {
            let b = budgets.get(h.name.as_str());
            ProviderView {
                provider: h.name.clone(),
                max_concurrency: b.map_or(h.budget.max_concurrency() as i32, |b| b.max_concurrency),
                limit: b.map_or(f64::from(h.budget.max_concurrency()), |b| b.limit_now),
                max_rate_per_second: b.and_then(|b| b.rate_per_second),
                retry_after_s: b.and_then(|b| b.retry_after_s).filter(|s| *s > 0.0),
                shares: b.map_or(0, |b| b.shares),
                in_flight_here: h.budget.in_flight(),
                paused: pauses.is_paused(PauseKind::Provider, &h.name),
            }
        })
        .collect();
    Ok(QueueView { classes, providers })
}
