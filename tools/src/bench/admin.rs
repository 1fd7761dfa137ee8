//! `cifpool-tools bench admin`: what operators read, on a queue the size of a busy week, and what the
//! service's periodic work costs while nothing else happens.
//!
//! Method, on the scratch database: `finished` sent jobs spread over the last six days, `pending` promo
//! jobs waiting and `dead` dead letters, over `tenants` tenants, are written straight into the jobs
//! table (one `INSERT … SELECT` each), which is then `VACUUM ANALYZE`d and checkpointed. One service
//! instance starts on it with its worker groups off (so the backlog stays) and every other background
//! task on as in production (statistics, sweeps, staging, gauges, budgets, the horizon probe). Once its
//! statistics have counted the queue:
//! - **reads**: `requests` sequential requests to each of `GET /admin/queue`, `GET /metrics`, the
//!   console's Queue page and its Dead letters page (signed in with the bench's key), timed at the
//!   client; goal p99 ≤ 100 ms each;
//! - **idle**: for `idle` seconds nothing is asked of the service; the CPU that Postgres and the
//!   service's process use meanwhile is its periodic work; goal ≤ 5 % of one core.

use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use super::cpu::{CpuSplit, CpuWatch};
use super::report::{BenchReport, Latency, Machine, ms, table as text_table, thousands};
use super::{BenchArgs, use_noop_providers};
use cifpool::config::Settings;

/// The p99 goal of each read, milliseconds.
pub const READ_GOAL_MS: f64 = 100.0;
/// The goal of the periodic work while idle, in cores.
pub const IDLE_GOAL_CORES: f64 = 0.05;

/// Parameters of an `admin` run.
#[derive(Debug, Clone, Serialize)]
pub struct AdminOptions {
    /// Sent jobs in the history.
    pub finished: u64,
    /// Promo jobs waiting.
    pub pending: u64,
    /// Dead letters.
    pub dead: u64,
    /// Tenants the jobs are spread over.
    pub tenants: usize,
    /// Requests per endpoint.
    pub requests: usize,
    /// Seconds of the idle window.
    pub idle_s: f64,
}

impl AdminOptions {
    /// From the command line.
    pub fn from_args(args: &BenchArgs) -> AdminOptions {
        AdminOptions {
            finished: args.finished_jobs,
            pending: args.pending_jobs,
            dead: args.dead_jobs,
            tenants: args.tenants.max(1),
            requests: args.requests.max(1),
            idle_s: args.idle_secs,
        }
    }
}

/// One endpoint's latency.
#[derive(Debug, Clone, Serialize)]
pub struct Read {
    /// What was asked for (method and path).
    pub endpoint: String,
    /// Client-side latency of the requests that answered 200.
    pub latency: Option<Latency>,
    /// Requests that did not answer 200.
    pub failed: u64,
}

/// Everything `bench admin` measured.
#[derive(Debug, Clone, Serialize)]
pub struct AdminResults {
    /// Seconds the rows took to write, vacuum and checkpoint.
    pub load_s: f64,
    /// Rows in the jobs table when the reads ran.
    pub rows: i64,
    /// Seconds the statistics' first count took (`queue_class_stats.counting_s`).
    pub counting_s: f64,
    /// Each endpoint.
    pub reads: Vec<Read>,
    /// CPU while idle.
    pub idle: Option<CpuSplit>,
    /// Postgres and the service's process together while idle, in cores.
    pub idle_cores: Option<f64>,
}

/// Runs the bench on the scratch database behind `connect`.
pub async fn run(
    connect: &PgConnectOptions,
    settings: &Settings,
    opts: &AdminOptions,
) -> anyhow::Result<BenchReport<AdminResults>> {
    let untimed = connect.clone().options([("statement_timeout", "0")]);
    let harness = PgPoolOptions::new().max_connections(2).connect_with(untimed).await?;
    let machine = Machine::probe(&harness).await?;
    let loading = Instant::now();
    load(&harness, opts).await?;
    let load_s = loading.elapsed().as_secs_f64();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM notification_jobs").fetch_one(&harness).await?;

    let mut app = settings.clone();
    use_noop_providers(&mut app);
    app.queue.workers_enabled = false;
    app.pools = vec![super::bench_pool("admin", "7", 1_000, 1)];
    let service = super::start_service(connect, app).await?;
    let deadline = Instant::now() + Duration::from_secs(300);
    let counting_s = loop {
        let took: Option<f64> =
            sqlx::query_scalar("SELECT max(counting_s) FROM queue_class_stats").fetch_one(&harness).await?;
        if let Some(took) = took {
            break took;
        }
        anyhow::ensure!(Instant::now() < deadline, "the service's statistics did not count the queue in 5 minutes");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };

    let client = super::client(connect, Duration::from_secs(30)).await?;
    let key = super::api_key(connect).await?;
    let cookie = sign_in(&service.base_url, &key).await?;
    let mut reads = Vec::new();
    for (path, console) in
        [("/admin/queue", false), ("/metrics", false), ("/console/queue", true), ("/console/dead-letters", true)]
    {
        let mut micros = Vec::with_capacity(opts.requests);
        let mut failed = 0;
        for _ in 0..opts.requests {
            let mut request = client.get(format!("{}{path}", service.base_url));
            if console {
                request = request.header(reqwest::header::COOKIE, &cookie);
            }
            let asked = Instant::now();
            match request.send().await {
                Ok(r) if r.status() == 200 => {
                    r.bytes().await.context("reading an answer")?;
                    micros.push(asked.elapsed().as_micros() as u64);
                }
                _ => failed += 1,
            }
        }
        reads.push(Read { endpoint: format!("GET {path}"), latency: Latency::from_micros(micros), failed });
    }

    let watch = CpuWatch::start();
    tokio::time::sleep(Duration::from_secs_f64(opts.idle_s)).await;
    let idle = watch.finish().await;
    let idle_cores = idle.map(|c| c.postgres_cores + c.cifpool_cores);
    super::stop_service(service).await;
    harness.close().await;

    let parameters = serde_json::json!({
        "finished_jobs": opts.finished,
        "pending_jobs": opts.pending,
        "dead_jobs": opts.dead,
        "tenants": opts.tenants,
        "requests_per_endpoint": opts.requests,
        "idle_s": opts.idle_s,
        "workers": "off (the backlog stays)",
        "stats_interval_s": 2,
    });
    let notes = vec![
        "rows are written straight into notification_jobs (not through intake): the reads and the periodic \
         work do not depend on how they arrived"
            .into(),
        "idle CPU counts every postgres process (autovacuum included) and this process (the service and the \
         idle bench)"
            .into(),
    ];
    let results = AdminResults { load_s, rows, counting_s, reads, idle, idle_cores };
    Ok(BenchReport { target: "admin".into(), parameters, machine, results, notes })
}

