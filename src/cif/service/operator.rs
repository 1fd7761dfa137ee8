//! What an operator does to the pools (the `/admin` API, the console and `cifpool pools`): refill
//! and reclaim now, reconcile with the customer system, fence after a restore, read the upkeep record.

use std::sync::Arc;

use tokio::io::AsyncBufRead;

use super::{Cif, CifError};
use crate::audit::Actor;
use crate::cif::fence::{self, Checked, FenceReport};
use crate::cif::reclaim::{self, ReclaimSummary};
use crate::cif::reconcile::{self, ReconcileError, ReconcileReport};
use crate::cif::refill::{RefillOptions, RefillSummary};
use crate::cif::rotate::{self, KeyRotated, RotateError};
use crate::cif::stats::{self, PoolUpkeep};
use crate::cif::store::CodeStatus;
use crate::cif::{Pools, upkeep};

/// What a fence asked for by an operator did.
#[derive(Debug, serde::Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum FenceOutcome {
    /// Every pool was fenced (see [`FenceReport`]).
    Fenced(FenceReport),
    /// The database was recorded as the one codes are issued from; `changed` is false when it already was.
    Accepted {
        /// Whether anything was recorded.
        changed: bool,
    },
}

/// A key rotation and the refill that followed it.
#[derive(Debug, serde::Serialize)]
pub struct Rotation {
    /// The new epoch.
    #[serde(flatten)]
    pub rotated: KeyRotated,
    /// The refill run right after, so that the pool does not wait for its schedule to have codes again.
    pub refill: RefillSummary,
}

/// Where a code comes from and where it stands.
#[derive(Debug, serde::Serialize)]
pub struct CodeOrigin {
    /// The code.
    pub cif: String,
    /// Its pool.
    pub customer_type: String,
    /// The key epoch whose key makes it (0: the configured key); absent when none of the pool's keys
    /// makes it from a counter in its range (such a code is never issued).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub epoch: Option<i16>,
    /// That epoch's key id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    /// The counter it was (or will be) made from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub counter: Option<u64>,
    /// Where it stands; absent for a code not generated (yet, or ever).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<CodeStatus>,
}

impl Cif {
    /// The pools this instance serves.
    pub fn pools(&self) -> &Arc<Pools> {
        &self.pools
    }

    /// Refills `customer_type`'s pool now, on the upkeep tracker (so a dropped request does not cut a
    /// batch in half); with `opts.force`, even above its watermark.
    pub async fn refill(&self, customer_type: &str, opts: RefillOptions) -> Result<RefillSummary, CifError> {
        let pool = self.pool(customer_type)?.clone();
        upkeep::refill_requested(&self.db, &self.upkeep, pool, opts)
            .await
            .map_err(|e| CifError::Interrupted(format!("the refill task ended before it answered: {e}")))?
            .map_err(CifError::Database)
    }

    /// Returns the expired holds of `customer_type`'s pool, or of every pool, to available.
    pub async fn reclaim(&self, customer_type: Option<&str>, actor: &Actor) -> Result<ReclaimSummary, CifError> {
        let only = customer_type.map(|name| self.pool(name).map(|pool| pool.id)).transpose()?;
        Ok(reclaim::reclaim(&self.db, &self.pools, only, actor).await?)
    }

    /// Reconciles the pools with the list of issued codes `list` (see [`crate::cif::reconcile`]);
    /// `progress` hears the number of lines read now and then.
    pub async fn reconcile(
        &self,
        list: impl AsyncBufRead + Unpin,
        apply: bool,
        actor: &Actor,
        progress: &(dyn Fn(u64) + Send + Sync),
    ) -> Result<ReconcileReport, ReconcileError> {
        reconcile::reconcile(&self.db, &self.pools, list, apply, actor, progress).await
    }

    /// Fences every pool now, or with `accept` records the database as it is; either way this
    /// instance issues again at once (the others at their next identity check).
    pub async fn fence(&self, accept: bool, actor: &Actor) -> Result<FenceOutcome, CifError> {
        let done = if accept {
            FenceOutcome::Accepted { changed: fence::accept(&self.db, actor).await? }
        } else {
            FenceOutcome::Fenced(fence::fence_now(&self.db, &self.fence_policy, actor).await?)
        };
        self.incarnation.note(&Checked::Same);
        Ok(done)
    }

    /// Starts a new key epoch for `customer_type`'s pool under `key_id` (see [`crate::cif::rotate`]),
    /// then refills it under the new key.
    pub async fn rotate_key(&self, customer_type: &str, key_id: &str, actor: &Actor) -> Result<Rotation, CifError> {
        let pool = self.pool(customer_type)?;
        let rotated = rotate::rotate(&self.db, pool, key_id, actor).await.map_err(|e| match e {
            e @ RotateError::InvalidKeyId(_) => CifError::Invalid(e.to_string()),
            e @ (RotateError::KeyIdUsed { .. } | RotateError::TooManyRotations(_)) => CifError::Conflict(e.to_string()),
            RotateError::Database(e) => CifError::Database(e),
        })?;
        let refill = self.refill(customer_type, RefillOptions { force: false, actor: actor.clone() }).await?;
        Ok(Rotation { rotated, refill })
    }

    /// The pool, key epoch and counter `cif` comes from, read under the pool's key epochs as the
    /// database has them now, and its status.
    pub async fn locate(&self, cif: &str) -> Result<CodeOrigin, CifError> {
        let pool = self.pool_for(cif)?;
        pool.reload_keys(&mut *self.db.acquire().await?).await?;
        let keys = pool.keys();
        let located = keys.locate(cif).map_err(|e| CifError::Malformed(e.to_string()))?;
        let epoch = located.map(|l| &keys.all()[l.epoch as usize]);
        Ok(CodeOrigin {
            cif: cif.to_string(),
            customer_type: pool.name().to_string(),
            epoch: located.map(|l| l.epoch),
            key_id: epoch.map(|e| e.key_id.clone()),
            counter: located.map(|l| l.counter),
            status: self.status(cif).await?,
        })
    }

    /// When each pool was last refilled and reclaimed, and what that did.
    pub async fn pool_upkeep(&self) -> Result<Vec<PoolUpkeep>, CifError> {
        Ok(stats::pool_upkeep(&self.db).await?)
    }
}
