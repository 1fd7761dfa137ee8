//! The streaming batch intake (`POST /v1/notifications/batch`): bodies sent in many pieces and large
//! enough to span several COPY chunks, a bad job or a broken body late in the stream (nothing left
//! behind), idempotency keys across chunk boundaries, and defaults given after the jobs.

use crate::common;

use std::fmt::Write as _;
use std::time::Duration;

use common::assert_problem;
use common::queue_env::{Env, env, env_with};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A batch body of `n` jobs of `class` for tenant `shop`, with `job(i)` giving each job's extra fields.
fn batch_body(n: usize, job: impl Fn(usize) -> String) -> String {
    let mut s = String::from(r#"{"class":"promo","tenant":"shop","jobs":["#);
    for i in 0..n {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, r#"{{"recipient":"device-{i}","payload":{{"title":"Sale","n":{i}}}{}}}"#, job(i));
    }
    s.push_str("]}");
    s
}

/// The status line and body of the answer to `body` posted in `pieces` pieces of chunked transfer
/// encoding (a client streaming its batch). With `cut`, the body stops after that many bytes and the
/// connection's write half is closed, as by a client that dies mid-upload.
async fn post_in_pieces(e: &Env, body: &[u8], pieces: usize, cut: Option<usize>) -> (u16, Value) {
    let addr = e.app.base.trim_start_matches("http://").to_string();
    let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let framing = if cut.is_some() {
        format!("Content-Length: {}", body.len())
    } else {
        "Transfer-Encoding: chunked".to_string()
    };
    let head = format!(
        "POST /v1/notifications/batch HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\n{framing}\r\nConnection: close\r\n\r\n",
        e.app.key
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    if let Some(cut) = cut {
        conn.write_all(&body[..cut]).await.unwrap();
        conn.shutdown().await.unwrap();
    } else {
        for piece in body.chunks(body.len().div_ceil(pieces)) {
            conn.write_all(format!("{:x}\r\n", piece.len()).as_bytes()).await.unwrap();
            conn.write_all(piece).await.unwrap();
            conn.write_all(b"\r\n").await.unwrap();
        }
        conn.write_all(b"0\r\n\r\n").await.unwrap();
    }
    let mut answer = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(30), conn.read_to_end(&mut answer))
        .await
        .expect("no answer within 30 s")
        .unwrap();
    let answer = String::from_utf8(answer).unwrap();
    let status = answer[9..12].parse().unwrap();
    let json = answer.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
    // A chunked answer: the JSON is the first line that starts with `{`.
    let json = json.lines().find(|l| l.starts_with('{')).unwrap_or("null");
    (status, serde_json::from_str(json).unwrap_or(Value::Null))
}

async fn nothing_left(e: &Env) {
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs").await, 0, "no job stays");
    assert_eq!(e.count("SELECT count(*) FROM notification_batches").await, 0, "no batch stays");
    assert_eq!(e.count("SELECT count(*) FROM notification_tenant_clock").await, 0, "no clock moved");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_sent_in_many_pieces_spanning_many_copy_chunks_is_stored_whole_in_order() {
    let e = env().await;
    let n = 100_000;
    let body = batch_body(n, |i| if i % 7 == 0 { r#","tenant":"bank""#.to_string() } else { String::new() });
    assert!(body.len() > 3 * cifpool::internals::batch::CHUNK_BYTES, "spans several COPY chunks");
    let (status, answer) = post_in_pieces(&e, body.as_bytes(), 2_000, None).await;
    assert_eq!(status, 202, "{answer}");
    assert_eq!((answer["accepted"].as_u64(), answer["duplicates"].as_u64()), (Some(n as u64), Some(0)));
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs").await, n as i64);
    // Ids follow the request's order, and so do each tenant's fair keys.
    let recipients: Vec<String> = e.opened().await.into_iter().map(|(_, recipient, _)| recipient).collect();
    let out_of_order = recipients.iter().enumerate().filter(|(i, r)| **r != format!("device-{i}")).count();
    assert_eq!((recipients.len(), out_of_order), (n, 0));
    let keys_back = e
        .count(
            "SELECT count(*) FROM (SELECT fair_key < lag(fair_key) OVER (PARTITION BY tenant ORDER BY id) AS back \
             FROM notification_jobs) r WHERE back",
        )
        .await;
    assert_eq!(keys_back, 0);
    let batch_id = answer["batch_id"].as_i64().unwrap();
    let (jobs, tenants): (i64, Vec<String>) =
        sqlx::query_as("SELECT jobs, tenants FROM notification_batches WHERE id = $1")
            .bind(batch_id)
            .fetch_one(&e.db.pool)
            .await
            .unwrap();
    assert_eq!((jobs, tenants), (n as i64, vec!["bank".to_string(), "shop".to_string()]));
    let keys: Vec<(String, i64)> =
        sqlx::query_as("SELECT tenant, count(DISTINCT fair_key) FROM notification_jobs GROUP BY 1 ORDER BY 1")
            .fetch_all(&e.db.pool)
            .await
            .unwrap();
    assert_eq!(keys, [("bank".into(), n.div_ceil(7) as i64), ("shop".into(), (n - n.div_ceil(7)) as i64)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_job_at_the_end_of_a_large_streamed_batch_refuses_it_all_naming_the_job() {
    let e = env().await;
    let n = 100_000;
    let body = batch_body(n, |i| if i == n - 1 { r#","idempotency_key":"""#.to_string() } else { String::new() });
    let (status, problem) = post_in_pieces(&e, body.as_bytes(), 500, None).await;
    assert_eq!(status, 422, "{problem}");
    assert!(problem["detail"].as_str().unwrap().starts_with("jobs[99999]: idempotency_key"), "{problem}");
    nothing_left(&e).await;
    // The first bad job is named, not a later one.
    let body = batch_body(n, |i| match i {
        70_000 => r#","recipient":"""#.to_string(),
        90_000 => r#","class":"carrier-pigeon""#.to_string(),
        _ => String::new(),
    });
    let (status, problem) =
        post_in_pieces(&e, body.replace(r#""recipient":"device-70000","#, "").as_bytes(), 50, None).await;
    assert_eq!(status, 422, "{problem}");
    assert!(problem["detail"].as_str().unwrap().starts_with("jobs[70000]: recipient"), "{problem}");
    nothing_left(&e).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_cut_off_or_malformed_mid_stream_is_400_and_leaves_nothing() {
    let e = env().await;
    let body = batch_body(60_000, |_| String::new());
    let (status, problem) = post_in_pieces(&e, body.as_bytes(), 1, Some(body.len() * 3 / 4)).await;
    assert_eq!(status, 400, "{problem}");
    assert_eq!(problem["type"], "urn:cifpool:problem:bad-request");
    nothing_left(&e).await;
    // Broken JSON deep in the stream, after valid jobs that were already copied.
    let broken = body.replacen(r#"{"recipient":"device-50000""#, r#"{"recipient" "device-50000""#, 1);
    let (status, problem) = post_in_pieces(&e, broken.as_bytes(), 100, None).await;
    assert_eq!(status, 400, "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("not valid JSON"), "{problem}");
    nothing_left(&e).await;
    // JSON that simply stops.
    let (status, problem) = post_in_pieces(&e, &body.as_bytes()[..body.len() / 2], 10, None).await;
    assert_eq!(status, 400, "{problem}");
    nothing_left(&e).await;
    // A job of the wrong shape is a 422 naming it.
    let shape = body.replacen(r#""n":40000}"#, r#""n":40000},"run_at":7"#, 1);
    let (status, problem) = post_in_pieces(&e, shape.as_bytes(), 100, None).await;
    assert_eq!(status, 422, "{problem}");
    assert!(problem["detail"].as_str().unwrap().starts_with("jobs[40000]: invalid type"), "{problem}");
    nothing_left(&e).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_body_past_the_batch_body_limit_is_413_and_leaves_nothing() {
    let e = env_with(|s| s.queue.batch_body_limit_bytes = 1 << 20).await;
    let body = batch_body(40_000, |_| String::new());
    let (status, problem) = post_in_pieces(&e, body.as_bytes(), 200, None).await;
    assert_eq!(status, 413, "{problem}");
    assert!(problem["detail"].as_str().unwrap().contains("batch_body_limit_bytes"), "{problem}");
    nothing_left(&e).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_hold_across_chunk_boundaries_and_against_existing_jobs() {
    let e = env().await;
    let r = e
        .app
        .client
        .post(e.app.url("/v1/notifications"))
        .json(&json!({ "class": "promo", "tenant": "shop", "recipient": "x", "idempotency_key": "k-5" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    // Job i and job i + 30,000 share a key, far apart in the stream (different COPY chunks).
    let n = 60_000;
    let body = batch_body(n, |i| format!(r#","idempotency_key":"k-{}""#, i % 30_000));
    let (status, answer) = post_in_pieces(&e, body.as_bytes(), 300, None).await;
    assert_eq!(status, 202, "{answer}");
    assert_eq!(answer["accepted"], 29_999, "{answer}");
    assert_eq!(answer["duplicates"], n - 29_999, "{answer}");
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs").await, 30_000);
    // The first of each pair was kept.
    let recipients: Vec<String> = e.opened().await.into_iter().map(|(_, recipient, _)| recipient).collect();
    assert_eq!(recipients.iter().filter(|r| *r == "device-30001").count(), 0);
    assert_eq!(recipients.iter().filter(|r| *r == "device-1").count(), 1);
    // The same batch again: all duplicates.
    let (status, answer) = post_in_pieces(&e, body.as_bytes(), 3, None).await;
    assert_eq!((status, answer["accepted"].as_u64(), answer["duplicates"].as_u64()), (202, Some(0), Some(n as u64)));
}

#[tokio::test]
async fn defaults_after_the_jobs_apply_and_their_checks_name_the_first_job_they_concern() {
    let e = env().await;
    let post = |body: &'static str| {
        e.app
            .client
            .post(e.app.url("/v1/notifications/batch"))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    // `class` and `tenant` after `jobs`: job 0 names its own tenant, job 1 takes the default.
    let r = post(r#"{"jobs":[{"recipient":"a","tenant":"bank"},{"recipient":"b"}],"tenant":"shop","class":"promo"}"#);
    let r = r.await.unwrap();
    assert_eq!(r.status(), 202);
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT tenant, class FROM notification_jobs ORDER BY id").fetch_all(&e.db.pool).await.unwrap();
    assert_eq!(rows, [("bank".into(), "promo".into()), ("shop".into(), "promo".into())]);
    let recipients: Vec<String> = e.opened().await.into_iter().map(|(_, recipient, _)| recipient).collect();
    assert_eq!(recipients, ["a", "b"]);
    // An unknown default class fails the first job that takes it, not an earlier one naming its own.
    let r = post(
        r#"{"tenant":"t","jobs":[{"recipient":"a","class":"otp"},{"recipient":"b"},{"recipient":""}],"class":"pigeon"}"#,
    );
    let p = assert_problem(r.await.unwrap(), 422).await;
    assert!(p["detail"].as_str().unwrap().starts_with("jobs[1]: unknown class"), "{p}");
    // A late default `run_at` past the OTP deadline fails the first OTP job without its own.
    let at = (chrono::Utc::now() + chrono::Duration::minutes(5)).to_rfc3339();
    let body = format!(
        r#"{{"tenant":"t","jobs":[{{"recipient":"a","class":"promo"}},{{"recipient":"b","class":"otp"}}],"run_at":"{at}"}}"#
    );
    let r =
        e.app.client.post(e.app.url("/v1/notifications/batch")).header("content-type", "application/json").body(body);
    let p = assert_problem(r.send().await.unwrap(), 422).await;
    assert!(p["detail"].as_str().unwrap().starts_with("jobs[1]: run_at"), "{p}");
    assert_eq!(e.count("SELECT count(*) FROM notification_jobs").await, 2, "only the first batch");
    // Without a JSON content type: 415, as before.
    let r = e.app.client.post(e.app.url("/v1/notifications/batch")).body(r#"{"jobs":[]}"#).send().await.unwrap();
    assert_problem(r, 415).await;
    tokio::time::sleep(Duration::from_millis(1)).await;
}
