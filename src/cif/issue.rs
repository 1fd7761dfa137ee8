//! The CIF operations the API offers, with their bookkeeping: a reservation is timed and counted and
//! triggers a depth check; a claim that finds the pool empty is counted and starts a refill; a
//! confirmation is counted. Handlers call these; the SQL lives in [`crate::cif::store`].

use std::sync::Arc;
use std::time::Instant;

use sqlx::PgPool;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::audit::Actor;
use crate::cif::coalesce::{Coalescer, Shared};
use crate::cif::store::{self, By, Confirmed, Reserved};
use crate::cif::{Pool, upkeep};

/// Reserves one code of `pool` for `holder` on behalf of `actor`: without an idempotency key through
/// the pool's shared claim statements ([`crate::cif::coalesce`]), with one alone (see
/// [`store::reserve`]).
#[tracing::instrument(name = "claim", skip_all, fields(pool = pool.name()))]
pub async fn reserve(
    db: &PgPool,
    pool: &Arc<Pool>,
    holder: Option<&str>,
    idempotency_key: Option<&str>,
    actor: &Actor,
    upkeep: &TaskTracker,
) -> Result<Reserved, sqlx::Error> {
    let started = Instant::now();
    let outcome = match idempotency_key {
        None => {
            let coalescer = pool.coalescer.get_or_init(|| Coalescer::start(db.clone(), Arc::downgrade(pool)));
            if coalescer.idle() {
                metrics::histogram!("cifpool_reservation_batch_size", "pool" => pool.name().to_string()).record(1.0);
                let alone = store::reserve(db, pool, holder, None, actor).await;
                coalescer.done_alone();
                alone?
            } else {
                let request = store::Request { holder: holder.map(str::to_string), actor: actor.clone() };
                match coalescer.reserve(request).await {
                    Shared::Reserved(r) => Reserved::Created(r),
                    Shared::Empty => Reserved::Empty,
                    Shared::RetryAlone => store::reserve(db, pool, holder, None, actor).await?,
                }
            }
        }
        Some(_) => store::reserve(db, pool, holder, idempotency_key, actor).await?,
    };
    let name = pool.name().to_string();
    metrics::histogram!("cifpool_reservation_duration_seconds", "pool" => name.clone())
        .record(started.elapsed().as_secs_f64());
    match &outcome {
        Reserved::Created(_) => {
            metrics::counter!("cifpool_reservations_total", "pool" => name).increment(1);
            upkeep::after_claim(db, pool, upkeep);
        }
        Reserved::Empty => {
            metrics::counter!("cifpool_pool_empty_total", "pool" => name).increment(1);
            upkeep::on_empty(db, pool, upkeep);
        }
        Reserved::Replayed(_) | Reserved::KeyReused { .. } => {}
    }
    Ok(outcome)
}

/// Confirms the code at `counter` for its holder `token` (see [`store::confirm`]); counts first
/// confirmations, not retried ones.
pub async fn confirm(
    db: &PgPool,
    pool: &Pool,
    counter: i64,
    token: Uuid,
    customer_ref: Option<&str>,
    by: By<'_>,
) -> Result<Confirmed, sqlx::Error> {
    let outcome = store::confirm(db, pool, counter, token, customer_ref, by).await?;
    if let Confirmed::Now(_) = outcome {
        metrics::counter!("cifpool_confirmations_total", "pool" => pool.name().to_string()).increment(1);
    }
    Ok(outcome)
}
