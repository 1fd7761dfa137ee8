//! `[queue]`: the notification queue, its classes, worker groups and providers, and the rules they
//! must keep together.

use std::time::Duration;

use secrecy::SecretString;
use serde::{Deserialize, Serialize};

use super::{ConfigError, redact};

/// `[queue]`: the notification queue, its classes, worker groups and providers.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct QueueSettings {
    /// Run the workers in `cifpool serve` (the enqueue API is always on).
    pub workers_enabled: bool,
    /// Strategy preset used when `groups` is empty.
    pub strategy: crate::queue::policy::Strategy,
    /// Total workers of the preset.
    pub workers: usize,
    /// Workers reserved for `urgent_classes` (bulkhead and floor-borrow presets).
    pub reserved: usize,
    /// Classes the reserved workers serve.
    pub urgent_classes: Vec<String>,
    /// Explicit groups; when non-empty they replace the preset.
    #[serde(default)]
    pub groups: Vec<crate::queue::policy::GroupPolicy>,
    /// Longest sleep of an idle claimer between polls (NOTIFY usually wakes it sooner).
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// Most jobs one claim statement takes for a group's idle workers.
    pub claim_batch: usize,
    /// Claim batches a group's next claim may take after a slow full one (see
    /// [`crate::queue::catch_up`]); 1 never takes more than a batch.
    pub catch_up_batches: usize,
    /// Whether a claim's commit waits for its WAL to be flushed (and, with synchronous replication, to
    /// reach a standby). Off by default: a claim lost in a crash of the database leaves its jobs
    /// pending, to be sent again under the same idempotency key (see [`crate::claim::Commit`]).
    #[serde(default)]
    pub durable_claims: bool,
    /// Lease of a claimed job; must exceed the slowest provider timeout (heartbeats extend it).
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// Cron of the maintenance sweep (expired leases, overdue jobs).
    pub sweep_schedule: String,
    /// What intake does for a class whose predicted wait exceeds its target: `reject` (429) or
    /// `defer` (accept with `run_after` pushed back by the predicted wait).
    pub overload: OverloadMode,
    /// Largest batch accepted by `POST /v1/notifications/batch`.
    pub max_batch: usize,
    /// Body limit of the batch endpoint, in bytes.
    pub batch_body_limit_bytes: usize,
    /// Batch requests one instance receives at once; more are answered 429 with `Retry-After`. Each
    /// streams in holding a database connection, its transaction and a few MiB of chunks (see
    /// OPERATIONS.md for measured figures).
    #[serde(default = "default_max_concurrent_batches")]
    pub max_concurrent_batches: usize,
    /// Slowest average rate, in bytes per second, at which a batch body may arrive once its first
    /// 5 s are past; a slower upload is cut off with 408, freeing its batch slot (0: any rate).
    #[serde(default = "default_batch_min_bytes_per_second")]
    pub batch_min_bytes_per_second: u64,
    /// Request deadline of the batch endpoint (a 500,000-job batch takes seconds).
    #[serde(with = "humantime_serde")]
    pub batch_timeout: Duration,
    /// Finished jobs (sent, expired, canceled, discarded) and their results are deleted after this long.
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// Dead letters are deleted after this long (unset: never; they wait for a retry or a discard).
    #[serde(default, with = "humantime_serde")]
    pub dead_letter_retention: Option<Duration>,
    /// Tenant weights for fair turns (default 1; a tier may weigh more).
    #[serde(default)]
    pub tenant_weights: std::collections::BTreeMap<String, f64>,
    /// Message classes (`[[queue.classes]]`), each with its priority, provider and limits.
    pub classes: Vec<ClassSettings>,
    /// Providers by name (`[queue.providers.NAME]`), referenced by the classes.
    pub providers: std::collections::BTreeMap<String, ProviderSettings>,
}

fn default_max_concurrent_batches() -> usize {
    2
}

fn default_batch_min_bytes_per_second() -> u64 {
    64 * 1024
}

impl QueueSettings {
    /// How many jobs a group's claims take: `claim_batch`, up to `catch_up_batches` of them after a
    /// slow full claim.
    pub fn claim_limits(&self) -> crate::queue::catch_up::ClaimLimits {
        crate::queue::catch_up::ClaimLimits::new(self.claim_batch, self.catch_up_batches)
    }

    /// How a group's claims commit (`durable_claims`).
    pub fn claim_commit(&self) -> crate::claim::Commit {
        if self.durable_claims { crate::claim::Commit::Flushed } else { crate::claim::Commit::Unflushed }
    }

