//! A private PostgreSQL cluster started from the installed server binaries.
//!
//! Used by `cifpool serve` when no `database.url` is configured, by the lab, and by the test harness.
//! The cluster listens on a unix socket only (no TCP port to collide with or expose).
//!
//! Lifetime: the postmaster is spawned behind a tiny `sh` guard that holds the read end of a pipe whose
//! write end only this process has. When this process exits for any reason — a clean stop, a panic, or
//! `kill -9` — the pipe reaches EOF and the guard sends the postmaster SIGINT (fast shutdown: active
//! transactions roll back, a clean checkpoint is written). So a crashed cifpool never leaves an orphaned
//! Postgres behind holding the data directory. The guard runs in its own process group, so a Ctrl-C in
//! the terminal reaches cifpool only, which then shuts down in order: HTTP first, the database last.
//!
//! `initdb` refuses to run as root; as root every server process runs as the `postgres` user through
//! `setpriv`, and the data directory is owned by that user.

use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;

/// Superuser created by `initdb` (independent of the OS user running it).
pub const SUPERUSER: &str = "postgres";
/// Longest unix socket path the kernel accepts, less room for `/.s.PGSQL.NNNNN`.
const MAX_SOCKET_DIR_LEN: usize = 90;

/// Why the embedded cluster could not be started or stopped.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    /// No server binaries on this machine.
    #[error(
        "PostgreSQL server binaries (initdb, postgres) were not found in PATH or /usr/lib/postgresql/*/bin. \
         Install them (Debian/Ubuntu: `apt-get install postgresql`; Fedora: `dnf install postgresql-server`) \
         or point cifpool at an existing server with database.url (env CIFPOOL_DATABASE__URL)"
    )]
    BinariesNotFound,
    /// The data directory was made by a Postgres major version whose binaries are not installed.
    #[error(
        "the embedded data directory {data_dir} was created by PostgreSQL {major} (its PG_VERSION), but only \
         {available} server binaries are installed; install PostgreSQL {major} (Debian/Ubuntu: \
         `apt-get install postgresql-{major}`) or upgrade the directory with pg_upgrade",
        data_dir = data_dir.display()
    )]
    VersionNotInstalled {
        /// The data directory.
        data_dir: PathBuf,
        /// Its major version.
        major: u32,
        /// The installed majors, for the message.
        available: String,
    },
    /// Running as root, the server runs as `postgres`, which cannot reach the data directory.
    #[error(
        "the embedded server runs as the `postgres` user (cifpool runs as root and initdb refuses root), \
         and `postgres` cannot enter {blocked} (mode {mode:04o}, owner uid {owner}), a parent of the data \
         directory {data_dir}. Put the data directory under a path `postgres` can traverse (e.g. \
         --data-dir /var/lib/cifpool/pg), give that directory o+x (`chmod o+x {blocked}`), or run cifpool \
         as a normal user",
        blocked = blocked.display(),
        data_dir = data_dir.display()
    )]
    ParentNotTraversable {
        /// The data directory.
        data_dir: PathBuf,
        /// The first parent `postgres` cannot enter.
        blocked: PathBuf,
        /// Its permission bits.
        mode: u32,
        /// Its owner.
        owner: u32,
    },
    /// Running as root but there is no `postgres` user to drop to.
    #[error(
        "running as root, but there is no `postgres` OS user to run the embedded server as \
         (initdb refuses root); install the postgresql package, which creates it, or run as a normal user"
    )]
    NoPostgresUser,
    /// A command failed; `log` holds what it printed.
    #[error("{what} failed: {log}")]
    Command {
        /// Which step.
        what: String,
        /// Tail of its output.
        log: String,
    },
    /// The server did not become ready in time.
    #[error("embedded postgres did not become ready within {0:?}; see {1}")]
    NotReady(Duration, String),
    /// Filesystem trouble around the data directory.
    #[error("embedded postgres: {context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        source: std::io::Error,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> EmbeddedError {
    let context = context.into();
    move |source| EmbeddedError::Io { context, source }
}

/// How to start a cluster.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    /// Data directory; created (and `initdb`-ed) when missing, reused when it holds a cluster.
    pub data_dir: PathBuf,
    /// Durable writes. On for anything holding real data; tests turn it off for speed.
    pub durable: bool,
    /// Postgres `max_connections`.
    pub max_connections: u32,
    /// A directory to delete once the server has exited (throw-away test clusters). It must be
    /// writable by the server's user.
    pub remove_on_exit: Option<PathBuf>,
    /// Extra `-c name=value` server settings.
    pub settings: Vec<(String, String)>,
}

