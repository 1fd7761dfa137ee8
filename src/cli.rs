//! Command-line interface: `cifpool <command>`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::config::{LogFormat, Settings};
use crate::db::Database;
use crate::startup::Application;

/// cifpool: unpredictable, never-duplicated customer numbers and an isolated notification queue.
#[derive(Debug, Parser)]
#[command(name = "cifpool", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// Configuration file layered over the defaults (env CIFPOOL_<SECTION>__<KEY> overrides both).
    #[arg(long, global = true, env = "CIFPOOL_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Log format (overrides log.format).
    #[arg(long, global = true, value_enum)]
    pub log_format: Option<LogFormat>,
    /// Data directory of the embedded Postgres (overrides database.data_dir).
    #[arg(long, global = true, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the HTTP service (and its background jobs).
    Serve {
        /// Address to listen on (overrides server.listen).
        #[arg(long, value_name = "ADDR")]
        listen: Option<SocketAddr>,
    },
    /// Apply database migrations and exit.
    Migrate,
    /// Configuration tools.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Generate or inspect CIF codes offline (ops, audits, tests).
    #[command(subcommand)]
    Codes(CodesCommand),
    /// Print a new random 256-bit master key in hex (for CIFPOOL_MASTER_KEY or a key file).
    Keygen,
    /// Run a stand-in SMS/push provider (latency, errors, hangs; counts deliveries per key).
    FakeProvider {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:9101")]
        listen: SocketAddr,
        #[command(flatten)]
        behaviour: crate::queue::fake_provider::FakeBehaviour,
    },
    /// Dead-letter queue (connects to the database directly; with the embedded database while
    /// `serve` runs, use the /admin/dlq endpoints instead).
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// API keys (connects to the database directly, like `dlq`; `/admin/keys` does the same over HTTP).
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Search the audit trail, newest first (one JSON object per line).
    Audit(AuditArgs),
    /// Queue operations: pause and resume a class or a provider for every pod, cancel a batch, list
    /// pauses (connects to the database directly, like `dlq`; `/admin/queue` does the same over HTTP).
    #[command(subcommand)]
    Queue(QueueCommand),
}

/// `cifpool queue …`
#[derive(Debug, Subcommand)]
pub enum QueueCommand {
    /// Stop every pod claiming a class's jobs (or, for a provider, the jobs of every class it sends)
    /// within a second; sends in flight finish and intake goes on accepting.
    Pause {
        /// class or provider.
        #[arg(value_enum)]
        kind: crate::queue::pause::PauseKind,
        /// Its configured name.
        name: String,
    },
    /// Undo a pause: every pod claims again within a second.
    Resume {
        /// class or provider.
        #[arg(value_enum)]
        kind: crate::queue::pause::PauseKind,
        /// Its configured name.
        name: String,
    },
    /// List the pauses in force (one JSON object per line: kind, name, since when, by whom).
    Pauses,
    /// Cancel every job of a batch that is not being sent yet; prints how many were canceled.
    CancelBatch {
        /// The batch id `POST /v1/notifications/batch` answered.
        id: i64,
    },
}

/// `cifpool keys …`
#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create a key and print its secret once (it is not stored; keep it in your secret store).
    Create {
        /// Unique name, 1-64 characters of A-Z a-z 0-9 . _ : - (the actor in the audit trail).
        name: String,
        /// Scopes: cif:reserve, cif:read, notify:send, notify:read, admin (comma-separated).
        #[arg(long, value_delimiter = ',', required = true)]
        scopes: Vec<String>,
        /// Tenants the key may act for (comma-separated); leave out for a trusted service.
        #[arg(long, value_delimiter = ',')]
        tenants: Option<Vec<String>>,
    },
    /// List every key (names, scopes, tenants, use and revocation; never secrets).
    List,
    /// Revoke a key: every pod refuses it within 5 seconds.
    Revoke {
        /// The key's name.
        name: String,
    },
}