    /// The groups to run: explicit `[[queue.groups]]`, else the strategy preset (empty groups dropped).
    pub fn group_policies(&self) -> Vec<crate::queue::policy::GroupPolicy> {
        if !self.groups.is_empty() {
            return self.groups.clone();
        }
        let all: Vec<String> = self.classes.iter().map(|c| c.name.clone()).collect();
        self.strategy
            .groups(self.workers, self.reserved, &self.urgent_classes, &all)
            .into_iter()
            .filter(|g| g.size > 0)
            .collect()
    }
}

/// Intake behaviour under overload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OverloadMode {
    /// Answer 429 with `Retry-After`.
    Reject,
    /// Accept, scheduled after the predicted wait.
    Defer,
    /// Accept everything; count and log what `reject` would refuse (to tune targets before they bite).
    Observe,
}

/// `[[queue.classes]]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClassSettings {
    /// Class name, e.g. `otp`.
    pub name: String,
    /// 0 = most urgent.
    pub priority: i16,
    /// Provider name (a key of `[queue.providers]`).
    pub provider: String,
    /// Attempts before a job goes to the dead-letter queue.
    pub max_attempts: u32,
    /// A job not sent within this time after creation expires instead (unset: no deadline).
    #[serde(default, with = "humantime_serde")]
    pub deadline: Option<Duration>,
    /// First retry delay; doubles per attempt, capped, with full jitter.
    #[serde(with = "humantime_serde")]
    pub backoff_base: Duration,
    /// Largest retry delay.
    #[serde(with = "humantime_serde")]
    pub backoff_cap: Duration,
    /// Intake sheds this class when the predicted wait exceeds it (unset: always accepted).
    #[serde(default, with = "humantime_serde")]
    pub target_wait: Option<Duration>,
    /// Most jobs of one tenant in flight at once in this class.
    pub tenant_inflight_cap: u32,
    /// How long a finished job keeps its payload and recipient (e.g. for disputes); unset: erased by the
    /// statement that finishes it (the recipient masked to its last four characters). Dead letters keep
    /// theirs until retried or discarded. A job keeps the value its class had when it was accepted.
    #[serde(default, with = "humantime_serde")]
    pub keep_personal_data: Option<Duration>,
}

/// How a provider delivers messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProviderKind {
    /// JSON over HTTP (`POST {url}/send`); `cifpool fake-provider` speaks it.
    Http,
    /// Accepts everything and sends nothing (development only; logged loudly).
    Noop,
}

/// `[queue.providers.NAME]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderSettings {
    /// How messages are delivered: `http` or `noop`.
    pub kind: ProviderKind,
    /// Base URL (http).
    #[serde(default)]
    pub url: Option<String>,
    /// Per-call timeout.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Calls in flight the provider can take, for the whole deployment: every pod together never has
    /// more than this many calls to it in flight.
    pub max_concurrency: u32,
    /// Concurrency floor the adaptive limit never cuts below (deployment-wide too).
    pub min_concurrency: u32,
    /// Calls per second the provider accepts, deployment-wide (unset: no rate limit).
    #[serde(default)]
    pub max_rate_per_second: Option<f64>,
    /// Value of the `Authorization` header sent with each call (e.g. `Bearer …`); a secret, so set it
    /// through `CIFPOOL_QUEUE__PROVIDERS__<NAME>__AUTHORIZATION`.
    #[serde(default, serialize_with = "redact")]
    pub authorization: Option<SecretString>,
    /// Accept `kind = "noop"` with an external database. A no-op provider marks every message sent and
    /// delivers nothing, so `serve` refuses it outside local development unless this says so.
    #[serde(default)]
    pub allow_noop: bool,
}

impl QueueSettings {
    /// The first provider that would deliver nothing (`kind = "noop"` without `allow_noop`), as the
    /// error `serve` gives with an external database.
    pub(super) fn noop_refused(&self) -> Result<(), ConfigError> {
        match self.providers.iter().find(|(_, p)| p.kind == ProviderKind::Noop && !p.allow_noop) {
            None => Ok(()),
            Some((name, _)) => Err(ConfigError::Invalid {
                key: format!("queue.providers.{name}.allow_noop"),
                message: format!(
                    "provider {name:?} is kind = \"noop\": every message sent through it is marked sent and goes \
                     nowhere. With an external database (database.url) that is refused: set kind = \"http\" and \
                     its url, or allow_noop = true where losing every message is intended (a test environment)"
                ),
            }),
        }
    }

