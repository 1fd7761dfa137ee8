//! Checked jobs as rows of the batch's staging table, in `COPY` text, cut into chunks that go to the
//! copying task through a bounded channel: the parser waits when the database falls behind, so a
//! request holds at most a few chunks, never the body.
//!
//! Each row carries its *group* (same priority, tenant and due-ness as far as known when it arrived)
//! and its place in it: fair keys are reserved per (priority, tenant) only at the end, when the counts
//! are known, and the insert turns the place into the key without sorting the batch.

use std::collections::HashMap;
use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use tokio::sync::mpsc;

use crate::queue::batch::rules::{Checked, Known};
use crate::queue::runtime::QueueRuntime;
use crate::queue::seal::Stored;

/// COPY text per chunk: large enough that a statement per chunk costs nothing, small enough that the
/// chunks in flight (the channel's and the two being filled and sent) stay a few MiB.
pub const CHUNK_BYTES: usize = 2 << 20;

/// Rows of a batch with the same priority, tenant and due-ness, as known when they arrived.
#[derive(Debug, Clone)]
pub struct Group {
    /// Priority of their class (`None`: the batch's class, read after the jobs).
    pub priority: Option<i16>,
    /// Their tenant (`None`: the batch's tenant, read after the jobs).
    pub tenant: Option<String>,
    /// Whether they are due at once (`None`: as the batch's `run_at`, read after the jobs, says).
    pub due: Option<bool>,
    /// Rows in the group.
    pub rows: u64,
}

/// What makes a group: priority, tenant, due-ness (`None`: the batch default, read later).
type GroupKey = (Option<i16>, Option<String>, Option<bool>);

/// Why the rows could not go on.
#[derive(Debug)]
pub struct CopyGone;

/// The staging rows of one batch request as they are produced.
pub struct Rows {
    text: String,
    chunks: mpsc::Sender<String>,
    /// Groups in order of first appearance; a row names its group by position + 1.
    groups: Vec<Group>,
    by_key: HashMap<GroupKey, usize>,
    /// The group of the row before.
    last: Option<usize>,
    /// When "due at once" is decided for jobs with their own `run_at`.
    now: DateTime<Utc>,
    /// Whether any job has an idempotency key (the insert then skips those already used).
    pub keyed: bool,
}

impl Rows {
    /// Rows sent, a chunk at a time, to `chunks`.
    pub fn new(chunks: mpsc::Sender<String>) -> Rows {
        Rows {
            text: String::with_capacity(CHUNK_BYTES + 64 * 1024),
            chunks,
            groups: Vec::new(),
            by_key: HashMap::new(),
            last: None,
            now: Utc::now(),
            keyed: false,
        }
    }

