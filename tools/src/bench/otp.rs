//! The third phase of `bench queue`: OTPs arriving one request at a time while a promo backlog drains
//! under `floor-borrow` (the isolation the worker groups exist for). A promo batch is enqueued with the
//! workers off, the worker instance starts, and OTPs arrive at a fixed rate (open loop) until the
//! backlog is drained (at least 10 s). The OTP wait is `picked_at − created_at` (queue time) and
//! `sent_at − created_at` (to the provider's acceptance), from the database's own clock.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use tokio_util::sync::CancellationToken;

use super::db_now;
use super::queue::{QueueBenchOptions, fill, unfinished, watch};
use super::report::Latency;
use crate::load::{Schedule, Tally, fixed_rate, post_json};
use cifpool::config::Settings;

/// The OTP-during-promo phase.
#[derive(Debug, Clone, Serialize)]
pub struct OtpResult {
    /// Promo backlog at the start.
    pub promo_jobs: u64,
    /// Promo jobs sent by the end.
    pub promo_sent: u64,
    /// From just before the worker instance was built to the last promo `finished_at`.
    pub promo_seconds: f64,
    /// OTPs requested per second.
    pub otp_rate: f64,
    /// OTPs accepted (HTTP 202).
    pub otp_enqueued: u64,
    /// OTPs sent.
    pub otp_sent: u64,
    /// OTPs that expired unsent (deadline 15 s).
    pub otp_expired: u64,
    /// Non-202 responses to OTP requests, by status.
    pub otp_errors: BTreeMap<String, u64>,
    /// Enqueue → claimed.
    pub otp_wait: Option<Latency>,
    /// Enqueue → accepted by the provider.
    pub otp_to_sent: Option<Latency>,
}

pub(crate) async fn otp_phase(
    client: &reqwest::Client,
    base: &str,
    db: &PgPool,
    connect: &PgConnectOptions,
    settings: &Settings,
    opts: &QueueBenchOptions,
) -> anyhow::Result<OtpResult> {
    let n = opts.promo_jobs;
    fill(client, base, db, n, opts.tenants).await?;
    let bar = super::bar(opts.progress, "promo drain + OTPs", n, "jobs");
    let started = Instant::now();
    let start = db_now(db).await?;
    let workers = super::start_service(connect, settings.clone()).await?;
    let stop_otp = CancellationToken::new();
    let otps = tokio::spawn(otp_load(client.clone(), base.to_string(), opts.otp_rate, stop_otp.clone()));
    // At least 10 s of OTPs even if promo drains sooner, so the percentiles rest on ~100 samples.
    let drained = watch(db, "promo", n, &bar, Duration::from_secs(600).max(Duration::from_millis(n))).await;
    let min_end = started + Duration::from_secs(10);
    tokio::time::sleep_until(min_end.into()).await;
    stop_otp.cancel();
    let otp_tally = otps.await.context("OTP load task")?;
    let (otp_enqueued, otp_errors) = (otp_tally.ok(), otp_tally.errors);
    // The last OTPs need a moment to be sent.
    let finish_by = Instant::now() + Duration::from_secs(20);
    while unfinished(db, "otp").await? > 0 && Instant::now() < finish_by {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    super::stop_service(workers).await;
    bar.finish();
    drained?;
    let (promo_sent, promo_last): (i64, Option<chrono::DateTime<chrono::Utc>>) = sqlx::query_as(
        "SELECT count(*), max(finished_at) FROM notification_jobs WHERE class = 'promo' AND status = 'sent'",
    )
    .fetch_one(db)
    .await?;
    let promo_seconds = promo_last.map_or(f64::NAN, |l| (l - start).as_seconds_f64());
    let rows: Vec<(String, Option<i64>, Option<i64>)> = sqlx::query_as(
        "SELECT j.status, \
                (extract(epoch FROM j.picked_at - j.created_at) * 1e6)::int8, \
                (extract(epoch FROM r.sent_at - j.created_at) * 1e6)::int8 \
         FROM notification_jobs j LEFT JOIN notification_results r ON r.job_id = j.id \
         WHERE j.class = 'otp'",
    )
    .fetch_all(db)
    .await?;
    let micros = |v: Option<i64>| v.map(|x| x.max(0) as u64);
    Ok(OtpResult {
        promo_jobs: n,
        promo_sent: promo_sent as u64,
        promo_seconds,
        otp_rate: opts.otp_rate,
        otp_enqueued,
        otp_sent: rows.iter().filter(|r| r.0 == "sent").count() as u64,
        otp_expired: rows.iter().filter(|r| r.0 == "expired").count() as u64,
        otp_errors,
        otp_wait: Latency::from_micros(rows.iter().filter_map(|r| micros(r.1)).collect()),
        otp_to_sent: Latency::from_micros(rows.iter().filter_map(|r| micros(r.2)).collect()),
    })
}

/// Posts one OTP every `1/rate` s (open loop: a slow answer does not delay the next) until `stop`;
/// a success is a 202.
async fn otp_load(client: reqwest::Client, base: String, rate: f64, stop: CancellationToken) -> Tally {
    let url = format!("{base}/v1/notifications");
    let schedule = Schedule { rate: rate.max(0.01), origin: tokio::time::Instant::now(), calls: None };
    fixed_rate(schedule, stop, Arc::default(), |i| {
        let body = format!(
            r#"{{"class":"otp","tenant":"bank","recipient":"+8490{i:07}","payload":{{"code":"{:06}"}}}}"#,
            i % 1_000_000
        );
        let (client, url) = (client.clone(), url.clone());
        async move { post_json(&client, &url, body, 202, "").await }
    })
    .await
}
