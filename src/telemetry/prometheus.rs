//! The process-wide Prometheus recorder, its buckets, and the counters created at zero.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Latency buckets (seconds) shared by every `*_seconds` histogram: 0.5 ms to 60 s.
const LATENCY_BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 30.0, 60.0];

/// Count buckets shared by every `*_size` histogram (rows per statement): 1 to 1024.
const SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];

/// The process-wide recorder. The `metrics` facade allows one global recorder per process, so every
/// app instance in a process (tests run several) shares it.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .expect("static bucket list is not empty")
                .set_buckets_for_metric(Matcher::Suffix("_size".into()), SIZE_BUCKETS)
                .expect("static bucket list is not empty")
                .install_recorder()
                .expect("no other metrics recorder is installed in this process");
            describe();
            handle
        })
        .clone()
}

/// Creates the event counters at zero, so an alert's `increase()` sees the first event after a
/// restart (a counter that first appears at 1 has no earlier sample to increase from).
pub(crate) fn register_event_counters(state: &crate::state::AppState) {
    for pool in state.cif.pools().iter() {
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
    for class in state.notifications.runtime().classes.keys() {
        for name in [
            "cifpool_queue_expired_total",
            "cifpool_queue_dead_total",
            "cifpool_queue_retries_total",
            "cifpool_queue_sent_total",
            "cifpool_queue_enqueued_total",
            "cifpool_queue_intake_rejected_total",
            "cifpool_queue_throttled_total",
            "cifpool_queue_intake_would_reject_total",
        ] {
            metrics::counter!(name, "class" => class.clone()).absolute(0);
        }
    }
    metrics::counter!("cifpool_queue_lease_lost_total").absolute(0);
    metrics::counter!("cifpool_queue_unreadable_total").absolute(0);
    metrics::counter!("cifpool_queue_rescued_total").absolute(0);
    metrics::counter!("cifpool_queue_batches_refused_total").absolute(0);
    metrics::counter!("cifpool_queue_jobs_analyzed_total").absolute(0);
}

/// The `# HELP` line of every metric the service exports, so a reader of `/metrics` need not guess
/// which of two similar names is which (per pod or per deployment, jobs or calls).
fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_gauge!("cifpool_build_info", "Always 1; the labels name the running version and git commit.");
    describe_gauge!(
        "cifpool_ready",
        "1 while this instance's readiness check passes (database reachable, schema current, background tasks running)."
    );
    describe_gauge!(
        "cifpool_db_pool_connections",
        "Connections of this instance's database pool, by state (idle, in_use)."
    );
    describe_gauge!(
        "cifpool_db_pool_max_connections",
        "Most connections this instance's pool opens (database.max_connections)."
    );
    describe_histogram!(
        "cifpool_db_pool_acquire_seconds",
        Unit::Seconds,
        "Time a probe waited for a pooled connection (one probe per second): high while the pool is exhausted."
    );
    describe_gauge!(
        "cifpool_db_oldest_snapshot_age_seconds",
        Unit::Seconds,
        "Age of the oldest transaction holding a snapshot in the service's database: while it is old, \
         dead rows pile up (other roles' sessions count only with pg_read_all_stats)."
    );
    describe_gauge!(
        "cifpool_db_replication_slot_xmin_age",
        "Transactions since the oldest row version a replication slot still needs (0: none): while it \
         grows, dead rows pile up."
    );
    describe_counter!("cifpool_http_requests_total", "HTTP requests answered, by route template, method and status.");
    describe_histogram!(
        "cifpool_http_request_duration_seconds",
        Unit::Seconds,
        "HTTP request latency by route template and method."
    );
    describe_counter!("cifpool_reservations_total", "CIF codes reserved, by pool.");
    describe_counter!("cifpool_confirmations_total", "CIF codes confirmed (used for good), by pool.");
    describe_counter!("cifpool_reclaimed_total", "Expired CIF holds returned to their pool by reclaim.");
    describe_counter!("cifpool_pool_empty_total", "Reservations refused because the pool had no available code.");
    describe_counter!("cifpool_refill_codes_total", "CIF codes added to a pool by refill.");
    describe_counter!("cifpool_refill_runs_total", "Refill runs, by pool and outcome.");
    describe_histogram!(
        "cifpool_reservation_duration_seconds",
        Unit::Seconds,
        "Time to reserve a CIF code (the claim statement and its audit row)."
    );
    describe_gauge!("cifpool_pool_available", "CIF codes ready to reserve, by pool.");
    describe_gauge!("cifpool_pool_reserved", "CIF codes held by a reservation not yet confirmed or released.");
    describe_gauge!(
        "cifpool_pool_used",
        "Counters taken that are neither available nor held: the codes confirmed, plus the counters a fence, a \
         key rotation or a reconcile took out of circulation."
    );
    describe_gauge!(
        "cifpool_pool_low_watermark",
        "The pool's low watermark: refill tops it up when available falls below."
    );
    describe_gauge!("cifpool_pool_low", "1 while the pool's available codes are below its low watermark.");
    describe_gauge!(
        "cifpool_pool_domain_used_ratio",
        "Share of the pool's whole code space already generated (0 to 1)."
    );
    describe_counter!("cifpool_queue_enqueued_total", "Notification jobs accepted, by class.");
    describe_counter!(
        "cifpool_queue_intake_rejected_total",
        "Notification jobs refused by intake backpressure (429), by class."
    );
    describe_counter!(
        "cifpool_queue_intake_would_reject_total",
        "Jobs accepted in observe mode that reject mode would have refused."
    );
    describe_counter!(
        "cifpool_queue_batches_refused_total",
        "Batch requests refused because this instance was receiving queue.max_concurrent_batches."
    );
    describe_counter!("cifpool_queue_sent_total", "Jobs the provider accepted, by class.");
    describe_counter!("cifpool_queue_retries_total", "Failed sends scheduled for another attempt, by class.");
    describe_counter!(
        "cifpool_queue_throttled_total",
        "Sends the provider asked to retry later (429/503 with Retry-After), by class."
    );
    describe_counter!("cifpool_queue_dead_total", "Jobs moved to the dead letters, by class.");
    describe_counter!(
        "cifpool_queue_expired_total",
        "Jobs dropped because their deadline passed before sending, by class."
    );
    describe_counter!(
        "cifpool_queue_lease_lost_total",
        "Jobs whose lease this instance lost before finishing (another worker owns them)."
    );
    describe_counter!(
        "cifpool_queue_unreadable_total",
        "Claimed jobs whose stored row could not be read, moved to the dead letters."
    );
    describe_counter!(
        "cifpool_http_refused_total",
        "Requests refused with 429 by a per-caller limit (limit = key_rate or failed_auth)."
    );
    describe_counter!(
        "cifpool_auth_key_lookups_total",
        "API key look-ups in the database (cache misses), by whether the secret named a key."
    );
    describe_counter!(
        "cifpool_database_fences_total",
        "Fences of every pool because the database was not the one codes were issued from (restore, \
         recovery, failover, copy), or because an operator fenced."
    );
    describe_gauge!(
        "cifpool_issuance_halted",
        "1 while this instance refuses reservations and refills until an operator fences or accepts a \
         changed database (database.on_incarnation_change = \"halt\")."
    );
    describe_counter!(
        "cifpool_task_restarts_total",
        "Background loops started again after a panic, by task (e.g. a worker group's claim loop)."
    );
    describe_counter!(
        "cifpool_queue_rescued_total",
        "Jobs of dead workers whose lease expired, returned to the queue."
    );
    describe_gauge!("cifpool_queue_pending", "Jobs waiting to be sent (pending or retrying, due now), by class.");
    describe_gauge!("cifpool_queue_dead", "Dead letters not yet retried or discarded, by class.");
    describe_gauge!(
        "cifpool_queue_dead_oldest_age_seconds",
        Unit::Seconds,
        "Age of the oldest unhandled dead letter, by class."
    );
    describe_gauge!(
        "cifpool_queue_oldest_pending_age_seconds",
        Unit::Seconds,
        "How long the oldest due job has waited, by class."
    );
    describe_gauge!("cifpool_queue_drain_per_second", "Jobs finished per second over the last 30 s, by class.");
    describe_gauge!("cifpool_queue_in_flight", "Jobs this instance is sending now, by class and worker group.");
    describe_gauge!("cifpool_queue_paused", "1 while a class or provider is paused (kind, name).");
    describe_histogram!(
        "cifpool_queue_wait_seconds",
        Unit::Seconds,
        "Time from enqueue to a job's first claim, by class (a scheduled job counts its wait for run_at too)."
    );
    describe_histogram!("cifpool_queue_finish_batch_size", "Sent jobs finished together by one statement.");
    describe_histogram!(
        "cifpool_queue_claim_duration_seconds",
        Unit::Seconds,
        "Time one claim of a worker group took, by group: its transaction (with any wait for a capped class's \
         claim lock) and the opening of the rows it returned."
    );
    describe_histogram!("cifpool_queue_claim_size", "Jobs one claim statement took, by worker group.");
    describe_counter!(
        "cifpool_queue_claims_from_floors_total",
        "Claims of a worker group that started each priority at the key its last claim began at, not at the head \
         of the claim order: claims from the head had become slow walks (a held cleanup horizon)."
    );
    describe_counter!(
        "cifpool_queue_jobs_analyzed_total",
        "Times this instance analyzed notification_jobs because the planner expected far fewer waiting jobs than \
         the stats round counted (a burst after a quiet spell)."
    );
    describe_histogram!(
        "cifpool_reservation_batch_size",
        "Reservations of a pool claimed by one shared statement, by pool."
    );
    describe_histogram!(
        "cifpool_provider_duration_seconds",
        Unit::Seconds,
        "Provider call latency, by provider and outcome."
    );
    describe_gauge!(
        "cifpool_provider_deployment_limit",
        "The provider's concurrency limit for the whole deployment (adaptive); the same on every pod."
    );
    describe_gauge!("cifpool_provider_pod_share", "This pod's share of the provider's deployment limit.");
    describe_gauge!("cifpool_provider_pod_in_flight", "Provider calls this pod has in flight.");
    describe_gauge!(
        "cifpool_provider_limit_at_floor",
        "1 while the provider's deployment limit sits at its min_concurrency."
    );
    describe_gauge!(
        "cifpool_provider_paused",
        "1 while sends to the provider are paused (by an operator or a Retry-After)."
    );
}
