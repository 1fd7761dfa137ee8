//! The console in a real browser: headless Chromium, driven over WebDriver (chromedriver), signs in,
//! refills a pool, retries a dead letter and pauses a class, at desktop and phone sizes, and saves a
//! screenshot of each step under `target/console-screenshots/`.
//!
//! Needs `chromium` and `chromedriver` (Debian: `chromium`, `chromium-driver`; `.ci/run` installs them).
//! Without them the test says so and passes, unless `CIFPOOL_REQUIRE_BROWSER=1` (set by `.ci/run`
//! once it has installed them), when a missing browser fails it.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cifpool::internals::fake_provider::FakeBehaviour;
use cifpool::queue::policy::Strategy;
use common::queue_env::{drain, env};
use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;

/// chromedriver, killed when the test ends however it ends.
struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn find_program(names: &[&str]) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/lib/chromium")])
        .flat_map(|dir| names.iter().map(move |n| dir.join(n)))
        .find(|p| p.is_file())
}

fn screenshot_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    let dir = target.join("console-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn start_driver(program: &Path) -> (Driver, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new(program)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", program.display()));
    let driver = Driver(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        assert!(Instant::now() < deadline, "chromedriver did not listen on port {port}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (driver, format!("http://127.0.0.1:{port}"))
}

async fn browser(webdriver: &str, chromium: &Path) -> Client {
    let mut capabilities = serde_json::Map::new();
    capabilities.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": chromium,
            // --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,800", "--hide-scrollbars"],
        }),
    );
    ClientBuilder::new(HttpConnector::new())
        .capabilities(capabilities)
        .connect(webdriver)
        .await
        .unwrap_or_else(|e| panic!("opening a Chromium session: {e}"))
}

async fn save(client: &Client, name: &str) -> PathBuf {
    let png = client.screenshot().await.unwrap();
    let path = screenshot_dir().join(format!("{name}.png"));
    std::fs::write(&path, png).unwrap();
    path
}

async fn text_of_page(client: &Client) -> String {
    client.find(Locator::Css("main")).await.unwrap().text().await.unwrap()
}

/// Clicks the submit button of the form whose `action` is `action`, then waits for the page that follows
/// to show `expect` (waiting for any element would find the old page's before the browser leaves it).
async fn press(client: &Client, action: &str, expect: &str) {
    let selector = format!("form[action=\"{action}\"] button[type=submit]");
    client.find(Locator::Css(&selector)).await.unwrap_or_else(|e| panic!("{selector}: {e}")).click().await.unwrap();
    let xpath = format!("//main[contains(., '{expect}')]");
    if let Err(e) = client.wait().at_most(Duration::from_secs(15)).for_element(Locator::XPath(&xpath)).await {
        let page = client.source().await.unwrap_or_default();
        panic!("after pressing {action}, no page showed {expect:?} ({e}); the page: {page}");
    }
}

#[tokio::test]
async fn an_operator_signs_in_refills_retries_a_dead_letter_and_pauses_a_class_in_chromium() {
    let required = std::env::var("CIFPOOL_REQUIRE_BROWSER").is_ok_and(|v| v == "1");
    let (Some(chromium), Some(chromedriver)) =
        (find_program(&["chromium", "chromium-browser", "google-chrome"]), find_program(&["chromedriver"]))
    else {
        assert!(!required, "CIFPOOL_REQUIRE_BROWSER=1 but chromium or chromedriver is not installed");
        eprintln!(
            "SKIPPED: the console browser test needs chromium and chromedriver (apt-get install chromium chromium-driver)"
        );
        return;
    };
    let e = env().await;
    e.sms.fake.set_behaviour(FakeBehaviour { reject_rate: 1.0, ..Default::default() });
    let dead = e.enqueue("transactional", "bank", 2).await;
    drain(&e.group(Strategy::Priority, 0)).await;
    e.sms.fake.set_behaviour(FakeBehaviour::default());

    let (_driver, webdriver) = start_driver(&chromedriver).await;
    let client = browser(&webdriver, &chromium).await;
    async {
        client.goto(&e.app.url("/console")).await.unwrap();
        assert!(client.current_url().await.unwrap().path().ends_with("/console/sign-in"));
        save(&client, "1-sign-in").await;
        client.find(Locator::Css("#key")).await.unwrap().send_keys(&e.app.key).await.unwrap();
        press(&client, "/console/sign-in", "Codes ready to reserve").await;
        assert!(client.current_url().await.unwrap().path().ends_with("/console/pools"));

        press(&client, "/console/pools/individual/refill", "Refill of individual: refilled").await;
        save(&client, "2-pools-after-refill").await;

        client.goto(&e.app.url("/console/dead-letters")).await.unwrap();
        save(&client, "3-dead-letters").await;
        let retried = format!("Job {} is back in the queue", dead[0]);
        press(&client, &format!("/console/dead-letters/{}/retry", dead[0]), &retried).await;

        client.goto(&e.app.url("/console/queue")).await.unwrap();
        press(&client, "/console/queue/classes/promo/pause", "Paused class promo for every pod.").await;
        let text = text_of_page(&client).await;
        assert!(text.contains("paused") && text.contains("Resume"), "{text}");
        save(&client, "4-queue-promo-paused").await;

        client.set_window_size(390, 844).await.unwrap();
        client.goto(&e.app.url("/console/queue")).await.unwrap();
        save(&client, "5-queue-on-a-phone").await;
        // Nothing wider than the phone's screen but the tables, which scroll inside their frame.
        let overflow = client
            .execute("return document.documentElement.scrollWidth - document.documentElement.clientWidth;", vec![])
            .await
            .unwrap();
        assert!(overflow.as_i64().unwrap_or(0) <= 0, "the page scrolls sideways on a phone by {overflow}");
    }
    .await;
    client.close().await.unwrap();

    let job: String = sqlx::query_scalar("SELECT status FROM notification_jobs WHERE id = $1")
        .bind(dead[0])
        .fetch_one(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(job, "pending", "the retried dead letter is back in the queue");
    let paused: i64 = sqlx::query_scalar("SELECT count(*) FROM queue_pauses WHERE kind = 'class' AND name = 'promo'")
        .fetch_one(&e.db.pool)
        .await
        .unwrap();
    assert_eq!(paused, 1);
    eprintln!("screenshots in {}", screenshot_dir().display());
}
