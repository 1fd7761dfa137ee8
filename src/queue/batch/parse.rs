//! Reading a batch request as it arrives: a `serde_json` visitor over the request object takes the
//! batch's defaults and walks `jobs` one job at a time, each checked ([`super::rules`]) and appended to
//! the staging rows ([`super::rows`]) as soon as it is parsed. Nothing but the current job and the
//! chunk being filled is held.

use std::cell::Cell;
use std::fmt;
use std::io::{BufReader, Read};
use std::rc::Rc;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::queue::batch::body::{BodyFailure, JobBound, body_failure};
use crate::queue::batch::rows::{Group, Rows};
use crate::queue::batch::rules::{Rules, Verdict};
use crate::queue::intake::{BatchJob, SubmitError};
use crate::queue::runtime::QueueRuntime;
use crate::validate;

/// Buffer between the body frames and the JSON reader (serde_json reads a byte at a time and the
/// standard library serves that fastest from a `BufReader`).
const READ_BUFFER: usize = 64 * 1024;

/// What a fully read, valid batch request comes to.
#[derive(Debug)]
pub struct Parsed {
    /// The rules' findings: jobs per class, tenants, defaults.
    pub verdict: Verdict,
    /// The staging rows' groups, for the fair keys.
    pub groups: Vec<Group>,
    /// Jobs in the request.
    pub jobs: u64,
    /// Whether any job has an idempotency key.
    pub keyed: bool,
}

/// Why reading stopped early, decided by this code rather than by the JSON.
#[derive(Debug)]
enum Stop {
    /// More jobs than `queue.max_batch`: no need to read further.
    TooMany,
    /// The copying side has gone (its error is the answer).
    CopyGone,
}

/// The state of one request's parse, shared by the visitors.
struct Intake<'a> {
    rt: &'a QueueRuntime,
    rules: Rules<'a>,
    rows: Rows,
    jobs: usize,
    /// Inside `jobs`: a data error then belongs to job `jobs`.
    in_jobs: bool,
    stop: Option<Stop>,
    /// Bytes read since the current job began (`None` outside `jobs`): see [`JobBound`].
    since_job: Rc<Cell<Option<usize>>>,
}

/// The longest a valid job's JSON can be: its payload's limit and room for the other fields.
const MAX_JOB_TEXT: usize = validate::MAX_PAYLOAD_BYTES + 4 * 1024;

/// Reads and checks the whole request from `body`, sending staging rows to `rows` as it goes. The first
/// bad job refuses the batch, but the body is still read to its end: a malformed body is a 400 wherever
/// the fault is, and defaults may follow the jobs.
pub fn run(body: impl Read, rt: &QueueRuntime, rules: Rules<'_>, rows: Rows) -> Result<Parsed, SubmitError> {
    let since_job = Rc::new(Cell::new(None));
    // The reader runs up to a buffer ahead of the job being parsed, so the bound allows for it.
    let body = JobBound::new(body, since_job.clone(), MAX_JOB_TEXT + READ_BUFFER);
    let mut intake = Intake { rt, rules, rows, jobs: 0, in_jobs: false, stop: None, since_job };
    let mut json = serde_json::Deserializer::from_reader(BufReader::with_capacity(READ_BUFFER, body));
    let read = (&mut intake).deserialize(&mut json).and_then(|()| json.end());
    let max = rt.settings.max_batch;
    match (read, intake.stop.take()) {
        (_, Some(Stop::TooMany)) => return Err(SubmitError::TooMany { max, got: intake.jobs }),
        (_, Some(Stop::CopyGone)) => return Err(SubmitError::Invalid("the batch could not be stored".into())),
        (Err(e), None) => return Err(refusal(e, intake.in_jobs.then_some(intake.jobs))),
        (Ok(()), None) => {}
    }
    if intake.jobs == 0 {
        return Err(SubmitError::Invalid("jobs must not be empty".into()));
    }
    let verdict = intake.rules.finish()?;
    let keyed = intake.rows.keyed;
    let groups = intake.rows.finish().map_err(|_| SubmitError::Invalid("the batch could not be stored".into()))?;
    Ok(Parsed { verdict, groups, jobs: intake.jobs as u64, keyed })
}

