//! The site in a real browser: headless Chromium through chromedriver
//! (Debian packages `chromium` and `chromium-driver`, which scripts/test
//! installs). Signs in with a code read from the outbox, asks for codes
//! until it lands on the error page, checks that the countdown runs, and
//! saves screenshots of the home, login, error and limits pages under
//! `target/screenshots/`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::helpers::spawn_app;
use crate::webdriver::{Browser, Driver};

const DEFAULT: &str = include_str!("../../config/default.toml");

fn shot(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/screenshots")
        .join(format!("{name}.png"))
}

/// Waits (bounded) until the browser's URL satisfies `ok`. A deadline, not
/// a speed: a loaded machine's Chromium may take seconds to load a page.
async fn wait_for_url(browser: &Browser, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let url = browser.url().await;
        if ok(&url) {
            return url;
        }
        assert!(Instant::now() < deadline, "never reached {what}; at {url}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn ask_for_code(browser: &Browser, base: &str, phone: &str) -> String {
    browser.goto(&format!("{base}/login")).await;
    let field = browser.find("#sms-form input[name=phone]").await;
    browser.type_into(&field, phone).await;
    let button = browser.find("#sms-form button[type=submit]").await;
    browser.click(&button).await;
    wait_for_url(browser, "the answer to /sms/send", |u| {
        u.contains("/sms/send") || u.contains("/err")
    })
    .await
}

#[actix_web::test]
async fn sign_in_then_hit_the_sms_limit_in_chromium() {
    let app = spawn_app(DEFAULT).await;
    let driver = Driver::start().await;
    let browser = driver.browser().await;
    let base = app.address.clone();
    let phone = "+1 (555) 010-7777";

    browser.goto(&format!("{base}/")).await;
    let h1 = browser.find("h1").await;
    assert!(browser.text(&h1).await.contains("Rate limits"));
    browser.screenshot(&shot("home")).await;

    browser.goto(&format!("{base}/login")).await;
    browser.screenshot(&shot("login")).await;

    // Sign in with the code from the outbox.
    ask_for_code(&browser, &base, phone).await;
    let notice = browser.find(".notice").await;
    assert!(browser.text(&notice).await.contains("+15550107777"));
    let messages: Value = app.get_json("/dev/outbox").await.json().await.unwrap();
    let text = messages[0]["text"].as_str().unwrap().to_string();
    let at = text.find(|c: char| c.is_ascii_digit()).unwrap();
    let code = &text[at..at + 6];
    let field = browser.find("#code-form input[name=code]").await;
    browser.type_into(&field, code).await;
    let button = browser.find("#code-form button[type=submit]").await;
    browser.click(&button).await;
    wait_for_url(&browser, "/account", |u| u.ends_with("/account")).await;
    let shown = browser.find(".phone").await;
    assert_eq!(browser.text(&shown).await, "+15550107777");

    // Ask for more codes until the limit (3 per minute) sends us to /err.
    let mut landed = String::new();
    for _ in 0..4 {
        let url = ask_for_code(&browser, &base, phone).await;
        if url.contains("/err") {
            landed = url;
            break;
        }
    }
    assert!(
        landed.contains("/err?rule=sms-per-phone&retry_after="),
        "the fourth code lands on the error page, not {landed:?}"
    );
    let limit = browser.find(".limit").await;
    assert!(browser
        .text(&limit)
        .await
        .contains("at most 3 codes per minute for this phone number"));

    // The countdown runs: the number shown goes down.
    let seconds = browser.find("[data-seconds]").await;
    let first: u64 = browser.text(&seconds).await.trim().parse().unwrap();
    assert!(first >= 1);
    // The number goes down once a second; the deadline is room for a
    // loaded machine, and the retry time (a minute) is far from running out.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let now: u64 = browser.text(&seconds).await.trim().parse().unwrap();
        if now < first {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the countdown did not move from {first}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    browser.screenshot(&shot("error")).await;
    // Without JavaScript the page still says how long and links back.
    let back = browser
        .eval("return document.querySelector('[data-back]').getAttribute('href')")
        .await;
    assert_eq!(back, "/login");

    browser.goto(&format!("{base}/limits")).await;
    let page = browser.eval("return document.body.innerText").await;
    assert!(page.as_str().unwrap().contains("sms-per-phone"));
    browser
        .eval("document.getElementById('rule-sms-per-phone').scrollIntoView(); return 0")
        .await;
    browser.screenshot(&shot("limits")).await;

    browser.quit().await;
}
