//! [`Cif`]: CIF issuance as its callers (the API, the tests, the tools) use it. It owns what the
//! operations need (the database, the pools, the upkeep a reservation triggers, the fence that can
//! halt issuance), turns a customer type or a code into its pool, and does the bookkeeping of each
//! operation; the statements are in [`crate::cif::store`].

use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::audit::Actor;
use crate::cif::coalesce::{Coalescer, Shared};
use crate::cif::fence::{FencePolicy, IncarnationGuard};
use crate::cif::stats::{self, PoolStats};
use crate::cif::store::{self, By, CodeStatus, Confirmed, Reserved};
use crate::cif::{Pool, Pools, upkeep};
use crate::claim::Fenced;

mod operator;
pub use operator::{FenceOutcome, Rotation};

/// Why a CIF operation was not carried out.
#[derive(Debug, thiserror::Error)]
pub enum CifError {
    /// No pool serves this customer type.
    #[error("unknown customer_type {given:?}; known types: {known}")]
    UnknownType {
        /// The customer type asked for.
        given: String,
        /// The configured ones, comma-separated.
        known: String,
    },
    /// The text is no code of any pool (not digits, wrong length or prefix, bad check digit).
    #[error("{0}")]
    Malformed(String),
    /// Issuance is halted until an operator fences the database (see [`crate::cif::fence`]).
    #[error(
        "issuance is halted: the database is not the one codes were issued from (a restore, a recovery or a \
         failover), and database.on_incarnation_change is \"halt\"; an operator must run `cifpool pools fence` \
         (or `--accept`)"
    )]
    Halted,
    /// The request asks for something the pool cannot do (the detail says what).
    #[error("{0}")]
    Invalid(String),
    /// The request conflicts with the pool's state (the detail says how).
    #[error("{0}")]
    Conflict(String),
    /// Work started for the request ended without an answer (a panic: the detail is in the log).
    #[error("{0}")]
    Interrupted(String),
    /// The database failed.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// The CIF operations of one instance. Cheap to clone.
#[derive(Clone)]
pub struct Cif {
    db: PgPool,
    pools: Arc<Pools>,
    upkeep: TaskTracker,
    incarnation: Arc<IncarnationGuard>,
    fence_policy: FencePolicy,
}

impl Cif {
    /// Operations on `pools` in `db`; refills a reservation starts run on `upkeep`, reservations are
    /// refused while `incarnation` is halted, and an operator's fence follows `fence_policy`.
    pub(crate) fn new(
        db: PgPool,
        pools: Arc<Pools>,
        upkeep: TaskTracker,
        incarnation: Arc<IncarnationGuard>,
        fence_policy: FencePolicy,
    ) -> Cif {
        Cif { db, pools, upkeep, incarnation, fence_policy }
    }

    /// The same operations, with reservations refused while `incarnation` is halted.
    pub(crate) fn guarded_by(self, incarnation: Arc<IncarnationGuard>) -> Cif {
        Cif { incarnation, ..self }
    }

    /// The pool serving `customer_type`.
    pub fn pool(&self, customer_type: &str) -> Result<&Arc<Pool>, CifError> {
        self.pools.get(customer_type).ok_or_else(|| CifError::UnknownType {
            given: customer_type.to_string(),
            known: self.pools.names().join(", "),
        })
    }

    /// The name of the pool whose codes have `cif`'s prefix and length (no decoding).
    pub fn pool_of(&self, cif: &str) -> Option<&str> {
        self.pools.for_code(cif).map(|pool| pool.name())
    }

    /// The pool `cif` belongs to (by its digits, length and prefix).
    fn pool_for(&self, cif: &str) -> Result<&Arc<Pool>, CifError> {
        if let Some(position) = cif.chars().position(|c| !c.is_ascii_digit()) {
            return Err(CifError::Malformed(format!(
                "code must contain only the digits 0-9, but character {} is not a digit",
                position + 1
            )));
        }
        self.pools.for_code(cif).ok_or_else(|| {
            CifError::Malformed(format!("{cif:?} does not have the length and prefix of any pool's codes"))
        })
    }

    /// `cif`'s counter in `pool` under the key epochs this instance knows (`None`: none of them makes it).
    fn counter(pool: &Pool, cif: &str) -> Result<Option<i64>, CifError> {
        let located = pool.keys().locate(cif).map_err(|e| CifError::Malformed(e.to_string()))?;
        Ok(located.map(|l| l.counter as i64))
    }

    /// After an operation found nothing at a code's counter: whether `pool` has a key epoch this
    /// instance had not read (now read), so that the code may be one the new key made, decoded under
    /// the old, and the operation is worth one more try.
    async fn learned_new_keys(&self, pool: &Pool) -> Result<bool, CifError> {
        Ok(pool.reload_keys(&mut *self.db.acquire().await?).await?)
    }