/// Writes the history, the backlog and the dead letters, then vacuums and checkpoints.
async fn load(db: &PgPool, opts: &AdminOptions) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE notification_jobs, notification_tenant_clock, queue_class_stats").execute(db).await?;
    // Finished over the last six days (inside the default seven-day retention, so no sweep purges them
    // during the run), masked and without payload, as finishing leaves them.
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, \
                                        status, attempts, created_at, picked_at, finished_at, provider) \
         SELECT c.class, c.priority, 't' || (i % $2), 0, '********1234', NULL, 5, 'sent', 1, at, at, at, 'push' \
         FROM generate_series(1, $1::int8) AS i, \
              LATERAL (SELECT now() - interval '6 days' + i * (interval '6 days' / greatest($1, 1)) AS at) AS t, \
              LATERAL (SELECT CASE WHEN i % 10 = 0 THEN 'otp' WHEN i % 10 = 1 THEN 'transactional' ELSE 'promo' END \
                              AS class, \
                              CASE WHEN i % 10 = 0 THEN 0 WHEN i % 10 = 1 THEN 1 ELSE 2 END::int2 AS priority) AS c",
    )
    .bind(opts.finished as i64)
    .bind(opts.tenants as i64)
    .execute(db)
    .await?;
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, status) \
         SELECT 'promo', 2, 't' || (i % $2), (i / $2)::float8, '+4479' || lpad(i::text, 8, '0'), \
                '{\"text\": \"hello\"}', 5, 'pending' \
         FROM generate_series(1, $1::int8) AS i",
    )
    .bind(opts.pending as i64)
    .bind(opts.tenants as i64)
    .execute(db)
    .await?;
    sqlx::query(
        "INSERT INTO notification_jobs (class, priority, tenant, fair_key, recipient, payload, max_attempts, \
                                        status, attempts, finished_at, last_error) \
         SELECT 'promo', 2, 't' || (i % $2), 0, '+4479' || lpad(i::text, 8, '0'), '{\"text\": \"hello\"}', 5, \
                'dead', 5, now() - i * interval '1 second', 'permanent: HTTP 400' \
         FROM generate_series(1, $1::int8) AS i",
    )
    .bind(opts.dead as i64)
    .bind(opts.tenants as i64)
    .execute(db)
    .await?;
    sqlx::query("VACUUM ANALYZE notification_jobs").execute(db).await?;
    sqlx::query("CHECKPOINT").execute(db).await?;
    Ok(())
}

/// Signs in to the console with `key`; returns the session's `Cookie` header value.
async fn sign_in(base: &str, key: &str) -> anyhow::Result<String> {
    let client = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build()?;
    let response = client
        .post(format!("{base}/console/sign-in"))
        .header(reqwest::header::ORIGIN, base)
        .form(&[("key", key)])
        .send()
        .await
        .context("signing in to the console")?;
    let cookie = response
        .headers()
        .get(reqwest::header::SET_COOKIE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(str::to_string);
    cookie.with_context(|| format!("the console sign-in answered {} without a session", response.status()))
}

/// The summary table of a report.
pub fn table(report: &BenchReport<AdminResults>) -> String {
    let r = &report.results;
    let mut out = format!(
        "admin reads: {} rows in notification_jobs (loaded in {:.0} s); the statistics' count took {} ms\n",
        thousands(r.rows as f64),
        r.load_s,
        ms(r.counting_s * 1000.0)
    );
    let rows: Vec<Vec<String>> = r
        .reads
        .iter()
        .map(|read| {
            let l = read.latency.as_ref();
            vec![
                read.endpoint.clone(),
                l.map_or("-".into(), |l| ms(l.p50_ms)),
                l.map_or("-".into(), |l| ms(l.p99_ms)),
                l.map_or("-".into(), |l| ms(l.max_ms)),
                read.failed.to_string(),
                format!("≤ {READ_GOAL_MS} ms"),
            ]
        })
        .collect();
    out.push_str(&text_table(&["endpoint", "p50 ms", "p99 ms", "max ms", "failed", "goal (p99)"], &rows));
    if let (Some(idle), Some(cores)) = (r.idle, r.idle_cores) {
        out.push_str(&format!(
            "\nidle for {:.0} s: postgres {:.3} cores, the service {:.3} cores, together {:.1} % of one core \
             (goal ≤ {:.0} %)",
            idle.seconds,
            idle.postgres_cores,
            idle.cifpool_cores,
            cores * 100.0,
            IDLE_GOAL_CORES * 100.0
        ));
    }
    for note in &report.notes {
        out.push_str(&format!("\nnote: {note}"));
    }
    out
}
