//! Intake: what a client may enqueue and whether the queue takes it now. Jobs are validated against
//! the configured classes, admitted or shed by the class's predicted wait (backpressure), then
//! inserted by [`crate::queue::enqueue`] (one job) or [`crate::queue::batch`] (a streamed batch, which
//! uses the rules here job by job); the outcome is counted per class.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::value::RawValue;
use sqlx::PgPool;

use crate::auth::Caller;
use crate::config::OverloadMode;
use crate::queue::enqueue;
use crate::queue::runtime::QueueRuntime;
use crate::queue::stats::QueueStats;

/// Longest recipient.
pub(crate) const MAX_RECIPIENT: usize = 256;
pub(crate) use crate::queue::job::null_payload;
pub use crate::queue::job::{NewJob, payload_of};
pub(crate) use crate::validate::MAX_LABEL;
/// Furthest a send may be scheduled ahead.
pub(crate) const MAX_SCHEDULE_AHEAD: Duration = Duration::from_secs(30 * 86_400);

/// Why a job was refused at intake (422).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

impl NewJob {
    /// Trims the label-like fields, so `" bank"` and `"bank"` are one tenant.
    pub(crate) fn normalize(&mut self) {
        for field in [&mut self.tenant, &mut self.recipient] {
            let trimmed = field.trim();
            if trimmed.len() != field.len() {
                *field = trimmed.to_string();
            }
        }
    }

    /// Checks the job against the configured classes.
    pub fn validate(&self, rt: &QueueRuntime) -> Result<(), Invalid> {
        check_class(rt, &self.class)?;
        use crate::validate;
        validate::text("recipient", &self.recipient, MAX_RECIPIENT).map_err(Invalid)?;
        validate::text("tenant", &self.tenant, MAX_LABEL).map_err(Invalid)?;
        if let Some(key) = &self.idempotency_key {
            validate::text("idempotency_key", key, MAX_LABEL).map_err(Invalid)?;
        }
        validate::json_text("payload", self.payload.get()).map_err(Invalid)?;
        if let Some(at) = self.run_at {
            check_ahead(at)?;
            check_deadline(rt, &self.class, at)?;
        }
        Ok(())
    }
}

/// The class rule of a job: one of the configured classes (the message lists them).
pub(crate) fn check_class(rt: &QueueRuntime, class: &str) -> Result<(), Invalid> {
    if rt.classes.contains_key(class) {
        return Ok(());
    }
    let known: Vec<&str> = rt.classes.keys().map(String::as_str).collect();
    Err(Invalid(format!("unknown class {class:?}; known classes: {}", known.join(", "))))
}

/// The first `run_at` rule, whatever the class: at most [`MAX_SCHEDULE_AHEAD`] from now.
pub(crate) fn check_ahead(at: DateTime<Utc>) -> Result<(), Invalid> {
    if (at - Utc::now()).to_std().unwrap_or_default() > MAX_SCHEDULE_AHEAD {
        return Err(Invalid(format!("run_at {at} is more than 30 days ahead")));
    }
    Ok(())
}

/// The second `run_at` rule: a job of a class with a deadline must not be scheduled at or past it
/// (it would only expire). A class that is not configured passes (its own rule refuses it).
pub(crate) fn check_deadline(rt: &QueueRuntime, class: &str, at: DateTime<Utc>) -> Result<(), Invalid> {
    let ahead = (at - Utc::now()).to_std().unwrap_or_default();
    if let Some(deadline) = rt.classes.get(class).and_then(|c| c.settings.deadline)
        && ahead >= deadline
    {
        return Err(Invalid(format!(
            "run_at {at} is past the deadline of class {class:?} ({}s after enqueue): it would expire unsent",
            deadline.as_secs()
        )));
    }
    Ok(())
}

/// Intake's decision for a class.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admission {
    /// Take it now.
    Accept,
    /// Take it, scheduled after this delay (`overload = "defer"`).
    Defer(Duration),
    /// Refuse: come back after this long (429).
    Reject(Duration),
    /// Take it now, though `reject` would refuse it (`overload = "observe"`: counted, logged).
    WouldReject(Duration),
}

