//! `cifpool keys create|list|revoke` and `cifpool audit` against a database, as ops run them.

use crate::common;

use common::{assert_cli_error, cifpool_cli as cifpool, json_lines as lines};

#[tokio::test]
async fn keys_are_managed_and_audited_from_the_command_line() {
    let db = common::fresh_database().await;
    let created = lines(&cifpool(
        &db.url,
        &["keys", "create", "crm", "--scopes", "notify:send,notify:read", "--tenants", "bank"],
    ));
    let secret = created[0]["key"].as_str().unwrap();
    assert!(secret.starts_with("cfp_"));
    assert_eq!(created[0]["tenants"], serde_json::json!(["bank"]));
    let bad = cifpool(&db.url, &["keys", "create", "crm", "--scopes", "notify:send"]);
    // A name is never reused.
    assert_cli_error(&bad, "already exists");
    let listed = lines(&cifpool(&db.url, &["keys", "list"]));
    assert_eq!(listed.len(), 1);
    assert!(!listed[0].to_string().contains(secret) && listed[0]["revoked_at"].is_null());
    assert!(cifpool(&db.url, &["keys", "revoke", "crm"]).status.success());
    assert!(!lines(&cifpool(&db.url, &["keys", "list"]))[0]["revoked_at"].is_null());
    assert_cli_error(&cifpool(&db.url, &["keys", "revoke", "nobody"]), "no key named \"nobody\"");
    let events = lines(&cifpool(&db.url, &["audit", "--action", "key.revoked"]));
    assert_eq!(events.len(), 1);
    assert!(events[0]["actor"].as_str().unwrap().starts_with("cli:"), "{}", events[0]);
    assert_eq!(events[0]["detail"]["name"], "crm");
}
