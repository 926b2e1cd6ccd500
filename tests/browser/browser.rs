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

/// Waits (bounded) until the page's text holds `what`.
async fn wait_for_text(browser: &Browser, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = browser.eval("return document.body.innerText").await;
        let text = text.as_str().unwrap_or_default().to_string();
        if text.contains(what) {
            return text;
        }
        assert!(Instant::now() < deadline, "never showed {what:?}:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The operators' page: asks for the token once, then shows the bans (an
/// operator's and a penalty's), the overrides, the most denied as bars, the
/// decisions chart and the audit trail, and unbans from a button; all under
/// the site's Content-Security-Policy, with nothing from another origin.
#[actix_web::test]
async fn the_operators_page_in_chromium() {
    let token = "browser-admin-token";
    let app = crate::helpers::spawn_app_with(DEFAULT, |c| {
        c.filter.admin.token = Some(token.to_string());
    })
    .await;
    let base = app.address.clone();
    // Something to show: denials on /check (5 per 10 s), a ban, an override.
    for _ in 0..8 {
        app.client.get(app.url("/check")).send().await.unwrap();
    }
    for (action, body) in [
        (
            "ban",
            r#"{"rule":"api","values":["203.0.113.7"],"for":"10m"}"#,
        ),
        (
            "override",
            r#"{"rule":"check","values":["198.51.100.4"],"limit":50,"for":"1h"}"#,
        ),
    ] {
        let res = app
            .client
            .post(app.url(&format!("/admin/{action}")))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{action}");
    }

    let driver = Driver::start().await;
    let browser = driver.browser().await;
    browser.goto(&format!("{base}/admin")).await;
    let field = browser.find("#admin-login input[name=token]").await;
    browser.type_into(&field, "wrong-token").await;
    let open = browser.find("#admin-login button[type=submit]").await;
    browser.click(&open).await;
    wait_for_text(&browser, "The token was refused").await;
    let field = browser.find("#admin-login input[name=token]").await;
    browser.type_into(&field, token).await;
    let open = browser.find("#admin-login button[type=submit]").await;
    browser.click(&open).await;

    let text = wait_for_text(&browser, "203.0.113.7").await;
    assert!(text.contains("198.51.100.4"), "the override:\n{text}");
    // The most denied on /check: 127.0.0.1 with 3 denials, as bars.
    wait_for_text(&browser, "last 10 minutes").await;
    let bars = browser
        .eval("return document.querySelectorAll('#top rect.deny-bar').length")
        .await;
    assert!(bars.as_u64().unwrap() >= 2, "bars: {bars}");
    let lines = browser
        .eval("return document.querySelectorAll('#decisions .series').length")
        .await;
    assert!(lines.as_u64().unwrap() >= 1, "chart: {lines}");
    // The token stays in this tab: a reload does not ask again.
    browser.goto(&format!("{base}/admin")).await;
    wait_for_text(&browser, "203.0.113.7").await;
    browser.eval("window.scrollTo(0, 0); return 0").await;
    browser.screenshot(&shot("admin")).await;
    browser
        .eval("document.getElementById('top').scrollIntoView(); return 0")
        .await;
    browser.screenshot(&shot("admin-charts")).await;

    // Unban from the page: the ban leaves the list, and the audit trail
    // names the page's client.
    browser
        .eval(
            "for (const b of document.querySelectorAll('#bans button')) \
             { if (b.textContent === 'Unban') { b.click(); break; } } return 0",
        )
        .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let bans = browser
            .eval("return document.querySelector('#bans tbody').innerText")
            .await;
        if !bans.as_str().unwrap_or_default().contains("203.0.113.7") {
            break;
        }
        assert!(Instant::now() < deadline, "the unban did not show");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let audit = wait_for_text(&browser, "unban").await;
    assert!(audit.contains("127.0.0.1"), "{audit}");
    // Nothing was refused by the Content-Security-Policy, nothing loaded
    // from elsewhere.
    let foreign = browser
        .eval(
            "return performance.getEntriesByType('resource')\
             .filter(e => !e.name.startsWith(location.origin)).length",
        )
        .await;
    assert_eq!(foreign.as_u64(), Some(0));
    browser.quit().await;
}
