//! Command line: `cifpool-tools bench <target>` and `cifpool-tools lab` (and the hidden
//! `bench-client`, the load generator a benchmark runs as its child).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand, ValueEnum};

use cifpool::cli::GlobalArgs;
use cifpool::config::Settings;
use cifpool::queue::policy::Strategy;

use crate::bench::BenchArgs;
use crate::bench::loadgen::BenchClientArgs;
use crate::lab::real::{self, LabOptions, LabScenario};
use crate::lab::sim::{self, SimOptions, SimScenario};

/// cifpool-tools: benchmarks, the send-flow lab and the simulator, on a scratch database of the
/// configured server (the embedded cluster unless `database.url` is set).
#[derive(Debug, Parser)]
#[command(name = "cifpool-tools", version, about)]
pub struct Cli {
    /// Configuration, as for `cifpool` (the database to use, the queue classes).
    #[command(flatten)]
    pub global: GlobalArgs,
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Measure the service against the physical limit on this machine (writes DIR/<target>.json).
    Bench(Box<BenchArgs>),
    /// Reproduce the send-flow isolation experiment: on the real queue (default) or simulated at
    /// production scale (`--simulate`). Writes CSV, Markdown and PNG into `--out`.
    Lab(Box<LabArgs>),
    /// A benchmark's load generator, run by the benchmark as a child process (not for direct use).
    #[command(name = "bench-client", hide = true)]
    BenchClient(Box<BenchClientArgs>),
}

/// `cifpool-tools lab …`
#[derive(Debug, Args)]
pub struct LabArgs {
    /// Run the discrete-event simulation (virtual time, production scale) instead of the real queue.
    #[arg(long)]
    pub simulate: bool,
    /// Strategies (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Strategy::ALL)]
    pub strategy: Vec<Strategy>,
    /// Scenarios (comma-separated), or `all`: on the real queue push-hang, sms-slow; simulated healthy,
    /// push-slow, sms-slow, push-timeout-30s.
    #[arg(long, value_delimiter = ',', default_value = "all")]
    pub scenario: Vec<String>,
    /// Output directory.
    #[arg(long, default_value = "lab-out")]
    pub out: PathBuf,
    /// The real lab's parameters.
    #[command(flatten)]
    pub real: LabOptions,
    /// The simulator's parameters.
    #[command(flatten)]
    pub sim: SimOptions,
}

impl LabArgs {
    /// The requested scenarios of kind `S` (all of `every` for `all`).
    fn scenarios<S: ValueEnum + Copy>(&self, every: &[S], kind: &str) -> anyhow::Result<Vec<S>> {
        if self.scenario.iter().any(|s| s == "all") {
            return Ok(every.to_vec());
        }
        self.scenario
            .iter()
            .map(|s| S::from_str(s, true).map_err(|_| anyhow::anyhow!("unknown {kind} --scenario {s:?}")))
            .collect()
    }
}

/// The value of options struct `T` with every flag at its default: how the option structs implement
/// `Default`, so each default lives once, in its `#[arg]`.
pub fn parse_defaults<T: Args>() -> T {
    #[derive(Parser)]
    struct Only<T: Args> {
        #[command(flatten)]
        inner: T,
    }
    Only::<T>::try_parse_from(["defaults"]).expect("every flag has a default").inner
}

/// Parses the command line and runs it.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    // A load generator needs no configuration or database: only what its parent passes.
    if let Command::BenchClient(args) = &cli.command {
        return crate::bench::loadgen::run_child(args);
    }
    let settings = cli.global.settings()?;
    match cli.command {
        Command::Bench(args) => {
            cifpool::telemetry::init_logging(settings.log.format, "warn");
            // Metrics are recorded as in `serve` (a recorder costs CPU per event; leaving it out
            // would flatter the figures).
            cifpool::telemetry::metrics_handle();
            crate::bench::run(&settings, &args)
        }
        Command::BenchClient(_) => unreachable!("run before the configuration is read"),
        Command::Lab(args) => {
            // Sends still in flight when a cell ends are abandoned on purpose; their failed finishes
            // are expected noise here.
            cifpool::telemetry::init_logging(settings.log.format, "warn,cifpool::internals::worker=error");
            run_lab(&settings, &args)
        }
    }
}