    /// Reserves one code of `customer_type`'s pool for `holder` on behalf of `actor`: without an
    /// idempotency key through the pool's shared claim statements ([`crate::cif::coalesce`]), with one
    /// alone (see [`store::reserve`]). Timed and counted; a claim leaves the pool's depth checked, and
    /// one that finds it empty starts a refill.
    #[tracing::instrument(name = "claim", skip_all, fields(pool = customer_type))]
    pub async fn reserve(
        &self,
        customer_type: &str,
        holder: Option<&str>,
        idempotency_key: Option<&str>,
        actor: &Actor,
    ) -> Result<Reserved, CifError> {
        let pool = self.pool(customer_type)?;
        if self.incarnation.halted() {
            return Err(CifError::Halted);
        }
        let started = Instant::now();
        let outcome = self.claim(pool, holder, idempotency_key, actor).await?;
        let name = pool.name().to_string();
        metrics::histogram!("cifpool_reservation_duration_seconds", "pool" => name.clone())
            .record(started.elapsed().as_secs_f64());
        match &outcome {
            Reserved::Created(_) => {
                metrics::counter!("cifpool_reservations_total", "pool" => name).increment(1);
                upkeep::after_claim(&self.db, pool, &self.upkeep);
            }
            Reserved::Empty => {
                metrics::counter!("cifpool_pool_empty_total", "pool" => name).increment(1);
                upkeep::on_empty(&self.db, pool, &self.upkeep);
            }
            Reserved::Replayed(_) | Reserved::KeyReused { .. } => {}
        }
        Ok(outcome)
    }

    async fn claim(
        &self,
        pool: &Arc<Pool>,
        holder: Option<&str>,
        idempotency_key: Option<&str>,
        actor: &Actor,
    ) -> Result<Reserved, sqlx::Error> {
        let db = &self.db;
        if idempotency_key.is_some() {
            return store::reserve(db, pool, holder, idempotency_key, actor).await;
        }
        let coalescer = pool.coalescer.get_or_init(|| Coalescer::start(db.clone(), Arc::downgrade(pool)));
        if let Some(alone) = coalescer.alone() {
            metrics::histogram!("cifpool_reservation_batch_size", "pool" => pool.name().to_string()).record(1.0);
            let mut lent = alone.connection(db).await?;
            let reserved = store::reserve_on(&mut lent.conn, pool, holder, actor).await?;
            alone.keep(lent);
            return Ok(reserved);
        }
        let request = store::Request { holder: holder.map(str::to_string), actor: actor.clone() };
        match coalescer.reserve(request).await {
            Shared::Reserved(r) => Ok(Reserved::Created(r)),
            Shared::Empty => Ok(Reserved::Empty),
            Shared::RetryAlone => store::reserve(db, pool, holder, None, actor).await,
        }
    }

    /// Confirms `cif` for its holder `token` (see [`store::confirm`]); counts first confirmations, not
    /// repeated ones.
    pub async fn confirm(
        &self,
        cif: &str,
        token: Uuid,
        customer_ref: Option<&str>,
        by: By<'_>,
    ) -> Result<Confirmed, CifError> {
        let pool = self.pool_for(cif)?;
        let mut retried = false;
        let outcome = loop {
            let outcome = match Self::counter(pool, cif)? {
                Some(counter) => store::confirm(&self.db, pool, counter, token, customer_ref, by).await?,
                None => Confirmed::LeaseLost,
            };
            if !matches!(outcome, Confirmed::LeaseLost) || retried || !self.learned_new_keys(pool).await? {
                break outcome;
            }
            retried = true;
        };
        if let Confirmed::Now(_) = outcome {
            metrics::counter!("cifpool_confirmations_total", "pool" => pool.name().to_string()).increment(1);
        }
        Ok(outcome)
    }

    /// Gives `cif` back to its pool if `token` still holds it (see [`store::release`]).
    pub async fn release(&self, cif: &str, token: Uuid, by: By<'_>) -> Result<Fenced, CifError> {
        let pool = self.pool_for(cif)?;
        let mut retried = false;
        loop {
            let outcome = match Self::counter(pool, cif)? {
                Some(counter) => store::release(&self.db, pool, counter, token, by).await?,
                None => Fenced::LeaseLost,
            };
            if matches!(outcome, Fenced::Done) || retried || !self.learned_new_keys(pool).await? {
                return Ok(outcome);
            }
            retried = true;
        }
    }

    /// Extends `token`'s hold of `cif` by its pool's lease; the new end, or `None` when the hold is lost.
    pub async fn extend(&self, cif: &str, token: Uuid, by: By<'_>) -> Result<Option<DateTime<Utc>>, CifError> {
        let pool = self.pool_for(cif)?;
        let mut retried = false;
        loop {
            let outcome = match Self::counter(pool, cif)? {
                Some(counter) => store::extend(&self.db, pool, counter, token, by).await?,
                None => None,
            };
            if outcome.is_some() || retried || !self.learned_new_keys(pool).await? {
                return Ok(outcome);
            }
            retried = true;
        }
    }

    /// Where `cif` stands (held, confirmed, …), or `None` for a well-formed code never issued.
    pub async fn status(&self, cif: &str) -> Result<Option<CodeStatus>, CifError> {
        let pool = self.pool_for(cif)?;
        let mut retried = false;
        loop {
            let outcome = match Self::counter(pool, cif)? {
                Some(counter) => store::status(&self.db, pool, counter, cif).await?,
                None => None,
            };
            if outcome.is_some() || retried || !self.learned_new_keys(pool).await? {
                return Ok(outcome);
            }
            retried = true;
        }
    }

    /// Each pool's depth, read now.
    pub async fn pool_stats(&self) -> Result<Vec<PoolStats>, CifError> {
        Ok(stats::refresh(&self.db, &self.pools).await?)
    }
}
