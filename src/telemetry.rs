//! Logs (tracing) and the process-wide Prometheus recorder.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global tracing subscriber. `RUST_LOG` wins over `level`. Safe to call twice (the second
/// call is a no-op), which tests rely on.
pub fn init_logging(format: LogFormat, level: &str) {
    // The scheduler logs every job registration at INFO; keep it to warnings unless asked for.
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("tokio_cron_scheduler=warn,{level}")));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// Latency buckets (seconds) shared by every `*_seconds` histogram: 0.5 ms to 60 s.
const LATENCY_BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0];

/// The process-wide recorder. The `metrics` facade allows one global recorder per process, so every
/// app instance in a process (tests run several) shares it.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .expect("static bucket list is not empty")
                .install_recorder()
                .expect("no other metrics recorder is installed in this process")
        })
        .clone()
}

/// Creates the event counters at zero, so an alert's `increase()` sees the first event after a
/// restart (a counter that first appears at 1 has no earlier sample to increase from).
pub fn register_event_counters(state: &crate::state::AppState) {
    for pool in state.pools.iter() {
        for name in [
            "cifpool_pool_empty_total",
            "cifpool_reclaimed_total",
            "cifpool_reservations_total",
            "cifpool_confirmations_total",
            "cifpool_refill_codes_total",
        ] {
            metrics::counter!(name, "pool" => pool.name().to_string()).absolute(0);
        }
    }
    for class in state.queue.classes.keys() {
        for name in [
            "cifpool_queue_expired_total",
            "cifpool_queue_dead_total",
            "cifpool_queue_retries_total",
            "cifpool_queue_sent_total",
            "cifpool_queue_enqueued_total",
            "cifpool_queue_rejected_total",
            "cifpool_queue_throttled_total",
            "cifpool_queue_intake_would_reject_total",
        ] {
            metrics::counter!(name, "class" => class.clone()).absolute(0);
        }
    }
    metrics::counter!("cifpool_queue_lease_lost_total").absolute(0);
    metrics::counter!("cifpool_queue_rescued_total").absolute(0);
    metrics::counter!("cifpool_queue_batches_refused_total").absolute(0);
}