    /// `[queue]` rules: classes, providers, groups and limits that fit together.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let q = self;
        let invalid = |key: String, message: String| Err(ConfigError::Invalid { key, message });
        if q.classes.is_empty() {
            return invalid("queue.classes".into(), "at least one class is required".into());
        }
        for (i, c) in q.classes.iter().enumerate() {
            if c.name.is_empty() || q.classes[..i].iter().any(|o| o.name == c.name) {
                return invalid(format!("queue.classes[{i}].name"), "must be non-empty and unique".into());
            }
            if !q.providers.contains_key(&c.provider) {
                return invalid(format!("queue.classes[{i}].provider"), format!("no provider named {:?}", c.provider));
            }
            if c.max_attempts == 0 {
                return invalid(format!("queue.classes[{i}].max_attempts"), "must be at least 1".into());
            }
            if c.backoff_base.is_zero() || c.backoff_cap < c.backoff_base {
                return invalid(
                    format!("queue.classes[{i}].backoff_cap"),
                    "needs 0 < backoff_base <= backoff_cap".into(),
                );
            }
            if c.tenant_inflight_cap == 0 {
                return invalid(format!("queue.classes[{i}].tenant_inflight_cap"), "must be at least 1".into());
            }
        }
        for (name, p) in &q.providers {
            if p.kind == ProviderKind::Http && p.url.as_deref().is_none_or(|u| !u.starts_with("http")) {
                return invalid(format!("queue.providers.{name}.url"), "an http provider needs an http(s) URL".into());
            }
            if p.min_concurrency == 0 || p.min_concurrency > p.max_concurrency {
                return invalid(
                    format!("queue.providers.{name}.min_concurrency"),
                    "needs 1 <= min <= max_concurrency".into(),
                );
            }
            if p.timeout >= q.lease {
                return invalid(format!("queue.providers.{name}.timeout"), "must be shorter than queue.lease".into());
            }
            // A share is trusted for the lease minus the call timeout minus a second of safety.
            if p.timeout + std::time::Duration::from_secs(2) > q.lease {
                return invalid(
                    format!("queue.providers.{name}.timeout"),
                    "must be at least 2s shorter than queue.lease (a pod's share of the provider budget is trusted for the lease minus the timeout)".into(),
                );
            }
            if let Some(rate) = p.max_rate_per_second
                && !(rate > 0.0 && rate.is_finite() && rate <= 1_000_000.0)
            {
                return invalid(
                    format!("queue.providers.{name}.max_rate_per_second"),
                    "must be a positive number of calls per second (at most 1000000)".into(),
                );
            }
        }
        for (i, g) in q.groups.iter().enumerate() {
            if g.size == 0 {
                return invalid(format!("queue.groups[{i}].size"), "must be at least 1".into());
            }
            if let Some(c) = g.classes.iter().find(|c| !q.classes.iter().any(|k| &k.name == *c)) {
                return invalid(format!("queue.groups[{i}].classes"), format!("unknown class {c:?}"));
            }
        }
        if q.groups.is_empty() && (q.workers == 0 || q.reserved > q.workers) {
            return invalid("queue.reserved".into(), "needs 0 <= reserved <= workers and workers >= 1".into());
        }
        if let Some(c) = q.urgent_classes.iter().find(|c| !q.classes.iter().any(|k| &k.name == *c)) {
            return invalid("queue.urgent_classes".into(), format!("unknown class {c:?}"));
        }
        // Every class needs at least one worker, or its messages would wait forever.
        let groups = q.group_policies();
        if let Some(c) = q.classes.iter().find(|c| !groups.iter().any(|g| g.size > 0 && g.takes(&c.name))) {
            let key = if q.groups.is_empty() { "queue.reserved" } else { "queue.groups" };
            return invalid(key.into(), format!("no worker group with workers takes class {:?}", c.name));
        }
        if q.max_concurrent_batches == 0 {
            return invalid("queue.max_concurrent_batches".into(), "must be at least 1".into());
        }
        if q.catch_up_batches == 0 {
            return invalid("queue.catch_up_batches".into(), "must be at least 1 (1 never catches up)".into());
        }
        if q.claim_batch == 0 || q.max_batch == 0 {
            return invalid("queue.claim_batch".into(), "claim_batch and max_batch must be at least 1".into());
        }
        crate::schedule::validate_cron(&q.sweep_schedule).or_else(|e| invalid("queue.sweep_schedule".into(), e))?;
        if let Some((t, w)) = q.tenant_weights.iter().find(|(_, w)| !(**w > 0.0 && w.is_finite())) {
            return invalid(format!("queue.tenant_weights.{t}"), format!("{w} must be a positive number"));
        }
        Ok(())
    }
}