/// `cifpool audit …`: the filters of `GET /admin/audit`.
#[derive(Debug, Args)]
pub struct AuditArgs {
    /// Only events of this code.
    #[arg(long)]
    pub cif: Option<String>,
    /// Only events carrying this customer reference.
    #[arg(long)]
    pub customer_ref: Option<String>,
    /// Only events by this actor (a key name, bootstrap, system, cli:USER).
    #[arg(long)]
    pub actor: Option<String>,
    /// Only events of this action, e.g. cif.confirmed.
    #[arg(long)]
    pub action: Option<String>,
    /// Only events at or after this RFC 3339 time.
    #[arg(long)]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only events before this RFC 3339 time.
    #[arg(long)]
    pub until: Option<chrono::DateTime<chrono::Utc>>,
    /// Most events to print.
    #[arg(long, default_value_t = 100)]
    pub limit: i64,
}

/// `cifpool dlq …`
#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead jobs, oldest first.
    List {
        #[command(flatten)]
        filter: DlqArgs,
        /// Most rows to print.
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Put dead jobs back in the queue at a bounded rate.
    Replay {
        #[command(flatten)]
        filter: DlqArgs,
        /// Most jobs to replay.
        #[arg(long)]
        max: i64,
        /// Jobs per second they become due at.
        #[arg(long, default_value_t = 10.0)]
        rate: f64,
        /// Extra attempts each job gets.
        #[arg(long, default_value_t = 1)]
        extra_attempts: i32,
    },
    /// Put one dead job back in the queue, due now; prints the job.
    Retry {
        /// The job's id.
        id: i64,
        /// Extra attempts it gets.
        #[arg(long, default_value_t = 1)]
        extra_attempts: i32,
    },
    /// Mark one dead job discarded (never sent, kept with its history); prints the job.
    Discard {
        /// The job's id.
        id: i64,
    },
}

/// Dead-letter filter flags.
#[derive(Debug, Args)]
pub struct DlqArgs {
    /// Only this class.
    #[arg(long)]
    pub class: Option<String>,
    /// Only this tenant.
    #[arg(long)]
    pub tenant: Option<String>,
    /// Only jobs whose last error contains this text.
    #[arg(long)]
    pub error: Option<String>,
}

impl DlqArgs {
    fn filter(&self) -> crate::queue::dlq::DlqFilter {
        crate::queue::dlq::DlqFilter {
            class: self.class.clone(),
            tenant: self.tenant.clone(),
            error: self.error.clone(),
        }
    }
}

/// `cifpool codes …`
#[derive(Debug, Subcommand)]
pub enum CodesCommand {
    /// Print the codes for counters START..START+COUNT, one per line.
    Gen {
        #[command(flatten)]
        format: CodeArgs,
        /// First counter.
        #[arg(long, default_value_t = 0)]
        start: u64,
        /// How many codes.
        #[arg(long)]
        count: u64,
    },
    /// Print the counter a code was generated from, or why the code is malformed.
    Inspect {
        #[command(flatten)]
        format: CodeArgs,
        /// The code to inspect.
        code: String,
    },
}

/// Which permutation and format: from flags, or from a configured pool (`--pool`), flags winning.
#[derive(Debug, Args)]
pub struct CodeArgs {
    /// Scrambled digits per code (6-18). Defaults to the pool's.
    #[arg(long)]
    pub digits: Option<u32>,
    /// Leading digits (0-6). Defaults to the pool's, else none.
    #[arg(long)]
    pub prefix: Option<String>,
    /// Check-digit scheme: damm, luhn, mod97 or none. Defaults to the pool's, else damm.
    #[arg(long)]
    pub check: Option<crate::code::check::CheckScheme>,
    /// Master key in hex, on the command line (other users see it in `ps`, and shells keep it in their
    /// history: prefer --key-stdin, or the CIFPOOL_MASTER_KEY environment variable). Without either, the
    /// configured master key (CIFPOOL_MASTER_KEY, security.master_key_file, the dev key).
    #[arg(long, value_name = "HEX", conflicts_with = "key_stdin")]
    pub key_hex: Option<String>,
    /// Read the master key in hex from the first line of standard input (e.g. `vault read … | cifpool
    /// codes inspect --key-stdin CODE`).
    #[arg(long)]
    pub key_stdin: bool,
    /// Key label of the pool. Defaults to the pool's, else "default".
    #[arg(long)]
    pub key_id: Option<String>,
    /// Pool name (part of the key derivation); a configured pool also supplies format and key id.
    #[arg(long, value_name = "NAME")]
    pub pool: Option<String>,
}