impl EmbeddedOptions {
    /// Durable defaults for a cluster that holds real data.
    pub fn durable(data_dir: impl Into<PathBuf>) -> Self {
        EmbeddedOptions {
            data_dir: data_dir.into(),
            durable: true,
            max_connections: 100,
            remove_on_exit: None,
            settings: Vec::new(),
        }
    }
}

/// A running private cluster; stop it with [`EmbeddedPostgres::stop`] (dropping it stops it too).
#[derive(Debug)]
pub struct EmbeddedPostgres {
    data_dir: PathBuf,
    socket_dir: PathBuf,
    port: u16,
    log_file: PathBuf,
    postmaster: Option<Child>,
    guard_pipe: Option<ChildStdin>,
}

/// Finds a directory holding `initdb` and `postgres`: `PATH` first, then the newest
/// `/usr/lib/postgresql/<version>/bin`.
pub fn find_bin_dir() -> Option<PathBuf> {
    installed_servers().into_iter().next().map(|(_, bin)| bin)
}

fn has_server(dir: &Path) -> bool {
    dir.join("initdb").is_file() && dir.join("postgres").is_file()
}

/// Every installed server, in order of preference (the one on `PATH` first, then the newest under
/// `/usr/lib/postgresql`), with its major version when it can be told.
fn installed_servers() -> Vec<(Option<u32>, PathBuf)> {
    let mut found = Vec::new();
    if let Some(path) = std::env::var_os("PATH")
        && let Some(dir) = std::env::split_paths(&path).find(|d| has_server(d))
    {
        found.push((server_major(&dir), dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            has_server(&bin).then_some((version, bin))
        })
        .collect();
    versions.sort();
    found.extend(versions.into_iter().rev().map(|(v, bin)| (Some(v), bin)));
    found
}

/// The major version of the server in `dir`, from `postgres --version` ("postgres (PostgreSQL) 15.8 …").
fn server_major(dir: &Path) -> Option<u32> {
    let out = Command::new(dir.join("postgres")).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.split(')').nth(1)?.split_whitespace().next()?;
    version.split('.').next()?.parse().ok()
}

/// The server binaries for `data_dir`: those of the major version it was created with, if it exists
/// (a newer installed Postgres cannot open it), else the preferred installed server.
fn bin_dir_for(data_dir: &Path) -> Result<PathBuf, EmbeddedError> {
    let servers = installed_servers();
    let made_by = fs::read_to_string(data_dir.join("PG_VERSION")).ok().and_then(|v| v.trim().parse::<u32>().ok());
    let Some(major) = made_by else {
        return servers.into_iter().next().map(|(_, bin)| bin).ok_or(EmbeddedError::BinariesNotFound);
    };
    if let Some((_, bin)) = servers.iter().find(|(v, _)| *v == Some(major)) {
        return Ok(bin.clone());
    }
    if servers.is_empty() {
        return Err(EmbeddedError::BinariesNotFound);
    }
    let mut majors: Vec<String> =
        servers.iter().map(|(v, _)| v.map_or_else(|| "unknown-version".to_string(), |v| v.to_string())).collect();
    majors.dedup();
    Err(EmbeddedError::VersionNotInstalled {
        data_dir: data_dir.to_owned(),
        major,
        available: format!("PostgreSQL {}", majors.join(", ")),
    })
}

/// Whether the `postgres` user can enter `dir`, asked of the system itself.
fn postgres_can_enter(dir: &Path) -> bool {
    server_command(Path::new("/bin/sh"), Some((0, 0)))
        .args(["-c", "test -x \"$1\"", "cifpool-check"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// When the server will run as `postgres` (`ids`), checks that it can enter every existing parent of
/// `data_dir`; initdb's own message ("could not access directory … Permission denied") does not say
/// which one, or why.
fn check_parents_traversable(data_dir: &Path, ids: Option<(u32, u32)>) -> Result<(), EmbeddedError> {
    use std::os::unix::fs::MetadataExt;
    let Some((uid, gid)) = ids else { return Ok(()) };
    for dir in data_dir.ancestors().skip(1) {
        let Ok(meta) = fs::metadata(dir) else { continue };
        let mode = meta.mode() & 0o7777;
        let enters = if meta.uid() == uid {
            mode & 0o100 != 0
        } else if meta.gid() == gid {
            mode & 0o010 != 0
        } else {
            mode & 0o001 != 0
        };
        // The mode bits leave out supplementary groups and ACLs: ask the system before refusing.
        if !enters && !postgres_can_enter(dir) {
            return Err(EmbeddedError::ParentNotTraversable {
                data_dir: data_dir.to_owned(),
                blocked: dir.to_owned(),
                mode,
                owner: meta.uid(),
            });
        }
    }
    Ok(())
}

/// The uid/gid to run the server as when we are root.
fn postgres_ids() -> Result<Option<(u32, u32)>, EmbeddedError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    let name = std::ffi::CString::new("postgres").expect("static name");
    // SAFETY: getpwnam returns a pointer into static storage or null; we copy the ids out at once.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    if pw.is_null() {
        return Err(EmbeddedError::NoPostgresUser);
    }
    // SAFETY: non-null result of getpwnam.
    let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
    Ok(Some((uid, gid)))
}

/// A command that runs the Postgres tool `program` as the user the server runs as (`postgres` when we
/// are root), so files it writes in a data directory belong to the server: `pg_ctl`, `pg_basebackup`.
pub fn command_as_server_user(program: &Path) -> Result<Command, EmbeddedError> {
    Ok(server_command(program, postgres_ids()?))
}

/// Builds a command that runs `program` as the `postgres` user when we are root.
fn server_command(program: &Path, ids: Option<(u32, u32)>) -> Command {
    match ids {
        Some(_) => {
            let mut cmd = Command::new("setpriv");
            cmd.args(["--reuid=postgres", "--regid=postgres", "--init-groups"]).arg(program);
            cmd
        }
        None => Command::new(program),
    }
}

/// Creates `dir` (mode 0700) owned by the user the server runs as, so the server may write and
/// delete inside it.
pub fn create_server_owned_dir(dir: &Path) -> Result<(), EmbeddedError> {
    make_private_dir(dir, postgres_ids()?)
}

fn make_private_dir(dir: &Path, ids: Option<(u32, u32)>) -> Result<(), EmbeddedError> {
    fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(io_err(format!("chmod {}", dir.display())))?;
    if let Some((uid, gid)) = ids {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid)).map_err(io_err(format!("chown {}", dir.display())))?;
    }
    Ok(())
}

