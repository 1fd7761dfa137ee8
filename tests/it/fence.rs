//! Unique forever: a database restored from a dump (into a new database, or over the same one) never
//! issues again a number confirmed after the dump; with `halt`, nothing is issued until an operator
//! fences.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::common;

use cifpool::config::OnIncarnationChange;
use cifpool::internals::refill::{RefillOptions, RefillOutcome, refill};
use common::{TEST_ADMIN_TOKEN, TestApp, client_with_key, spawn_passive_app, test_settings_with_pools};
use serde_json::{Value, json};
use sqlx::Connection;

pub(crate) async fn fill(app: &TestApp) {
    let pool = app.state.cif.pools().get("individual").unwrap();
    let summary = refill(&app.state.db, pool, RefillOptions { force: true, ..Default::default() }).await.unwrap();
    assert_eq!(summary.outcome, RefillOutcome::Refilled, "{summary:?}");
}

/// Reserves and confirms `n` numbers of the `individual` pool over HTTP: what customers were given.
pub(crate) async fn confirm_numbers(app: &TestApp, n: usize) -> Vec<String> {
    let mut issued = Vec::with_capacity(n);
    for i in 0..n {
        let r = app.client.post(app.url("/v1/cif")).json(&json!({ "customer_type": "individual" })).send().await;
        let r = r.unwrap();
        assert_eq!(r.status(), 201, "reservation {i}");
        let held: Value = r.json().await.unwrap();
        let cif = held["cif"].as_str().unwrap().to_string();
        let body = json!({ "reservation_token": held["reservation_token"], "customer_ref": format!("crm-{cif}") });
        let r = app.client.post(app.url(&format!("/v1/cif/{cif}/confirm"))).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200, "confirmation of {cif}");
        issued.push(cif);
    }
    issued
}

/// A client tool of the server the harness runs (a `postgres` on PATH may be a lone symlink).
pub(crate) fn pg_tool(name: &str) -> PathBuf {
    let server =
        cifpool::db::embedded::find_bin_dir().expect("the Postgres binaries the harness runs").join("postgres");
    server.canonicalize().unwrap().with_file_name(name)
}

fn run(tool: &str, args: &[&str]) {
    let out = std::process::Command::new(pg_tool(tool)).args(args).output().unwrap();
    assert!(out.status.success(), "{tool} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn dump(url: &str, file: &Path) {
    run("pg_dump", &["--format=custom", "--file", file.to_str().unwrap(), "--dbname", url]);
}

/// A new, empty database beside the test's; its URL.
async fn empty_database(beside: &common::TestDb) -> String {
    let name = format!("{}_restored", beside.name);
    let mut admin = sqlx::PgConnection::connect(&beside.url).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name} TEMPLATE template0")))
        .execute(&mut admin)
        .await
        .unwrap();
    admin.close().await.unwrap();
    beside.url.replacen(&format!("/{}?", beside.name), &format!("/{name}?"), 1)
}

async fn fences(url: &str) -> Vec<Value> {
    let mut conn = sqlx::PgConnection::connect(url).await.unwrap();
    let rows: Vec<(Value,)> =
        sqlx::query_as("SELECT detail FROM audit_events WHERE action = 'pool.fenced' ORDER BY id")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    rows.into_iter().map(|(d,)| d).collect()
}

/// The numbers confirmed before the dump, after it, and after the restore: the last share none with
/// the first two.
pub(crate) fn assert_never_twice(before_dump: &[String], after_dump: &[String], after_restore: &[String]) -> usize {
    let earlier: HashSet<&String> = before_dump.iter().chain(after_dump).collect();
    assert_eq!(earlier.len(), before_dump.len() + after_dump.len());
    let twice: Vec<&String> = after_restore.iter().filter(|c| earlier.contains(c)).collect();
    assert!(twice.is_empty(), "{} numbers issued twice, e.g. {:?}", twice.len(), &twice[..twice.len().min(5)]);
    assert_eq!(after_restore.iter().collect::<HashSet<_>>().len(), after_restore.len());
    twice.len()
}

/// What a night between a dump and its restore leaves: the numbers confirmed before the dump, those
/// confirmed after it, and the new database the dump went into (no service has opened it yet).
struct Restored {
    before_dump: Vec<String>,
    after_dump: Vec<String>,
    url: String,
}

