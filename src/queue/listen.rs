//! The LISTEN relay: `NOTIFY cifpool_jobs` (sent when jobs are enqueued) wakes idle claimers at once
//! instead of at their next poll.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::queue::runtime::QueueRuntime;

/// Relays `NOTIFY cifpool_jobs` to idle claimers until `stop` (polling covers any gap).
pub async fn relay(db: PgPool, runtime: Arc<QueueRuntime>, stop: CancellationToken) {
    loop {
        let mut listener = match sqlx::postgres::PgListener::connect_with(&db).await {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = %e, "LISTEN unavailable; claimers poll");
                tokio::select! { _ = stop.cancelled() => return, _ = tokio::time::sleep(Duration::from_secs(2)) => continue }
            }
        };
        if listener.listen("cifpool_jobs").await.is_err() {
            tokio::select! { _ = stop.cancelled() => return, _ = tokio::time::sleep(Duration::from_secs(2)) => continue }
        }
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                n = listener.recv() => match n {
                    Ok(_) => runtime.wake.notify_waiters(),
                    Err(_) => break,
                },
            }
        }
    }
}