/// Decides whether `class` is accepted, from its predicted wait (pending ahead / recent drain rate)
/// against its `target_wait`. Classes without a target (OTP) are always accepted.
pub fn admit(rt: &QueueRuntime, stats: &QueueStats, class: &str) -> Admission {
    let Some(target) = rt.classes.get(class).and_then(|c| c.settings.target_wait) else {
        return Admission::Accept;
    };
    let Some(predicted) = stats.predicted_wait(class) else { return Admission::Accept };
    if predicted <= target {
        return Admission::Accept;
    }
    match rt.settings.overload {
        OverloadMode::Reject => Admission::Reject((predicted - target).max(Duration::from_secs(1))),
        OverloadMode::Defer => Admission::Defer(predicted - target),
        OverloadMode::Observe => Admission::WouldReject((predicted - target).max(Duration::from_secs(1))),
    }
}

/// [`admit`] for `jobs` more jobs of `tenant`: when the class is over its target wait but its groups
/// claim it in weighted turns among tenants, a tenant whose own predicted wait (its backlog over its
/// part of the drain) is within the target is still accepted. So the tenants whose backlog causes the
/// overload are refused (or deferred), and a tenant within its fair share is not. A class claimed in
/// arrival order by any group, or with nothing draining, is judged as a whole.
pub(crate) fn admit_tenant(rt: &QueueRuntime, stats: &QueueStats, class: &str, tenant: &str, jobs: u64) -> Admission {
    let whole = admit(rt, stats, class);
    if whole == Admission::Accept {
        return whole;
    }
    let Some(target) = rt.classes.get(class).and_then(|c| c.settings.target_wait) else { return whole };
    let fair = rt
        .group_policies()
        .iter()
        .filter(|g| g.takes(class))
        .all(|g| g.order == crate::queue::policy::ClaimOrder::Priority);
    if !fair {
        return whole;
    }
    match stats.tenant_predicted_wait(class, tenant, jobs, &rt.settings.tenant_weights) {
        Some(own) if own <= target => Admission::Accept,
        Some(own) => match whole {
            Admission::Defer(_) => Admission::Defer(own - target),
            Admission::Reject(_) => Admission::Reject((own - target).max(Duration::from_secs(1))),
            Admission::WouldReject(_) => Admission::WouldReject((own - target).max(Duration::from_secs(1))),
            Admission::Accept => Admission::Accept,
        },
        None => whole,
    }
}

/// Logs an observed would-be rejection at most once every 10 s per class.
fn log_would_reject(class: &str, excess: Duration) {
    static LAST: std::sync::Mutex<BTreeMap<String, std::time::Instant>> = std::sync::Mutex::new(BTreeMap::new());
    let mut last = LAST.lock().expect("log rate lock");
    let due = last.get(class).is_none_or(|t| t.elapsed() >= Duration::from_secs(10));
    if due {
        last.insert(class.to_string(), std::time::Instant::now());
        tracing::warn!(class, over_target_by = ?excess, "intake would reject this class (overload = \"observe\")");
    }
}

/// Why intake refused a submission.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// A job breaks a rule (unknown class, bad text, bad payload); the message names the job and field.
    #[error("{0}")]
    Invalid(String),
    /// A batch holds more jobs than `queue.max_batch`.
    #[error("a batch holds at most {max} jobs, got {got} or more")]
    TooMany {
        /// `queue.max_batch`.
        max: usize,
        /// Jobs read before the batch was refused (reading stops at the first one too many).
        got: usize,
    },
    /// The body is not JSON, or ends (or the connection breaks) before the JSON does (400).
    #[error("{0}")]
    Malformed(String),
    /// The batch body arrived more slowly than `queue.batch_min_bytes_per_second` (408).
    #[error("{0}; send it faster or in smaller batches (queue.batch_min_bytes_per_second)")]
    TooSlow(String),
    /// The batch body outgrew `queue.batch_body_limit_bytes` while it streamed in (413).
    #[error("the request body is larger than the batch body limit (queue.batch_body_limit_bytes)")]
    BodyTooLarge,
    /// The class is over its target wait because of this tenant's own backlog (or as a whole, when
    /// its jobs are not claimed in turns among tenants), and intake sheds it: retry after the delay.
    #[error("class {class:?} is over its target wait; retry later")]
    Overloaded {
        /// The class shed.
        class: String,
        /// When to come back.
        retry_after: Duration,
    },
    /// The caller's key is bound to other tenants (403).
    #[error("this API key may not act for tenant {0:?}")]
    Forbidden(String),
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// The tenant rule of a key: a job that names no tenant takes the caller's only one; a job may only
/// name a tenant the caller may act for. So with a tenant-bound key, a job's tenant is a fact of the
/// credential, and fairness caps cannot be dodged by renaming.
fn apply_tenant(job: &mut NewJob, caller: &Caller) -> Result<(), SubmitError> {
    job.tenant = implied_tenant(std::mem::take(&mut job.tenant), caller);
    job.normalize();
    check_tenant_allowed(&job.tenant, caller)
}

