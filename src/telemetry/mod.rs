//! What the service tells its operators: logs ([`init_logging`], [`init_for_serve`]), traces exported
//! over OTLP when `telemetry.otlp_endpoint` is set ([`traces`]), and Prometheus metrics ([`prometheus`],
//! with the process, database-pool and build gauges of [`collectors`]).

pub(crate) mod collectors;
pub(crate) mod horizon;
pub(crate) mod prometheus;
pub(crate) mod traces;

use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::{LogFormat, Settings};

pub use self::prometheus::metrics_handle;
pub(crate) use self::prometheus::register_event_counters;

/// Installs the global tracing subscriber, logs only. `RUST_LOG` wins over `level`. Safe to call twice
/// (the second call is a no-op), which tests rely on.
pub fn init_logging(format: LogFormat, level: &str) {
    install(format, level, None);
}

/// Installs logs and, when `telemetry.otlp_endpoint` is set, the OTLP trace exporter; `serve` calls it
/// inside its runtime (the exporter sends on it). Flush the traces with [`traces::shutdown`] at exit.
pub(crate) fn init_for_serve(settings: &Settings) -> anyhow::Result<()> {
    traces::install_propagator();
    let provider = match &settings.telemetry.otlp_endpoint {
        Some(endpoint) => Some(traces::provider(endpoint, &settings.telemetry)?),
        None => None,
    };
    install(settings.log.format, &settings.log.level, provider.clone());
    if let Some(provider) = provider {
        traces::keep(provider);
        tracing::info!(
            endpoint = settings.telemetry.otlp_endpoint.as_deref().unwrap_or(""),
            sample_ratio = settings.telemetry.sample_ratio,
            "exporting traces over OTLP"
        );
    }
    Ok(())
}

fn install(format: LogFormat, level: &str, traces: Option<SdkTracerProvider>) {
    // The scheduler logs every job registration at INFO; keep it to warnings unless asked for.
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("tokio_cron_scheduler=warn,{level}")));
    // Colours only for a person at a terminal: escape codes in a log file or pipeline are noise.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let json = (format == LogFormat::Json).then(|| {
        tracing_subscriber::fmt::layer().json().flatten_event(true).with_current_span(true).with_writer(std::io::stderr)
    });
    let text = (format == LogFormat::Text)
        .then(|| tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(std::io::stderr));
    let otel = traces.map(|provider| {
        use opentelemetry::trace::TracerProvider as _;
        tracing_opentelemetry::layer().with_tracer(provider.tracer("cifpool"))
    });
    let _ = tracing_subscriber::registry().with(filter).with(json).with(text).with(otel).try_init();
}
