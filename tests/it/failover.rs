//! Unique forever through a failover: a primary streams to an asynchronous standby, the standby falls
//! behind, the primary dies with transactions the standby never received, and the standby is promoted
//! at the address the running service connects to. The service's next connection finds a new timeline
//! and fences, so none of the numbers confirmed on the lost primary (nor before) is issued again.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common;
use crate::fence::{confirm_numbers, fill};

use cifpool::db::embedded::{self, EmbeddedOptions, EmbeddedPostgres, SUPERUSER};
use common::{spawn_passive_app, test_settings_with_pools};
use serde_json::Value;
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};

const DATABASE: &str = "cif";

/// A Postgres tool of the server the harness runs, as the server's user.
fn pg(tool: &str) -> Command {
    let server = embedded::find_bin_dir().expect("the Postgres binaries the harness runs").join("postgres");
    embedded::command_as_server_user(&server.canonicalize().unwrap().with_file_name(tool)).unwrap()
}

fn run(mut cmd: Command) {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The standby: a cluster `pg_ctl` runs from a base backup of the primary, removed (with the whole
/// directory) when the test ends, however it ends.
struct Standby {
    base: PathBuf,
    data_dir: PathBuf,
}

impl Standby {
    fn pg_ctl(&self, args: &[&str]) -> Command {
        let mut cmd = pg("pg_ctl");
        cmd.arg("-D").arg(&self.data_dir).args(args);
        cmd
    }

    fn start(&self) {
        let mut cmd = self.pg_ctl(&["-w", "-t", "60", "start"]);
        let options = format!("-k {} -p 5432 -c listen_addresses= -c fsync=off", self.data_dir.display());
        cmd.arg("-l").arg(self.base.join("standby.log")).arg("-o").arg(options);
        let out = cmd.output().unwrap();
        let log = std::fs::read_to_string(self.base.join("standby.log")).unwrap_or_default();
        assert!(out.status.success(), "starting the standby: {}\n{log}", String::from_utf8_lossy(&out.stdout));
    }

    fn stop(&self) {
        run(self.pg_ctl(&["-w", "-m", "fast", "stop"]));
    }

    fn connect_options(&self) -> PgConnectOptions {
        PgConnectOptions::new().host(&self.data_dir.to_string_lossy()).port(5432).username(SUPERUSER).database(DATABASE)
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-w", "-m", "immediate", "stop"]).output();
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// Points the symlink `link` at `target` in one step, as a virtual IP or DNS name moves to a new primary.
fn point(link: &Path, target: &Path) {
    let next = link.with_extension("next");
    let _ = std::fs::remove_file(&next);
    std::os::unix::fs::symlink(target, &next).unwrap();
    std::fs::rename(&next, link).unwrap();
}

/// Waits until the standby has replayed everything the primary has logged so far (the insert position:
/// the test cluster commits asynchronously, so the last commits may not be written out yet).
async fn wait_until_replayed(primary: &mut PgConnection, standby: &Standby) {
    let lsn: String =
        sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text").fetch_one(&mut *primary).await.unwrap();
    let mut conn = PgConnection::connect_with(&standby.connect_options()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let replayed: bool = sqlx::query_scalar("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
            .bind(&lsn)
            .fetch_one(&mut conn)
            .await
            .unwrap();
        if replayed {
            return;
        }
        assert!(Instant::now() < deadline, "the standby did not replay up to {lsn}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_promoted_asynchronous_standby_issues_none_of_the_numbers_the_old_primary_confirmed() {
    let base =
        std::env::temp_dir().join(format!("cifpool-failover-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]));
    embedded::create_server_owned_dir(&base).unwrap();
    let standby = Standby { base: base.clone(), data_dir: base.join("standby") };
    let options = EmbeddedOptions {
        data_dir: base.join("primary"),
        durable: false,
        max_connections: 50,
        remove_on_exit: None,
        settings: vec![("wal_keep_size".into(), "256MB".into())],
    };
    let primary = tokio::task::spawn_blocking(move || EmbeddedPostgres::start(&options).unwrap()).await.unwrap();
    let mut admin = PgConnection::connect_with(&primary.connect_options("postgres")).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {DATABASE}"))).execute(&mut admin).await.unwrap();
    let db = sqlx::PgPool::connect_with(primary.connect_options(DATABASE)).await.unwrap();
    cifpool::db::migrate(&db).await.unwrap();
    db.close().await;

    let mut backup = pg("pg_basebackup");
    backup.arg("-D").arg(&standby.data_dir).args(["-R", "-X", "stream", "-c", "fast", "-d"]);
    backup.arg(format!("host={} port=5432 user={SUPERUSER}", primary.socket_dir().display()));
    run(backup);
    // The primary's socket lives in its data directory, so the backup holds its lock file.
    for file in [".s.PGSQL.5432.lock", ".s.PGSQL.5432"] {
        let _ = std::fs::remove_file(standby.data_dir.join(file));
    }
    standby.start();

    // The service reaches the primary through `live`, the address that moves in a failover.
    let live = base.join("live");
    point(&live, primary.socket_dir());
    let url = format!("postgres://{SUPERUSER}@localhost/{DATABASE}?host={}&port=5432", live.display());
    let app = spawn_passive_app(test_settings_with_pools(&url)).await;
    fill(&app).await;
    let replicated = confirm_numbers(&app, 100).await;
    let mut primary_conn = PgConnection::connect_with(&primary.connect_options(DATABASE)).await.unwrap();
    wait_until_replayed(&mut primary_conn, &standby).await;
    primary_conn.close().await.unwrap();

    // The standby falls behind; the primary goes on confirming, then dies.
    standby.stop();
    let lost = confirm_numbers(&app, 100).await;
    let mut crash = pg("pg_ctl");
    crash.arg("-D").arg(primary.data_dir()).args(["-w", "-m", "immediate", "stop"]);
    run(crash);
    drop(admin);

    // Failover: the standby is promoted and takes the address.
    standby.start();
    run(standby.pg_ctl(&["-w", "-t", "60", "promote"]));
    point(&live, &standby.data_dir);

    // The running service reconnects on its own.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ready = app.client.get(app.url("/readyz")).send().await.unwrap().status() == 200;
        if ready {
            break;
        }
        assert!(Instant::now() < deadline, "the service did not reconnect to the promoted standby");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fill(&app).await;
    let after = confirm_numbers(&app, 200).await;
    assert_eq!(crate::fence::assert_never_twice(&replicated, &lost, &after), 0);

    let mut promoted = PgConnection::connect_with(&standby.connect_options()).await.unwrap();
    let fences: Vec<(Value, Value)> =
        sqlx::query_as("SELECT previous, current FROM cif_fences WHERE outcome = 'fenced'")
            .fetch_all(&mut promoted)
            .await
            .unwrap();
    assert_eq!(fences.len(), 1, "{fences:#?}");
    let (previous, current) = &fences[0];
    assert_eq!(current["timeline"].as_i64().unwrap(), previous["timeline"].as_i64().unwrap() + 1, "{fences:#?}");
    let counts: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM cif_issued), (SELECT count(*) FROM cif_issued WHERE code = ANY($1))",
    )
    .bind(&lost)
    .fetch_one(&mut promoted)
    .await
    .unwrap();
    assert_eq!(counts, (300, 0), "the promoted standby knows the replicated and new numbers, not the lost ones");
    promoted.close().await.unwrap();
    app.stop().await;
    drop(primary);
}
