//! The catalog of assembled statements: `docs/SQL.md` shows each one as the code builds it, and every
//! one of them prepares against the migrated schema.

use crate::common;

#[test]
fn docs_sql_md_is_the_catalog_the_code_builds() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/SQL.md");
    let rendered = cifpool::sql_catalog::render();
    if std::env::var_os("CIFPOOL_WRITE_SQL_CATALOG").is_some() {
        std::fs::write(path, &rendered).unwrap();
    }
    let written = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        written == rendered,
        "docs/SQL.md differs from the statements the code builds: rewrite it with \
         CIFPOOL_WRITE_SQL_CATALOG=1 cargo test --test it sql_catalog"
    );
}

#[tokio::test]
async fn every_assembled_statement_prepares_against_the_schema() {
    let db = common::fresh_database().await;
    let catalog = cifpool::sql_catalog::catalog();
    assert!(catalog.len() > 30, "the catalog lists {} statements", catalog.len());
    let mut failed = Vec::new();
    for (i, statement) in catalog.iter().enumerate() {
        let mut tx = db.pool.begin().await.unwrap();
        for setup in cifpool::sql_catalog::session_setup() {
            sqlx::raw_sql(setup).execute(&mut *tx).await.unwrap();
        }
        // PREPARE parses, resolves every name and infers every parameter's type, without running it.
        let prepare = format!("PREPARE catalog_{i} AS {}", statement.text);
        if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(prepare)).execute(&mut *tx).await {
            failed.push(format!("{}: {e}", statement.name));
        }
        tx.rollback().await.unwrap();
    }
    assert!(failed.is_empty(), "statements that do not prepare:\n{}", failed.join("\n"));
}
