//! A job as a client asks for it, before intake has checked it (see [`crate::queue::intake`]) and the
//! insert has stored it (see [`crate::queue::enqueue`]).

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::value::RawValue;

/// A message to enqueue.
#[derive(Debug, Clone, Deserialize)]
pub struct NewJob {
    /// Class, e.g. `otp`.
    pub class: String,
    /// Tenant (the product or customer the message belongs to). May be left out by a key bound to
    /// exactly one tenant, which then supplies it.
    #[serde(default)]
    pub tenant: String,
    /// Phone number, device token, ….
    pub recipient: String,
    /// Message body / template data: any JSON, kept as the text it arrived as (Postgres stores it as
    /// `jsonb`), so a 500,000-job batch is not parsed into values only to be printed again.
    #[serde(default = "null_payload")]
    pub payload: Box<RawValue>,
    /// Same key (per tenant) again returns the existing job.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// Send no earlier than this (RFC 3339); at most 30 days ahead, and not past the class's deadline.
    #[serde(default)]
    pub run_at: Option<DateTime<Utc>>,
}

/// JSON `null`, the payload of a job that gives none.
pub(crate) fn null_payload() -> Box<RawValue> {
    RawValue::from_string("null".to_string()).expect("null is JSON")
}

/// A payload from a JSON value (callers that build jobs in code).
pub fn payload_of(value: &serde_json::Value) -> Box<RawValue> {
    serde_json::value::to_raw_value(value).expect("a Value always serialises")
}