/// A JSON or body error as the client's fault: 413 past the body limit, 400 for a body cut short or
/// not JSON, 422 for JSON of the wrong shape (naming the job it is in), as the `Json` extractor had it.
fn refusal(e: serde_json::Error, job: Option<usize>) -> SubmitError {
    use serde_json::error::Category;
    match e.classify() {
        Category::Io => {
            // The reader's own error, with the `BodyFailure` it carries.
            let io = std::io::Error::from(e);
            match body_failure(&io) {
                Some(BodyFailure::TooLarge) => SubmitError::BodyTooLarge,
                Some(failure @ BodyFailure::TooSlow(_)) => SubmitError::TooSlow(failure.to_string()),
                Some(BodyFailure::JobTooLong(limit)) => SubmitError::Invalid(format!(
                    "jobs[{}]: longer than {limit} bytes of JSON (a payload may have at most {} bytes)",
                    job.unwrap_or_default(),
                    validate::MAX_PAYLOAD_BYTES
                )),
                Some(failure) => SubmitError::Malformed(failure.to_string()),
                None => SubmitError::Malformed(format!("the request body could not be read: {io}")),
            }
        }
        Category::Syntax => SubmitError::Malformed(format!("the request body is not valid JSON: {e}")),
        Category::Eof => SubmitError::Malformed(format!("the request body ends before the JSON does: {e}")),
        Category::Data => match job {
            Some(i) => SubmitError::Invalid(format!("jobs[{i}]: {e}")),
            None => SubmitError::Invalid(e.to_string()),
        },
    }
}

impl<'de> DeserializeSeed<'de> for &mut Intake<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(Request(self))
    }
}

/// The request object: `class`, `tenant`, `run_at` (defaults) and `jobs`, in any order.
struct Request<'i, 'a>(&'i mut Intake<'a>);

impl<'de> Visitor<'de> for Request<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a batch request object with `jobs`")
    }

    fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<(), M::Error> {
        let mut jobs_seen = false;
        while let Some(key) = map.next_key::<String>()? {
            let defaults = &mut self.0.rules.defaults;
            match key.as_str() {
                "class" if defaults.class.is_some() => return Err(de::Error::duplicate_field("class")),
                "class" => defaults.class = Some(map.next_value()?),
                "tenant" if defaults.tenant.is_some() => return Err(de::Error::duplicate_field("tenant")),
                "tenant" => defaults.tenant = Some(map.next_value()?),
                "run_at" if defaults.run_at.is_some() => return Err(de::Error::duplicate_field("run_at")),
                "run_at" => defaults.run_at = Some(map.next_value()?),
                "jobs" if jobs_seen => return Err(de::Error::duplicate_field("jobs")),
                "jobs" => {
                    jobs_seen = true;
                    map.next_value_seed(Jobs(&mut *self.0))?;
                }
                _ => _ = map.next_value::<IgnoredAny>()?,
            }
        }
        if !jobs_seen {
            return Err(de::Error::missing_field("jobs"));
        }
        Ok(())
    }
}

/// The `jobs` array, taken one job at a time.
struct Jobs<'i, 'a>(&'i mut Intake<'a>);

impl<'de> DeserializeSeed<'de> for Jobs<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Jobs<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of jobs")
    }

    fn visit_seq<S: SeqAccess<'de>>(self, mut seq: S) -> Result<(), S::Error> {
        let intake = self.0;
        intake.in_jobs = true;
        // Every job is parsed whole, even after a bad one: a later job of the wrong shape is still the
        // 422 it would have been when the body was parsed before any check.
        loop {
            intake.since_job.set(Some(0));
            let Some(job) = seq.next_element::<BatchJob>()? else { break };
            if let Err(stop) = intake.take(job) {
                intake.stop = Some(stop);
                return Err(de::Error::custom("stopped"));
            }
        }
        intake.since_job.set(None);
        intake.in_jobs = false;
        Ok(())
    }
}

impl Intake<'_> {
    fn take(&mut self, job: BatchJob) -> Result<(), Stop> {
        let index = self.jobs;
        self.jobs += 1;
        if self.jobs > self.rt.settings.max_batch {
            return Err(Stop::TooMany);
        }
        if self.rules.failed() {
            return Ok(());
        }
        if let Some(checked) = self.rules.check(index, job) {
            self.rows.push(self.rt, &checked).map_err(|_| Stop::CopyGone)?;
        }
        Ok(())
    }
}