/// Confirms `before` numbers, dumps `db` into `dir`, confirms `after` more, stops the service and
/// restores the dump into a new database beside `db`.
async fn restore_after_confirming(db: &common::TestDb, dir: &Path, before: usize, after: usize) -> Restored {
    let file = dir.join("nightly.dump");
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    fill(&app).await;
    let before_dump = confirm_numbers(&app, before).await;
    dump(&db.url, &file);
    let after_dump = confirm_numbers(&app, after).await;
    app.stop().await;
    let url = empty_database(db).await;
    run("pg_restore", &["--no-owner", "--dbname", &url, file.to_str().unwrap()]);
    Restored { before_dump, after_dump, url }
}

#[tokio::test]
async fn a_dump_restored_into_a_new_database_issues_none_of_the_numbers_confirmed_since_the_dump() {
    let db = common::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let Restored { before_dump, after_dump, url: restored } = restore_after_confirming(&db, dir.path(), 150, 150).await;
    let app = spawn_passive_app(test_settings_with_pools(&restored)).await;
    assert!(!app.state.incarnation.halted());
    fill(&app).await;
    let after_restore = confirm_numbers(&app, 300).await;
    assert_eq!(assert_never_twice(&before_dump, &after_dump, &after_restore), 0);

    let fenced = fences(&restored).await;
    assert_eq!(fenced.len(), 2, "one row per pool: {fenced:#?}");
    let individual = fenced.iter().find(|d| d["set_aside"].as_i64().unwrap() > 0).expect("codes set aside");
    assert_eq!(individual["counter_to"].as_i64().unwrap() - individual["counter_from"].as_i64().unwrap(), 1_000_000);
    // The codes set aside are kept, and none of them is in the pool any more.
    let mut conn = sqlx::PgConnection::connect(&restored).await.unwrap();
    let (kept, back): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM cif_fenced_codes), \
                (SELECT count(*) FROM cif_codes c JOIN cif_fenced_codes f USING (code))",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!((kept, back), (individual["set_aside"].as_i64().unwrap(), 0));
    // A second start on the same database finds what it recorded: no second fence.
    app.stop().await;
    let app = spawn_passive_app(test_settings_with_pools(&restored)).await;
    assert_eq!(fences(&restored).await.len(), 2);
    app.stop().await;
}

#[tokio::test]
async fn a_dump_restored_over_the_same_database_issues_none_of_the_numbers_confirmed_since_the_dump() {
    let db = common::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("nightly.dump");
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    fill(&app).await;
    let before_dump = confirm_numbers(&app, 100).await;
    dump(&db.url, &file);
    let after_dump = confirm_numbers(&app, 100).await;
    app.stop().await;
    db.pool.close().await;

    run("pg_restore", &["--clean", "--if-exists", "--no-owner", "--dbname", &db.url, file.to_str().unwrap()]);
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    fill(&app).await;
    let after_restore = confirm_numbers(&app, 200).await;
    assert_eq!(assert_never_twice(&before_dump, &after_dump, &after_restore), 0);
    assert_eq!(fences(&db.url).await.len(), 2);
    app.stop().await;
}