fn tail(path: &Path, max: usize) -> String {
    let mut text = String::new();
    if let Ok(mut f) = fs::File::open(path) {
        let _ = f.read_to_string(&mut text);
    }
    let start = text.len().saturating_sub(max);
    let start = (start..text.len()).find(|&i| text.is_char_boundary(i)).unwrap_or(text.len());
    text[start..].trim().to_string()
}

/// Shell guard: keeps the pipe on fd 3 and turns its EOF into SIGINT for the postmaster, which
/// replaces the shell by `exec` and so keeps the shell's pid (`$$`).
const GUARD_SCRIPT: &str = r#"
exec 3<&0
cleanup="$1"; shift
(
  while read -r _ <&3; do :; done
  kill -INT $$ 2>/dev/null
  if [ -n "$cleanup" ]; then
    while kill -0 $$ 2>/dev/null; do sleep 0.05; done
    rm -rf "$cleanup"
  fi
) </dev/null >/dev/null 2>&1 &
exec "$@"
"#;

impl EmbeddedPostgres {
    /// Initialises the data directory when needed, starts the server and waits until it accepts
    /// connections. Blocking; async callers use `tokio::task::spawn_blocking`.
    pub fn start(opts: &EmbeddedOptions) -> Result<EmbeddedPostgres, EmbeddedError> {
        let ids = postgres_ids()?;
        let data_dir = std::path::absolute(&opts.data_dir).map_err(io_err("resolving data dir"))?;
        let bin = bin_dir_for(&data_dir)?;
        if let Some(parent) = data_dir.parent() {
            fs::create_dir_all(parent).map_err(io_err(format!("creating {}", parent.display())))?;
        }
        check_parents_traversable(&data_dir, ids)?;
        let log_file = data_dir.with_extension("log");

        if !data_dir.join("PG_VERSION").is_file() {
            make_private_dir(&data_dir, ids)?;
            let mut cmd = server_command(&bin.join("initdb"), ids);
            cmd.arg("-D").arg(&data_dir).args(["-U", SUPERUSER, "--auth=trust", "--encoding=UTF8", "--locale=C"]);
            if !opts.durable {
                cmd.arg("--no-sync");
            }
            let out = cmd.output().map_err(io_err("running initdb"))?;
            if !out.status.success() {
                return Err(EmbeddedError::Command {
                    what: "initdb".into(),
                    log: String::from_utf8_lossy(&[out.stdout, out.stderr].concat()).into_owned(),
                });
            }
        }

        // The socket lives in the 0700 data dir, so only its owner (and root) can connect — which is
        // what makes `trust` authentication acceptable here. Long paths fall back to a private temp dir.
        let socket_dir = if data_dir.as_os_str().len() <= MAX_SOCKET_DIR_LEN {
            data_dir.clone()
        } else {
            let dir = std::env::temp_dir().join(format!("cifpool-sock-{}", std::process::id()));
            make_private_dir(&dir, ids)?;
            dir
        };
        let port = 5432;

        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_file)
            .map_err(io_err(format!("opening {}", log_file.display())))?;
        let log_err = log.try_clone().map_err(io_err("cloning log handle"))?;

