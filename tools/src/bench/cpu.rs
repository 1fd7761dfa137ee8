//! Where the cycles go: CPU seconds used by this process (the service under test), by one child
//! process the phase runs (`reserve`'s HTTP load generator, `queue`'s peer), by every `postgres`
//! process and by `pgbench`, read from `/proc` around a phase. pgbench and the watched child have
//! exited by the end of their phase, so they are also counted through this process's
//! reaped-children times (`cutime + cstime`), which cover them to their last tick.
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

/// Microseconds of CPU per item when `cores` were busy while `per_s` items a second went through
/// (`None` when none did).
pub fn micros_each(cores: f64, per_s: f64) -> Option<f64> {
    (per_s > 0.0).then(|| cores * 1e6 / per_s)
}

/// CPU used during a phase, per party, in cores busy on average.
#[derive(Debug, Clone, Copy, Serialize, serde::Deserialize, PartialEq)]
pub struct CpuSplit {
    /// Wall-clock seconds of the phase.
    pub seconds: f64,
    /// Cores' worth of CPU used by this process: the service under test (and the load generator too
    /// when it runs in-process).
    pub cifpool_cores: f64,
    /// Cores' worth used by the watched child process ([`CpuWatch::with_child`]): `reserve`'s HTTP
    /// load generator, `queue`'s peer worker; 0 when none was watched.
    #[serde(default)]
    pub child_cores: f64,
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
    Child,
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
        CpuWatch::with_child(None)
    }

    /// Starts sampling, with `child` (a child process of this one) as a party of its own, counted from
    /// now. While a child is watched, this process's reaped-children times are its, not pgbench's (no
    /// phase runs both): they give its whole life's CPU once it has exited, less what it had used
    /// when the watch started.
    pub fn with_child(child: Option<u32>) -> CpuWatch {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        // The starting point is read here, not in the task, which may first run much later.
        let started = Instant::now();
        let (own0, children0) = process_seconds("self");
        // pid -> (party, seconds at first sight, seconds at last sight)
        let mut seen: HashMap<u32, (Party, f64, f64)> = HashMap::new();
        if let Some(pid) = child {
            let now = process_seconds(&pid.to_string()).0;
            seen.insert(pid, (Party::Child, now, now));
        }
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
            // `max(0.0)`: an empty f64 sum is -0.0, which prints as "-0.00".
            let used = |party: Party| -> f64 {
                seen.values().filter(|(p, _, _)| *p == party).map(|(_, first, last)| last - first).sum::<f64>().max(0.0)
            };
            let reaped = (children1 - children0).max(0.0);
            let (child_seconds, pgbench_seconds) = match child.and_then(|pid| seen.get(&pid)) {
                Some(&(_, first, last)) => (last.max(reaped) - first, used(Party::Pgbench)),
                None => (0.0, used(Party::Pgbench).max(reaped)),
            };
            CpuSplit {
                seconds,
                cifpool_cores: (own1 - own0).max(0.0) / seconds,
                child_cores: child_seconds / seconds,
                postgres_cores: used(Party::Postgres) / seconds,
                pgbench_cores: pgbench_seconds / seconds,
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

/// The CPU splits of a run's phases as a table: phase, this process (headed `own`), the watched child
/// (`child`), postgres and pgbench, in cores. The child's and pgbench's columns are left out when no
/// phase had one (a refill runs neither).
pub fn table(own: &str, child: &str, rows: &[(String, CpuSplit)]) -> String {
    let cores = |x: f64| format!("{x:.2}");
    let with_child = rows.iter().any(|(_, c)| c.child_cores > 0.0);
    let with_pgbench = rows.iter().any(|(_, c)| c.pgbench_cores > 0.0);
    let mut header = vec!["phase", own];
    header.extend(with_child.then_some(child));
    header.push("postgres");
    header.extend(with_pgbench.then_some("pgbench"));
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|(phase, c)| {
            let mut row = vec![phase.clone(), cores(c.cifpool_cores)];
            row.extend(with_child.then(|| cores(c.child_cores)));
            row.push(cores(c.postgres_cores));
            row.extend(with_pgbench.then(|| cores(c.pgbench_cores)));
            row
        })
        .collect();
    super::report::table(&header, &rows)
}

fn sample(seen: &mut HashMap<u32, (Party, f64, f64)>, initial: bool) {
    let Ok(entries) = std::fs::read_dir("/proc") else { return };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        if let Some(e) = seen.get_mut(&pid)
            && e.0 == Party::Child
        {
            // Its name is not known in advance (the tools binary, node); it was registered by pid.
            e.2 = e.2.max(process_seconds(&pid.to_string()).0);
            continue;
        }
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

    /// The tests measure this whole process: one at a time, or each counts the other's work.
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

    #[tokio::test]
    async fn this_process_uses_cpu() {
        let _serial = SERIAL.lock().await;
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

    #[tokio::test]
    async fn a_watched_child_is_its_own_party() {
        if !std::path::Path::new("/proc/self/stat").exists() {
            return;
        }
        let _serial = SERIAL.lock().await;
        // A shell busy for a few hundred milliseconds, counted while alive and after it is reaped.
        let child = tokio::process::Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"])
            .spawn()
            .unwrap();
        let watch = CpuWatch::with_child(child.id());
        let status = child.wait_with_output().await.unwrap().status;
        assert!(status.success());
        let split = watch.finish().await.unwrap();
        // CPU seconds, not cores: on a busy machine the loop gets a fraction of a core.
        assert!(split.child_cores * split.seconds > 0.1, "{split:?}");
        assert!(split.cifpool_cores < split.child_cores, "the parent only waited: {split:?}");
        assert_eq!(split.pgbench_cores, 0.0, "{split:?}");
    }

    fn split(child: f64, pgbench: f64) -> CpuSplit {
        CpuSplit {
            seconds: 1.0,
            cifpool_cores: 0.5,
            child_cores: child,
            postgres_cores: 0.9,
            pgbench_cores: pgbench,
            cores: 2,
        }
    }

    #[test]
    fn the_table_leaves_out_the_parties_no_phase_had() {
        let refill = table("bench", "-", &[("refill".into(), split(0.0, 0.0)), ("raw COPY".into(), split(0.0, 0.0))]);
        let header = refill.lines().next().unwrap();
        assert!(header.contains("postgres") && !header.contains("pgbench") && !header.contains(" -"), "{refill}");
        let reserve =
            table("service", "load gen", &[("service".into(), split(0.3, 0.0)), ("raw".into(), split(0.0, 0.2))]);
        let header = reserve.lines().next().unwrap();
        assert!(header.contains("load gen") && header.contains("pgbench"), "{reserve}");
        assert!(reserve.lines().nth(2).unwrap().trim_end().ends_with("0.00"), "the service's pgbench cell: {reserve}");
    }
}
