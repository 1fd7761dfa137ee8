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

pub(crate) mod master_key;
mod pools;
mod queue;

pub use pools::PoolSettings;
pub use queue::{ClassSettings, OverloadMode, ProviderKind, ProviderSettings, QueueSettings};

/// The defaults, compiled in so the binary works from any directory (and in a container).
pub(crate) const DEFAULT_TOML: &str = include_str!("../../config/default.toml");

/// Prefix of the environment variables that override configuration keys.
pub(crate) const ENV_PREFIX: &str = "CIFPOOL";

/// Why a configuration could not be loaded; the message names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A layer could not be read or parsed, or a value has the wrong type.
    #[error("{}", dotted_paths(&.0.to_string()))]
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

/// The loader writes a key inside a list as `pools[0]low_watermark`; the rest of the service (and the
/// operator reading the error) spells it `pools[0].low_watermark`.
fn dotted_paths(message: &str) -> String {
    let mut out = String::with_capacity(message.len() + 4);
    let mut chars = message.chars().peekable();
    while let Some(c) = chars.next() {
        out.push(c);
        if c == ']' && chars.peek().is_some_and(|n| n.is_ascii_alphabetic() || *n == '_') {
            out.push('.');
        }
    }
    out
}

/// The whole effective configuration.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// `[server]`: listen address, timeouts, body limit, shutdown grace.
    pub server: ServerSettings,
    /// Postgres, external or embedded.
    pub database: DatabaseSettings,
    /// `[log]`: format and filter.
    pub log: LogSettings,
    /// `[telemetry]`: traces exported over OTLP.
    pub telemetry: TelemetrySettings,
    /// Secrets and key material locations.
    pub security: SecuritySettings,
    /// CIF pools, one per customer type (`[[pools]]`).
    #[serde(default)]
    pub pools: Vec<PoolSettings>,
    /// `[queue]`: the notification queue, its classes, worker groups and providers.
    pub queue: QueueSettings,
    /// `[console]`: the operations console at `/console`.
    pub console: ConsoleSettings,
}

/// `[console]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleSettings {
    /// Serve `/console` (off: every console path is 404).
    pub enabled: bool,
    /// A session ends this long after sign-in, however active.
    #[serde(with = "humantime_serde")]
    pub session_ttl: Duration,
    /// A session ends after this long without a request.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// When the session cookie carries `Secure`.
    pub secure_cookie: SecureCookie,
}

/// When the console's session cookie is marked `Secure` (sent over HTTPS only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SecureCookie {
    /// When the request came over TLS to the proxy in front (`X-Forwarded-Proto: https`): cifpool
    /// itself serves plain HTTP behind an ingress.
    Auto,
    /// Always (a browser then keeps the cookie only over HTTPS).
    Always,
    /// Never (local development over plain HTTP).
    Never,
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
    /// Most connections this instance opens (each pod's share of the server's `max_connections`).
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
    /// What to do when the database is not the one codes were issued from (a restore, a recovery to
    /// a point in time, a promoted standby, a copy): see [`crate::cif::fence`].
    pub on_incarnation_change: OnIncarnationChange,
    /// How often a running instance compares the database's identity with the recorded one (new
    /// connections are checked before they serve anything).
    #[serde(with = "humantime_serde")]
    pub incarnation_check_interval: Duration,
}

/// `database.on_incarnation_change`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnIncarnationChange {
    /// Set every pool's codes aside, move its counter past the margin and go on issuing.
    Fence,
    /// Refuse reservations and refills until an operator fences or accepts.
    Halt,
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

/// `[telemetry]`
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetrySettings {
    /// OTLP/HTTP endpoint of a collector (e.g. `http://otel-collector:4318`); unset: no traces.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans.
    pub service_name: String,
    /// Share of new traces recorded (0 to 1); a request whose `traceparent` says sampled is always
    /// recorded, so a caller's sampling decision holds through cifpool.
    pub sample_ratio: f64,
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
    /// Requests per second one API key may make to one pod (a burst of as many); more get 429 with
    /// `Retry-After`. 0: no limit.
    #[serde(default = "default_requests_per_second_per_key")]
    pub requests_per_second_per_key: u32,
    /// Failed authentications (an unknown or revoked key, a refused console sign-in) one client
    /// address may make per minute on one pod (a burst of as many); past that the address gets 429
    /// before its credential is looked up. 0: no limit.
    #[serde(default = "default_failed_auth_per_minute")]
    pub failed_auth_per_minute: u32,
    /// Proxies (addresses or CIDR blocks) whose `X-Forwarded-For` names the client; empty: the
    /// socket's peer is the client.
    #[serde(default)]
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Seal notification jobs' recipients and payloads before they reach the database (see
    /// `crate::queue::seal`). Off only to measure what sealing costs: jobs are then stored in clear.
    #[serde(default = "default_seal_personal_data")]
    pub seal_personal_data: bool,
    /// Names the key new jobs are sealed under (derived from the master key and this id). A new id
    /// starts a new key; jobs sealed under earlier ids stay readable.
    #[serde(default = "default_personal_data_key_id")]
    pub personal_data_key_id: String,
}

