//! What an operator does to the queue (the `/admin` API, the console): see it whole, pause and resume
//! classes and providers, and act on dead letters.

use std::sync::Arc;

use super::Queue;
use crate::audit::Actor;
use crate::queue::cancel::{self, Batch};
use crate::queue::dlq::{self, DeadJob, DeadLetterAction, DlqFilter, Replay};
use crate::queue::erase::{self, Erasure};
use crate::queue::pause::{self, PauseKind, PauseRow};
use crate::queue::runtime::QueueRuntime;
use crate::queue::stats::QueueStats;
use crate::queue::view::{self, QueueView};

impl Queue {
    /// The configured classes and providers, with their budgets and pauses as this pod sees them.
    pub fn runtime(&self) -> &Arc<QueueRuntime> {
        &self.runtime
    }

    /// The latest depth of each class (what backpressure and the gauges read).
    pub fn stats(&self) -> &Arc<QueueStats> {
        &self.stats
    }

    /// One of the few batch requests this instance receives at once, held until it is dropped; `None`
    /// while all `queue.max_concurrent_batches` are taken.
    pub fn try_batch_permit(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.runtime.batch_permits.clone().try_acquire_owned().ok()
    }

    /// Every class, provider and group: depth, ages, budgets and pauses, read now.
    pub async fn view(&self) -> Result<QueueView, sqlx::Error> {
        view::read(&self.db, &self.runtime, &self.stats).await
    }

    /// Pauses (or resumes) a class or provider for every pod, at once on this one; `None` when this
    /// deployment has no such class or provider, else whether anything changed.
    pub async fn set_pause(
        &self,
        kind: PauseKind,
        name: &str,
        paused: bool,
        actor: &Actor,
    ) -> Result<Option<bool>, sqlx::Error> {
        self.runtime.set_pause(&self.db, kind, name, paused, actor).await
    }

    /// Up to `limit` dead letters matching `filter`, the oldest first (in id order).
    pub async fn dead_letters(&self, filter: &DlqFilter, limit: i64) -> Result<Vec<DeadJob>, sqlx::Error> {
        dlq::list(&self.db, filter, limit).await
    }

    /// How many dead letters match `filter`, counting no further than `limit`.
    pub async fn count_dead_letters(&self, filter: &DlqFilter, limit: i64) -> Result<u64, sqlx::Error> {
        dlq::count(&self.db, filter, limit).await
    }

    /// Puts the dead letters `replay` selects back in the queue at its pace; how many.
    pub async fn replay(&self, replay: &Replay, actor: &Actor) -> Result<u64, sqlx::Error> {
        dlq::replay(&self.db, replay, actor).await
    }

    /// Puts dead letter `id` back in the queue, due now, with `extra_attempts` more attempts.
    pub async fn retry_dead_letter(
        &self,
        id: i64,
        extra_attempts: i32,
        actor: &Actor,
    ) -> Result<DeadLetterAction, sqlx::Error> {
        dlq::retry_one(&self.db, id, extra_attempts, actor).await
    }

    /// Marks dead letter `id` discarded (kept with its history until retention purges it).
    pub async fn discard_dead_letter(&self, id: i64, actor: &Actor) -> Result<DeadLetterAction, sqlx::Error> {
        dlq::discard_one(&self.db, id, actor).await
    }

    /// The pauses recorded for every pod, whether or not this deployment configures their class or
    /// provider.
    pub async fn pauses(&self) -> Result<Vec<PauseRow>, sqlx::Error> {
        pause::list(&self.db).await
    }

    /// Batch `id` whatever tenants it holds: the operator's view, for whom no tenant is out of reach.
    pub async fn batch_for_operator(&self, id: i64) -> Result<Option<Batch>, sqlx::Error> {
        cancel::batch(&self.db, id).await
    }

    /// Erases what the service holds of `recipient` (of `tenant`'s jobs only, if given; see
    /// [`crate::queue::erase`]); with `apply` off, only counts.
    pub async fn erase_recipient(
        &self,
        recipient: &str,
        tenant: Option<&str>,
        apply: bool,
        actor: &Actor,
    ) -> Result<Erasure, sqlx::Error> {
        erase::erase_recipient(&self.db, &self.runtime.seal, recipient, tenant, apply, actor).await
    }
}