    /// Appends one checked job; sends the chunk when it is full (waiting while the channel is).
    pub fn push(&mut self, rt: &QueueRuntime, job: &Checked) -> Result<(), CopyGone> {
        let class = match &job.class {
            Known::Now(name) => Some((name.as_str(), &rt.classes[name].settings)),
            Known::Later => None,
        };
        let due = match job.run_at {
            Known::Now(at) => Some(at.is_none_or(|t| t <= self.now)),
            Known::Later => None,
        };
        let tenant = match &job.tenant {
            Known::Now(t) => Some(t.as_str()),
            Known::Later => None,
        };
        let (group, nth) = self.place(class.map(|(_, c)| c.priority), tenant, due);
        let text = &mut self.text;
        let _ = write!(text, "{group}\t{nth}\t");
        match class {
            Some((name, c)) => {
                let deadline = c.deadline.map_or_else(|| "\\N".to_string(), |d| d.as_secs_f64().to_string());
                let _ = write!(text, "{}\t{}\t{}\t{deadline}\t", escape(name), c.priority, c.max_attempts);
            }
            None => text.push_str("\\N\t\\N\t\\N\t\\N\t"),
        }
        match tenant {
            Some(t) => {
                text.push_str(&escape(t));
                text.push('\t');
            }
            None => text.push_str("\\N\t"),
        }
        match job.run_at {
            Known::Now(Some(at)) => {
                _ = write!(text, "{}\tf\t", at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
            }
            Known::Now(None) => text.push_str("\\N\tf\t"),
            Known::Later => text.push_str("\\N\tt\t"),
        }
        text.push_str(match due {
            Some(true) => "t\t",
            Some(false) => "f\t",
            None => "\\N\t",
        });
        // Recipient, payload and sealed columns.
        match rt.seal.store(&job.recipient, job.payload.get()) {
            Stored::Clear { recipient, payload } => {
                let _ = write!(text, "{}\t{}\t\\N\t", escape(recipient), escape(payload));
            }
            Stored::Sealed { masked, sealed } => {
                let _ = write!(text, "{}\t\\N\t", escape(&masked));
                push_bytea(text, &sealed);
                text.push('\t');
            }
        }
        match &job.idempotency_key {
            Some(key) => {
                self.keyed = true;
                text.push_str(&escape(key));
                text.push('\n');
            }
            None => text.push_str("\\N\n"),
        }
        if self.text.len() >= CHUNK_BYTES {
            self.send()?;
        }
        Ok(())
    }

    /// The row's group (1-based) and its place in it (0-based).
    fn place(&mut self, priority: Option<i16>, tenant: Option<&str>, due: Option<bool>) -> (usize, u64) {
        // Runs of rows of one group are the common case: no key built for them.
        let same_as_last = self.last.is_some_and(|i| {
            let g = &self.groups[i];
            g.priority == priority && g.tenant.as_deref() == tenant && g.due == due
        });
        let index = match self.last {
            Some(i) if same_as_last => i,
            _ => {
                let key = (priority, tenant.map(str::to_string), due);
                let next = self.groups.len();
                let groups = &mut self.groups;
                *self.by_key.entry(key).or_insert_with(|| {
                    groups.push(Group { priority, tenant: tenant.map(str::to_string), due, rows: 0 });
                    next
                })
            }
        };
        self.last = Some(index);
        let group = &mut self.groups[index];
        group.rows += 1;
        (index + 1, group.rows - 1)
    }

    fn send(&mut self) -> Result<(), CopyGone> {
        let full = std::mem::replace(&mut self.text, String::with_capacity(CHUNK_BYTES + 64 * 1024));
        self.chunks.blocking_send(full).map_err(|_| CopyGone)
    }

    /// Sends what is left; the groups, for the fair keys.
    pub fn finish(mut self) -> Result<Vec<Group>, CopyGone> {
        if !self.text.is_empty() {
            self.send()?;
        }
        Ok(self.groups)
    }
}

/// Escapes a value for COPY's text format (backslash, tab, newline, carriage return).
/// `bytes` as a `bytea` field of COPY text: `\\x` and hex digits (the backslash doubled for COPY).
fn push_bytea(text: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    text.reserve(3 + 2 * bytes.len());
    text.push_str("\\\\x");
    for b in bytes {
        text.push(HEX[usize::from(b >> 4)] as char);
        text.push(HEX[usize::from(b & 15)] as char);
    }
}

fn escape(value: &str) -> std::borrow::Cow<'_, str> {
    if !value.contains(['\\', '\t', '\n', '\r']) {
        return std::borrow::Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 8);
    for ch in value.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::{escape, push_bytea};

    #[test]
    fn bytes_go_as_hex_behind_a_doubled_backslash() {
        let mut text = String::new();
        push_bytea(&mut text, &[0x00, 0x9f, 0xff]);
        assert_eq!(text, "\\\\x009fff");
    }

    #[test]
    fn escape_doubles_backslashes_and_escapes_separators() {
        assert_eq!(escape("plain"), "plain");
        assert_eq!(escape(r#"{"a":"x\"y"}"#), r#"{"a":"x\\"y"}"#);
        assert_eq!(escape("a\tb\nc\rd"), "a\\tb\\nc\\rd");
    }
}
