//! The rules of a batch's jobs, checked as each job arrives: its class, tenant and `run_at` after the
//! batch's defaults, and the rules of [`crate::queue::intake`]. A default the body gives only after
//! `jobs` (JSON objects have no key order; `serde_json` sorts `tenant` after `jobs`) is not known while
//! the jobs stream past: such a job is kept with its field "to be resolved", and the checks that need
//! the default are remembered by the index of the first job they concern and run once at the end, so
//! the batch is still refused by its first bad job, as if it had been read whole.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use serde_json::value::RawValue;

use crate::auth::Caller;
use crate::queue::intake::{
    self, BatchJob, Invalid, MAX_LABEL, MAX_RECIPIENT, SubmitError, check_ahead, check_class, check_deadline,
};
use crate::queue::runtime::QueueRuntime;
use crate::validate;

/// A job field as far as the body has been read: its value, or "the batch default", which comes later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Known<T> {
    /// The job's own value, or a default that came before `jobs`.
    Now(T),
    /// The batch default, not read yet.
    Later,
}

/// The batch-wide defaults read so far: `None` until the key is met (`Some(None)`: met, `null`).
#[derive(Debug, Default)]
pub struct Defaults {
    /// `class` of the batch.
    pub class: Option<Option<String>>,
    /// `tenant` of the batch.
    pub tenant: Option<Option<String>>,
    /// `run_at` of the batch.
    pub run_at: Option<Option<DateTime<Utc>>>,
}

/// A job that passed every check that could be made when it arrived.
#[derive(Debug)]
pub struct Checked {
    /// Its class.
    pub class: Known<String>,
    /// Its tenant, implied and trimmed.
    pub tenant: Known<String>,
    /// When it is to be sent (`Now(None)`: now).
    pub run_at: Known<Option<DateTime<Utc>>>,
    /// Its recipient, trimmed.
    pub recipient: String,
    /// Its payload as it arrived.
    pub payload: Box<RawValue>,
    /// Its idempotency key.
    pub idempotency_key: Option<String>,
}

/// The defaults after the whole body: what every [`Known::Later`] stands for.
#[derive(Debug, Clone)]
pub struct Final {
    /// Class of the jobs that name none.
    pub class: String,
    /// Tenant of the jobs that name none (implied and trimmed).
    pub tenant: String,
    /// `run_at` of the jobs that give none.
    pub run_at: Option<DateTime<Utc>>,
}

/// What the rules found in a batch that passed them all.
#[derive(Debug)]
pub struct Verdict {
    /// Jobs per class, for admission and the outcome metrics.
    pub per_class: BTreeMap<String, u64>,
    /// Every tenant the batch holds (kept with the batch, for who may see or cancel it).
    pub tenants: Vec<String>,
    /// The defaults.
    pub defaults: Final,
}

/// The first failure: by job index, then by the order in which one job's checks run (tenant allowed,
/// class, recipient, tenant text, key, payload, `run_at`).
type Failure = (usize, u8, SubmitError);

/// Checks that wait for a default, by the first job each concerns.
#[derive(Debug, Default)]
struct Pending {
    no_class: Option<usize>,
    no_tenant: Option<usize>,
    /// Jobs with their own `run_at` but no class: per configured class with a deadline, the first
    /// job whose `run_at` would be past it (a job's class, once known, is one of the configured ones,
    /// or it fails earlier).
    own_run_at_no_class: BTreeMap<String, (usize, DateTime<Utc>)>,
    /// Jobs with their class but no `run_at`: the first per class.
    no_run_at: BTreeMap<String, usize>,
    no_run_at_no_class: Option<usize>,
}

/// The rule keeper of one batch request.
pub struct Rules<'a> {
    rt: &'a QueueRuntime,
    caller: &'a Caller,
    /// The defaults read so far (the parser fills them in).
    pub defaults: Defaults,
    failure: Option<Failure>,
    pending: Pending,
    per_class: BTreeMap<String, u64>,
    later_class_jobs: u64,
    tenants: BTreeSet<String>,
    later_tenant: bool,
}

