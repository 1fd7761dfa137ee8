//! Typed configuration, layered: the compiled-in `config/default.toml`, then an optional file, then
//! environment variables `CIFPOOL_<SECTION>__<KEY>`.
//!
//! Secrets (`database.url` may carry a password, `security.admin_token`) are [`SecretString`]s: they
//! never show up in `Debug`, logs or `cifpool config check`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize, Serializer};

use crate::code::check::CheckScheme;
use crate::code::format::CodeFormat;

/// The defaults, compiled in so the binary works from any directory (and in a container).
pub const DEFAULT_TOML: &str = include_str!("../config/default.toml");

/// Prefix of the environment variables that override configuration keys.
pub const ENV_PREFIX: &str = "CIFPOOL";

/// Why a configuration could not be loaded; the message names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A layer could not be read or parsed, or a value has the wrong type.
    #[error("{0}")]
    Load(#[from] config::ConfigError),
    /// A value parsed but breaks a rule.
    #[error("invalid configuration: {key}: {message}")]
    Invalid {
        /// Dotted path of the key, e.g. `server.body_limit_bytes`.
        key: String,
        /// What is wrong with it.
        message: String,
    },
}

/// The whole effective configuration.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// HTTP server.
    pub server: ServerSettings,
    /// Postgres, external or embedded.
    pub database: DatabaseSettings,
    /// Logging.
    pub log: LogSettings,
    /// Secrets and key material locations.
    pub security: SecuritySettings,
    /// CIF pools, one per customer type (`[[pools]]`).
    #[serde(default)]
    pub pools: Vec<PoolSettings>,
    /// Notification queue.
    pub queue: QueueSettings,
}

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
    /// Request deadline of the batch endpoint (a 500,000-job batch takes seconds).
    #[serde(with = "humantime_serde")]
    pub batch_timeout: Duration,
    /// Finished jobs (sent, dead, expired) and their results are deleted after this long.
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// Tenant weights for fair turns (default 1; a tier may weigh more).
    #[serde(default)]
    pub tenant_weights: std::collections::BTreeMap<String, f64>,
    /// Message classes.
    pub classes: Vec<ClassSettings>,
    /// Providers by name.
    pub providers: std::collections::BTreeMap<String, ProviderSettings>,
}

impl QueueSettings {
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
}

/// Provider kind.
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
    /// Kind.
    pub kind: ProviderKind,
    /// Base URL (http).
    #[serde(default)]
    pub url: Option<String>,
    /// Per-call timeout.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Concurrency ceiling (the provider's real capacity).
    pub max_concurrency: u32,
    /// Concurrency floor the adaptive limit never cuts below.
    pub min_concurrency: u32,
    /// Value of the `Authorization` header sent with each call (e.g. `Bearer …`); a secret, so set it
    /// through `CIFPOOL_QUEUE__PROVIDERS__<NAME>__AUTHORIZATION`.
    #[serde(default, serialize_with = "redact")]
    pub authorization: Option<SecretString>,
}

/// `[[pools]]`: one customer type's code pool.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSettings {
    /// Customer type served by this pool (`customer_type` in the API), e.g. `individual`.
    pub name: String,
    /// 0–6 leading digits. Pinned once the pool has issued codes.
    #[serde(default)]
    pub prefix: String,
    /// Scrambled digits per code (6–18). Pinned.
    pub digits: u32,
    /// Check-digit scheme. Pinned.
    #[serde(default)]
    pub check: CheckScheme,
    /// Label mixed into the pool's key derivation; a pool is re-keyed only by creating a new pool. Pinned.
    pub key_id: String,
    /// Refill when fewer codes than this are available.
    pub low_watermark: u64,
    /// Codes generated per refill transaction.
    pub batch_size: u32,
    /// Upper bound of batches per refill run, so an empty pool does not get one giant insert.
    pub max_batches_per_run: u32,
    /// How long a reservation holds a code before reclaim may take it back.
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// Cron (with seconds) of the scheduled refill check.
    pub refill_schedule: String,
    /// Cron (with seconds) of the scheduled reclaim of expired holds.
    pub reclaim_schedule: String,
}

impl PoolSettings {
    /// The pool's code format.
    pub fn format(&self) -> Result<CodeFormat, crate::code::format::FormatError> {
        CodeFormat::new(self.prefix.clone(), self.digits, self.check)
    }
}

/// `[server]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSettings {
    /// Address to bind.
    pub listen: SocketAddr,
    /// Per-request deadline.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// Largest request body for ordinary endpoints.
    pub body_limit_bytes: usize,
    /// Grace period for a graceful shutdown.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
}