fn run_lab(settings: &Settings, args: &LabArgs) -> anyhow::Result<()> {
    if args.simulate {
        let scenarios = args.scenarios(&SimScenario::ALL, "simulation")?;
        let opts = args.sim.clone().with_priorities_from(&settings.queue)?;
        let results = sim::run_all(&opts, &args.strategy, &scenarios, true);
        let rows: Vec<_> = results.iter().map(|r| r.row.clone()).collect();
        let csv = sim::write_csv(&args.out, &rows)?;
        let png = sim::write_png(&args.out, &results)?;
        println!("{}", sim::markdown_table(&rows));
        println!("wrote {} and {}", csv.display(), png.display());
        return Ok(());
    }
    let scenarios = args.scenarios(&LabScenario::ALL, "lab")?;
    let opts = &args.real;
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    runtime.block_on(async {
        let (database, db) = real::open_lab_database(settings).await?;
        let cells = real::run_all(&db, opts, &args.strategy, &scenarios, true).await;
        db.close().await;
        database.close().await;
        let cells = cells?;
        let (csv, md) = real::write_tables(&args.out, &cells)?;
        let png = crate::lab::plot::write_lab_png(&args.out, &cells, opts.duration)?;
        println!("{}", std::fs::read_to_string(&md)?);
        println!("wrote {}, {} and {}", csv.display(), md.display(), png.display());
        anyhow::Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lab_flags_default_to_the_option_defaults_and_parse_lists() {
        let cli = Cli::try_parse_from(["cifpool-tools", "lab"]).expect("defaults parse");
        let Command::Lab(lab) = cli.command else { panic!("lab") };
        assert_eq!(lab.sim, SimOptions::default());
        assert_eq!(lab.real.workers, LabOptions::default().workers);
        assert_eq!(lab.strategy, Strategy::ALL);
        assert_eq!(lab.scenarios(&SimScenario::ALL, "simulation").unwrap(), SimScenario::ALL);
        let cli = Cli::try_parse_from([
            "cifpool-tools",
            "lab",
            "--simulate",
            "--scenario",
            "push-timeout-30s,sms-slow",
            "--strategy",
            "floor-borrow",
            "--sim-workers",
            "600",
        ])
        .expect("lists parse");
        let Command::Lab(lab) = cli.command else { panic!("lab") };
        assert_eq!(
            lab.scenarios(&SimScenario::ALL, "simulation").unwrap(),
            [SimScenario::PushTimeout30s, SimScenario::SmsSlow]
        );
        assert!(lab.scenarios(&LabScenario::ALL, "lab").is_err(), "push-timeout-30s is no lab scenario");
        assert_eq!(lab.strategy, [Strategy::FloorBorrow]);
        assert_eq!(lab.sim.workers, 600);
    }

    #[test]
    fn a_load_generator_run_round_trips_through_its_command_line() {
        use crate::bench::loadgen::{ClientTarget, ReserveLoad};
        let runs = [
            ReserveLoad {
                url: "http://127.0.0.1:4321/v1/cif".into(),
                clients: Some(16),
                rate: None,
                duration: 5,
                timeout: 30,
                no_progress: true,
                guess_keys: true,
            },
            ReserveLoad {
                url: "http://127.0.0.1:4321/v1/cif".into(),
                clients: None,
                rate: Some(1000.5),
                duration: 2,
                timeout: 7,
                no_progress: false,
                guess_keys: false,
            },
        ];
        for run in runs {
            let argv = std::iter::once("cifpool-tools".to_string()).chain(run.to_args());
            let cli = Cli::try_parse_from(argv).expect("its own command line parses");
            let Command::BenchClient(args) = cli.command else { panic!("bench-client") };
            assert_eq!(args.target, ClientTarget::Reserve(run));
        }
        let both = [
            "cifpool-tools",
            "bench-client",
            "reserve",
            "--url",
            "u",
            "--clients",
            "1",
            "--rate",
            "2",
            "--duration",
            "1",
        ];
        assert!(Cli::try_parse_from(both).is_err(), "closed or open loop, not both");
        let neither = ["cifpool-tools", "bench-client", "reserve", "--url", "u", "--duration", "1"];
        assert!(Cli::try_parse_from(neither).is_err(), "one of them");
    }

    #[test]
    fn bench_flags_parse() {
        let cli = Cli::try_parse_from(["cifpool-tools", "bench", "reserve", "--concurrency", "1,4"]).unwrap();
        let Command::Bench(b) = cli.command else { panic!("bench") };
        assert_eq!(b.concurrency, [1, 4]);
    }
}
