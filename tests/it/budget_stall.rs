//! The database stops answering for 5 s in the middle of a send storm (every process of its cluster
//! stopped with SIGSTOP, then SIGCONT): the provider's budget is never exceeded, nothing is lost, and
//! after the stall the send rate rises over seconds instead of stepping back to the maximum.
//!
//! This test runs its own Postgres (not the shared test cluster) because it freezes it.

use crate::common;

use std::path::Path;
use std::time::{Duration, Instant};

use cifpool::db::embedded::{EmbeddedOptions, EmbeddedPostgres, create_server_owned_dir};
use cifpool::internals::fake_provider::FakeBehaviour;
use common::{fake_server, spawn_app_with, test_settings_with_pools, use_fake_providers};
use serde_json::{Value, json};

/// Every process of the cluster in `data_dir`: the postmaster and its children.
fn cluster_pids(data_dir: &Path) -> Vec<i32> {
    let pid_file = std::fs::read_to_string(data_dir.join("postmaster.pid")).unwrap();
    let postmaster: i32 = pid_file.lines().next().unwrap().trim().parse().unwrap();
    let mut pids = vec![postmaster];
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // Fields after the parenthesised command: state, ppid, …
        let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("");
        if after.split_whitespace().nth(1).and_then(|p| p.parse::<i32>().ok()) == Some(postmaster) {
            pids.push(pid);
        }
    }
    pids
}

fn signal_all(pids: &[i32], signal: i32) {
    for pid in pids {
        // SAFETY: kill(2) on processes of the cluster this test started.
        unsafe { libc::kill(*pid, signal) };
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_stall_keeps_the_budget_loses_nothing_and_recovery_is_paced() {
    let base = std::env::temp_dir().join(format!("cifpool-stall-{}", std::process::id()));
    create_server_owned_dir(&base).unwrap();
    let options = EmbeddedOptions {
        data_dir: base.join("pg"),
        durable: false,
        max_connections: 100,
        remove_on_exit: Some(base.clone()),
        settings: Vec::new(),
    };
    let pg = EmbeddedPostgres::start(&options).unwrap();
    let sms = fake_server(FakeBehaviour { latency_ms: 20, ..Default::default() }).await;
    let mut apps = Vec::new();
    for _ in 0..2 {
        let mut s = test_settings_with_pools(&pg.url("postgres"));
        use_fake_providers(&mut s, &sms, &sms);
        let p = s.queue.providers.get_mut("sms").unwrap();
        (p.max_concurrency, p.min_concurrency) = (20, 2);
        s.queue.workers = 64;
        s.queue.reserved = 4;
        s.queue.lease = Duration::from_secs(6);
        s.database.acquire_timeout = Duration::from_secs(30);
        // Not a test of backpressure: right after the first 1,500 jobs the drain rate is averaged over
        // a mostly idle window, so the second 1,500 could be refused as overload (429 in one CI run).
        s.queue.overload = cifpool::config::OverloadMode::Observe;
        apps.push(spawn_app_with(s).await);
    }
    let jobs = 3_000;
    for chunk in (0..jobs).collect::<Vec<_>>().chunks(1500) {
        let batch: Vec<Value> = chunk.iter().map(|i| json!({ "recipient": format!("+8490{i:07}") })).collect();
        let r = apps[0].client.post(apps[0].url("/v1/notifications/batch"));
        let r = r.json(&json!({ "class": "transactional", "tenant": "bank", "jobs": batch })).send().await.unwrap();
        assert_eq!(r.status(), 202);
    }
    // Freeze the database only once the sends are flowing (on a loaded machine the pods take a while).
    let flowing_by = Instant::now() + Duration::from_secs(30);
    while sms.fake.report().calls < 200 {
        assert!(Instant::now() < flowing_by, "sends never got going: {:?}", sms.fake.report());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pids = cluster_pids(&options.data_dir);
    signal_all(&pids, libc::SIGSTOP);
    tokio::time::sleep(Duration::from_secs(5)).await;
    signal_all(&pids, libc::SIGCONT);
    let resumed = sms.fake.elapsed();
    let back = Instant::now();

    // The deployment's limit for the provider, about every 250 ms for 8 s after the database came
    // back, each sample with its time (a loaded machine stretches the cadence: pick samples by time).
    let db = sqlx::PgPool::connect(&pg.url("postgres")).await.unwrap();
    let mut limits: Vec<(Duration, f64)> = Vec::new();
    while back.elapsed() < Duration::from_secs(8) {
        let limit: f64 = sqlx::query_scalar("SELECT limit_now FROM provider_budgets WHERE provider = 'sms'")
            .fetch_one(&db)
            .await
            .unwrap();
        limits.push((back.elapsed(), limit));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let finished_by = Instant::now() + Duration::from_secs(120);
    loop {
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM notification_jobs WHERE finished_at IS NOT NULL")
            .fetch_one(&db)
            .await
            .unwrap();
        if done == jobs as i64 {
            break;
        }
        assert!(Instant::now() < finished_by, "{done} of {jobs} finished");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (sent, results): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE status = 'sent'), (SELECT count(*) FROM notification_results) FROM notification_jobs",
    )
    .fetch_one(&db)
    .await
    .unwrap();
    assert_eq!((sent, results), (jobs as i64, jobs as i64), "every job sent, one result each");
    let report = sms.fake.report();
    assert!(report.peak_in_flight <= 20, "the provider saw {} calls at once (budget 20)", report.peak_in_flight);

    // The recovery curve: calls per second after the database came back.
    let arrivals = sms.fake.arrivals();
    let per_second: Vec<usize> = (0..8)
        .map(|s| {
            let from = resumed + Duration::from_secs(s);
            arrivals.iter().filter(|t| **t >= from && **t < from + Duration::from_secs(1)).count()
        })
        .collect();
    eprintln!("calls per second after the stall: {per_second:?}; peak in flight {}", report.peak_in_flight);
    let whole: Vec<usize> = (0..(arrivals.last().unwrap().as_secs() + 1))
        .map(|s| arrivals.iter().filter(|t| t.as_secs() == s).count())
        .collect();
    eprintln!(
        "calls per second over the run (stall from {:?} to {resumed:?}): {whole:?}",
        resumed - Duration::from_secs(5)
    );
    let rounded: Vec<(f64, f64)> =
        limits.iter().map(|(t, l)| ((t.as_secs_f64() * 100.0).round() / 100.0, (l * 10.0).round() / 10.0)).collect();
    eprintln!("sms limit (seconds after the stall, limit): {rounded:?}");
    // Restarted at the floor (2) within the first second, then rising over seconds, not stepping to 20.
    let low = limits.iter().filter(|(t, _)| *t < Duration::from_secs(1)).map(|(_, l)| *l).fold(f64::MAX, f64::min);
    assert!(low <= 4.0, "the limit restarts near the floor after a stall: {rounded:?}");
    let at_2s = limits.iter().find(|(t, _)| *t >= Duration::from_secs(2)).expect("a sample at 2 s").1;
    let at_8s = limits.last().unwrap().1;
    assert!(at_2s < 12.0, "two seconds after the stall the limit is still rising: {rounded:?}");
    // Regrowth is paced (~0.6 a second here, more with successes): rising, and still far from the
    // maximum six seconds later.
    assert!(at_8s >= at_2s + 2.0, "the limit regrows over the following seconds: {rounded:?}");
    assert!(at_8s < 16.0, "the limit regrows gradually, not in a step: {rounded:?}");
    db.close().await;
    for app in apps {
        app.stop().await;
    }
    drop(pg);
}