#[tokio::test]
async fn with_halt_nothing_is_issued_until_an_operator_fences() {
    let db = common::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("nightly.dump");
    let mut settings = test_settings_with_pools(&db.url);
    settings.database.on_incarnation_change = OnIncarnationChange::Halt;
    let app = spawn_passive_app(settings.clone()).await;
    fill(&app).await;
    let before_dump = confirm_numbers(&app, 50).await;
    dump(&db.url, &file);
    let after_dump = confirm_numbers(&app, 50).await;
    app.stop().await;

    let restored = empty_database(&db).await;
    run("pg_restore", &["--no-owner", "--dbname", &restored, file.to_str().unwrap()]);
    settings.database.url = Some(restored.clone().into());
    let app = spawn_passive_app(settings).await;
    assert!(app.state.incarnation.halted());
    let r = app.client.post(app.url("/v1/cif")).json(&json!({ "customer_type": "individual" })).send().await.unwrap();
    let problem = common::assert_problem(r, 503).await;
    assert!(problem["detail"].as_str().unwrap().contains("cifpool pools fence"), "{problem}");
    let pool = app.state.cif.pools().get("individual").unwrap();
    let summary = refill(&app.state.db, pool, RefillOptions { force: true, ..Default::default() }).await.unwrap();
    assert_eq!((summary.outcome, summary.codes_added), (RefillOutcome::Halted, 0));
    assert!(fences(&restored).await.is_empty(), "nothing fenced without the operator");

    let admin = client_with_key(TEST_ADMIN_TOKEN);
    let r = admin.post(app.url("/admin/pools/fence")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let report: Value = r.json().await.unwrap();
    assert_eq!(report["outcome"], "fenced", "{report}");
    assert!(!app.state.incarnation.halted());
    fill(&app).await;
    let after_fence = confirm_numbers(&app, 100).await;
    assert_eq!(assert_never_twice(&before_dump, &after_dump, &after_fence), 0);
    let actors: Vec<(String,)> = sqlx::query_as("SELECT DISTINCT actor FROM audit_events WHERE action = 'pool.fenced'")
        .fetch_all(&app.state.db)
        .await
        .unwrap();
    assert_eq!(actors, [("bootstrap".to_string(),)]);
    app.stop().await;
}

/// The pools of [`test_settings_with_pools`] as a config file, for `cifpool` child processes.
fn test_pools_config(dir: &Path) -> PathBuf {
    let file = dir.join("pools.toml");
    let pools: String = [("individual", "1"), ("business", "2")]
        .iter()
        .map(|(name, prefix)| {
            format!("[[pools]]\nname = \"{name}\"\nprefix = \"{prefix}\"\ndigits = 9\ncheck = \"damm\"\nkey_id = \"test-1\"\n")
        })
        .collect();
    std::fs::write(&file, pools).unwrap();
    file
}

/// After a restore, the customer system's list of issued numbers goes in with `cifpool pools
/// reconcile`: the numbers confirmed since the dump (set aside by the fence) are issued again as they
/// were, each pool's counter stays past them, and a second run finds nothing to do.
#[tokio::test]
async fn after_a_restore_the_customer_systems_list_is_reconciled_from_the_command_line() {
    let db = common::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let Restored { before_dump, after_dump, url: restored } = restore_after_confirming(&db, dir.path(), 100, 100).await;
    spawn_passive_app(test_settings_with_pools(&restored)).await.stop().await;

    let config = test_pools_config(dir.path());
    let config = config.to_str().unwrap();
    let list = dir.path().join("issued.txt");
    let lines: Vec<String> = before_dump.iter().chain(&after_dump).map(|c| format!("{c},crm-{c}")).collect();
    std::fs::write(&list, lines.join("\n")).unwrap();
    let list = list.to_str().unwrap();
    let reconcile = |apply: bool| {
        let mut args = vec!["--config", config, "pools", "reconcile", list];
        if apply {
            args.push("--apply");
        }
        let report = common::json_lines(&common::cifpool_cli(&restored, &args));
        let pool = report[0]["pools"].as_array().unwrap().iter().find(|p| p["pool"] == "individual").unwrap().clone();
        (report[0]["applied"].as_bool().unwrap(), pool)
    };
    let (applied, dry) = reconcile(false);
    assert!(!applied);
    assert_eq!(
        (&dry["listed"], &dry["already_issued"], &dry["were_set_aside"]),
        (&json!(200), &json!(100), &json!(100))
    );
    assert_eq!(dry["counter_before"], dry["counter_after"], "the fence already moved the counter past them");
    let (applied, done) = reconcile(true);
    assert!(applied);
    assert_eq!(done, dry);
    let (_, again) = reconcile(true);
    assert_eq!((&again["already_issued"], &again["were_set_aside"]), (&json!(200), &json!(0)));
    let mut conn = sqlx::PgConnection::connect(&restored).await.unwrap();
    let refs: i64 = sqlx::query_scalar("SELECT count(*) FROM cif_issued WHERE customer_ref = 'crm-' || code")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(refs, 200, "the 100 restored rows keep their reference, the 100 added take the listed one");

    std::fs::write(dir.path().join("bad.txt"), format!("{}\nnonsense\n", before_dump[0])).unwrap();
    let bad = dir.path().join("bad.txt");
    let out =
        common::cifpool_cli(&restored, &["--config", config, "pools", "reconcile", bad.to_str().unwrap(), "--apply"]);
    common::assert_cli_error(&out, "1 of 2 lines are not valid codes");
}
