//! Command-line interface: `cifpool <command>`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::config::{LogFormat, Settings};
use crate::startup::{Application, Database};

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
    let settings = cli.global.settings()?;
    match cli.command {
        Command::Config(ConfigCommand::Check) => {
            print!("{}", settings.to_redacted_toml());
            eprintln!("configuration is valid");
            Ok(ExitCode::SUCCESS)
        }
        Command::Serve { listen } => {
            let mut settings = settings;
            if let Some(addr) = listen {
                settings.server.listen = addr;
            }
            crate::telemetry::init_logging(settings.log.format, &settings.log.level);
            runtime()?.block_on(async {
                let app = Application::build(settings).await?;
                app.run_until(crate::startup::shutdown_signal()).await
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
