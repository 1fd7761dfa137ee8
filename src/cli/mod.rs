//! Command-line interface: `cifpool <command>`. This module parses the command line and runs `serve`,
//! `migrate` and `config`; [`codes`] holds the code generator's commands, [`database`] those that
//! work on the database directly, [`pools`] the operator's fence and [`fake_provider`] the stand-in
//! gateway of `cifpool fake-provider` (for tests, the lab, load runs and outage drills; the service
//! itself never uses it).

pub(crate) mod codes;
pub(crate) mod database;
pub(crate) mod fake_provider;
pub(crate) mod pools;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::config::{LogFormat, Settings};
use crate::db::Database;
use crate::startup::Application;

use codes::CodesCommand;
use database::{AuditArgs, DlqCommand, KeysCommand, QueueCommand};
use database::{run_audit, run_dlq, run_keys, run_queue, with_database};
use pools::PoolsCommand;

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
        behaviour: crate::cli::fake_provider::FakeBehaviour,
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
    /// Pool operations after the database changed under the service: fence, or accept (connects to
    /// the database directly, like `dlq`).
    #[command(subcommand)]
    Pools(PoolsCommand),
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
            let keys = format.keys(&settings)?;
            let capacity = keys.current().codec.capacity();
            let end = start.checked_add(count).filter(|&end| end <= capacity).ok_or_else(|| {
                anyhow::anyhow!("counters {start}..{start}+{count} exceed the domain of {capacity} codes")
            })?;
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            // A counter whose code an earlier key epoch made has none: nothing is printed for it.
            for counter in start..end {
                if let Some(code) = keys.encode(counter) {
                    writeln!(out, "{code}")?;
                }
            }
            out.flush()?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Codes(CodesCommand::Inspect { format, code }) => {
            let keys = format.keys(&settings)?;
            match keys.locate(code.trim()) {
                Ok(Some(located)) => {
                    println!("{}", located.counter);
                    if keys.all().len() > 1 {
                        let epoch = &keys.all()[located.epoch as usize];
                        eprintln!("key epoch {} (key_id {})", epoch.number, epoch.key_id);
                    }
                    Ok(ExitCode::SUCCESS)
                }
                Ok(None) => {
                    eprintln!("error: {:?} is well-formed, but none of the given keys makes it", code.trim());
                    Ok(ExitCode::FAILURE)
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
                let fake = crate::cli::fake_provider::FakeProvider::new(behaviour);
                crate::cli::fake_provider::serve(fake, listener, crate::startup::shutdown_signal()).await?;
                anyhow::Ok(())
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Dlq(command) => {
            crate::telemetry::init_logging(settings.log.format, "warn");
            let settings_ = settings.clone();
            with_database(&settings, move |db| {
                Box::pin(async move { run_dlq(&database::queue_service(db, &settings_)?, command).await })
            })?;
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
            let settings_ = settings.clone();
            with_database(&settings, move |db| {
                Box::pin(async move { run_queue(&database::queue_service(db, &settings_)?, command).await })
            })?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Pools(command) => {
            // A fence or a reconcile of millions of codes runs statements of many seconds by design: sqlx's
            // slow-statement warnings would read as trouble.
            crate::telemetry::init_logging(settings.log.format, "warn,sqlx::query=error");
            let settings_ = settings.clone();
            with_database(&settings, move |db| {
                Box::pin(async move { pools::run_pools(db, &settings_, command).await })
            })?;
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

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")
}
