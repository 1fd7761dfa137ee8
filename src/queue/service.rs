//! [`Queue`]: the notification queue as the API's callers use it. It owns what intake and the job
//! operations need (the database, the classes and providers, the depth behind backpressure, the
//! tracker that lets a batch cancel outlive its request), and answers for one caller: a job or batch
//! of a tenant the caller may not act for is answered as one that does not exist.

use std::sync::Arc;

use sqlx::PgPool;
use tokio_util::task::TaskTracker;

use crate::audit::Actor;
use crate::auth::Caller;
use crate::queue::batch::ByteStream;
use crate::queue::cancel::{self, Batch, BatchView, Canceled};
use crate::queue::intake::{self, BatchSubmitted, NewJob, SubmitError, Submitted};
use crate::queue::runtime::QueueRuntime;
use crate::queue::stats::QueueStats;
use crate::queue::store::{self, JobView};

mod operator;

/// The queue operations of one instance. Cheap to clone.
#[derive(Clone)]
pub struct Queue {
    db: PgPool,
    runtime: Arc<QueueRuntime>,
    stats: Arc<QueueStats>,
    upkeep: TaskTracker,
}

impl Queue {
    /// Operations on `db` with the classes of `runtime`, intake judged against `stats`; a batch cancel
    /// runs on `upkeep`, which shutdown waits for.
    pub fn new(db: PgPool, runtime: Arc<QueueRuntime>, stats: Arc<QueueStats>, upkeep: TaskTracker) -> Queue {
        Queue { db, runtime, stats, upkeep }
    }

    /// Validates and enqueues one job for `caller` (see [`SubmitError`]); a repeated idempotency key
    /// answers the existing job.
    pub async fn submit_one(&self, caller: &Caller, job: NewJob) -> Result<Submitted, SubmitError> {
        intake::submit_one(&self.db, &self.runtime, &self.stats, caller, job).await
    }

    /// Reads a batch's bytes as they arrive and enqueues its jobs in one transaction (see
    /// [`crate::queue::batch`]).
    pub async fn submit_batch(&self, caller: &Caller, body: ByteStream) -> Result<BatchSubmitted, SubmitError> {
        crate::queue::batch::submit(&self.db, &self.runtime, &self.stats, caller, body).await
    }

    /// Job `id`, if it exists and `caller` may act for its tenant.
    pub async fn job(&self, caller: &Caller, id: i64) -> Result<Option<JobView>, sqlx::Error> {
        Ok(store::get_job(&self.db, id).await?.filter(|job| caller.may_act_for(&job.tenant)))
    }

    /// Cancels job `id` if it has not been sent; a job `caller` may not see is [`Canceled::NotFound`],
    /// and is left alone.
    pub async fn cancel(&self, caller: &Caller, id: i64, actor: &Actor) -> Result<Canceled, sqlx::Error> {
        if self.job(caller, id).await?.is_none() {
            return Ok(Canceled::NotFound);
        }
        cancel::cancel_job(&self.db, id, actor).await
    }

    /// Batch `id`, if it exists and `caller` may act for every tenant it holds.
    pub async fn batch(&self, caller: &Caller, id: i64) -> Result<Option<Batch>, sqlx::Error> {
        Ok(cancel::batch(&self.db, id).await?.filter(|b| b.tenants.iter().all(|t| caller.may_act_for(t))))
    }

    /// How many jobs of `batch` are in each status now.
    pub async fn batch_view(&self, batch: &Batch) -> Result<BatchView, sqlx::Error> {
        cancel::batch_view(&self.db, batch).await
    }

    /// Cancels every unsent job of `batch`; the work goes on to the end if the request is dropped.
    /// Returns how many were canceled.
    pub async fn cancel_batch(&self, batch: Batch, actor: Actor) -> anyhow::Result<u64> {
        let done = cancel::cancel_batch_detached(&self.db, &self.upkeep, batch, actor)
            .await
            .map_err(|e| anyhow::anyhow!("batch cancel task: {e}"))?;
        Ok(done?)
    }
}
