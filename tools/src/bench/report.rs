//! What every benchmark writes: the figures, the parameters that produced them and the machine they
//! ran on, as `DIR/<target>.json`; plus the latency summary and the plain-text table printed at the end.

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;
use sqlx::PgPool;

/// The JSON document of one benchmark run.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport<T: Serialize> {
    /// `reserve`, `refill`, …
    pub target: String,
    /// Every knob the run used (so it can be re-run).
    pub parameters: serde_json::Value,
    /// Where it ran.
    pub machine: Machine,
    /// The figures.
    pub results: T,
    /// Caveats (fallbacks taken, extrapolations, errors seen).
    pub notes: Vec<String>,
}

impl<T: Serialize> BenchReport<T> {
    /// Writes `dir/<target>.json` (creating `dir`), returning the path.
    pub fn write(&self, dir: &Path) -> anyhow::Result<PathBuf> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let path = dir.join(format!("{}.json", self.target));
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(&path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }
}

/// The machine and software a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// Logical cores available to this process.
    pub cores: usize,
    /// `model name` from /proc/cpuinfo.
    pub cpu_model: Option<String>,
    /// Total memory, bytes (/proc/meminfo).
    pub memory_bytes: Option<u64>,
    /// `linux`, …
    pub os: &'static str,
    /// `x86_64`, …
    pub arch: &'static str,
    /// `SELECT version()`.
    pub postgres_version: String,
    /// `SHOW fsync` (durability changes every write-bound figure).
    pub postgres_fsync: String,
    /// `SHOW synchronous_commit`.
    pub postgres_synchronous_commit: String,
    /// `SHOW shared_buffers`.
    pub postgres_shared_buffers: String,
    /// This build's version.
    pub cifpool_version: &'static str,
    /// `release` or `debug` (a debug build's figures are not meaningful).
    pub cifpool_profile: &'static str,
    /// When the run started (RFC 3339, UTC).
    pub date: String,
}

impl Machine {
    /// Probes the local machine and the server behind `db`.
    pub async fn probe(db: &PgPool) -> anyhow::Result<Machine> {
        let show = |name: &'static str| async move {
            sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(format!("SHOW {name}")))
                .fetch_one(db)
                .await
                .unwrap_or_else(|_| "unknown".into())
        };
        let postgres_version: String =
            sqlx::query_scalar("SELECT version()").fetch_one(db).await.context("querying the Postgres version")?;
        Ok(Machine {
            cores: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            cpu_model: proc_field("/proc/cpuinfo", "model name"),
            memory_bytes: proc_field("/proc/meminfo", "MemTotal")
                .and_then(|v| v.split_whitespace().next().and_then(|kb| kb.parse::<u64>().ok()))
                .map(|kb| kb * 1024),
            os: std::env::consts::OS,
            arch: std::env::consts::ARCH,
            postgres_version,
            postgres_fsync: show("fsync").await,
            postgres_synchronous_commit: show("synchronous_commit").await,
            postgres_shared_buffers: show("shared_buffers").await,
            cifpool_version: env!("CARGO_PKG_VERSION"),
            cifpool_profile: if cfg!(debug_assertions) { "debug" } else { "release" },
            date: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        })
    }
}

/// First `key: value` line of a /proc file.
fn proc_field(path: &str, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// Latency percentiles of a set of samples, milliseconds.
#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize, PartialEq)]
pub struct Latency {
    /// Number of samples.
    pub samples: usize,
    /// Mean.
    pub mean_ms: f64,
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// 99.9th percentile.
    pub p999_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

impl Latency {
    /// Summarises samples in microseconds; `None` when there are none.
    pub fn from_micros(mut us: Vec<u64>) -> Option<Latency> {
        if us.is_empty() {
            return None;
        }
        us.sort_unstable();
        let n = us.len();
        let pct = |p: f64| crate::stats::percentile(&us, p / 100.0).expect("not empty") as f64 / 1000.0;
        Some(Latency {
            samples: n,
            mean_ms: us.iter().sum::<u64>() as f64 / n as f64 / 1000.0,
            p50_ms: pct(50.0),
            p90_ms: pct(90.0),
            p99_ms: pct(99.0),
            p999_ms: pct(99.9),
            max_ms: us[n - 1] as f64 / 1000.0,
        })
    }
}

/// A plain-text table (right-aligned columns, header underlined).
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
    }
    let line = |cells: Vec<String>| {
        cells.iter().zip(&widths).map(|(c, w)| format!("{c:>w$}")).collect::<Vec<_>>().join("  ").trim_end().to_string()
    };
    let mut out = line(headers.iter().map(|h| h.to_string()).collect());
    out.push('\n');
    out.push_str(&widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("  "));
    for row in rows {
        out.push('\n');
        out.push_str(&line(row.clone()));
    }
    out
}

/// `1234.5` → `"1,234"`; for rates and counts in tables.
pub fn thousands(x: f64) -> String {
    let n = x.round() as i64;
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    if n < 0 { format!("-{out}") } else { out }
}

/// Milliseconds with sensible precision.
pub fn ms(x: f64) -> String {
    if x < 10.0 { format!("{x:.2}") } else { format!("{x:.1}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_nearest_rank() {
        let l = Latency::from_micros((1..=100).map(|i| i * 1000).collect()).unwrap();
        assert_eq!(l.p50_ms, 50.0);
        assert_eq!(l.p99_ms, 99.0);
        assert_eq!(l.max_ms, 100.0);
        assert!(Latency::from_micros(Vec::new()).is_none());
    }

    #[test]
    fn formats() {
        assert_eq!(thousands(1234567.4), "1,234,567");
        assert_eq!(thousands(999.0), "999");
        let t = table(&["a", "bb"], &[vec!["1".into(), "22222".into()]]);
        assert_eq!(t, "a     bb\n-  -----\n1  22222");
    }
}
