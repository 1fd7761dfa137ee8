//! The operations console over HTTP, as a browser uses it (cookies, forms, redirects): sign-in and its
//! cookie, every page, every action with its audit row, and the refusals (no session, no or a wrong
//! CSRF token, another origin, a revoked key).

use crate::common;

use cifpool::auth::Scope;
use cifpool::internals::fake_provider::FakeBehaviour;
use cifpool::internals::worker::Outcome;
use cifpool::queue::policy::Strategy;
use common::queue_env::{Env, drain, env, env_with};
use common::{TEST_ADMIN_TOKEN, create_key};
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, LOCATION, SET_COOKIE};

/// A browser without script: keeps the session cookie, does not follow redirects (tests read them).
struct Browser {
    http: reqwest::Client,
    base: String,
    cookie: Option<String>,
}

struct Page {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Page {
    fn location(&self) -> &str {
        self.headers.get(LOCATION).and_then(|v| v.to_str().ok()).unwrap_or("")
    }

    /// The CSRF token the page's forms carry.
    fn csrf(&self) -> String {
        let re = regex::Regex::new(r#"name="csrf" value="([0-9a-f]{64})""#).unwrap();
        re.captures(&self.body).unwrap_or_else(|| panic!("no CSRF token in {}", self.body))[1].to_string()
    }
}

impl Browser {
    fn new(e: &Env) -> Browser {
        let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
        Browser { http, base: e.app.base.clone(), cookie: None }
    }

    async fn send(&mut self, request: reqwest::RequestBuilder) -> Page {
        let request = match &self.cookie {
            Some(c) => request.header("cookie", c),
            None => request,
        };
        let response = request.send().await.unwrap();
        let headers = response.headers().clone();
        if let Some(set) = headers.get(SET_COOKIE).and_then(|v| v.to_str().ok()) {
            let pair = set.split(';').next().unwrap().to_string();
            self.cookie = if pair.ends_with('=') { None } else { Some(pair) };
        }
        Page { status: response.status(), headers, body: response.text().await.unwrap() }
    }

    async fn get(&mut self, path: &str) -> Page {
        let request = self.http.get(format!("{}{path}", self.base));
        self.send(request).await
    }

    async fn post(&mut self, path: &str, form: &[(&str, &str)]) -> Page {
        let request = self.http.post(format!("{}{path}", self.base)).form(form);
        self.send(request).await
    }

    /// Posts `form` with the CSRF token of the page at `from`.
    async fn act(&mut self, from: &str, path: &str, form: &[(&str, &str)]) -> Page {
        let csrf = self.get(from).await.csrf();
        let mut fields = vec![("csrf", csrf.as_str())];
        fields.extend_from_slice(form);
        self.post(path, &fields).await
    }