impl CodeArgs {
    /// Builds the codec these arguments describe.
    pub fn codec(&self, settings: &Settings) -> anyhow::Result<crate::code::format::PoolCodec> {
        use crate::code::format::{CodeFormat, PoolCodec};
        let configured = match &self.pool {
            Some(name) => settings.pool(name),
            None => None,
        };
        if self.pool.is_some() && configured.is_none() && self.key_hex.is_none() && !self.key_stdin {
            anyhow::bail!(
                "pool {:?} is not in the configuration; pass the key (--key-stdin or --key-hex) and the format flags",
                self.pool.as_deref().unwrap_or_default()
            );
        }
        let digits = self
            .digits
            .or(configured.map(|p| p.digits))
            .ok_or_else(|| anyhow::anyhow!("--digits is required unless --pool names a configured pool"))?;
        let prefix = self.prefix.clone().or(configured.map(|p| p.prefix.clone())).unwrap_or_default();
        let check = self.check.or(configured.map(|p| p.check)).unwrap_or_default();
        let key_id = self.key_id.clone().or(configured.map(|p| p.key_id.clone())).unwrap_or_else(|| "default".into());
        let pool_name = self.pool.clone().unwrap_or_else(|| "default".into());
        let master = match &self.key_hex {
            Some(hex) => crate::keys::MasterKey::from_hex(hex).context("--key-hex")?,
            None if self.key_stdin => {
                let mut line = String::new();
                std::io::stdin().read_line(&mut line).context("reading the key from standard input")?;
                let key = crate::keys::MasterKey::from_hex(&line).context("--key-stdin");
                line.replace_range(.., &"0".repeat(line.len()));
                key?
            }
            None => crate::keys::resolve_master_key(settings, false)?,
        };
        let format = CodeFormat::new(prefix, digits, check)?;
        Ok(PoolCodec::new(format, &master.derive_pool_key(&pool_name, &key_id))?)
    }
}

/// `cifpool config …`
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate the configuration and print the effective values (secrets redacted).
    Check,
}

impl GlobalArgs {
    /// Loads the configuration and applies the command-line overrides.
    pub fn settings(&self) -> anyhow::Result<Settings> {
        let mut settings = Settings::load(self.config.as_deref())?;
        if let Some(format) = self.log_format {
            settings.log.format = format;
        }
        if let Some(dir) = &self.data_dir {
            settings.database.data_dir = dir.clone();
        }
        Ok(settings)
    }
}

