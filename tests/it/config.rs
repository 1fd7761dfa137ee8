//! Configuration layering and validation, in-process and through `cifpool config check`.

use std::io::Write;
use std::process::Command;

use cifpool::config::{ConfigError, Settings};

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn toml_file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

fn error_text(result: Result<Settings, ConfigError>) -> String {
    result.expect_err("configuration should have been refused").to_string()
}

#[test]
fn defaults_load_and_validate() {
    let s = Settings::load_with_env(None, Vec::new()).unwrap();
    assert_eq!(s.server.listen.to_string(), "127.0.0.1:8080");
    assert!(s.database.url.is_none(), "default is the embedded database");
}

#[test]
fn file_then_env_layering() {
    let f = toml_file("[server]\nlisten = \"127.0.0.1:9000\"\nbody_limit_bytes = 4096\n");
    let s = Settings::load_with_env(Some(f.path()), Vec::new()).unwrap();
    assert_eq!(s.server.listen.port(), 9000);
    assert_eq!(s.server.body_limit_bytes, 4096);

    let s = Settings::load_with_env(
        Some(f.path()),
        env(&[("CIFPOOL_SERVER__LISTEN", "0.0.0.0:9100"), ("CIFPOOL_MASTER_KEY", "not a config key")]),
    )
    .unwrap();
    assert_eq!(s.server.listen.to_string(), "0.0.0.0:9100", "env wins over the file");
    assert_eq!(s.server.body_limit_bytes, 4096, "file value kept where env is silent");
}

#[test]
fn wrong_type_names_the_key() {
    let msg = error_text(Settings::load_with_env(None, env(&[("CIFPOOL_DATABASE__MAX_CONNECTIONS", "many")])));
    assert!(msg.contains("database.max_connections"), "{msg}");
}

#[test]
fn bad_address_names_the_key() {
    let f = toml_file("[server]\nlisten = \"not an address\"\n");
    let msg = error_text(Settings::load_with_env(Some(f.path()), Vec::new()));
    assert!(msg.contains("server.listen"), "{msg}");
}

#[test]
fn unknown_key_is_refused() {
    let f = toml_file("[server]\nlisen = \"127.0.0.1:1\"\n");
    let msg = error_text(Settings::load_with_env(Some(f.path()), Vec::new()));
    assert!(msg.contains("lisen"), "{msg}");
    // Inside a worker group too (a misspelt key there once fell back to the default silently).
    let f = toml_file("[[queue.groups]]\nname = \"all\"\nsize = 4\nclasses = [\"otp\"]\norder = \"fifo\"\nsise = 8\n");
    let msg = error_text(Settings::load_with_env(Some(f.path()), Vec::new()));
    assert!(msg.contains("sise"), "{msg}");
}

#[test]
fn rule_violations_name_the_key() {
    let cases = [
        ("[database]\nmin_connections = 50\nmax_connections = 2\n", "database.min_connections"),
        ("[database]\nurl = \"mysql://x\"\n", "database.url"),
        ("[server]\nbody_limit_bytes = 10\n", "server.body_limit_bytes"),
        ("[security]\nadmin_token = \"short\"\n", "security.admin_token"),
        ("[log]\nlevel = \"=?=\"\n", "log.level"),
    ];
    for (text, key) in cases {
        let f = toml_file(text);
        let msg = error_text(Settings::load_with_env(Some(f.path()), Vec::new()));
        assert!(msg.contains(key), "expected {key} in {msg:?}");
    }
}

#[test]
fn a_schedule_that_never_fires_is_refused() {
    let f = toml_file("[queue]\nsweep_schedule = \"0 0 0 30 2 *\"\n");
    let msg = error_text(Settings::load_with_env(Some(f.path()), Vec::new()));
    assert!(msg.contains("queue.sweep_schedule") && msg.contains("never fires"), "{msg}");
    // The tests' own "not during a test" schedule is one that fires.
    let f = toml_file(&format!("[queue]\nsweep_schedule = \"{}\"\n", crate::common::NEVER_DURING_A_TEST));
    Settings::load_with_env(Some(f.path()), Vec::new()).expect("February 29th comes every four years");
}

#[test]
fn missing_config_file_is_an_error() {
    let msg = error_text(Settings::load_with_env(Some(std::path::Path::new("/nonexistent/cifpool.toml")), Vec::new()));
    assert!(msg.contains("/nonexistent/cifpool.toml"), "{msg}");
}

