//! The embedded cluster's start-up errors: they say what is wrong and what to do, before initdb or
//! postgres fail with messages of their own.

use cifpool::db::embedded::{EmbeddedError, EmbeddedOptions, EmbeddedPostgres};

#[test]
fn a_data_directory_of_an_uninstalled_major_version_is_named_not_opened_with_another() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().join("pg");
    std::fs::create_dir(&data_dir).unwrap();
    // A cluster made by a PostgreSQL this machine does not have (no major 9 is ever installed here).
    std::fs::write(data_dir.join("PG_VERSION"), "9\n").unwrap();
    let err = EmbeddedPostgres::start(&EmbeddedOptions::durable(&data_dir)).unwrap_err();
    assert!(matches!(err, EmbeddedError::VersionNotInstalled { major: 9, .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains("PostgreSQL 9") && text.contains("postgresql-9") && text.contains("pg_upgrade"), "{text}");
}

#[test]
fn as_root_a_parent_the_postgres_user_cannot_enter_is_named() {
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: the server runs as this user, who can enter its own directories");
        return;
    }
    // What `mktemp -d` gives: mode 0700, owned by root.
    let private = tempfile::tempdir().unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(private.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let data_dir = private.path().join("cifpool").join("pg");
    let err = EmbeddedPostgres::start(&EmbeddedOptions::durable(&data_dir)).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, EmbeddedError::ParentNotTraversable { .. }), "{text}");
    assert!(text.contains(&private.path().display().to_string()) && text.contains("chmod o+x"), "{text}");
    assert!(!data_dir.join("PG_VERSION").exists(), "nothing was initialised");
}