/// Parses the command line and runs it.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    if matches!(cli.command, Command::Keygen) {
        // Needs no configuration: it may run anywhere, before any config exists.
        println!("{}", crate::keys::MasterKey::generate().to_hex());
        return Ok(ExitCode::SUCCESS);
    }
    let settings = cli.global.settings()?;
    match cli.command {
        Command::Config(ConfigCommand::Check) => {
            print!("{}", settings.to_redacted_toml());
            settings.check_for_serve()?;
            eprintln!("configuration is valid");
            Ok(ExitCode::SUCCESS)
        }
        Command::Serve { listen } => {
            let mut settings = settings;
            if let Some(addr) = listen {
                settings.server.listen = addr;
            }
            runtime()?.block_on(async {
                crate::telemetry::init_for_serve(&settings)?;
                let result = async {
                    let app = Application::build(settings).await?;
                    app.run_until(crate::startup::shutdown_signal()).await
                }
                .await;
                // Spans of the last requests leave before the process does.
                let _ = tokio::task::spawn_blocking(crate::telemetry::traces::shutdown).await;
                result
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Keygen => unreachable!("handled before the configuration is loaded"),
        Command::Codes(CodesCommand::Gen { format, start, count }) => {
            use std::io::Write;
            let codec = format.codec(&settings)?;
            let end = start.checked_add(count).filter(|&end| end <= codec.capacity()).ok_or_else(|| {
                anyhow::anyhow!("counters {start}..{start}+{count} exceed the domain of {} codes", codec.capacity())
            })?;
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            for counter in start..end {
                writeln!(out, "{}", codec.encode(counter))?;
            }
            out.flush()?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Codes(CodesCommand::Inspect { format, code }) => {
            let codec = format.codec(&settings)?;
            match codec.decode(code.trim()) {
                Ok(counter) => {
                    println!("{counter}");
                    Ok(ExitCode::SUCCESS)
                }
                Err(e) => {
                    eprintln!("error: invalid code {:?}: {e}", code.trim());
                    Ok(ExitCode::FAILURE)
                }
            }
        }
        Command::FakeProvider { listen, behaviour } => {
            crate::telemetry::init_logging(settings.log.format, &settings.log.level);
            runtime()?.block_on(async {
                let listener =
                    tokio::net::TcpListener::bind(listen).await.with_context(|| format!("binding {listen}"))?;
                tracing::info!(addr = %listener.local_addr()?, ?behaviour, "fake provider listening");
                let fake = crate::queue::fake_provider::FakeProvider::new(behaviour);
                crate::queue::fake_provider::serve(fake, listener, crate::startup::shutdown_signal()).await?;
                anyhow::Ok(())
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Dlq(command) => {
            crate::telemetry::init_logging(settings.log.format, "warn");
            with_database(&settings, |db| Box::pin(run_dlq(db, command)))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Keys(command) => {
            crate::telemetry::init_logging(settings.log.format, "warn");
            with_database(&settings, |db| Box::pin(run_keys(db, command)))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Audit(args) => {
            crate::telemetry::init_logging(settings.log.format, "warn");
            with_database(&settings, |db| Box::pin(run_audit(db, args)))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Queue(command) => {
            crate::telemetry::init_logging(settings.log.format, "warn");
            let queue = settings.queue.clone();
            with_database(&settings, move |db| Box::pin(async move { run_queue(db, &queue, command).await }))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate => {
            crate::telemetry::init_logging(settings.log.format, &settings.log.level);
            runtime()?.block_on(async {
                let database = Database::open(&settings).await?;
                let result = crate::db::migrate(&database.pool).await.context("applying migrations");
                database.close().await;
                result?;
                tracing::info!(version = crate::db::latest_migration(), "migrations applied");
                anyhow::Ok(())
            })?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Runs `work` on the configured database (migrated first: the commands need the tables of this build).
fn with_database<F>(settings: &Settings, work: F) -> anyhow::Result<()>
where
    F: for<'a> FnOnce(
        &'a sqlx::PgPool,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + 'a>>,
{
    runtime()?.block_on(async {
        let database = Database::open(settings).await?;
        let result = match crate::db::migrate(&database.pool).await {
            Ok(()) => work(&database.pool).await,
            Err(e) => Err(anyhow::Error::new(e).context("applying migrations")),
        };
        database.close().await;
        result
    })
}

async fn run_keys(db: &sqlx::PgPool, command: KeysCommand) -> anyhow::Result<()> {
    use crate::auth::api_key;
    let actor = crate::audit::Actor::cli();
    match command {
        KeysCommand::Create { name, scopes, tenants } => {
            let created = api_key::create(db, &actor, &api_key::NewKey { name, scopes, tenants }).await?;
            println!("{}", serde_json::to_string(&created)?);
            eprintln!("the key is shown this once: store it now");
        }
        KeysCommand::List => {
            for key in api_key::list(db).await? {
                println!("{}", serde_json::to_string(&key)?);
            }
        }
        KeysCommand::Revoke { name } => {
            api_key::revoke(db, &actor, &name).await?;
            eprintln!("revoked {name}: every pod refuses it within 5 s");
        }
    }
    Ok(())
}

async fn run_audit(db: &sqlx::PgPool, args: AuditArgs) -> anyhow::Result<()> {
    let query = crate::audit::AuditQuery {
        cif: args.cif,
        customer_ref: args.customer_ref,
        actor: args.actor,
        action: args.action,
        since: args.since,
        until: args.until,
        cursor: None,
        limit: Some(args.limit),
    };
    query.validate().map_err(|e| anyhow::anyhow!(e))?;
    for event in crate::audit::search(db, &query).await?.events {
        println!("{}", serde_json::to_string(&event)?);
    }
    Ok(())
}

async fn run_queue(
    db: &sqlx::PgPool,
    queue: &crate::config::QueueSettings,
    command: QueueCommand,
) -> anyhow::Result<()> {
    use crate::queue::{cancel, pause};
    let actor = &crate::audit::Actor::cli();
    let set = |kind: pause::PauseKind, name: String, paused: bool| async move {
        let known = match kind {
            pause::PauseKind::Class => queue.classes.iter().any(|c| c.name == name),
            pause::PauseKind::Provider => queue.providers.contains_key(&name),
        };
        anyhow::ensure!(known, "no {} named {name:?} in the configuration", kind.as_str());
        let changed = pause::set(db, kind, &name, paused, actor).await?;
        let state = if paused { "paused" } else { "resumed" };
        if changed {
            eprintln!("{} {name} {state}: every pod follows within 1 s", kind.as_str());
        } else {
            eprintln!("{} {name} was already {state}", kind.as_str());
        }
        anyhow::Ok(())
    };
    match command {
        QueueCommand::Pause { kind, name } => set(kind, name, true).await?,
        QueueCommand::Resume { kind, name } => set(kind, name, false).await?,
        QueueCommand::Pauses => {
            for row in pause::list(db).await? {
                println!("{}", serde_json::to_string(&row)?);
            }
        }
        QueueCommand::CancelBatch { id } => {
            let batch = cancel::batch(db, id).await?.ok_or_else(|| anyhow::anyhow!("no batch {id}"))?;
            let canceled = cancel::cancel_batch(db, &batch, actor).await?;
            println!("{}", serde_json::json!({ "batch_id": id, "canceled": canceled }));
        }
    }
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")
}

async fn run_dlq(db: &sqlx::PgPool, command: DlqCommand) -> anyhow::Result<()> {
    use crate::queue::dlq;
    match command {
        DlqCommand::List { filter, limit } => {
            for job in dlq::list(db, &filter.filter(), limit).await? {
                println!("{}", serde_json::to_string(&job)?);
            }
        }
        DlqCommand::Replay { filter, max, rate, extra_attempts } => {
            let replay = dlq::Replay { filter: filter.filter(), max, rate_per_sec: rate, extra_attempts };
            replay.validate().map_err(|e| anyhow::anyhow!(e))?;
            let n = dlq::replay(db, &replay, &crate::audit::Actor::cli()).await?;
            println!("replayed {n} jobs at {rate}/s");
        }
        DlqCommand::Retry { id, extra_attempts } => {
            anyhow::ensure!(
                (1..=dlq::MAX_EXTRA_ATTEMPTS).contains(&extra_attempts),
                "--extra-attempts must be between 1 and {}",
                dlq::MAX_EXTRA_ATTEMPTS
            );
            let done = dlq::retry_one(db, id, extra_attempts, &crate::audit::Actor::cli()).await?;
            print_dead_letter_action(id, done)?;
        }
        DlqCommand::Discard { id } => {
            let done = dlq::discard_one(db, id, &crate::audit::Actor::cli()).await?;
            print_dead_letter_action(id, done)?;
        }
    }
    Ok(())
}

fn print_dead_letter_action(id: i64, done: crate::queue::dlq::DeadLetterAction) -> anyhow::Result<()> {
    use crate::queue::dlq::DeadLetterAction;
    match done {
        DeadLetterAction::Done(job) => {
            println!("{}", serde_json::to_string(&job)?);
            Ok(())
        }
        DeadLetterAction::NotDead(status) => anyhow::bail!("job {id} is {status}, not a dead letter"),
        DeadLetterAction::NotFound => anyhow::bail!("no job {id}"),
    }
}