impl Default for SecuritySettings {
    fn default() -> Self {
        SecuritySettings {
            admin_token: None,
            master_key_file: None,
            requests_per_second_per_key: default_requests_per_second_per_key(),
            failed_auth_per_minute: default_failed_auth_per_minute(),
            trusted_proxies: Vec::new(),
            seal_personal_data: default_seal_personal_data(),
            personal_data_key_id: default_personal_data_key_id(),
        }
    }
}

fn default_seal_personal_data() -> bool {
    true
}

fn default_personal_data_key_id() -> String {
    "1".to_string()
}

fn default_requests_per_second_per_key() -> u32 {
    5_000
}

fn default_failed_auth_per_minute() -> u32 {
    30
}

pub(crate) fn redact<S: Serializer>(value: &Option<SecretString>, s: S) -> Result<S::Ok, S::Error> {
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
pub(crate) fn redacted_url(url: &str) -> String {
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

/// Whether `key` (dotted, lower case) holds a secret that may come from a file named by a `…_FILE`
/// variable: the database URL, the admin token and the providers' `authorization` headers.
fn is_file_secret(key: &str) -> bool {
    matches!(key, "database.url" | "security.admin_token")
        || key
            .strip_prefix("queue.providers.")
            .and_then(|rest| rest.strip_suffix(".authorization"))
            .is_some_and(|name| !name.is_empty() && !name.contains('.'))
}

/// Replaces each `CIFPOOL_<SECRET>_FILE` override by the secret read from that file (trailing newline
/// trimmed), so Kubernetes can mount secrets as files rather than expose them as environment variables.
/// A file that cannot be read, or a secret given both ways, is an error naming the variable, never the
/// content.
fn read_secret_files(overrides: HashMap<String, String>) -> Result<HashMap<String, String>, ConfigError> {
    let mut out = HashMap::with_capacity(overrides.len());
    for (key, value) in &overrides {
        let Some(secret) = key.strip_suffix("_file").filter(|k| is_file_secret(k)) else {
            out.insert(key.clone(), value.clone());
            continue;
        };
        let variable = format!("{ENV_PREFIX}_{}_FILE", secret.to_ascii_uppercase().replace('.', "__"));
        if overrides.contains_key(secret) {
            return Err(ConfigError::Invalid {
                key: secret.to_string(),
                message: format!("set both directly and through {variable}; keep one"),
            });
        }
        let content = std::fs::read_to_string(value).map_err(|e| ConfigError::Invalid {
            key: secret.to_string(),
            message: format!("{variable}: cannot read {value}: {e}"),
        })?;
        out.insert(secret.to_string(), content.trim_end_matches(['\n', '\r']).to_string());
    }
    Ok(out)
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
        let overrides = read_secret_files(overrides)?;
        for (key, value) in overrides {
            builder = builder.set_override(key, value)?;
        }
        let settings: Settings = builder.build()?.try_deserialize()?;
        settings.validate()?;
        Ok(settings)
    }

    /// What `serve` needs beyond a valid configuration: with an external database (production), every
    /// provider must deliver (no `noop` provider unless it says `allow_noop = true`). The embedded
    /// database is local development, where the no-op default is the point.
    pub fn check_for_serve(&self) -> Result<(), ConfigError> {
        if self.database.url.is_none() {
            return Ok(());
        }
        self.queue.noop_refused()
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
        let console = &self.console;
        if console.session_ttl < Duration::from_secs(60) || console.session_ttl > Duration::from_secs(7 * 86_400) {
            return invalid("console.session_ttl", "must be between 1 minute and 7 days");
        }
        if console.idle_timeout < Duration::from_secs(60) || console.idle_timeout > console.session_ttl {
            return invalid("console.idle_timeout", "must be at least 1 minute and at most console.session_ttl");
        }
        let telemetry = &self.telemetry;
        if let Some(endpoint) = &telemetry.otlp_endpoint
            && !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
        {
            return invalid("telemetry.otlp_endpoint", "must start with http:// or https:// (OTLP over HTTP)");
        }
        if !(0.0..=1.0).contains(&telemetry.sample_ratio) {
            return invalid("telemetry.sample_ratio", "must be between 0 and 1");
        }
        if telemetry.service_name.is_empty() {
            return invalid("telemetry.service_name", "must not be empty");
        }
        if let Some(token) = &self.security.admin_token
            && token.expose_secret().len() < 16
        {
            return invalid("security.admin_token", "must be at least 16 characters");
        }
        let key_id = &self.security.personal_data_key_id;
        if key_id.is_empty() || key_id.len() > 64 || key_id.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return invalid("security.personal_data_key_id", "must be 1 to 64 characters, without spaces");
        }
        pools::validate(&self.pools)?;
        self.queue.validate()
    }

    /// The pool serving `customer_type`.
    pub fn pool(&self, customer_type: &str) -> Option<&PoolSettings> {
        self.pools.iter().find(|p| p.name == customer_type)
    }

    /// The effective configuration as TOML, secrets redacted (for `cifpool config check`).
    pub(crate) fn to_redacted_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# could not render configuration: {e}\n"))
    }
}
