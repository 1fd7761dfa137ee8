//! Worker groups' claim statements as the service's own metrics count them
//! (`cifpool_queue_claim_duration_seconds`, `cifpool_queue_claim_size`,
//! `cifpool_queue_claims_from_floors_total`): read from this process's recorder before and after a
//! phase, they tell how close each group's claiming was to its ceiling, and whether its claims walked
//! from the head of the order or started at their floors.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

/// One worker group's claims so far, as its histograms count them.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct GroupTotals {
    /// Seconds spent in claim statements.
    seconds: f64,
    /// Claim statements run.
    statements: f64,
    /// Jobs they took.
    jobs: f64,
    /// Claims that started at the group's floors.
    from_floors: f64,
}

/// [`GroupTotals`] per worker group.
pub(crate) type ClaimTotals = BTreeMap<String, GroupTotals>;

/// One worker group's claim statements over a phase, from the service's own histograms
/// (`cifpool_queue_claim_duration_seconds`, `cifpool_queue_claim_size`).
#[derive(Debug, Clone, Serialize)]
pub struct GroupClaims {
    /// The worker group.
    pub group: String,
    /// Claim statements run (idle polls included).
    pub statements: u64,
    /// Their mean time, milliseconds (a wait for a capped class's claim lock and the opening of the
    /// returned rows included).
    pub mean_ms: f64,
    /// Jobs they took, on average.
    pub jobs_per_statement: f64,
    /// Share of the phase the group's claim loops spent inside a claim: near 1, the loops claim back
    /// to back and the drain is as fast as the claims are.
    pub loops_busy: f64,
    /// Claims that started each priority at the group's floors instead of the head of the order
    /// (claims from the head had become slow walks).
    pub from_floors: u64,
}

/// The `_sum` and `_count` of histogram `name` per `group` label, from this process's recorder.
fn group_histograms(name: &str) -> BTreeMap<String, (f64, f64)> {
    let rendered = cifpool::telemetry::metrics_handle().render();
    let mut out: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for line in rendered.lines() {
        for (suffix, sum) in [("_sum{group=\"", true), ("_count{group=\"", false)] {
            let Some(rest) = line.strip_prefix(name).and_then(|l| l.strip_prefix(suffix)) else { continue };
            let Some((group, value)) = rest.split_once("\"} ") else { continue };
            let Ok(value) = value.trim().parse::<f64>() else { continue };
            let entry = out.entry(group.to_string()).or_default();
            if sum { entry.0 = value } else { entry.1 = value }
        }
    }
    out
}

/// Counter `name` per `group` label, from this process's recorder.
fn group_counters(name: &str) -> BTreeMap<String, f64> {
    let rendered = cifpool::telemetry::metrics_handle().render();
    let prefix = format!("{name}{{group=\"");
    rendered
        .lines()
        .filter_map(|line| line.strip_prefix(&prefix)?.split_once("\"} "))
        .filter_map(|(group, value)| Some((group.to_string(), value.trim().parse::<f64>().ok()?)))
        .collect()
}

/// Every group's claims so far.
pub(crate) fn claim_totals() -> ClaimTotals {
    let sizes = group_histograms("cifpool_queue_claim_size");
    let from_floors = group_counters("cifpool_queue_claims_from_floors_total");
    group_histograms("cifpool_queue_claim_duration_seconds")
        .into_iter()
        .map(|(group, (seconds, statements))| {
            let jobs = sizes.get(&group).map_or(0.0, |s| s.0);
            let from_floors = from_floors.get(&group).copied().unwrap_or(0.0);
            (group, GroupTotals { seconds, statements, jobs, from_floors })
        })
        .collect()
}

/// What each group's claims did between two [`claim_totals`] readings `elapsed` apart.
pub(crate) fn claims_between(before: &ClaimTotals, after: &ClaimTotals, elapsed: Duration) -> Vec<GroupClaims> {
    after
        .iter()
        .filter_map(|(group, now)| {
            let then = before.get(group).copied().unwrap_or_default();
            let n = now.statements - then.statements;
            let seconds = now.seconds - then.seconds;
            (n > 0.0).then(|| GroupClaims {
                group: group.clone(),
                statements: n as u64,
                mean_ms: seconds / n * 1000.0,
                jobs_per_statement: (now.jobs - then.jobs) / n,
                loops_busy: seconds / (elapsed.as_secs_f64() * cifpool::internals::worker::CLAIM_LOOPS as f64),
                from_floors: (now.from_floors - then.from_floors) as u64,
            })
        })
        .collect()
}