/// `[database]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseSettings {
    /// External Postgres URL; `None` means the embedded cluster.
    #[serde(default, serialize_with = "redact_url")]
    pub url: Option<SecretString>,
    /// Data directory of the embedded cluster.
    pub data_dir: PathBuf,
    /// Pool size.
    pub max_connections: u32,
    /// Connections kept open while idle.
    pub min_connections: u32,
    /// Longest wait for a pooled connection.
    #[serde(with = "humantime_serde")]
    pub acquire_timeout: Duration,
    /// Server-side statement timeout for request work.
    #[serde(with = "humantime_serde")]
    pub statement_timeout: Duration,
    /// How long start-up waits for an unreachable database before giving up.
    #[serde(with = "humantime_serde")]
    pub startup_timeout: Duration,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// `[log]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LogSettings {
    /// Output format.
    pub format: LogFormat,
    /// `tracing` filter directive.
    pub level: String,
}

/// `[security]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SecuritySettings {
    /// Bearer token for `/admin`; admin endpoints answer 401 to everyone while it is unset.
    #[serde(default, serialize_with = "redact")]
    pub admin_token: Option<SecretString>,
    /// File holding the hex master key.
    #[serde(default)]
    pub master_key_file: Option<PathBuf>,
}

fn redact<S: Serializer>(value: &Option<SecretString>, s: S) -> Result<S::Ok, S::Error> {
    match value {
        Some(_) => s.serialize_str("[redacted]"),
        None => s.serialize_none(),
    }
}

/// Shows where the database is without its password.
fn redact_url<S: Serializer>(value: &Option<SecretString>, s: S) -> Result<S::Ok, S::Error> {
    match value {
        Some(url) => s.serialize_str(&redacted_url(url.expose_secret())),
        None => s.serialize_none(),
    }
}

/// `postgres://user:pw@host/db` → `postgres://user:[redacted]@host/db`; anything unparseable is fully redacted.
pub fn redacted_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return "[redacted]".into();
    };
    let (authority, tail) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split(':').next().unwrap_or("");
            let masked = if userinfo.contains(':') { format!("{user}:[redacted]") } else { user.to_string() };
            // Query parameters may carry `password=`: drop the whole query to be safe.
            let path = tail.split('?').next().unwrap_or("");
            format!("{scheme}://{masked}@{host}{path}")
        }
        None => format!("{scheme}://{authority}{}", tail.split('?').next().unwrap_or("")),
    }
}