impl<'a> Rules<'a> {
    /// Rules for `caller`'s batch under the configured classes.
    pub fn new(rt: &'a QueueRuntime, caller: &'a Caller) -> Rules<'a> {
        Rules {
            rt,
            caller,
            defaults: Defaults::default(),
            failure: None,
            pending: Pending::default(),
            per_class: BTreeMap::new(),
            later_class_jobs: 0,
            tenants: BTreeSet::new(),
            later_tenant: false,
        }
    }

    /// Whether a job has already failed: the batch is refused, later jobs need no checking.
    pub fn failed(&self) -> bool {
        self.failure.is_some()
    }

    fn fail(&mut self, index: usize, rank: u8, error: SubmitError) {
        if self.failure.as_ref().is_none_or(|(i, r, _)| (index, rank) < (*i, *r)) {
            self.failure = Some((index, rank, error));
        }
    }

    /// Job `index` after the defaults read so far, checked; `None` when it fails (remembered).
    pub fn check(&mut self, index: usize, job: BatchJob) -> Option<Checked> {
        let class = match (job.class, &self.defaults.class) {
            (Some(own), _) => Known::Now(own),
            (None, Some(default)) => Known::Now(default.clone().unwrap_or_default()),
            (None, None) => Known::Later,
        };
        let tenant = match (job.tenant, &self.defaults.tenant) {
            (Some(own), _) => Known::Now(intake::implied_tenant(own, self.caller)),
            (None, Some(default)) => {
                Known::Now(intake::implied_tenant(default.clone().unwrap_or_default(), self.caller))
            }
            (None, None) => Known::Later,
        };
        let run_at = match (job.run_at, self.defaults.run_at) {
            (Some(own), _) => Known::Now(Some(own)),
            (None, Some(default)) => Known::Now(default),
            (None, None) => Known::Later,
        };
        let recipient = match job.recipient.trim() {
            trimmed if trimmed.len() == job.recipient.len() => job.recipient,
            trimmed => trimmed.to_string(),
        };
        let checked =
            Checked { class, tenant, run_at, recipient, payload: job.payload, idempotency_key: job.idempotency_key };
        if let Err((rank, error)) = self.check_now(index, &checked) {
            self.fail(index, rank, error);
            return None;
        }
        match &checked.class {
            Known::Now(class) => *self.per_class.entry(class.clone()).or_default() += 1,
            Known::Later => self.later_class_jobs += 1,
        }
        match &checked.tenant {
            Known::Now(tenant) if !self.tenants.contains(tenant) => _ = self.tenants.insert(tenant.clone()),
            Known::Now(_) => {}
            Known::Later => self.later_tenant = true,
        }
        Some(checked)
    }

    /// The checks that can be made now, in the order `submit_one` makes them; notes those that wait.
    fn check_now(&mut self, index: usize, job: &Checked) -> Result<(), (u8, SubmitError)> {
        let invalid = |rank: u8| move |e: Invalid| (rank, SubmitError::Invalid(format!("jobs[{index}]: {}", e.0)));
        let text = |rank: u8, field: &str, value: &str, max| {
            validate::text(field, value, max).map_err(|e| (rank, SubmitError::Invalid(format!("jobs[{index}]: {e}"))))
        };
        match &job.tenant {
            Known::Now(tenant) => intake::check_tenant_allowed(tenant, self.caller).map_err(|e| (0, e))?,
            Known::Later => _ = self.pending.no_tenant.get_or_insert(index),
        }
        match &job.class {
            Known::Now(class) => check_class(self.rt, class).map_err(invalid(1))?,
            Known::Later => _ = self.pending.no_class.get_or_insert(index),
        }
        text(2, "recipient", &job.recipient, MAX_RECIPIENT)?;
        if let Known::Now(tenant) = &job.tenant {
            text(3, "tenant", tenant, MAX_LABEL)?;
        }
        if let Some(key) = &job.idempotency_key {
            text(4, "idempotency_key", key, MAX_LABEL)?;
        }
        validate::json_text("payload", job.payload.get()).map_err(|e| invalid(5)(Invalid(e)))?;
        match (&job.run_at, &job.class) {
            (Known::Now(None), _) => {}
            (Known::Now(Some(at)), Known::Now(class)) => {
                check_ahead(*at).map_err(invalid(6))?;
                check_deadline(self.rt, class, *at).map_err(invalid(6))?;
            }
            (Known::Now(Some(at)), Known::Later) => {
                check_ahead(*at).map_err(invalid(6))?;
                for class in self.rt.classes.keys() {
                    if check_deadline(self.rt, class, *at).is_err() {
                        self.pending.own_run_at_no_class.entry(class.clone()).or_insert((index, *at));
                    }
                }
            }
            (Known::Later, Known::Now(class)) => _ = self.pending.no_run_at.entry(class.clone()).or_insert(index),
            (Known::Later, Known::Later) => _ = self.pending.no_run_at_no_class.get_or_insert(index),
        }
        Ok(())
    }

    /// The waiting checks, once the whole body is read; the batch's first failure if any.
    pub fn finish(mut self) -> Result<Verdict, SubmitError> {
        let defaults = Final {
            class: self.defaults.class.take().flatten().unwrap_or_default(),
            tenant: intake::implied_tenant(self.defaults.tenant.take().flatten().unwrap_or_default(), self.caller),
            run_at: self.defaults.run_at.take().flatten(),
        };
        let (rt, pending) = (self.rt, std::mem::take(&mut self.pending));
        let invalid = |index: usize, e: Invalid| SubmitError::Invalid(format!("jobs[{index}]: {}", e.0));
        if let Some(index) = pending.no_tenant {
            if let Err(e) = intake::check_tenant_allowed(&defaults.tenant, self.caller) {
                self.fail(index, 0, e);
            } else if let Err(e) = validate::text("tenant", &defaults.tenant, MAX_LABEL) {
                self.fail(index, 3, invalid(index, Invalid(e)));
            }
        }
        if let Some(index) = pending.no_class
            && let Err(e) = check_class(rt, &defaults.class)
        {
            self.fail(index, 1, invalid(index, e));
        }
        if let Some(&(index, at)) = pending.own_run_at_no_class.get(&defaults.class)
            && let Err(e) = check_deadline(rt, &defaults.class, at)
        {
            self.fail(index, 6, invalid(index, e));
        }
        if let Some(at) = defaults.run_at {
            let first = pending.no_run_at.values().copied().chain(pending.no_run_at_no_class).min();
            if let Some(index) = first
                && let Err(e) = check_ahead(at)
            {
                self.fail(index, 6, invalid(index, e));
            }
            let by_class = pending.no_run_at.iter().map(|(class, index)| (class.as_str(), *index));
            let defaulted = pending.no_run_at_no_class.map(|index| (defaults.class.as_str(), index));
            for (class, index) in by_class.chain(defaulted) {
                if let Err(e) = check_deadline(rt, class, at) {
                    self.fail(index, 6, invalid(index, e));
                }
            }
        }
        if let Some((_, _, error)) = self.failure {
            return Err(error);
        }
        if self.later_class_jobs > 0 {
            *self.per_class.entry(defaults.class.clone()).or_default() += self.later_class_jobs;
        }
        if self.later_tenant {
            self.tenants.insert(defaults.tenant.clone());
        }
        Ok(Verdict { per_class: self.per_class, tenants: self.tenants.into_iter().collect(), defaults })
    }
}