fn cifpool() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cifpool"));
    for (k, _) in std::env::vars() {
        if k.starts_with("CIFPOOL_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

#[test]
fn config_check_prints_effective_config_with_secrets_redacted() {
    let out = cifpool()
        .args(["config", "check"])
        .env("CIFPOOL_SECURITY__ADMIN_TOKEN", "super-secret-admin-token-123")
        .env("CIFPOOL_DATABASE__URL", "postgres://app:hunter2secret@db.internal:5432/cifpool?password=hunter2secret")
        .env("CIFPOOL_QUEUE__PROVIDERS__SMS__ALLOW_NOOP", "true")
        .env("CIFPOOL_QUEUE__PROVIDERS__PUSH__ALLOW_NOOP", "true")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("listen = \"127.0.0.1:8080\""), "{stdout}");
    assert!(stdout.contains("db.internal"), "the url's host is shown: {stdout}");
    assert!(!stdout.contains("super-secret-admin-token-123"), "{stdout}");
    assert!(!stdout.contains("hunter2secret"), "{stdout}");
    assert!(stdout.contains("[redacted]"), "{stdout}");
}

#[test]
fn config_check_fails_nonzero_naming_the_key() {
    let out = cifpool().args(["config", "check"]).env("CIFPOOL_SERVER__REQUEST_TIMEOUT", "forever").output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("server.request_timeout"), "{stderr}");
}

#[test]
fn every_message_class_needs_a_worker() {
    let f = toml_file("[queue]\nstrategy = \"bulkhead\"\nreserved = 0\n");
    let msg = error_text(Settings::load_with_env(Some(f.path()), Vec::new()));
    assert!(msg.contains("queue.reserved") && msg.contains("otp"), "{msg}");
    let f = toml_file("[queue]\nstrategy = \"bulkhead\"\nworkers = 8\nreserved = 8\n");
    let msg = error_text(Settings::load_with_env(Some(f.path()), Vec::new()));
    assert!(msg.contains("promo") || msg.contains("transactional"), "{msg}");
    let f = toml_file("[queue]\nstrategy = \"priority\"\nworkers = 8\nreserved = 0\n");
    Settings::load_with_env(Some(f.path()), Vec::new()).unwrap();
}

#[test]
fn serve_with_an_external_database_refuses_noop_providers_unless_allowed() {
    let url = ("CIFPOOL_DATABASE__URL", "postgres://cifpool@db.internal/cifpool");
    let s = Settings::load_with_env(None, env(&[url])).unwrap();
    let refused = s.check_for_serve().expect_err("noop providers with a real database").to_string();
    assert!(refused.contains("queue.providers.push.allow_noop"), "{refused}");
    assert!(refused.contains("goes nowhere"), "{refused}");
    // `config check` says so too, and fails.
    let out = cifpool().args(["config", "check"]).env(url.0, url.1).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("queue.providers.push.allow_noop"));

    let allowed = Settings::load_with_env(
        None,
        env(&[
            url,
            ("CIFPOOL_QUEUE__PROVIDERS__PUSH__ALLOW_NOOP", "true"),
            ("CIFPOOL_QUEUE__PROVIDERS__SMS__KIND", "http"),
            ("CIFPOOL_QUEUE__PROVIDERS__SMS__URL", "https://sms.internal"),
        ]),
    )
    .unwrap();
    allowed.check_for_serve().unwrap();
    // The embedded database is local development: the no-op default is fine there.
    Settings::load_with_env(None, Vec::new()).unwrap().check_for_serve().unwrap();
}

#[tokio::test]
async fn serve_does_not_start_with_a_noop_provider_and_an_external_database() {
    let mut s = Settings::load_with_env(None, Vec::new()).unwrap();
    s.database.url = Some("postgres://cifpool@127.0.0.1:1/never-reached".to_string().into());
    let e = cifpool::startup::Application::build(s).await.err().expect("refused before connecting");
    assert!(format!("{e:#}").contains("allow_noop"), "{e:#}");
}

