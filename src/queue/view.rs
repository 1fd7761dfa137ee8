//! The queue at a glance (`GET /admin/queue`): per class what waits, what is scheduled, in flight,
//! retrying and dead, the oldest waiting age, the drain rate and whether it is paused; per provider its
//! deployment-wide budget, what the pods hold of it, this pod's calls in flight and whether it is paused.
//! The waiting, scheduled and dead counts are the statistics' last count (`queue_class_stats`, at most
//! a few seconds old, see [`crate::queue::stats`]): counting a million waiting jobs per request would
//! make the page as slow as the count. Jobs in flight are counted live (a partial index of the few
//! being sent); nothing reads the finished history.

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
    /// Seconds since the waiting, scheduled and dead counts were taken (`None` before the first count).
    pub counted_age_s: Option<f64>,
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

/// One class's counts as the statistics last stored them.
#[derive(sqlx::FromRow)]
struct Counted {
    class: String,
    pending: i64,
    retrying: i64,
    scheduled: i64,
    dead: i64,
    oldest_age_s: Option<f64>,
    age_s: f64,
}

/// Reads the view: the counts of the last statistics refresh, the jobs in flight from their partial
/// index, the drain rates from `stats`, the budgets from `provider_budgets` with the live shares
/// summed, the pauses as this pod last read them.
pub async fn read(db: &PgPool, rt: &QueueRuntime, stats: &QueueStats) -> Result<QueueView, sqlx::Error> {
    let counted: Vec<Counted> = sqlx::query_as(
        "SELECT class, pending, retrying, scheduled, dead, \
                extract(epoch FROM refreshed_at - oldest_due_at)::float8 AS oldest_age_s, \
                extract(epoch FROM now() - refreshed_at)::float8 AS age_s \
         FROM queue_class_stats",
    )
    .fetch_all(db)
    .await?;
    let sending: Vec<(String, i64)> = sqlx::query_as(
        "SELECT class, count(*) FROM notification_jobs \
         WHERE lease_expires_at IS NOT NULL AND status = 'sending' GROUP BY class",
    )
    .fetch_all(db)
    .await?;
    let pauses = rt.pauses();
    let find = |v: &[(String, i64)], c: &str| v.iter().find(|r| r.0 == c).map_or(0, |r| r.1);
    let classes = rt
        .classes
        .keys()
        .map(|c| {
            let w = counted.iter().find(|r| &r.class == c);
            ClassView {
                class: c.clone(),
                // The stored `pending` is every job waiting to be claimed, retries included.
                pending: w.map_or(0, |r| (r.pending - r.retrying).max(0)),
                scheduled: w.map_or(0, |r| r.scheduled),
                retrying: w.map_or(0, |r| r.retrying),
                oldest_waiting_age_s: w.and_then(|r| r.oldest_age_s).map_or(0.0, |a| a.max(0.0)),
                in_flight: find(&sending, c),
                dead: w.map_or(0, |r| r.dead),
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
    let counted_age_s = counted.iter().map(|r| r.age_s.max(0.0)).reduce(f64::max);
    Ok(QueueView { counted_age_s, classes, providers })
}