    async fn sign_in(&mut self, key: &str) -> Page {
        self.post("/console/sign-in", &[("key", key)]).await
    }
}

async fn audit_rows(e: &Env, action: &str) -> Vec<(String, Option<serde_json::Value>)> {
    sqlx::query_as("SELECT actor, detail FROM audit_events WHERE action = $1 ORDER BY id")
        .bind(action)
        .fetch_all(&e.db.pool)
        .await
        .unwrap()
}

async fn key_name(e: &Env, key: &str) -> String {
    let digest = cifpool::internals::api_key::digest(key);
    sqlx::query_scalar("SELECT name FROM api_keys WHERE digest = $1")
        .bind(digest.as_slice())
        .fetch_one(&e.db.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn signing_in_with_an_admin_key_gives_a_strict_http_only_cookie_and_stores_no_secret() {
    let e = env().await;
    let mut browser = Browser::new(&e);
    let page = browser.sign_in(&e.app.key).await;
    assert_eq!((page.status, page.location()), (StatusCode::SEE_OTHER, "/console/pools"));
    let cookie = page.headers.get(SET_COOKIE).unwrap().to_str().unwrap().to_string();
    assert!(cookie.starts_with("cifpool_console="), "{cookie}");
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/console", "Max-Age=28800"] {
        assert!(cookie.contains(attribute), "{attribute} missing from {cookie}");
    }
    assert!(!cookie.contains("Secure"), "plain HTTP without a TLS proxy: {cookie}");
    let token = browser.cookie.clone().unwrap().split_once('=').unwrap().1.to_string();

    // Postgres holds the token's digest and the key's name, never the token or the key.
    let rows: Vec<(Vec<u8>, Option<String>)> =
        sqlx::query_as("SELECT digest, key_name FROM console_sessions").fetch_all(&e.db.pool).await.unwrap();
    let name = key_name(&e, &e.app.key).await;
    assert_eq!(rows, vec![(cifpool::internals::api_key::digest(&token).to_vec(), Some(name.clone()))]);
    let dump: String = sqlx::query_scalar("SELECT string_agg(t::text, ' ') FROM console_sessions t")
        .fetch_one(&e.db.pool)
        .await
        .unwrap();
    assert!(!dump.contains(&token) && !dump.contains(&e.app.key[4..]), "{dump}");
    assert_eq!(audit_rows(&e, "console.signed_in").await, vec![(name, None)]);

    // Behind a TLS-terminating proxy the cookie is Secure.
    let mut behind_tls = Browser::new(&e);
    let request = behind_tls
        .http
        .post(e.app.url("/console/sign-in"))
        .header("x-forwarded-proto", "https")
        .form(&[("key", &e.app.key)]);
    let page = behind_tls.send(request).await;
    assert!(page.headers.get(SET_COOKIE).unwrap().to_str().unwrap().ends_with("; Secure"));

    // The bootstrap admin token signs in too, as `bootstrap`.
    let mut ops = Browser::new(&e);
    assert_eq!(ops.sign_in(TEST_ADMIN_TOKEN).await.status, StatusCode::SEE_OTHER);
    assert!(ops.get("/console/pools").await.body.contains(">bootstrap</span>"));
}

#[tokio::test]
async fn a_wrong_key_or_one_without_admin_gets_the_form_again_and_no_session() {
    let e = env().await;
    let mut browser = Browser::new(&e);
    let page = browser.sign_in("cfp_0000000000000000000000000000000000000000000000000000000000000000").await;
    assert_eq!(page.status, StatusCode::UNAUTHORIZED);
    assert!(page.body.contains("That key is not accepted.") && page.headers.get(SET_COOKIE).is_none());
    let reserver = create_key(&e.db.pool, &[Scope::CifReserve, Scope::CifRead], None).await;
    let page = browser.sign_in(&reserver).await;
    assert_eq!(page.status, StatusCode::FORBIDDEN);
    assert!(page.body.contains("admin scope"), "{}", page.body);
    let sessions: i64 =
        sqlx::query_scalar("SELECT count(*) FROM console_sessions").fetch_one(&e.db.pool).await.unwrap();
    assert_eq!(sessions, 0);
    // Each refusal is audited with the client's address: an unknown key as `anonymous`, a key
    // without the admin scope by its name.
    let refused = audit_rows(&e, "console.sign_in_refused").await;
    let reserver_name = key_name(&e, &reserver).await;
    let client = |detail: &Option<serde_json::Value>| detail.as_ref().unwrap()["client"].clone();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert_eq!((refused[0].0.as_str(), client(&refused[0].1)), ("anonymous", serde_json::json!("127.0.0.1")));
    assert_eq!(
        (refused[1].0.as_str(), client(&refused[1].1)),
        (reserver_name.as_str(), serde_json::json!("127.0.0.1"))
    );
}

/// Wrong keys from one address use up its failed attempts: then even the right key from there gets
/// 429 (no look-up) until the budget has room again; the refusals are audited.
#[tokio::test]
async fn repeated_wrong_sign_ins_are_throttled_per_address() {
    let e = env_with(|s| s.security.failed_auth_per_minute = 3).await;
    let mut browser = Browser::new(&e);
    for i in 0..4 {
        let page = browser.sign_in(&format!("cfp_{i:064x}")).await;
        assert_eq!(page.status, StatusCode::UNAUTHORIZED, "attempt {i}");
    }
    let page = browser.sign_in(&e.app.key).await;
    assert_eq!(page.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(page.body.contains("Too many failed sign-ins"), "{}", page.body);
    assert_eq!(audit_rows(&e, "console.sign_in_refused").await.len(), 4);
}

#[tokio::test]
async fn every_page_needs_a_session_and_shows_its_data_with_protective_headers() {
    let e = env().await;
    e.sms.fake.set_behaviour(FakeBehaviour { reject_rate: 1.0, ..Default::default() });
    let dead = e.enqueue("transactional", "bank", 1).await;
    assert_eq!(drain(&e.group(Strategy::Priority, 0)).await, vec![Outcome::Dead(dead[0])]);
    let mut browser = Browser::new(&e);
    let pages = ["/console/pools", "/console/queue", "/console/dead-letters", "/console/keys", "/console/audit"];
    for path in pages {
        let page = browser.get(path).await;
        assert_eq!((page.status, page.location()), (StatusCode::SEE_OTHER, "/console/sign-in"), "{path}");
    }
    browser.sign_in(&e.app.key).await;
    let name = key_name(&e, &e.app.key).await;
    let expected: [(&str, &[&str]); 5] = [
        ("/console/pools", &["individual", "business", "Refill", "Reclaim"]),
        ("/console/queue", &["otp", "transactional", "promo", "sms", "push", "Pause"]),
        ("/console/dead-letters", &[&dead[0].to_string(), "bank", "Retry", "Discard", "Review replay"]),
        ("/console/keys", &[&name, "Create key", "Revoke"]),
        ("/console/audit", &["console.signed_in", &name]),
    ];
    for (path, texts) in expected {
        let page = browser.get(path).await;
        assert_eq!(page.status, StatusCode::OK, "{path}: {}", page.body);
        let header = |n: &str| page.headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        assert!(header("content-type").starts_with("text/html"), "{path}");
        assert_eq!(header("cache-control"), "no-store", "{path}");
        assert!(header("content-security-policy").contains("frame-ancestors 'none'"), "{path}");
        for text in texts {
            assert!(page.body.contains(text), "{path} lacks {text:?}");
        }
        assert!(!page.body.contains(&e.app.key), "{path} shows the key");
    }
    let filtered = browser.get("/console/dead-letters?class=otp").await;
    assert!(filtered.body.contains("No dead letters match."));
    let css = browser.get("/console/static/console.css").await;
    assert!(css.body.contains("--brand"));
}

#[tokio::test]
async fn actions_without_this_sessions_csrf_token_or_from_another_origin_change_nothing() {
    let e = env().await;
    let mut browser = Browser::new(&e);
    browser.sign_in(&e.app.key).await;
    let paused = || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM queue_pauses").fetch_one(&e.db.pool).await.unwrap();
        n
    };
    let page = browser.post("/console/queue/classes/promo/pause", &[]).await;
    assert_eq!(page.status, StatusCode::FORBIDDEN);
    let wrong = "0".repeat(64);
    let page = browser.post("/console/queue/classes/promo/pause", &[("csrf", &wrong)]).await;
    assert_eq!(page.status, StatusCode::FORBIDDEN);
    assert!(page.body.contains("not from your current session"), "{}", page.body);
    // Another browser's session has another token.
    let mut other = Browser::new(&e);
    other.sign_in(&e.app.key).await;
    let theirs = other.get("/console/queue").await.csrf();
    assert_eq!(
        browser.post("/console/queue/classes/promo/pause", &[("csrf", &theirs)]).await.status,
        StatusCode::FORBIDDEN
    );
    // The right token from a page of another origin.
    let mine = browser.get("/console/queue").await.csrf();
    let request = browser
        .http
        .post(format!("{}/console/queue/classes/promo/pause", browser.base))
        .header("origin", "https://evil.example")
        .form(&[("csrf", &mine)]);
    assert_eq!(browser.send(request).await.status, StatusCode::FORBIDDEN);
    // Without a session at all: to the sign-in page.
    let mut stranger = Browser::new(&e);
    let page = stranger.post("/console/queue/classes/promo/pause", &[("csrf", &mine)]).await;
    assert_eq!((page.status, page.location()), (StatusCode::SEE_OTHER, "/console/sign-in"));
    assert_eq!(paused().await, 0);
    assert!(audit_rows(&e, "queue.paused").await.is_empty());
}

#[tokio::test]
async fn pool_and_queue_actions_go_through_the_domain_and_leave_the_apis_audit_rows() {
    let e = env().await;
    let mut browser = Browser::new(&e);
    browser.sign_in(&e.app.key).await;
    let name = key_name(&e, &e.app.key).await;

    let page = browser.act("/console/pools", "/console/pools/individual/refill", &[]).await;
    assert_eq!((page.status, page.location()), (StatusCode::SEE_OTHER, "/console/pools"));
    let pools = browser.get("/console/pools").await;
    assert!(pools.body.contains("Refill of individual: refilled, 1000 codes added"), "{}", pools.body);
    assert!(pools.body.contains("s ago, 1000 codes added"), "last refill shown");
    assert!(!browser.get("/console/pools").await.body.contains("Refill of individual"), "a notice is shown once");
    let refills = audit_rows(&e, "pool.refilled").await;
    assert!(!refills.is_empty() && refills.iter().all(|(actor, _)| *actor == name), "{refills:?}");

    browser.act("/console/pools", "/console/pools/individual/reclaim", &[]).await;
    assert!(browser.get("/console/pools").await.body.contains("0 holds returned"));

    // A key rotation from the console: the notice, the pool's new epoch, the API's audit row by this key.
    assert!(browser.get("/console/pools").await.body.contains("ff1, key 0: test-1"));
    browser.act("/console/pools", "/console/pools/individual/rotate-key", &[("key_id", "console-1")]).await;
    let pools = browser.get("/console/pools").await;
    assert!(pools.body.contains("Key of individual rotated: epoch 1 (key id console-1"), "{}", pools.body);
    assert!(pools.body.contains("ff1, key 1: console-1"), "{}", pools.body);
    let rotated = audit_rows(&e, "pool.key_rotated").await;
    assert_eq!(rotated.len(), 1);
    assert_eq!(rotated[0].0, name);
    assert_eq!(rotated[0].1.as_ref().unwrap()["key_id"], "console-1");
    // The same key id again is refused, and nothing changes.
    let again = browser.act("/console/pools", "/console/pools/individual/rotate-key", &[("key_id", "console-1")]).await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert_eq!(audit_rows(&e, "pool.key_rotated").await.len(), 1);

    for (path, action, rows) in [
        ("/console/queue/classes/promo/pause", "queue.paused", 1),
        ("/console/queue/providers/sms/pause", "queue.paused", 2),
        ("/console/queue/classes/promo/resume", "queue.resumed", 1),
    ] {
        let page = browser.act("/console/queue", path, &[]).await;
        assert_eq!(page.status, StatusCode::SEE_OTHER, "{path}");
        let audited = audit_rows(&e, action).await;
        assert_eq!(audited.len(), rows, "{path}: {audited:?}");
        assert!(audited.iter().all(|(actor, _)| *actor == name), "{path}: {audited:?}");
    }
    let paused: Vec<(String, String)> =
        sqlx::query_as("SELECT kind, name FROM queue_pauses").fetch_all(&e.db.pool).await.unwrap();
    assert_eq!(paused, vec![("provider".to_string(), "sms".to_string())]);
    let queue = browser.get("/console/queue").await;
    assert!(queue.body.contains("Resumed class promo."), "{}", queue.body);
    assert_eq!(
        browser.act("/console/queue", "/console/queue/classes/nope/pause", &[]).await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn dead_letters_are_retried_discarded_and_replayed_after_a_confirmation_that_counts_them() {
    let e = env().await;
    e.sms.fake.set_behaviour(FakeBehaviour { reject_rate: 1.0, ..Default::default() });
    let ids = e.enqueue("transactional", "bank", 5).await;
    drain(&e.group(Strategy::Priority, 0)).await;
    let mut browser = Browser::new(&e);
    browser.sign_in(&e.app.key).await;
    let name = key_name(&e, &e.app.key).await;
    let status = |id: i64| {
        let pool = e.db.pool.clone();
        async move {
            let s: String = sqlx::query_scalar("SELECT status::text FROM notification_jobs WHERE id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap();
            s
        }
    };

    let from = "/console/dead-letters?class=transactional";
    let page =
        browser.act(from, &format!("/console/dead-letters/{}/retry", ids[0]), &[("class", "transactional")]).await;
    assert_eq!((page.status, page.location()), (StatusCode::SEE_OTHER, from));
    assert_eq!(status(ids[0]).await, "pending");
    browser.act(from, &format!("/console/dead-letters/{}/discard", ids[1]), &[]).await;
    assert_eq!(status(ids[1]).await, "discarded");
    let page = browser.act(from, &format!("/console/dead-letters/{}/discard", ids[1]), &[]).await;
    assert_eq!(page.status, StatusCode::CONFLICT);
    assert_eq!(audit_rows(&e, "dlq.retried").await[0].0, name);
    assert_eq!(audit_rows(&e, "dlq.discarded").await[0].0, name);

    // The preview counts and changes nothing; the confirmation replays that many.
    let form = [("class", "transactional"), ("rate_per_sec", "5"), ("max", "1000")];
    let preview = browser.act(from, "/console/dead-letters/replay/preview", &form).await;
    assert_eq!(preview.status, StatusCode::OK, "{}", preview.body);
    assert!(preview.body.contains("Replay 3 dead letters?"), "{}", preview.body);
    assert_eq!(status(ids[2]).await, "dead");
    let csrf = preview.csrf();
    let confirm = [("csrf", csrf.as_str()), ("class", "transactional"), ("rate_per_sec", "5"), ("max", "3")];
    let page = browser.post("/console/dead-letters/replay", &confirm).await;
    assert_eq!(page.status, StatusCode::SEE_OTHER);
    for &id in &ids[2..] {
        assert_eq!(status(id).await, "scheduled");
    }
    let replays = audit_rows(&e, "dlq.replayed").await;
    assert_eq!(replays.len(), 1);
    assert_eq!((replays[0].0.as_str(), replays[0].1.as_ref().unwrap()["replayed"].as_i64()), (name.as_str(), Some(3)));
    assert!(browser.get(from).await.body.contains("Replayed 3 dead letters"));
    let nothing = browser.act(from, "/console/dead-letters/replay/preview", &form).await;
    assert_eq!(nothing.status, StatusCode::SEE_OTHER, "nothing left to confirm");
    let bad = [("rate_per_sec", "fast"), ("max", "10")];
    assert_eq!(browser.act(from, "/console/dead-letters/replay/preview", &bad).await.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn a_key_is_shown_once_at_creation_and_revoking_the_signed_in_key_ends_its_session() {
    let e = env().await;
    let admin = create_key(&e.db.pool, &[Scope::Admin], None).await;
    let admin_name = key_name(&e, &admin).await;
    let mut browser = Browser::new(&e);
    browser.sign_in(&admin).await;

    let form = [("name", "onboarding-eu"), ("scope", "cif:reserve"), ("scope", "cif:read"), ("tenants", "")];
    let page = browser.act("/console/keys", "/console/keys", &form).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    let secret = regex::Regex::new(r"cfp_[0-9a-f]{64}").unwrap().find(&page.body).unwrap().as_str().to_string();
    let created: (Vec<String>, Option<Vec<String>>) =
        sqlx::query_as("SELECT scopes, tenants FROM api_keys WHERE name = 'onboarding-eu'")
            .fetch_one(&e.db.pool)
            .await
            .unwrap();
    assert_eq!(created, (vec!["cif:reserve".to_string(), "cif:read".to_string()], None));
    assert_eq!(key_name(&e, &secret).await, "onboarding-eu", "the secret shown is the key's");
    assert!(!browser.get("/console/keys").await.body.contains(&secret), "shown once");
    assert_eq!(audit_rows(&e, "key.created").await.last().unwrap().0, admin_name);
    let duplicate = browser.act("/console/keys", "/console/keys", &form).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);

    browser.act("/console/keys", "/console/keys/onboarding-eu/revoke", &[]).await;
    assert_eq!(audit_rows(&e, "key.revoked").await[0].0, admin_name);
    // Revoking its own key: the next request finds no session.
    let page = browser.act("/console/keys", &format!("/console/keys/{admin_name}/revoke"), &[]).await;
    assert_eq!(page.status, StatusCode::SEE_OTHER);
    let page = browser.get("/console/keys").await;
    assert_eq!((page.status, page.location()), (StatusCode::SEE_OTHER, "/console/sign-in"));
}

#[tokio::test]
async fn sign_out_and_expiry_end_a_session() {
    let e = env().await;
    let mut browser = Browser::new(&e);
    browser.sign_in(&e.app.key).await;
    let kept = browser.cookie.clone();
    let page = browser.act("/console/pools", "/console/sign-out", &[]).await;
    assert_eq!((page.status, page.location()), (StatusCode::SEE_OTHER, "/console/sign-in"));
    assert!(page.headers.get(SET_COOKIE).unwrap().to_str().unwrap().contains("Max-Age=0"));
    assert_eq!(audit_rows(&e, "console.signed_out").await.len(), 1);
    browser.cookie = kept;
    assert_eq!(browser.get("/console/pools").await.status, StatusCode::SEE_OTHER, "a signed-out cookie is dead");

    browser.sign_in(&e.app.key).await;
    assert_eq!(browser.get("/console/pools").await.status, StatusCode::OK);
    sqlx::query("UPDATE console_sessions SET last_seen_at = now() - interval '31 minutes'")
        .execute(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(browser.get("/console/pools").await.status, StatusCode::SEE_OTHER, "idle beyond the timeout");
    assert_eq!(browser.sign_in(&e.app.key).await.status, StatusCode::SEE_OTHER);
    assert_eq!(browser.get("/console/pools").await.status, StatusCode::OK, "signed in again");
    sqlx::query("UPDATE console_sessions SET expires_at = now() - interval '1 second'")
        .execute(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(browser.get("/console/pools").await.status, StatusCode::SEE_OTHER, "past its lifetime");
}

#[tokio::test]
async fn every_action_refuses_a_form_without_the_csrf_token() {
    let e = env().await;
    e.sms.fake.set_behaviour(FakeBehaviour { reject_rate: 1.0, ..Default::default() });
    let dead = e.enqueue("transactional", "bank", 1).await[0].to_string();
    drain(&e.group(Strategy::Priority, 0)).await;
    let mut browser = Browser::new(&e);
    browser.sign_in(&e.app.key).await;
    let name = key_name(&e, &e.app.key).await;
    let audit_count = || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_events").fetch_one(&e.db.pool).await.unwrap();
        n
    };
    let before = audit_count().await;
    let actions: Vec<(String, Vec<(&str, &str)>)> = vec![
        ("/console/pools/individual/refill".into(), vec![("force", "1")]),
        ("/console/pools/individual/reclaim".into(), vec![]),
        ("/console/pools/individual/rotate-key".into(), vec![("key_id", "sneaky-1")]),
        ("/console/queue/classes/promo/pause".into(), vec![]),
        ("/console/queue/providers/sms/pause".into(), vec![]),
        (format!("/console/dead-letters/{dead}/retry"), vec![]),
        (format!("/console/dead-letters/{dead}/discard"), vec![]),
        ("/console/dead-letters/replay/preview".into(), vec![("rate_per_sec", "1"), ("max", "10")]),
        ("/console/dead-letters/replay".into(), vec![("rate_per_sec", "1"), ("max", "10")]),
        ("/console/keys".into(), vec![("name", "sneaky"), ("scope", "admin")]),
        (format!("/console/keys/{name}/revoke"), vec![]),
        ("/console/sign-out".into(), vec![]),
    ];
    for (path, form) in &actions {
        let page = browser.post(path, form).await;
        assert_eq!(page.status, StatusCode::FORBIDDEN, "{path} without a CSRF token");
    }
    assert_eq!(audit_count().await, before, "no action was taken");
    assert_eq!(browser.get("/console/pools").await.status, StatusCode::OK, "still signed in");
}
