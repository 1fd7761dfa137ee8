//! Identity: every operation of `openapi.yaml` that needs a key, tried with no key, an unknown key, a
//! revoked key, a key lacking its scope and a key holding only its scope; tenant-bound keys; key
//! administration over HTTP; revocation seen by another instance; the development key.

use crate::common;

use std::time::{Duration, Instant};

use cifpool::audit::Actor;
use cifpool::auth::Scope;
use cifpool::internals::api_key;
use common::{
    TEST_ADMIN_TOKEN, TestApp, assert_problem, client_with_key, create_key, fresh_database, spawn_passive_app,
    test_settings_with_pools,
};
use serde_json::{Value, json};

/// The scope an operation needs, by the rules the service documents.
fn needed_scope(method: &str, path: &str) -> Scope {
    match (method, path) {
        (_, p) if p.starts_with("/admin/") => Scope::Admin,
        ("GET", "/v1/pools" | "/v1/cif/{cif}" | "/cif/{cif}") => Scope::CifRead,
        ("POST", p) if p.starts_with("/v1/cif") || p.starts_with("/cif") => Scope::CifReserve,
        ("POST", p) if p.starts_with("/v1/notifications") => Scope::NotifySend,
        ("GET", "/v1/notifications/{id}" | "/v1/notifications/batches/{id}") => Scope::NotifyRead,
        other => panic!("no scope rule for {other:?}: teach tests/it/auth.rs"),
    }
}

/// Every operation of the spec except the open probes, with its path parameters filled in.
fn protected_operations() -> Vec<(String, String, Scope)> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi.yaml");
    let spec: serde_yaml_ng::Value = serde_yaml_ng::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut ops = Vec::new();
    for (path, item) in spec["paths"].as_mapping().unwrap() {
        let path = path.as_str().unwrap();
        if ["/healthz", "/readyz", "/metrics"].contains(&path) {
            continue;
        }
        for (method, _) in item.as_mapping().unwrap() {
            let method = method.as_str().unwrap().to_uppercase();
            if method == "PARAMETERS" {
                continue;
            }
            let scope = needed_scope(&method, path);
            let concrete = path
                .replace("{cif}", "1000000000")
                .replace("{id}", "1")
                .replace("{name}", "nobody")
                .replace("{customer_type}", "individual");
            ops.push((method, concrete, scope));
        }
    }
    assert!(ops.len() >= 20, "the spec lists the service's operations ({} found)", ops.len());
    ops
}

fn request(client: &reqwest::Client, app: &TestApp, method: &str, path: &str) -> reqwest::RequestBuilder {
    let url = app.url(path);
    let builder = match method {
        "GET" => client.get(url),
        "POST" => client.post(url).json(&json!({})),
        "DELETE" => client.delete(url),
        other => panic!("method {other}"),
    };
    builder.header("x-request-id", "auth-matrix")
}