/// The tenant a job's (or batch's) `tenant` text stands for: blank means the caller's only tenant
/// when it has exactly one; surrounding spaces are trimmed either way.
pub(crate) fn implied_tenant(named: String, caller: &Caller) -> String {
    match caller.only_tenant() {
        Some(only) if named.trim().is_empty() => only.to_string(),
        _ if named.trim().len() != named.len() => named.trim().to_string(),
        _ => named,
    }
}

/// Refuses a tenant the caller's key is not bound to (an empty one is left to validation).
pub(crate) fn check_tenant_allowed(tenant: &str, caller: &Caller) -> Result<(), SubmitError> {
    if !tenant.is_empty() && !caller.may_act_for(tenant) {
        return Err(SubmitError::Forbidden(tenant.to_string()));
    }
    Ok(())
}

/// What [`submit_one`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Submitted {
    /// The job's id.
    pub id: i64,
    /// False when the idempotency key matched an existing job, which is returned instead.
    pub created: bool,
}

/// The delay intake gives `jobs` jobs of `class` for `tenant` now (zero, or the deferral), or its
/// refusal ([`admit_tenant`]); counts the outcome.
pub(crate) fn delay_or_shed(
    rt: &QueueRuntime,
    stats: &QueueStats,
    class: &str,
    tenant: &str,
    jobs: u64,
) -> Result<Duration, SubmitError> {
    match admit_tenant(rt, stats, class, tenant, jobs) {
        Admission::Accept => Ok(Duration::ZERO),
        Admission::Defer(delay) => Ok(delay),
        Admission::Reject(retry_after) => {
            metrics::counter!("cifpool_queue_intake_rejected_total", "class" => class.to_string()).increment(jobs);
            Err(SubmitError::Overloaded { class: class.to_string(), retry_after })
        }
        Admission::WouldReject(excess) => {
            metrics::counter!("cifpool_queue_intake_would_reject_total", "class" => class.to_string()).increment(jobs);
            log_would_reject(class, excess);
            Ok(Duration::ZERO)
        }
    }
}

/// Validates and enqueues one job for `caller` (see [`SubmitError::Forbidden`] for tenants). A
/// repeated idempotency key returns the existing job, even while intake is shedding its class (a
/// retried request must get its answer).
pub(crate) async fn submit_one(
    db: &PgPool,
    rt: &QueueRuntime,
    stats: &QueueStats,
    caller: &Caller,
    mut job: NewJob,
) -> Result<Submitted, SubmitError> {
    apply_tenant(&mut job, caller)?;
    job.validate(rt).map_err(|e| SubmitError::Invalid(e.0))?;
    if let Some(key) = &job.idempotency_key
        && let Some(id) = enqueue::existing(db, &job.tenant, key).await?
    {
        return Ok(Submitted { id, created: false });
    }
    let delay = delay_or_shed(rt, stats, &job.class, &job.tenant, 1)?;
    let done = enqueue::enqueue_one(db, rt, &job, delay).await?;
    metrics::counter!("cifpool_queue_enqueued_total", "class" => job.class.clone()).increment(u64::from(done.created));
    Ok(Submitted { id: done.id, created: done.created })
}

/// One job of a batch; `class` and `tenant` default to the batch's.
#[derive(Debug, Deserialize)]
pub struct BatchJob {
    /// Class of this job, if not the batch's.
    #[serde(default)]
    pub class: Option<String>,
    /// Tenant of this job, if not the batch's.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Phone number, device token, ….
    pub recipient: String,
    /// Message data, kept as the JSON text it arrived as.
    #[serde(default = "null_payload")]
    pub payload: Box<RawValue>,
    /// Same key (per tenant) again is skipped as a duplicate.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// Send no earlier than this, if not the batch's `run_at`.
    #[serde(default)]
    pub run_at: Option<DateTime<Utc>>,
}

/// What a batch request did (see [`crate::queue::batch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSubmitted {
    /// Jobs inserted.
    pub accepted: u64,
    /// Jobs skipped because their idempotency key was used before.
    pub duplicates: u64,
    /// The batch, to watch (`GET /v1/notifications/batches/{id}`) or cancel.
    pub batch_id: i64,
}
