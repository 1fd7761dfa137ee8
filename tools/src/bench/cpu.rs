//! Where the cycles go: CPU seconds used by this process (the service under test and its load
//! generator), by every `postgres` process and by `pgbench`, read from `/proc` around a phase.
//! pgbench is a child that has exited by the end of its phase, so it is counted through this
//! process's reaped-children times (`cutime + cstime`).
//!
//! The figures are `utime + stime` in clock ticks of 1/100 s (Linux's `USER_HZ`, fixed by its ABI),
//! so a phase should last seconds for them to mean anything. On systems without `/proc` every
//! figure is zero and the split is left out of the report.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Clock ticks per second in `/proc/<pid>/stat`.
const TICKS_PER_SECOND: f64 = 100.0;
/// How often the processes are sampled: a process that exits is counted up to its last sample.
const SAMPLE_EVERY: Duration = Duration::from_millis(200);

/// CPU used during a phase, per party, in cores busy on average.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct CpuSplit {
    /// Wall-clock seconds of the phase.
    pub seconds: f64,
    /// Cores' worth of CPU used by this process (service and load generator together).
    pub cifpool_cores: f64,
    /// Cores' worth used by all `postgres` processes (backends, WAL writer, checkpointer, autovacuum).
    pub postgres_cores: f64,
    /// Cores' worth used by `pgbench`.
    pub pgbench_cores: f64,
    /// Cores available.
    pub cores: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Party {
    Postgres,
    Pgbench,
}

/// Samples `/proc` during a phase; [`CpuWatch::finish`] gives the split. Processes that start during
/// the phase (pgbench and its backends) count from zero; ones that exit count up to their last sample,
/// and pgbench itself, a reaped child by then, through this process's children times.
pub struct CpuWatch {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<CpuSplit>,
}

impl CpuWatch {
    /// Starts sampling.
    pub fn start() -> CpuWatch {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        // The starting point is read here, not in the task, which may first run much later.
        let started = Instant::now();
        let (own0, children0) = process_seconds("self");
        // pid -> (party, seconds at first sight, seconds at last sight)
        let mut seen: HashMap<u32, (Party, f64, f64)> = HashMap::new();
        sample(&mut seen, true);
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tokio::time::sleep(SAMPLE_EVERY) => sample(&mut seen, false),
                }
            }
            sample(&mut seen, false);
            let (own1, children1) = process_seconds("self");
            let seconds = started.elapsed().as_secs_f64().max(1e-9);
            let used = |party: Party| -> f64 {
                seen.values().filter(|(p, _, _)| *p == party).map(|(_, first, last)| last - first).sum()
            };
            CpuSplit {
                seconds,
                cifpool_cores: (own1 - own0).max(0.0) / seconds,
                postgres_cores: used(Party::Postgres) / seconds,
                pgbench_cores: (used(Party::Pgbench).max(children1 - children0)).max(0.0) / seconds,
                cores: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            }
        });
        CpuWatch { stop, task }
    }

    /// Stops sampling and returns the split.
    pub async fn finish(self) -> Option<CpuSplit> {
        let _ = self.stop.send(());
        self.task.await.ok()
    }
}

fn sample(seen: &mut HashMap<u32, (Party, f64, f64)>, initial: bool) {
    let Ok(entries) = std::fs::read_dir("/proc") else { return };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let party = match comm(pid).as_deref() {
            Some("postgres") => Party::Postgres,
            Some("pgbench") => Party::Pgbench,
            _ => continue,
        };
        let (now, _) = process_seconds(&pid.to_string());
        seen.entry(pid)
            .and_modify(|e| e.2 = e.2.max(now))
            // A process first seen after the start began during the phase: all its CPU counts.
            .or_insert((party, if initial { now } else { 0.0 }, now));
    }
}

fn comm(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).ok().map(|s| s.trim().to_string())
}

/// (`utime + stime`, `cutime + cstime`) of a process, seconds; zeros if it cannot be read.
fn process_seconds(pid: &str) -> (f64, f64) {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return (0.0, 0.0) };
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let Some((_, rest)) = stat.rsplit_once(')') else { return (0.0, 0.0) };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state); utime, stime, cutime, cstime are fields 14 to 17.
    let tick = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    ((tick(11) + tick(12)) / TICKS_PER_SECOND, (tick(13) + tick(14)) / TICKS_PER_SECOND)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn this_process_uses_cpu() {
        let watch = CpuWatch::start();
        let until = Instant::now() + Duration::from_millis(300);
        let mut x = 0u64;
        while Instant::now() < until {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let split = watch.finish().await.unwrap();
        if std::path::Path::new("/proc/self/stat").exists() {
            assert!(split.cifpool_cores > 0.3, "{split:?}");
        }
    }
}
