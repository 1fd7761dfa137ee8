//! A notification job's status, the one place its names are spelled, for Rust and for SQL.
//!
//! ```text
//! scheduled ──stager (due)──▶ pending ──claim──▶ sending ──▶ sent
//!                                ▲                 │ ├────▶ dead      (permanent error, attempts used up;
//!                                │                 │ │                  retry → pending, replay → scheduled,
//!                                │                 │ │                  discard → discarded)
//!                                │                 │ └────▶ expired   (deadline passed; also straight from
//!                                │                 │                    pending/retrying)
//!                                └── failed-retrying ◀─┘ (transient error, or a lease that expired:
//!                                                          back after a backoff)
//! scheduled / pending / failed-retrying ──cancel──▶ canceled
//! ```
//!
//! A job enqueued for later (`run_at`, deferred intake, a paced replay) is `scheduled`: out of the claim
//! indexes until the stager makes it `pending`, with a fair key of that moment.

use serde::Serialize;

/// Where a job stands; the text form is the `status` column's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum JobStatus {
    /// Waiting for its `run_after` before it may be claimed (not in the claim indexes).
    Scheduled,
    /// Waiting for its first attempt (or a retry by an operator).
    Pending,
    /// Waiting for another attempt after a transient failure; due at `run_after`.
    #[serde(rename = "failed-retrying")]
    Retrying,
    /// Claimed by a worker under a lease; the provider call may be under way.
    Sending,
    /// The provider accepted it (final).
    Sent,
    /// Dead letter: a permanent failure or every attempt used (final until replayed).
    Dead,
    /// Its deadline passed before it could be sent (final).
    Expired,
    /// Taken out of the queue before it was sent (final).
    Canceled,
    /// A dead letter an operator chose not to retry (final, kept with its history).
    Discarded,
}

impl JobStatus {
    /// The states a worker may claim from (what the claim indexes cover).
    pub(crate) const CLAIMABLE: [JobStatus; 2] = [JobStatus::Pending, JobStatus::Retrying];
    /// The states a job may be canceled in: not sent, not being sent.
    pub(crate) const CANCELABLE: [JobStatus; 3] = [JobStatus::Scheduled, JobStatus::Pending, JobStatus::Retrying];
    /// The states `queue.retention` purges from (dead letters have a retention of their own).
    pub(crate) const FINISHED: [JobStatus; 4] =
        [JobStatus::Sent, JobStatus::Expired, JobStatus::Canceled, JobStatus::Discarded];

    /// The column value, e.g. `failed-retrying`.
    pub const fn as_str(self) -> &'static str {
        match self {
            JobStatus::Scheduled => "scheduled",
            JobStatus::Pending => "pending",
            JobStatus::Retrying => "failed-retrying",
            JobStatus::Sending => "sending",
            JobStatus::Sent => "sent",
            JobStatus::Dead => "dead",
            JobStatus::Expired => "expired",
            JobStatus::Canceled => "canceled",
            JobStatus::Discarded => "discarded",
        }
    }

    /// The quoted SQL literal, e.g. `'failed-retrying'`.
    pub fn sql(self) -> String {
        format!("'{}'", self.as_str())
    }

    /// A comma-separated list of SQL literals, for `status IN (…)`.
    pub(crate) fn sql_list(states: &[JobStatus]) -> String {
        states.iter().map(|s| s.sql()).collect::<Vec<_>>().join(", ")
    }

    /// Every status, in the order of a job's life (for the tests that walk them all).
    #[cfg(test)]
    pub(crate) const ALL: [JobStatus; 9] = [
        JobStatus::Scheduled,
        JobStatus::Pending,
        JobStatus::Retrying,
        JobStatus::Sending,
        JobStatus::Sent,
        JobStatus::Dead,
        JobStatus::Expired,
        JobStatus::Canceled,
        JobStatus::Discarded,
    ];
}

impl std::fmt::Display for JobStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::JobStatus;

    #[test]
    fn text_sql_and_serde_agree() {
        for s in JobStatus::ALL {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
            assert_eq!(s.sql(), format!("'{s}'"));
        }
        assert_eq!(JobStatus::sql_list(&JobStatus::CLAIMABLE), "'pending', 'failed-retrying'");
    }
}
