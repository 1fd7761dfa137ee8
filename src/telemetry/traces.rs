//! OpenTelemetry traces over OTLP/HTTP, and W3C trace-context propagation.
//!
//! Spans come from `tracing`: one per HTTP request (a child of the caller's `traceparent`, if any),
//! per claim statement, per send and per refill batch. The provider call of a send carries the send
//! span's `traceparent`, so a gateway's traces join ours. Without `telemetry.otlp_endpoint` nothing is
//! exported and the propagation helpers cost a header look-up.

use std::sync::Mutex;

use bytes::Bytes;
use opentelemetry::global;
use opentelemetry_http::{HeaderExtractor, HeaderInjector, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{SpanExporter, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::config::TelemetrySettings;

/// How long one export may take before it is given up (spans are dropped, never the service slowed).
const EXPORT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The provider of this process, kept to flush it at exit.
static PROVIDER: Mutex<Option<SdkTracerProvider>> = Mutex::new(None);

/// Makes W3C `traceparent`/`tracestate` the propagation format.
pub(crate) fn install_propagator() {
    global::set_text_map_propagator(TraceContextPropagator::new());
}

/// A tracer provider exporting to `endpoint` (`/v1/traces` appended unless present) in batches. Must
/// be called inside the Tokio runtime the exports will run on.
pub fn provider(endpoint: &str, settings: &TelemetrySettings) -> anyhow::Result<SdkTracerProvider> {
    let endpoint = endpoint.trim_end_matches('/');
    let url = if endpoint.ends_with("/v1/traces") { endpoint.to_string() } else { format!("{endpoint}/v1/traces") };
    let client = reqwest::Client::builder().timeout(EXPORT_TIMEOUT).build()?;
    let exporter = SpanExporter::builder()
        .with_http()
        .with_endpoint(url)
        .with_timeout(EXPORT_TIMEOUT)
        .with_http_client(OnRuntime { client, runtime: tokio::runtime::Handle::current() })
        .build()?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(settings.sample_ratio))))
        .with_resource(
            Resource::builder()
                .with_service_name(settings.service_name.clone())
                .with_attribute(opentelemetry::KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                .build(),
        )
        .build())
}

/// Keeps `provider` for [`shutdown`].
pub(crate) fn keep(provider: SdkTracerProvider) {
    *PROVIDER.lock().expect("provider lock") = Some(provider);
}

/// Exports the spans still buffered and stops the exporter; a no-op without traces. Blocks while it
/// exports, so call it from a blocking thread while the runtime still runs.
pub fn shutdown() {
    if let Some(provider) = PROVIDER.lock().expect("provider lock").take()
        && let Err(e) = provider.shutdown()
    {
        eprintln!("flushing traces: {e}");
    }
}

/// Makes `span` a child of the trace context in `headers` (a W3C `traceparent`), if there is one.
pub(crate) fn continue_from(span: &tracing::Span, headers: &http::HeaderMap) {
    let parent = global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)));
    let _ = span.set_parent(parent);
}

/// Writes the current span's trace context into `headers` (`traceparent`), for an outgoing call.
pub(crate) fn inject_current(headers: &mut http::HeaderMap) {
    let context = tracing::Span::current().context();
    global::get_text_map_propagator(|p| p.inject_context(&context, &mut HeaderInjector(headers)));
}

/// The current span's W3C `traceparent`, when it belongs to a trace (traces on); kept with a queued job
/// so that its send continues the enqueuing request's trace.
pub(crate) fn current_traceparent() -> Option<String> {
    use opentelemetry::trace::TraceContextExt as _;
    let context = tracing::Span::current().context();
    // Without traces (the common case) there is no trace to carry: skip the propagator.
    if !context.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = std::collections::HashMap::new();
    global::get_text_map_propagator(|p| p.inject_context(&context, &mut carrier));
    carrier.remove("traceparent")
}

/// Makes `span` a child of a stored W3C `traceparent` (a queued job's).
pub(crate) fn continue_from_traceparent(span: &tracing::Span, traceparent: &str) {
    let carrier = std::collections::HashMap::from([("traceparent".to_string(), traceparent.to_string())]);
    let parent = global::get_text_map_propagator(|p| p.extract(&carrier));
    let _ = span.set_parent(parent);
}

/// The OTLP exporter's HTTP client: the batch exporter runs on a thread of its own with no Tokio
/// reactor, so each export is spawned onto the service's runtime and awaited from there.
#[derive(Debug)]
struct OnRuntime {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl HttpClient for OnRuntime {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let (parts, body) = request.into_parts();
        let task = self.runtime.spawn(async move {
            let answer =
                client.request(parts.method, parts.uri.to_string()).headers(parts.headers).body(body).send().await?;
            let status = answer.status();
            let headers = answer.headers().clone();
            let body = answer.bytes().await?;
            let mut response = Response::new(body);
            *response.status_mut() = status;
            *response.headers_mut() = headers;
            Ok::<_, reqwest::Error>(response)
        });
        Ok(task.await??)
    }
}