#[tokio::test]
async fn every_protected_operation_checks_key_revocation_and_scope() {
    let db = fresh_database().await;
    let mut settings = test_settings_with_pools(&db.url);
    // Three refused credentials per route, all from this one address: far past the failed-attempt
    // budget, which is not what this test is about (see the limits test below).
    settings.security.failed_auth_per_minute = 0;
    let app = spawn_passive_app(settings).await;
    let anonymous = reqwest::Client::new();
    let unknown = client_with_key(&format!("{}{}", api_key::PREFIX, "0".repeat(64)));
    let all: Vec<String> = Scope::ALL.iter().map(|s| s.as_str().to_string()).collect();
    let new = api_key::NewKey { name: "to-revoke".into(), scopes: all, tenants: None };
    let revoked_key = api_key::create(&app.state.db, &Actor::system(), &new).await.unwrap().key;
    api_key::revoke(&app.state.db, &Actor::system(), "to-revoke").await.unwrap();
    let revoked = client_with_key(&revoked_key);
    for (method, path, scope) in protected_operations() {
        let what = format!("{method} {path}");
        for (who, client) in [("no key", &anonymous), ("unknown key", &unknown), ("revoked key", &revoked)] {
            let r = request(client, &app, &method, &path).send().await.unwrap();
            assert_eq!(
                r.headers().get("www-authenticate").map(|v| v.to_str().unwrap()),
                Some("Bearer"),
                "{what}: {who}"
            );
            assert_problem(r, 401).await;
        }
        let others: Vec<Scope> = Scope::ALL.into_iter().filter(|s| *s != scope).collect();
        let lacking = client_with_key(&create_key(&app.state.db, &others, None).await);
        let r = request(&lacking, &app, &method, &path).send().await.unwrap();
        let problem = assert_problem(r, 403).await;
        assert!(problem["detail"].as_str().unwrap().contains(scope.as_str()), "{what}: 403 names {scope}: {problem}");
        let holder = client_with_key(&create_key(&app.state.db, &[scope], None).await);
        let status = request(&holder, &app, &method, &path).send().await.unwrap().status().as_u16();
        // Authorised: the operation runs and answers for its own reasons (this test sends no valid
        // body or id), never 401/403 and never a server error.
        assert!(matches!(status, 200..=299 | 400 | 404 | 409 | 413 | 415 | 422), "{what} with only {scope}: {status}");
    }
    // The probes stay open.
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(anonymous.get(app.url(path)).send().await.unwrap().status(), 200, "{path}");
    }
    // The bootstrap token is an admin, nothing more.
    let bootstrap = client_with_key(TEST_ADMIN_TOKEN);
    assert_eq!(bootstrap.get(app.url("/admin/keys")).send().await.unwrap().status(), 200);
    assert_problem(bootstrap.get(app.url("/v1/pools")).send().await.unwrap(), 403).await;
}