        let mut cmd = server_command(Path::new("/bin/sh"), ids);
        cmd.arg("-c").arg(GUARD_SCRIPT).arg("cifpool-pg-guard");
        cmd.arg(opts.remove_on_exit.as_deref().unwrap_or(Path::new("")));
        cmd.arg(bin.join("postgres")).arg("-D").arg(&data_dir).arg("-k").arg(&socket_dir);
        cmd.args(["-p", &port.to_string(), "-c", "listen_addresses="]);
        let mut settings: Vec<(String, String)> = vec![
            ("max_connections".into(), opts.max_connections.to_string()),
            ("unix_socket_permissions".into(), "0700".into()),
        ];
        if !opts.durable {
            for (k, v) in [("fsync", "off"), ("synchronous_commit", "off"), ("full_page_writes", "off")] {
                settings.push((k.into(), v.into()));
            }
        }
        settings.extend(opts.settings.iter().cloned());
        for (k, v) in &settings {
            cmd.arg("-c").arg(format!("{k}={v}"));
        }
        cmd.stdin(Stdio::piped()).stdout(log).stderr(log_err).process_group(0);
        let mut child = cmd.spawn().map_err(io_err("spawning postgres"))?;
        let guard_pipe = child.stdin.take();

        let mut pg = EmbeddedPostgres { data_dir, socket_dir, port, log_file, postmaster: Some(child), guard_pipe };
        pg.wait_ready(Duration::from_secs(60))?;
        Ok(pg)
    }

    /// Polls `postmaster.pid`, whose last line reads `ready` once connections are accepted (what
    /// `pg_ctl -w` does), while checking that the server has not died.
    fn wait_ready(&mut self, limit: Duration) -> Result<(), EmbeddedError> {
        let deadline = Instant::now() + limit;
        let pid_file = self.data_dir.join("postmaster.pid");
        let our_pid = self.postmaster.as_ref().map(|c| c.id().to_string()).unwrap_or_default();
        loop {
            if let Some(child) = self.postmaster.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.postmaster = None;
                return Err(EmbeddedError::Command {
                    what: format!("postgres ({status})"),
                    log: tail(&self.log_file, 2000),
                });
            }
            if let Ok(text) = fs::read_to_string(&pid_file) {
                let lines: Vec<&str> = text.lines().collect();
                if lines.first().map(|l| l.trim()) == Some(our_pid.as_str())
                    && lines.get(7).map(|l| l.trim()) == Some("ready")
                {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(EmbeddedError::NotReady(limit, self.log_file.display().to_string()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Connection options for `database` on this cluster, as the superuser.
    pub fn connect_options(&self, database: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .host(&self.socket_dir.to_string_lossy())
            .port(self.port)
            .username(SUPERUSER)
            .database(database)
    }

    /// A `postgres://` URL for `database` on this cluster (unix socket), for child processes and tools.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://{SUPERUSER}@localhost/{database}?host={}&port={}", self.socket_dir.display(), self.port)
    }

    /// The directory holding the server's unix socket (`.s.PGSQL.5432`).
    pub fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }

    /// The data directory.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The server log file.
    pub(crate) fn log_file(&self) -> &Path {
        &self.log_file
    }

    /// Fast shutdown (clean checkpoint) and wait up to 30 s for it; then immediate shutdown.
    pub fn stop(mut self) -> Result<(), EmbeddedError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), EmbeddedError> {
        // Closing the pipe is the stop signal (see the module docs).
        drop(self.guard_pipe.take());
        let Some(mut child) = self.postmaster.take() else {
            return Ok(());
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match child.try_wait() {
                Ok(Some(_)) => return Ok(()),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    // SAFETY: plain kill(2) on our own child's pid.
                    unsafe { libc::kill(child.id() as i32, libc::SIGQUIT) };
                    let _ = child.wait();
                    return Err(EmbeddedError::Command {
                        what: "postgres fast shutdown (timed out, sent SIGQUIT)".into(),
                        log: tail(&self.log_file, 2000),
                    });
                }
            }
        }
    }
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
