//! `cifpool bench reserve|refill` with tiny parameters on a test database: each writes its JSON with
//! positive figures. (The figures themselves mean nothing here: debug-ish build, fsync off.)

#[path = "../../tests/it/common/cluster.rs"]
mod common;

use cifpool_tools::bench::{BenchArgs, RawMode, Target, run_on};
use sqlx::postgres::PgConnectOptions;

fn positive(v: &serde_json::Value, what: &str) -> f64 {
    let x = v.as_f64().unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(x > 0.0, "{what} = {x}");
    x
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_and_refill_write_json_with_positive_figures() {
    cifpool::telemetry::init_logging(cifpool::config::LogFormat::Text, "warn");
    let db = common::fresh_database().await;
    let settings = common::test_settings(&db.url);
    let connect: PgConnectOptions = db.url.parse().unwrap();
    let out = tempfile::tempdir().unwrap();

    let mut args = BenchArgs::new(Target::Reserve);
    args.out = out.path().to_path_buf();
    args.duration = 1.0;
    args.concurrency = vec![1, 4];
    args.rate = 200.0;
    args.auth_concurrency = 2;
    args.guessing_clients = 4;
    args.raw = RawMode::Auto;
    // The test harness has no `bench-client`: the load generator is the tools binary Cargo built.
    args.client_bin = Some(env!("CARGO_BIN_EXE_cifpool-tools").into());
    args.no_progress = true;
    let path = run_on(&connect, &settings, &args).await.expect("bench reserve");
    assert_eq!(path, out.path().join("reserve.json"));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(json["target"], "reserve");
    positive(&json["machine"]["cores"], "cores");
    assert!(json["machine"]["postgres_version"].as_str().unwrap().starts_with("PostgreSQL"));
    let levels = json["results"]["levels"].as_array().unwrap();
    assert_eq!(levels.len(), 2);
    for level in levels {
        positive(&level["service"]["rate_per_s"], "service rate");
        positive(&level["service"]["latency"]["p99_ms"], "service p99");
        positive(&level["raw"]["rate_per_s"], "raw rate");
        positive(&level["service_over_raw"], "ratio");
        assert!(level["service"]["errors"].as_object().unwrap().is_empty(), "errors: {level}");
        // The load generator ran as a child process, and its CPU was watched.
        positive(&level["service"]["cpu"]["child_cores"], "load generator CPU");
    }
    assert_eq!(json["parameters"]["load_generator"]["kind"], "process");
    let auth = &json["results"]["auth"];
    for side in ["with_auth_per_s", "without_auth_per_s"] {
        let runs = auth[side].as_array().unwrap();
        assert_eq!(runs.len(), 2, "{auth}");
        for r in runs {
            positive(r, side);
        }
    }
    assert!(auth["overhead"].is_number(), "{auth}");
    let fixed = &json["results"]["fixed_rate"];
    positive(&fixed["achieved_rate"], "fixed-rate achieved");
    positive(&fixed["latency"]["p99_ms"], "fixed-rate p99");
    let guessing = &json["results"]["under_guessing"];
    positive(&guessing["fixed_rate"]["achieved_rate"], "fixed rate under guessing");
    positive(&guessing["guesses_per_s"], "guesses answered");
    let answers = guessing["guess_answers"].as_object().unwrap();
    assert!(!answers.is_empty() && answers.keys().all(|s| s == "401" || s == "429"), "{guessing}");
    assert!(json["notes"].as_array().unwrap().iter().all(|n| !n.as_str().unwrap().contains("accepted")), "{json}");

    let mut args = BenchArgs::new(Target::Refill);
    args.out = out.path().to_path_buf();
    args.refill_codes = 20_000;
    args.naive_rows = 300;
    args.no_progress = true;
    let path = run_on(&connect, &settings, &args).await.expect("bench refill");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(json["target"], "refill");
    let r = &json["results"];
    assert_eq!(r["refill"]["rows"], 20_000);
    assert_eq!(r["refill_batches"], 2);
    for key in ["refill", "copy", "naive_insert", "encode_only"] {
        positive(&r[key]["codes_per_s"], key);
    }
    positive(&r["refill_over_copy"], "refill/COPY");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_and_soak_write_json_with_clean_runs() {
    cifpool::telemetry::init_logging(cifpool::config::LogFormat::Text, "warn");
    let db = common::fresh_database().await;
    let settings = common::test_settings(&db.url);
    let connect: PgConnectOptions = db.url.parse().unwrap();
    let out = tempfile::tempdir().unwrap();

    let mut args = BenchArgs::new(Target::Queue);
    args.out = out.path().to_path_buf();
    args.jobs = 3_000;
    args.enqueue_jobs = 2_000;
    args.promo_jobs = 3_000;
    args.otp_rate = 20.0;
    args.tenants = 7;
    // The peer needs node, npm and (once) the npm registry: not in a test.
    args.no_peer = true;
    args.no_progress = true;
    let path = run_on(&connect, &settings, &args).await.expect("bench queue");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(json["target"], "queue");
    let r = &json["results"];
    assert_eq!(r["enqueue"]["accepted"], 2_000);
    positive(&r["enqueue"]["jobs_per_s"], "enqueue rate");
    // A clean drain: every job sent once, one result each.
    assert_eq!(r["drain"]["sent"], 3_000, "{r}");
    assert_eq!(r["drain"]["result_rows"], 3_000);
    assert_eq!(r["drain"]["attempts"], 3_000);
    positive(&r["drain"]["jobs_per_s"], "drain rate");
    // The claims that took the drain's jobs were counted by the group that ran them.
    let claimed: f64 = r["drain"]["claims"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["statements"].as_f64().unwrap() * g["jobs_per_statement"].as_f64().unwrap())
        .sum();
    assert!(claimed >= 3_000.0 - 0.5, "{}", r["drain"]["claims"]);
    let otp = &r["otp_during_promo"];
    assert_eq!(otp["promo_sent"], 3_000);
    assert!(otp["otp_enqueued"].as_u64().unwrap() >= 150, "{otp}");
    assert_eq!(otp["otp_sent"], otp["otp_enqueued"], "{otp}");
    positive(&otp["otp_wait"]["p99_ms"], "OTP wait p99");
    assert_eq!(
        (r["drain_peer"]["status"].as_str(), r["drain_peer"]["reason"].as_str()),
        (Some("skipped"), Some("--no-peer"))
    );
    assert!(r["cifpool_over_peer"].is_null(), "{r}");
    assert!(r["peer_postgres_us_per_job"].is_null(), "{r}");
    assert!(json["notes"].as_array().unwrap().len() == 2, "unexpected notes: {}", json["notes"]);

    let mut args = BenchArgs::new(Target::Soak);
    args.out = out.path().to_path_buf();
    args.minutes = 0.1;
    args.concurrency = vec![2];
    args.queue_rate = 500.0;
    args.no_progress = true;
    let path = run_on(&connect, &settings, &args).await.expect("bench soak");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(json["target"], "soak");
    let r = &json["results"];
    assert!(r["errors"].as_object().unwrap().is_empty(), "{r}");
    let end = r["tables_end"].as_array().unwrap();
    let live = |t: &str| end.iter().find(|x| x["table"] == t).unwrap()["live_rows"].as_i64().unwrap();
    assert!(live("cif_issued") > 0, "{r}");
    assert!(live("notification_jobs") > 0, "{r}");

    let mut args = BenchArgs::new(Target::Horizon);
    args.out = out.path().to_path_buf();
    (args.before_secs, args.hold_secs, args.after_secs, args.window_secs) = (3.0, 4.0, 3.0, 1.0);
    args.clients = 2;
    args.queue_rate = 500.0;
    args.no_progress = true;
    let path = run_on(&connect, &settings, &args).await.expect("bench horizon");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(json["target"], "horizon");
    let r = &json["results"];
    assert!(r["errors"].as_object().unwrap().is_empty(), "{r}");
    let (from, until) = (r["held_from_s"].as_f64().unwrap(), r["held_until_s"].as_f64().unwrap());
    assert!(from >= 3.0 && until - from >= 4.0, "held {from}..{until}");
    let windows = r["windows"].as_array().unwrap();
    let phases: Vec<&str> = windows.iter().map(|w| w["phase"].as_str().unwrap()).collect();
    assert!(
        phases.first() == Some(&"before") && phases.contains(&"hold") && phases.last() == Some(&"after"),
        "{phases:?}"
    );
    // The service's own probe sees the hold: the snapshot ages in the windows it spans.
    let oldest_in_hold = windows
        .iter()
        .filter(|w| w["phase"] == "hold")
        .map(|w| w["oldest_snapshot_s"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(oldest_in_hold >= 2.0, "{r}");
    // Promo drains throughout, so every window shows the claims of the group draining it.
    assert!(windows.iter().all(|w| w["claims"]["statements"].as_u64().is_some_and(|n| n > 0)), "{r}");
    positive(&r["before"]["sent_per_s"], "promo sent/s before the hold");
    positive(&r["before"]["reserve_p99_ms"], "reservation p99 before the hold");

    let mut args = BenchArgs::new(Target::Admin);
    args.out = out.path().to_path_buf();
    (args.finished_jobs, args.pending_jobs, args.dead_jobs) = (2_000, 500, 30);
    args.requests = 5;
    args.idle_secs = 1.0;
    args.no_progress = true;
    let path = run_on(&connect, &settings, &args).await.expect("bench admin");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(json["target"], "admin");
    let r = &json["results"];
    assert_eq!(r["rows"], 2_530, "{r}");
    let reads = r["reads"].as_array().unwrap();
    assert_eq!(reads.len(), 4, "{r}");
    for read in reads {
        assert_eq!(read["failed"], 0, "{read}");
        positive(&read["latency"]["p99_ms"], "a read's p99");
    }
}

/// The real thing on the embedded cluster (fsync on), until the CLI is wired:
/// `CIFPOOL_BENCH_OUT=bench-out cargo test --release --test bench_smoke -- --ignored --nocapture`.
#[test]
#[ignore = "a full benchmark run: minutes, release build"]
fn full_run_on_the_embedded_cluster() {
    cifpool::telemetry::init_logging(cifpool::config::LogFormat::Text, "warn");
    let mut settings = cifpool::config::Settings::load_with_env(None, Vec::new()).unwrap();
    let dir = std::env::temp_dir().join("cifpool-bench-cluster");
    cifpool::db::embedded::create_server_owned_dir(&dir).unwrap();
    settings.database.data_dir = dir.join("pg");
    let out = std::env::var("CIFPOOL_BENCH_OUT").unwrap_or_else(|_| "bench-out".into());
    let seconds: f64 = std::env::var("CIFPOOL_BENCH_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(5.0);
    for target in [Target::Reserve, Target::Refill] {
        let mut args = BenchArgs::new(target);
        args.out = out.clone().into();
        args.duration = seconds;
        args.no_progress = true;
        cifpool_tools::bench::run(&settings, &args).unwrap();
    }
}
