//! The first phase of `bench queue`: one `POST /v1/notifications/batch` of N promo jobs (spread over T
//! tenants) to a service whose workers are off, timed from sending the body (prebuilt, ~32 bytes a job)
//! to the `202`, so parsing, validation, fair keys and the inserts all count; then the cancel of that
//! batch. Also the batch body and request the other phases fill the queue with.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sqlx::PgPool;

use super::queue::QueueBenchOptions;

/// The bulk-enqueue phase.
#[derive(Debug, Clone, Serialize)]
pub struct EnqueueResult {
    /// Jobs in the one batch request.
    pub jobs: u64,
    /// Jobs the service reported accepted.
    pub accepted: u64,
    /// Request body size.
    pub body_bytes: usize,
    /// From sending the request to the response.
    pub seconds: f64,
    /// `accepted / seconds`.
    pub jobs_per_s: f64,
    /// Jobs `POST /v1/notifications/batches/{id}/cancel` then canceled (all of them: no worker runs).
    pub canceled: u64,
    /// From sending the cancel to its answer.
    pub cancel_seconds: f64,
}

/// A batch request body: `n` jobs of `class`, tenants `t000…` round robin.
pub fn batch_body(class: &str, n: u64, tenants: usize, tag: &str) -> Vec<u8> {
    let mut s = String::with_capacity(n as usize * 80 + 64);
    write!(s, r#"{{"class":"{class}","jobs":["#).expect("write to a String");
    for i in 0..n {
        if i > 0 {
            s.push(',');
        }
        write!(
            s,
            r#"{{"tenant":"t{:03}","recipient":"device-{tag}-{i}","payload":{{"title":"Sale","n":{i}}}}}"#,
            i % tenants as u64
        )
        .expect("write to a String");
    }
    s.push_str("]}");
    s.into_bytes()
}

/// Posts a batch; returns the time to the answer, the jobs accepted and the batch id.
pub(crate) async fn post_batch(
    client: &reqwest::Client,
    base: &str,
    body: Vec<u8>,
) -> anyhow::Result<(Duration, u64, i64)> {
    let started = Instant::now();
    let resp = client
        .post(format!("{base}/v1/notifications/batch"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .context("posting the batch")?;
    let status = resp.status();
    let text = resp.text().await?;
    let elapsed = started.elapsed();
    anyhow::ensure!(status.as_u16() == 202, "batch refused: {status} {text}");
    let body: serde_json::Value = serde_json::from_str(&text)?;
    Ok((elapsed, body["accepted"].as_u64().unwrap_or(0), body["batch_id"].as_i64().unwrap_or(0)))
}

/// Cancels batch `id`; returns the time to the answer and the jobs canceled.
async fn cancel_batch(client: &reqwest::Client, base: &str, id: i64) -> anyhow::Result<(Duration, u64)> {
    let started = Instant::now();
    let resp = client
        .post(format!("{base}/v1/notifications/batches/{id}/cancel"))
        .send()
        .await
        .context("canceling the batch")?;
    let status = resp.status();
    let text = resp.text().await?;
    let elapsed = started.elapsed();
    anyhow::ensure!(status.as_u16() == 200, "batch cancel refused: {status} {text}");
    let body: serde_json::Value = serde_json::from_str(&text)?;
    Ok((elapsed, body["canceled"].as_u64().unwrap_or(0)))
}

pub(crate) async fn enqueue_phase(
    client: &reqwest::Client,
    base: &str,
    db: &PgPool,
    opts: &QueueBenchOptions,
) -> anyhow::Result<EnqueueResult> {
    let body = batch_body("promo", opts.enqueue_jobs, opts.tenants, "e");
    super::checkpoint(db).await;
    let body_bytes = body.len();
    let bar = super::bar(opts.progress, "enqueue (one batch)", 1, "request");
    let (elapsed, accepted, batch_id) = post_batch(client, base, body).await?;
    bar.inc(1);
    bar.finish();
    super::checkpoint(db).await;
    let (cancel_elapsed, canceled) = cancel_batch(client, base, batch_id).await?;
    Ok(EnqueueResult {
        jobs: opts.enqueue_jobs,
        accepted,
        body_bytes,
        seconds: elapsed.as_secs_f64(),
        jobs_per_s: accepted as f64 / elapsed.as_secs_f64(),
        canceled,
        cancel_seconds: cancel_elapsed.as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_body_is_valid_json_with_round_robin_tenants() {
        let body = batch_body("promo", 5, 2, "x");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["class"], "promo");
        let jobs = v["jobs"].as_array().unwrap();
        assert_eq!(jobs.len(), 5);
        assert_eq!(jobs[0]["tenant"], "t000");
        assert_eq!(jobs[3]["tenant"], "t001");
        assert_eq!(jobs[4]["recipient"], "device-x-4");
    }
}