impl Settings {
    /// Loads defaults, then `file` (if any), then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Settings, ConfigError> {
        Self::load_with_env(file, std::env::vars())
    }

    /// Like [`Settings::load`] with an explicit environment, so tests need not mutate the process's.
    pub fn load_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Settings, ConfigError> {
        let mut builder =
            config::Config::builder().add_source(config::File::from_str(DEFAULT_TOML, config::FileFormat::Toml));
        if let Some(path) = file {
            if !path.is_file() {
                return Err(ConfigError::Invalid {
                    key: "--config".into(),
                    message: format!("{} is not a readable file", path.display()),
                });
            }
            builder = builder.add_source(config::File::from(path).format(config::FileFormat::Toml));
        }
        // Only `CIFPOOL_<SECTION>__<KEY>` maps onto keys; other CIFPOOL_* variables (CIFPOOL_MASTER_KEY,
        // CIFPOOL_CONFIG) have their own readers and must not trip `deny_unknown_fields`.
        let prefix = format!("{ENV_PREFIX}_");
        let overrides: HashMap<String, String> = env
            .into_iter()
            .filter_map(|(k, v)| {
                let rest = k.strip_prefix(&prefix)?;
                rest.contains("__").then(|| (rest.to_ascii_lowercase().replace("__", "."), v))
            })
            .collect();
        for (key, value) in overrides {
            builder = builder.set_override(key, value)?;
        }
        let settings: Settings = builder.build()?.try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }

    /// Rules serde cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn invalid(key: &str, message: impl Into<String>) -> Result<(), ConfigError> {
            Err(ConfigError::Invalid { key: key.into(), message: message.into() })
        }
        if self.server.body_limit_bytes < 1024 {
            return invalid("server.body_limit_bytes", "must be at least 1024");
        }
        if self.server.request_timeout.is_zero() {
            return invalid("server.request_timeout", "must be greater than zero");
        }
        let db = &self.database;
        if db.max_connections == 0 {
            return invalid("database.max_connections", "must be at least 1");
        }
        if db.min_connections > db.max_connections {
            return invalid("database.min_connections", "must not exceed database.max_connections");
        }
        if db.acquire_timeout.is_zero() {
            return invalid("database.acquire_timeout", "must be greater than zero");
        }
        if let Some(url) = &db.url {
            let url = url.expose_secret();
            if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
                return invalid("database.url", "must start with postgres:// or postgresql://");
            }
        }
        if let Err(e) = self.log.level.parse::<tracing_subscriber::EnvFilter>() {
            return invalid("log.level", format!("not a tracing filter: {e}"));
        }
        if let Some(token) = &self.security.admin_token
            && token.expose_secret().len() < 16
        {
            return invalid("security.admin_token", "must be at least 16 characters");
        }
        self.validate_pools()?;
        self.validate_queue()
    }

    fn validate_pools(&self) -> Result<(), ConfigError> {
        let invalid = |i: usize, field: &str, message: String| ConfigError::Invalid {
            key: format!("pools[{i}].{field}"),
            message,
        };
        let mut formats = Vec::with_capacity(self.pools.len());
        for (i, pool) in self.pools.iter().enumerate() {
            let name_ok = !pool.name.is_empty()
                && pool.name.len() <= 64
                && pool.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
            if !name_ok {
                return Err(invalid(i, "name", format!("{:?} must be 1-64 characters of a-z, 0-9, _ or -", pool.name)));
            }
            if self.pools[..i].iter().any(|p| p.name == pool.name) {
                return Err(invalid(i, "name", format!("pool {:?} is defined twice", pool.name)));
            }
            let format = pool.format().map_err(|e| {
                let field =
                    if matches!(e, crate::code::format::FormatError::Digits { .. }) { "digits" } else { "prefix" };
                invalid(i, field, e.to_string())
            })?;
            if pool.key_id.trim().is_empty() || pool.key_id.len() > 64 {
                return Err(invalid(i, "key_id", "must be 1-64 characters".into()));
            }
            if pool.low_watermark == 0 {
                return Err(invalid(i, "low_watermark", "must be at least 1".into()));
            }
            if !(1..=100_000).contains(&pool.batch_size) {
                return Err(invalid(i, "batch_size", "must be between 1 and 100000".into()));
            }
            if !(1..=10_000).contains(&pool.max_batches_per_run) {
                return Err(invalid(i, "max_batches_per_run", "must be between 1 and 10000".into()));
            }
            if pool.lease_ttl < Duration::from_secs(1) {
                return Err(invalid(i, "lease_ttl", "must be at least 1s".into()));
            }
            for (field, schedule) in
                [("refill_schedule", &pool.refill_schedule), ("reclaim_schedule", &pool.reclaim_schedule)]
            {
                crate::schedule::validate_cron(schedule).map_err(|e| invalid(i, field, e))?;
            }
            // Two pools whose codes have the same length and one prefix starting the other could
            // produce the same string: refuse, since a code must identify its pool.
            if let Some((j, other)) = self.pools[..i].iter().enumerate().find(|(j, other)| {
                let o: &CodeFormat = &formats[*j];
                o.total_len() == format.total_len()
                    && (other.prefix.starts_with(&pool.prefix) || pool.prefix.starts_with(&other.prefix))
            }) {
                return Err(invalid(
                    i,
                    "prefix",
                    format!(
                        "code space of pool {:?} (prefix {:?}, {} characters) overlaps pool {:?} (pools[{j}], prefix {:?}): \
                         give them prefixes where neither starts the other, or different lengths",
                        pool.name,
                        pool.prefix,
                        format.total_len(),
                        other.name,
                        other.prefix
                    ),
                ));
            }
            formats.push(format);
        }
        Ok(())
    }

    fn validate_queue(&self) -> Result<(), ConfigError> {
        let q = &self.queue;
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
        if q.claim_batch == 0 || q.max_batch == 0 {
            return invalid("queue.claim_batch".into(), "claim_batch and max_batch must be at least 1".into());
        }
        crate::schedule::validate_cron(&q.sweep_schedule).or_else(|e| invalid("queue.sweep_schedule".into(), e))?;
        if let Some((t, w)) = q.tenant_weights.iter().find(|(_, w)| !(**w > 0.0 && w.is_finite())) {
            return invalid(format!("queue.tenant_weights.{t}"), format!("{w} must be a positive number"));
        }
        Ok(())
    }

    /// The pool serving `customer_type`.
    pub fn pool(&self, customer_type: &str) -> Option<&PoolSettings> {
        self.pools.iter().find(|p| p.name == customer_type)
    }

    /// The effective configuration as TOML, secrets redacted (for `cifpool config check`).
    pub fn to_redacted_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# could not render configuration: {e}\n"))
    }
}