#[tokio::test]
async fn a_tenant_bound_key_acts_only_for_its_tenants() {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    let bank =
        client_with_key(&create_key(&app.state.db, &[Scope::NotifySend, Scope::NotifyRead], Some(&["bank"])).await);
    let one = |tenant: Option<&str>| {
        let mut body = json!({ "class": "transactional", "recipient": "+84900000001" });
        if let Some(t) = tenant {
            body["tenant"] = json!(t);
        }
        body
    };
    let r = bank.post(app.url("/v1/notifications")).json(&one(Some("shop"))).send().await.unwrap();
    let problem = assert_problem(r, 403).await;
    assert!(problem["detail"].as_str().unwrap().contains("shop"), "{problem}");
    // No tenant named: the key's only tenant.
    let r = bank.post(app.url("/v1/notifications")).json(&one(None)).send().await.unwrap();
    assert_eq!(r.status(), 202);
    let id = r.json::<Value>().await.unwrap()["id"].as_i64().unwrap();
    let job: Value = bank.get(app.url(&format!("/v1/notifications/{id}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(job["tenant"], "bank");
    // A batch with one job for another tenant is refused whole.
    let batch = json!({ "class": "promo", "tenant": "bank", "jobs": [
        { "recipient": "a" }, { "recipient": "b", "tenant": "shop" } ] });
    assert_problem(bank.post(app.url("/v1/notifications/batch")).json(&batch).send().await.unwrap(), 403).await;
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM notification_jobs").fetch_one(&db.pool).await.unwrap();
    assert_eq!(jobs, 1, "the refused batch wrote nothing");
    // Another tenant's job, read or canceled, answers exactly as a job that does not exist: the probe
    // learns neither that it exists nor whose it is.
    let r = app.client.post(app.url("/v1/notifications")).json(&one(Some("shop"))).send().await.unwrap();
    let shop_id = r.json::<Value>().await.unwrap()["id"].as_i64().unwrap();
    let missing = shop_id + 1000;
    for (verb, path) in [("GET", ""), ("POST", "/cancel")] {
        let ask = |id: i64| {
            let url = app.url(&format!("/v1/notifications/{id}{path}"));
            if verb == "GET" { bank.get(url) } else { bank.post(url) }
        };
        let theirs = assert_problem(ask(shop_id).send().await.unwrap(), 404).await;
        let nobodys = assert_problem(ask(missing).send().await.unwrap(), 404).await;
        let detail = |p: &Value, id: i64| p["detail"].as_str().unwrap().replace(&id.to_string(), "N");
        assert_eq!(detail(&theirs, shop_id), detail(&nobodys, missing), "{verb} {path}");
        assert!(!theirs.to_string().contains("shop"), "{theirs}");
    }
    assert_eq!(
        sqlx::query_scalar::<_, String>("SELECT status FROM notification_jobs WHERE id = $1")
            .bind(shop_id)
            .fetch_one(&db.pool)
            .await
            .unwrap(),
        "pending",
        "the probe canceled nothing"
    );
    // A key bound to two tenants must name one.
    let two = client_with_key(&create_key(&app.state.db, &[Scope::NotifySend], Some(&["bank", "shop"])).await);
    assert_problem(two.post(app.url("/v1/notifications")).json(&one(None)).send().await.unwrap(), 422).await;
    assert_eq!(two.post(app.url("/v1/notifications")).json(&one(Some("shop"))).send().await.unwrap().status(), 202);
}

/// One key over its request rate gets 429 with `Retry-After` while another key is served; an address
/// that keeps presenting unknown keys gets 429 before any look-up, even with a good key.
#[tokio::test]
async fn a_busy_key_and_a_guessing_address_are_limited_without_touching_others() {
    let db = fresh_database().await;
    let mut settings = test_settings_with_pools(&db.url);
    settings.security.requests_per_second_per_key = 3;
    settings.security.failed_auth_per_minute = 5;
    let app = spawn_passive_app(settings).await;
    let busy = client_with_key(&create_key(&db.pool, &[Scope::CifRead], None).await);
    let calm = client_with_key(&create_key(&db.pool, &[Scope::CifRead], None).await);
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let r = busy.get(app.url("/v1/pools")).send().await.unwrap();
        if r.status() == 429 {
            assert!(r.headers().get("retry-after").is_some());
            let problem = assert_problem(r, 429).await;
            assert!(problem["detail"].as_str().unwrap().contains("requests_per_second_per_key"), "{problem}");
            statuses.push(429);
        } else {
            statuses.push(r.status().as_u16());
        }
    }
    assert!(statuses.contains(&429) && statuses[0] == 200, "{statuses:?}");
    assert!(statuses.iter().all(|s| matches!(s, 200 | 429)), "{statuses:?}");
    assert_eq!(calm.get(app.url("/v1/pools")).send().await.unwrap().status(), 200, "another key is served");

    for i in 0..6 {
        let guess = client_with_key(&format!("cfp_{i:064x}"));
        let status = guess.get(app.url("/v1/pools")).send().await.unwrap().status().as_u16();
        assert_eq!(status, 401, "guess {i}: within the budget, and the one that uses it up");
    }
    let guess = client_with_key(&format!("cfp_{:064x}", 99));
    let problem = assert_problem(guess.get(app.url("/v1/pools")).send().await.unwrap(), 429).await;
    assert!(problem["detail"].as_str().unwrap().contains("failed authentications"), "{problem}");
    // The real callers behind the same address keep working: a key this instance knows is served
    // (no look-up); one it has not seen yet waits out the address's minute like a guess.
    assert_eq!(calm.get(app.url("/v1/pools")).send().await.unwrap().status(), 200, "a known key is served");
    let unseen = client_with_key(&create_key(&db.pool, &[Scope::CifRead], None).await);
    let problem = assert_problem(unseen.get(app.url("/v1/pools")).send().await.unwrap(), 429).await;
    assert!(problem["detail"].as_str().unwrap().contains("failed authentications"), "{problem}");
}

/// A flood of made-up secrets fills only the cache of secrets that name no key: a real key stays
/// cached (its next request asks nothing of the database) however many strangers come.
#[tokio::test]
async fn made_up_secrets_cannot_flush_a_real_key_from_the_cache() {
    use cifpool::auth::Authenticator;
    let db = fresh_database().await;
    let real = create_key(&db.pool, &[Scope::CifRead], None).await;
    let auth = Authenticator::with_capacity(db.pool.clone(), None, tokio_util::task::TaskTracker::new(), 50);
    let caller = auth.authenticate(Some(&real)).await.unwrap();
    for i in 0..200 {
        let stranger = format!("cfp_{i:064x}");
        assert!(auth.authenticate(Some(&stranger)).await.is_err());
    }
    // Revoked in the database: a cached key keeps working until its entry expires, a flushed one
    // would be read again and refused.
    sqlx::query("UPDATE api_keys SET revoked_at = now()").execute(&db.pool).await.unwrap();
    assert_eq!(auth.authenticate(Some(&real)).await.unwrap(), caller, "still served from the cache");
}

#[tokio::test]
async fn keys_are_created_listed_and_revoked_over_http_and_a_revocation_reaches_another_instance() {
    let db = fresh_database().await;
    let a = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    let b = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    let admin = client_with_key(TEST_ADMIN_TOKEN);
    let create = |body: Value| admin.post(a.url("/admin/keys")).json(&body).send();

    let r = create(json!({ "name": "onboarding-pod", "scopes": ["cif:reserve", "cif:read"] })).await.unwrap();
    assert_eq!(r.status(), 201);
    let created: Value = r.json().await.unwrap();
    let secret = created["key"].as_str().unwrap().to_string();
    assert!(secret.starts_with("cfp_") && secret.len() == 68, "{secret}");
    assert_eq!(created["scopes"], json!(["cif:reserve", "cif:read"]));
    // The database holds the digest only.
    let stored: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM api_keys WHERE name = 'onboarding-pod' AND digest = sha256(convert_to($1, 'UTF8'))",
    )
    .bind(&secret)
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(stored, 1);
    let dump: String =
        sqlx::query_scalar("SELECT string_agg(t::text, ' ') FROM api_keys t").fetch_one(&db.pool).await.unwrap();
    assert!(!dump.contains(&secret[4..]), "the secret is not stored");

    for (body, status) in [
        (json!({ "name": "onboarding-pod", "scopes": ["cif:read"] }), 409),
        (json!({ "name": "", "scopes": ["cif:read"] }), 422),
        (json!({ "name": "x".repeat(65), "scopes": ["cif:read"] }), 422),
        (json!({ "name": "k", "scopes": ["cif:write"] }), 422),
        (json!({ "name": "k", "scopes": [] }), 422),
    ] {
        assert_problem(create(body.clone()).await.unwrap(), status).await;
    }
    let listed: Value = admin.get(a.url("/admin/keys")).send().await.unwrap().json().await.unwrap();
    let text = listed.to_string();
    assert!(text.contains("onboarding-pod") && !text.contains(&secret) && !text.contains("digest"), "{listed}");

    // The key works on instance b (and is cached there), then is revoked through instance a.
    let pod = client_with_key(&secret);
    assert_eq!(pod.get(b.url("/v1/pools")).send().await.unwrap().status(), 200);
    assert_problem(admin.delete(a.url("/admin/keys/nobody")).send().await.unwrap(), 404).await;
    let revoked_at = Instant::now();
    assert_eq!(admin.delete(a.url("/admin/keys/onboarding-pod")).send().await.unwrap().status(), 204);
    assert_eq!(admin.delete(a.url("/admin/keys/onboarding-pod")).send().await.unwrap().status(), 204, "again is fine");
    assert_eq!(
        pod.get(a.url("/v1/pools")).send().await.unwrap().status(),
        401,
        "refused at once where it was never cached"
    );
    loop {
        let status = pod.get(b.url("/v1/pools")).send().await.unwrap().status();
        if status == 401 {
            break;
        }
        assert_eq!(status, 200);
        assert!(revoked_at.elapsed() < Duration::from_secs(8), "instance b still accepts the key after 8 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The cache keeps a key 5 s; the rest is this loop's polling and a loaded machine's scheduling.
    assert!(revoked_at.elapsed() <= Duration::from_millis(6_500), "refused after {:?}", revoked_at.elapsed());
    assert_problem(create(json!({ "name": "onboarding-pod", "scopes": ["cif:read"] })).await.unwrap(), 409).await;

    let last_used: Option<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT last_used_at FROM api_keys WHERE name = 'onboarding-pod'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert!(last_used.is_some(), "use is recorded");
}

#[tokio::test]
async fn the_unversioned_cif_paths_are_the_v1_handlers() {
    let db = fresh_database().await;
    let app = spawn_passive_app(test_settings_with_pools(&db.url)).await;
    cifpool::internals::refill::refill(
        &app.state.db,
        app.state.cif.pools().get("individual").unwrap(),
        cifpool::internals::refill::RefillOptions { force: true, ..Default::default() },
    )
    .await
    .unwrap();
    let r = app.client.post(app.url("/cif")).json(&json!({ "customer_type": "individual" })).send().await.unwrap();
    assert_eq!(r.status(), 201);
    let held: Value = r.json().await.unwrap();
    let cif = held["cif"].as_str().unwrap();
    let old: Value = app.client.get(app.url(&format!("/cif/{cif}"))).send().await.unwrap().json().await.unwrap();
    let new: Value = app.client.get(app.url(&format!("/v1/cif/{cif}"))).send().await.unwrap().json().await.unwrap();
    assert_eq!(old, new);
    let body = json!({ "reservation_token": held["reservation_token"] });
    assert_eq!(app.client.post(app.url(&format!("/cif/{cif}/extend"))).json(&body).send().await.unwrap().status(), 200);
    assert_eq!(
        app.client.post(app.url(&format!("/cif/{cif}/confirm"))).json(&body).send().await.unwrap().status(),
        200
    );
    assert_problem(reqwest::Client::new().post(app.url("/cif")).json(&json!({})).send().await.unwrap(), 401).await;
}

#[tokio::test]
async fn the_development_key_is_made_only_for_the_embedded_database_and_only_once() {
    let db = fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let mut settings = common::test_settings(&db.url);
    assert!(cifpool::auth::ensure_dev_key(&db.pool, &settings).await.is_err(), "never with database.url");
    settings.database.url = None;
    settings.database.data_dir = dir.path().join("pg");
    let path = cifpool::auth::ensure_dev_key(&db.pool, &settings).await.unwrap().expect("a key was made");
    assert_eq!(path, dir.path().join("dev-api-key"));
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    let secret = std::fs::read_to_string(&path).unwrap().trim().to_string();
    let found = api_key::find(&db.pool, &api_key::digest(&secret)).await.unwrap().expect("the file holds the key");
    assert_eq!(found.scopes.0, Scope::ALL);
    assert!(cifpool::auth::ensure_dev_key(&db.pool, &settings).await.unwrap().is_none(), "a key exists: none made");
}

/// The scope table of docs/API.md names every `/v1` operation under the scope the service asks for it
/// (the unversioned `/cif` twins are covered by the words "unversioned `/cif` twins" in their row).
#[test]
fn the_documented_scope_table_matches_what_each_operation_needs() {
    let readme = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/API.md")).unwrap();
    let row = |scope: Scope| -> String {
        let start = format!("| `{}` |", scope.as_str());
        let line =
            readme.lines().find(|l| l.starts_with(&start)).unwrap_or_else(|| panic!("no docs/API.md row {start}"));
        // `POST /v1/cif/{cif}/confirm\|release\|extend` names three operations.
        let mut expanded = String::new();
        for item in line.split('`') {
            let mut alternatives = item.split("\\|");
            let first = alternatives.next().unwrap_or_default();
            expanded.push_str(first);
            let stem = first.rsplit_once('/').map_or("", |(stem, _)| stem);
            for other in alternatives {
                expanded.push_str(&format!(" {stem}/{other}"));
            }
            expanded.push(' ');
        }
        expanded
    };
    let spec: serde_yaml_ng::Value = serde_yaml_ng::from_str(
        &std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi.yaml")).unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for (path, item) in spec["paths"].as_mapping().unwrap() {
        let path = path.as_str().unwrap();
        if path.starts_with("/admin/") || ["/healthz", "/readyz", "/metrics"].contains(&path) {
            continue;
        }
        for (method, _) in item.as_mapping().unwrap() {
            let method = method.as_str().unwrap().to_uppercase();
            let text = row(needed_scope(&method, path));
            let named = if path.starts_with("/cif") {
                text.contains("unversioned") && text.contains(&format!("{method} /v1{path}"))
                    || text.contains(&format!("{method} {path}"))
            } else {
                text.contains(&format!("{method} {path}"))
            };
            assert!(
                named,
                "docs/API.md's row for {:?} does not name {method} {path}: {text}",
                needed_scope(&method, path)
            );
            checked += 1;
        }
    }
    assert!(checked >= 14, "{checked} operations checked");
}