#[test]
fn secrets_can_come_from_files_named_by_file_variables() {
    use secrecy::ExposeSecret;
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, content: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, content).unwrap();
        path.to_str().unwrap().to_string()
    };
    let url = write("database-url", "postgres://cifpool:s3cret@db:5432/cifpool\n");
    let token = write("admin-token", "a-long-admin-token-from-a-file\n");
    let auth = write("sms-authorization", "Bearer gateway-secret");
    let env = |extra: Vec<(&str, String)>| {
        let mut env = vec![
            ("CIFPOOL_DATABASE__URL_FILE".to_string(), url.clone()),
            ("CIFPOOL_SECURITY__ADMIN_TOKEN_FILE".to_string(), token.clone()),
            ("CIFPOOL_QUEUE__PROVIDERS__SMS__AUTHORIZATION_FILE".to_string(), auth.clone()),
        ];
        env.extend(extra.into_iter().map(|(k, v)| (k.to_string(), v)));
        env
    };
    let s = Settings::load_with_env(None, env(vec![])).unwrap();
    assert_eq!(s.database.url.as_ref().unwrap().expose_secret(), "postgres://cifpool:s3cret@db:5432/cifpool");
    assert_eq!(s.security.admin_token.as_ref().unwrap().expose_secret(), "a-long-admin-token-from-a-file");
    let sms = &s.queue.providers["sms"];
    assert_eq!(sms.authorization.as_ref().unwrap().expose_secret(), "Bearer gateway-secret");
    // The master key file keeps its own meaning (a path), not a secret read by the loader.
    let s = Settings::load_with_env(None, env(vec![("CIFPOOL_SECURITY__MASTER_KEY_FILE", "/run/k".into())])).unwrap();
    assert_eq!(s.security.master_key_file.as_deref(), Some(std::path::Path::new("/run/k")));

    // Both ways at once, or a file that cannot be read: an error naming the setting, never the secret.
    let both = Settings::load_with_env(None, env(vec![("CIFPOOL_DATABASE__URL", "postgres://x@y/z".into())]));
    let message = both.unwrap_err().to_string();
    assert!(message.contains("database.url") && message.contains("CIFPOOL_DATABASE__URL_FILE"), "{message}");
    let missing = dir.path().join("absent").to_str().unwrap().to_string();
    let env = vec![("CIFPOOL_SECURITY__ADMIN_TOKEN_FILE".to_string(), missing)];
    let message = Settings::load_with_env(None, env).unwrap_err().to_string();
    assert!(message.contains("security.admin_token") && message.contains("cannot read"), "{message}");
    assert!(!message.contains("a-long-admin-token"), "{message}");
}

/// Every key the code reads is a row of docs/CONFIGURATION.md, and every row is a key the code reads:
/// the keys come from the serialized settings (defaults plus one worker group, so the group's keys show),
/// lists as `pools[].name`, the providers' map as `queue.providers.<name>.kind`.
#[test]
fn every_configuration_key_is_documented() {
    fn flatten(value: &serde_json::Value, path: &str, keys: &mut std::collections::BTreeSet<String>) {
        let leaf_maps = ["queue.tenant_weights"];
        match value {
            serde_json::Value::Object(map) if !leaf_maps.contains(&path) => {
                for (k, v) in map {
                    // Providers are a map by name: every provider has the same keys.
                    let child = match path {
                        "" => k.clone(),
                        "queue.providers" => format!("{path}.<name>"),
                        _ => format!("{path}.{k}"),
                    };
                    flatten(v, &child, keys);
                }
            }
            serde_json::Value::Array(items) if items.first().is_some_and(|i| i.is_object()) => {
                for item in items {
                    flatten(item, &format!("{path}[]"), keys);
                }
            }
            _ => {
                keys.insert(path.to_string());
            }
        }
    }
    let groups = toml_file(
        "[[queue.groups]]\nname = \"all\"\nsize = 4\nclasses = [\"otp\", \"transactional\", \"promo\"]\norder = \"priority\"\n",
    );
    let settings = Settings::load_with_env(Some(groups.path()), Vec::new()).unwrap();
    let mut in_code = std::collections::BTreeSet::new();
    flatten(&serde_json::to_value(&settings).unwrap(), "", &mut in_code);
    let doc_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/CONFIGURATION.md");
    let doc = std::fs::read_to_string(doc_path).unwrap();
    let documented: std::collections::BTreeSet<String> = doc
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once("` |").map(|(key, _)| key.to_string()))
        .filter(|key| key != "key")
        .collect();
    let missing: Vec<_> = in_code.difference(&documented).collect();
    // A list of tables may have a row of its own (`queue.groups`) beside its keys' rows.
    let is_list = |key: &String| in_code.iter().any(|k| k.starts_with(&format!("{key}[]")));
    let stale: Vec<_> = documented.difference(&in_code).filter(|key| !is_list(key)).collect();
    assert!(missing.is_empty(), "keys the code reads that docs/CONFIGURATION.md lacks: {missing:?}");
    assert!(stale.is_empty(), "keys docs/CONFIGURATION.md names that the code does not read: {stale:?}");
    assert!(in_code.len() > 60, "{} keys", in_code.len());
}
