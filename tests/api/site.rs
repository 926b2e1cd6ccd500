//! The demo site's flows against the real app and `config/default.toml`:
//! sign-in by code and by password, sign-out, password reset, wrong and
//! reused and expired codes, CSRF, no account enumeration, the SMS limits
//! (also when the phone is written another way), `/limits`, `/dev/outbox`.

use std::time::Duration;

use serde_json::Value;

use crate::helpers::{header, remaining, spawn_app, wait_until, TestApp};

const DEFAULT: &str = include_str!("../../config/default.toml");

/// The default config with one rule switched to shadow mode (to test what
/// lies behind a limit without meeting it).
fn default_with_shadow(rule: &str) -> String {
    DEFAULT.replace(
        &format!("name = \"{rule}\"\n"),
        &format!("name = \"{rule}\"\nmode = \"shadow\"\n"),
    )
}

/// One browser: its own cookie jar, no redirects followed.
struct User<'a> {
    app: &'a TestApp,
    http: reqwest::Client,
}

impl<'a> User<'a> {
    fn new(app: &'a TestApp) -> User<'a> {
        User {
            app,
            http: reqwest::Client::builder()
                .cookie_store(true)
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
        }
    }

    async fn get(&self, path: &str) -> reqwest::Response {
        self.http.get(self.app.url(path)).send().await.unwrap()
    }

    /// The CSRF token of this user's session, from a form page.
    async fn csrf(&self) -> String {
        let page = self.get("/login").await.text().await.unwrap();
        let at = page.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
        page[at..at + 64].to_string()
    }

    async fn post(&self, path: &str, fields: &[(&str, &str)]) -> reqwest::Response {
        let csrf = self.csrf().await;
        let mut all: Vec<(&str, &str)> = fields.to_vec();
        all.push(("csrf", &csrf));
        self.post_raw(path, &all).await
    }

    async fn post_raw(&self, path: &str, fields: &[(&str, &str)]) -> reqwest::Response {
        self.http
            .post(self.app.url(path))
            .form(fields)
            .send()
            .await
            .unwrap()
    }

    async fn post_raw_owned(&self, path: &str, fields: Vec<(&str, String)>) -> reqwest::Response {
        self.http
            .post(self.app.url(path))
            .form(&fields)
            .send()
            .await
            .unwrap()
    }

    /// Signs in by SMS code; returns the account page's HTML.
    async fn sign_in(&self, phone: &str) -> String {
        assert_eq!(
            self.post("/sms/send", &[("phone", phone)]).await.status(),
            200
        );
        let code = latest_code(self.app, phone).await;
        let res = self
            .post("/login/sms", &[("phone", phone), ("code", &code)])
            .await;
        assert_eq!(res.status(), 303);
        assert_eq!(header(&res, "location").as_deref(), Some("/account"));
        let account = self.get("/account").await;
        assert_eq!(account.status(), 200);
        account.text().await.unwrap()
    }
}

/// The messages in the outbox, newest first.
async fn outbox(app: &TestApp) -> Vec<Value> {
    let v: Value = app.get_json("/dev/outbox").await.json().await.unwrap();
    v.as_array().unwrap().clone()
}

/// The 6-digit code of the newest message to `phone` (any format).
async fn latest_code(app: &TestApp, phone: &str) -> String {
    let digits: String = phone.chars().filter(char::is_ascii_digit).collect();
    let messages = outbox(app).await;
    let m = messages
        .iter()
        .find(|m| m["phone"] == format!("+{digits}"))
        .unwrap_or_else(|| panic!("no message to {phone}: {messages:?}"));
    let text = m["text"].as_str().unwrap();
    let at = text.find(|c: char| c.is_ascii_digit()).unwrap();
    text[at..at + 6].to_string()
}

#[actix_web::test]
async fn sign_in_by_code_creates_the_account_and_renews_the_session() {
    let app = spawn_app(DEFAULT).await;
    let user = User::new(&app);
    let before = user.csrf().await;
    let page = user.sign_in("+1 (555) 010-0001").await;
    assert!(page.contains("+15550100001"), "{page}");
    // A new session ID means a new CSRF token.
    assert_ne!(user.csrf().await, before);
    // The outbox is JSON, newest first, with the documented fields.
    let m = &outbox(&app).await[0];
    assert_eq!(m["phone"], "+15550100001");
    assert!(m["sent_at"].as_str().unwrap().ends_with('Z'));
    // The session cookie is HttpOnly and SameSite=Lax.
    let res = user.get("/login").await;
    let _ = res; // (cookies were set earlier; check a fresh visitor's)
    let fresh = app.get("/login").await;
    let cookie = header(&fresh, "set-cookie").unwrap();
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Lax"),
        "{cookie}"
    );
}

#[actix_web::test]
async fn a_code_works_once() {
    let app = spawn_app(DEFAULT).await;
    let user = User::new(&app);
    user.sign_in("+15550100002").await;
    let code = latest_code(&app, "+15550100002").await;
    let other = User::new(&app);
    let res = other
        .post("/login/sms", &[("phone", "+15550100002"), ("code", &code)])
        .await;
    assert_eq!(res.status(), 400);
    assert!(res.text().await.unwrap().contains("no valid code"));
}

#[actix_web::test]
async fn five_wrong_codes_invalidate_the_code() {
    // verify-per-phone (5 per 10 minutes) would stop the sixth try first;
    // in shadow mode it lets us see the code's own attempt limit.
    let app = spawn_app(&default_with_shadow("verify-per-phone")).await;
    let user = User::new(&app);
    let phone = "+15550100003";
    assert_eq!(
        user.post("/sms/send", &[("phone", phone)]).await.status(),
        200
    );
    let code = latest_code(&app, phone).await;
    let wrong = if code == "000000" { "111111" } else { "000000" };
    for left in (0..5).rev() {
        let res = user
            .post("/login/sms", &[("phone", phone), ("code", wrong)])
            .await;
        assert_eq!(res.status(), 400);
        let text = res.text().await.unwrap();
        if left > 1 {
            assert!(text.contains(&format!("{left} more tries")), "{text}");
        }
    }
    let res = user
        .post("/login/sms", &[("phone", phone), ("code", &code)])
        .await;
    assert_eq!(res.status(), 400, "the right code no longer works");
}

#[actix_web::test]
async fn the_code_check_is_rate_limited_per_phone() {
    let app = spawn_app(DEFAULT).await;
    let user = User::new(&app);
    let phone = "+15550100013";
    user.post("/sms/send", &[("phone", phone)]).await;
    for _ in 0..5 {
        let res = user
            .post("/login/sms", &[("phone", phone), ("code", "000000")])
            .await;
        assert_eq!(res.status(), 400);
    }
    let res = user
        .post(
            "/login/sms",
            &[("phone", "1 555 010 0013"), ("code", "000000")],
        )
        .await;
    assert_eq!(res.status(), 303);
    let location = header(&res, "location").unwrap();
    assert!(
        location.starts_with("/err?rule=verify-per-phone&retry_after="),
        "{location}"
    );
}

#[actix_web::test]
async fn an_expired_code_is_refused() {
    let app = spawn_app(DEFAULT).await;
    let user = User::new(&app);
    let phone = "+15550100004";
    user.post("/sms/send", &[("phone", phone)]).await;
    let code = latest_code(&app, phone).await;
    let key = "floodgate:@site:code:signin:+15550100004";
    assert!(app.redis.pttl(key) > 290_000, "a code lives 5 minutes");
    // Let Redis expire it now rather than in five minutes.
    let _: () = redis::cmd("PEXPIRE")
        .arg(key)
        .arg(1)
        .query(&mut app.redis.connection())
        .unwrap();
    wait_until(Duration::from_secs(2), "the code to expire", || {
        app.redis.pttl(key) == -2
    });
    let res = user
        .post("/login/sms", &[("phone", phone), ("code", &code)])
        .await;
    assert_eq!(res.status(), 400);
    // Only a keyed hash was stored, never the code.
    assert!(!format!("{:?}", app.redis.keys("*")).contains(&code));
}

#[actix_web::test]
async fn password_sign_in_and_sign_out() {
    let app = spawn_app(DEFAULT).await;
    let user = User::new(&app);
    let phone = "+15550100005";
    user.sign_in(phone).await;
    let elsewhere = User::new(&app);
    elsewhere.sign_in(phone).await;
    let res = user
        .post("/account/password", &[("password", "short")])
        .await;
    assert_eq!(res.status(), 400);
    let set = || {
        user.post(
            "/account/password",
            &[("password", "correct horse battery")],
        )
    };
    assert_eq!(set().await.status(), 200);
    // The account's other session is signed out; this one stays.
    assert_eq!(
        header(&elsewhere.get("/account").await, "location").as_deref(),
        Some("/login")
    );
    assert_eq!(user.get("/account").await.status(), 200);
    // Each change costs a hash: 5 per 15 minutes for one account.
    for _ in 0..3 {
        assert_eq!(set().await.status(), 200);
    }
    let res = set().await;
    assert_eq!(res.status(), 303);
    assert!(header(&res, "location")
        .unwrap()
        .starts_with("/err?rule=password-set&"));

    let res = user.post("/logout", &[]).await;
    assert_eq!(res.status(), 303);
    assert_eq!(
        header(&user.get("/account").await, "location").as_deref(),
        Some("/login")
    );

    let res = user
        .post(
            "/login/password",
            &[("phone", phone), ("password", "wrong password")],
        )
        .await;
    assert_eq!(res.status(), 400);
    let res = user
        .post(
            "/login/password",
            &[
                ("phone", "1-555-010-0005"),
                ("password", "correct horse battery"),
            ],
        )
        .await;
    assert_eq!(res.status(), 303);
    assert_eq!(user.get("/account").await.status(), 200);
}

#[actix_web::test]
async fn reset_changes_the_password_and_signs_every_session_out() {
    let app = spawn_app(DEFAULT).await;
    let phone = "+15550100006";
    let laptop = User::new(&app);
    laptop.sign_in(phone).await;
    laptop
        .post("/account/password", &[("password", "old password 1")])
        .await;

    let stranger = User::new(&app);
    let res = stranger.post("/password/reset", &[("phone", phone)]).await;
    assert_eq!(res.status(), 200);
    let code = latest_code(&app, phone).await;
    assert!(outbox(&app).await[0]["text"]
        .as_str()
        .unwrap()
        .contains("reset"));
    // A password too short, more often than the 5 wrong codes allowed:
    // the code is not tried, and no try is spent.
    for _ in 0..7 {
        let res = stranger
            .post(
                "/password/reset/confirm",
                &[("phone", phone), ("code", &code), ("password", "short")],
            )
            .await;
        assert_eq!(res.status(), 400);
    }
    let res = stranger
        .post(
            "/password/reset/confirm",
            &[
                ("phone", phone),
                ("code", &code),
                ("password", "new password 2"),
            ],
        )
        .await;
    assert_eq!(res.status(), 303);
    assert_eq!(
        header(&res, "location").as_deref(),
        Some("/login?reset=done")
    );
    // Not signed in by the reset, and the laptop was signed out.
    assert_eq!(stranger.get("/account").await.status(), 303);
    assert_eq!(laptop.get("/account").await.status(), 303);

    let res = stranger
        .post(
            "/login/password",
            &[("phone", phone), ("password", "old password 1")],
        )
        .await;
    assert_eq!(res.status(), 400);
    let res = stranger
        .post(
            "/login/password",
            &[("phone", phone), ("password", "new password 2")],
        )
        .await;
    assert_eq!(res.status(), 303);
}

#[actix_web::test]
async fn reset_answers_alike_for_known_and_unknown_phones() {
    let app = spawn_app(DEFAULT).await;
    User::new(&app).sign_in("+15550100007").await;
    let sent_before = outbox(&app).await.len();

    let known = User::new(&app)
        .post("/password/reset", &[("phone", "+15550100007")])
        .await;
    let unknown = User::new(&app)
        .post("/password/reset", &[("phone", "+15550100008")])
        .await;
    assert_eq!(known.status(), unknown.status());
    let known = known.text().await.unwrap().replace("15550100007", "N");
    let unknown = unknown.text().await.unwrap().replace("15550100008", "N");
    let strip = |s: &str| {
        // Drop the per-session CSRF token; everything else must match.
        let at = s.find("name=\"csrf\" value=\"").unwrap() + 19;
        format!("{}{}", &s[..at], &s[at + 64..])
    };
    assert_eq!(strip(&known), strip(&unknown));
    // Only the real account got a text.
    assert_eq!(outbox(&app).await.len(), sent_before + 1);
}

#[actix_web::test]
async fn every_post_needs_the_sessions_csrf_token() {
    let app = spawn_app(DEFAULT).await;
    let routes = [
        "/sms/send",
        "/login/sms",
        "/login/password",
        "/logout",
        "/account/password",
        "/password/reset",
        "/password/reset/confirm",
    ];
    let user = User::new(&app);
    let _ = user.csrf().await;
    let other = User::new(&app).csrf().await;
    // A new phone for each request: the limits (checked before any
    // handler) must not be what answers.
    let mut n = 0;
    let mut phone = move || {
        n += 1;
        format!("+1555019{n:04}")
    };
    for route in routes {
        let fields = |phone: String| {
            vec![
                ("phone", phone),
                ("code", "123456".to_string()),
                ("password", "long enough".to_string()),
            ]
        };
        let missing = user.post_raw_owned(route, fields(phone())).await;
        assert_eq!(missing.status(), 403, "{route} without csrf");
        let mut with_other = fields(phone());
        with_other.push(("csrf", other.clone()));
        let wrong = user.post_raw_owned(route, with_other).await;
        assert_eq!(wrong.status(), 403, "{route} with another session's csrf");
        let mut with_other = fields(phone());
        with_other.push(("csrf", other.clone()));
        let no_cookie = app
            .client
            .post(app.url(route))
            .form(&with_other)
            .send()
            .await
            .unwrap();
        assert_eq!(no_cookie.status(), 403, "{route} without a session");
        // No form at all has no token either. (Once per route: a request
        // without a phone is keyed by its address, which the next one
        // would share.)
        let res = app.client.post(app.url(route)).send().await.unwrap();
        assert_eq!(res.status(), 403, "{route} with no body");
    }
    // Nor has a body of another type (no rule guards `/logout`).
    let res = app
        .client
        .post(app.url("/logout"))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 403, "a JSON body");
}

/// What a browser, a link checker or a cache meets beside the flows: HEAD
/// answered as GET, a form's address asked for as a page sends to the
/// form, an unknown address is a page of the site, and no answer about a
/// visitor is kept by a cache (static files are).
#[actix_web::test]
async fn head_form_addresses_not_found_and_caching() {
    let app = spawn_app(DEFAULT).await;
    for path in [
        "/",
        "/login",
        "/password/reset",
        "/limits",
        "/static/style.css",
    ] {
        let res = app.client.head(app.url(path)).send().await.unwrap();
        assert_eq!(res.status(), 200, "HEAD {path}");
        assert!(res.bytes().await.unwrap().is_empty(), "HEAD {path}");
    }
    for (path, form) in [
        ("/sms/send", "/login"),
        ("/login/sms", "/login"),
        ("/login/password", "/login"),
        ("/account/password", "/account"),
        ("/password/reset/confirm", "/password/reset"),
        ("/logout", "/"),
    ] {
        let res = app.get(path).await;
        assert_eq!(res.status(), 303, "GET {path}");
        assert_eq!(
            header(&res, "location").as_deref(),
            Some(form),
            "GET {path}"
        );
    }
    let res = app
        .client
        .get(app.url("/no/such/page"))
        .header("accept", "text/html")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
    assert!(res.text().await.unwrap().contains("Page not found"));
    // A known address asked with a method it does not take: 405, naming
    // the ones it does.
    for (method, path, allow) in [
        (reqwest::Method::PUT, "/login", "GET, HEAD"),
        (reqwest::Method::PATCH, "/sms/send", "GET, HEAD, POST"),
        (reqwest::Method::DELETE, "/api/sms/send", "POST"),
    ] {
        let res = app
            .client
            .request(method.clone(), app.url(path))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 405, "{method} {path}");
        assert_eq!(
            header(&res, "allow").as_deref(),
            Some(allow),
            "{method} {path}"
        );
    }
    assert_eq!(
        app.get("/no/such/page").await.text().await.unwrap(),
        "not found\n"
    );
    for path in ["/", "/login", "/account", "/check"] {
        let res = app.get(path).await;
        assert_eq!(
            header(&res, "cache-control").as_deref(),
            Some("no-store"),
            "{path}"
        );
    }
    let res = app.get("/static/style.css").await;
    assert_eq!(
        header(&res, "cache-control").as_deref(),
        Some("public, max-age=300")
    );
}

/// A form without a valid token, which another site's page can make a
/// visitor's browser send, takes no quota from the visitor's address or
/// number; nor does a number that cannot be read (it sends no code).
#[actix_web::test]
async fn forged_forms_and_unreadable_numbers_take_no_quota() {
    let app = spawn_app(DEFAULT).await;
    // More than the 5 failed password tries per number and address.
    for _ in 0..8 {
        let res = app
            .client
            .post(app.url("/login/password"))
            .header("accept", "text/html")
            .form(&[("phone", "+15550106666"), ("password", "guess")])
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 403);
    }
    // More than the 3 codes a minute for a number, and the 20 an hour
    // from an address.
    let user = User::new(&app);
    for _ in 0..25 {
        let res = user
            .post_raw_owned("/sms/send", vec![("phone", "+15550106667".to_string())])
            .await;
        assert_eq!(res.status(), 403);
        let res = user.post("/sms/send", &[("phone", "555 010")]).await;
        assert_eq!(res.status(), 400);
        // A form that cannot be read (a field twice) has no valid token.
        let res = app
            .client
            .post(app.url("/sms/send"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body("csrf=x&csrf=y&phone=%2B15550106667")
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 403);
    }
    // The JSON API: another type (a page on another site can send
    // text/plain without asking), unreadable JSON, an unreadable number.
    for (content_type, body) in [
        ("text/plain", r#"{"phone":"+15550106667"}"#),
        ("application/json", "{"),
        ("application/json", r#"{"phone":"555 010"}"#),
    ] {
        for _ in 0..8 {
            let res = app
                .client
                .post(app.url("/api/sms/send"))
                .header("content-type", content_type)
                .body(body)
                .send()
                .await
                .unwrap();
            assert!([400, 415].contains(&res.status().as_u16()), "{body}");
        }
    }
    for _ in 0..3 {
        let res = user.post("/sms/send", &[("phone", "+15550106667")]).await;
        assert_eq!(res.status(), 200);
    }
    let res = user
        .post(
            "/login/password",
            &[("phone", "+15550106666"), ("password", "guess")],
        )
        .await;
    assert_eq!(res.status(), 400, "a wrong password, not the limit");
}

#[actix_web::test]
async fn the_fourth_code_in_a_minute_goes_to_the_error_page_whatever_the_format() {
    let app = spawn_app(DEFAULT).await;
    let user = User::new(&app);
    for phone in ["+1 (555) 010-0010", "1-555-010-0010", "15550100010"] {
        let res = user.post("/sms/send", &[("phone", phone)]).await;
        assert_eq!(res.status(), 200, "{phone}");
    }
    let res = user
        .post("/sms/send", &[("phone", "+1.555.010.0010")])
        .await;
    assert_eq!(res.status(), 303);
    let location = header(&res, "location").unwrap();
    assert!(
        location.starts_with("/err?rule=sms-per-phone&retry_after="),
        "{location}"
    );
    let retry: u64 = location.rsplit('=').next().unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let page = user.get(&location).await.text().await.unwrap();
    assert!(page.contains("at most 3 codes per minute for this phone number"));
    // Three texts went out, not four.
    assert_eq!(outbox(&app).await.len(), 3);
    // Another number is not affected.
    let res = user.post("/sms/send", &[("phone", "+15550100011")]).await;
    assert_eq!(res.status(), 200);
}

#[actix_web::test]
async fn one_reset_code_per_ten_minutes() {
    let app = spawn_app(DEFAULT).await;
    let user = User::new(&app);
    let res = user
        .post("/password/reset", &[("phone", "+15550100012")])
        .await;
    assert_eq!(res.status(), 200);
    let res = user
        .post("/password/reset", &[("phone", "1 555 010 0012")])
        .await;
    assert_eq!(res.status(), 303);
    let location = header(&res, "location").unwrap();
    assert!(
        location.starts_with("/err?rule=reset-per-phone&retry_after="),
        "{location}"
    );
    let retry: u64 = location.rsplit('=').next().unwrap().parse().unwrap();
    assert!((590..=600).contains(&retry), "{retry}");
}

#[actix_web::test]
async fn a_bad_phone_is_a_form_error() {
    // A value that is no phone number is counted by address; shadow the
    // small per-phone limits so that every try reaches the form.
    let mut config = DEFAULT.to_string();
    for rule in ["sms-per-phone", "reset-per-phone", "password-per-phone"] {
        config = config.replace(
            &format!("name = \"{rule}\"\n"),
            &format!("name = \"{rule}\"\nmode = \"shadow\"\n"),
        );
    }
    let app = spawn_app(&config).await;
    let user = User::new(&app);
    for phone in [
        "",
        "12345",
        "555-CALL-NOW",
        "1234567890123456",
        "+1 555 010 ☎",
        // The right number of digits, but no possible number in the US.
        "001 555 010 7777",
        "12345678",
    ] {
        for route in ["/sms/send", "/login/password", "/password/reset"] {
            let res = user
                .post(route, &[("phone", phone), ("password", "whatever1")])
                .await;
            assert_eq!(res.status(), 400, "{route} {phone:?}");
            let text = res.text().await.unwrap();
            assert!(text.contains("8 to 15 digits"), "{route}: {text}");
        }
    }
}

#[actix_web::test]
async fn session_rules_key_by_the_signed_in_account() {
    let config = format!(
        "{DEFAULT}\n[[rule]]\nname = \"per-account\"\npaths = [\"/account\"]\nkey = \"session\"\nlimit = 100\nwindow = \"1m\"\n"
    );
    let app = spawn_app(&config).await;
    let user = User::new(&app);
    user.get("/account").await; // not signed in: keyed by address
    assert_eq!(app.redis.keys("floodgate:per-account:ip:*").len(), 1);
    user.sign_in("+15550100014").await;
    let keys = app.redis.keys("floodgate:per-account:session:*");
    assert_eq!(keys.len(), 1, "{keys:?}");
}

#[actix_web::test]
async fn the_limits_page_shows_rules_and_the_visitors_usage() {
    let app = spawn_app(DEFAULT).await;
    for _ in 0..3 {
        assert_eq!(app.get("/check").await.status(), 200);
    }
    let res = app.get("/limits").await;
    assert_eq!(res.status(), 200);
    let page = res.text().await.unwrap();
    // Every rule, the per-address abuse thresholds too (`headers =
    // "none"` hides them from the fields only), here and on the home page.
    let home = app.get("/").await.text().await.unwrap();
    for rule in [
        "check",
        "api",
        "sms-per-phone",
        "reset-per-phone",
        "verify-per-phone",
        "password-per-phone",
        "sms-per-ip",
        "sms-per-phone-total",
        "verify-per-ip",
        "password-per-ip",
        "password-set",
    ] {
        assert!(page.contains(&format!("id=\"rule-{rule}\"")), "{rule}");
        assert!(home.contains(rule), "{rule} on the home page");
    }
    // The error page, which anyone may ask for any rule, names an abuse
    // threshold, not its numbers. A plain rule's page gives them.
    for hidden in ["sms-per-ip", "verify-per-ip", "password-per-ip"] {
        let text = app
            .get(&format!("/err?rule={hidden}&retry_after=5"))
            .await
            .text()
            .await
            .unwrap();
        assert!(text.contains(&format!("<code>{hidden}</code>")), "{text}");
        assert!(!text.contains("at most"), "{hidden}: {text}");
    }
    let text = app
        .get("/err?rule=check&retry_after=5")
        .await
        .text()
        .await
        .unwrap();
    assert!(
        text.contains("You reached a limit: <strong>at most 5"),
        "{text}"
    );
    assert!(page.contains("3 of 5 used"), "usage of /check");
    assert_eq!(
        page.matches("class=\"tick\"").count(),
        3,
        "three entries drawn"
    );
    assert!(page.contains("http-equiv=\"refresh\""));
}

/// A signed-in visitor's phone rules on `/limits` are the keys the filter
/// counted their sends under (the phone written any way, from their
/// address), with the remaining of the last send's `RateLimit` field.
#[actix_web::test]
async fn the_limits_page_shows_the_phone_keys_the_filter_counts() {
    let app = spawn_app(DEFAULT).await;
    let user = User::new(&app);
    user.sign_in("+1 (555) 010-0030").await;
    let res = user.post("/sms/send", &[("phone", "1-555-010-0030")]).await;
    assert_eq!(res.status(), 200);
    let left = remaining(&res, "sms-per-phone").unwrap();
    assert_eq!(left, 1, "two codes of three");
    let page = user.get("/limits").await.text().await.unwrap();
    let card = page
        .split("id=\"rule-sms-per-phone\"")
        .nth(1)
        .and_then(|rest| rest.split("</section>").next())
        .unwrap();
    assert!(
        card.contains("your phone +15550100030 from your address 127.0.0.1"),
        "{card}"
    );
    assert!(card.contains(&format!("{} of 3 used", 3 - left)), "{card}");
    assert!(
        page.contains("signed in as <code>+15550100030</code>"),
        "{page}"
    );
}

/// The default config behind a proxy on 127.0.0.1, so that a request can
/// come from another address (X-Forwarded-For) than the test's users.
fn default_behind_proxy(config: &str) -> String {
    config.replace("trusted_proxies = []", "trusted_proxies = [\"127.0.0.1\"]")
}

/// A stranger's cookie-less, CSRF-less posts for someone else's number,
/// from another address, as many as they like: the owner still gets codes,
/// signs in by code, and signs in by password.
#[actix_web::test]
async fn a_stranger_cannot_lock_someone_else_out() {
    let app = spawn_app(&default_behind_proxy(DEFAULT)).await;
    let victim = "+15550100020";
    // A stranger with a session of their own (a form without its token
    // takes no quota at all: see forged_forms_and_unreadable_numbers_take_no_quota).
    let session = User::new(&app);
    let csrf = session.csrf().await;
    let stranger = |path: &'static str, fields: &'static [(&str, &str)]| {
        let mut all = fields.to_vec();
        all.push(("csrf", &csrf));
        session
            .http
            .post(app.url(path))
            .header("x-forwarded-for", "6.6.6.6")
            .form(&all)
            .send()
    };
    let mut denied = 0;
    for _ in 0..10 {
        for (path, fields) in [
            ("/sms/send", &[("phone", "1 555 010 0020")][..]),
            (
                "/login/sms",
                &[("phone", "+1 555 010 0020"), ("code", "000000")][..],
            ),
            (
                "/login/password",
                &[("phone", "(555) 010-0020"), ("password", "guess guess")][..],
            ),
            ("/password/reset", &[("phone", "15550100020")][..]),
        ] {
            let res = stranger(path, fields).await.unwrap();
            match res.status().as_u16() {
                200 | 400 => {}
                303 => denied += 1,
                other => panic!("{path}: {other}"),
            }
        }
    }
    assert!(denied > 0, "the stranger met the limits");
    // The owner, from their own address.
    let owner = User::new(&app);
    owner.sign_in(victim).await;
    let res = owner
        .post(
            "/account/password",
            &[("password", "correct horse battery")],
        )
        .await;
    assert_eq!(res.status(), 200);
    let again = User::new(&app);
    let res = again
        .post(
            "/login/password",
            &[("phone", victim), ("password", "correct horse battery")],
        )
        .await;
    assert_eq!(res.status(), 303);
    assert_eq!(header(&res, "location").as_deref(), Some("/account"));
    let res = again.post("/password/reset", &[("phone", victim)]).await;
    assert_eq!(res.status(), 200);
}

/// One password tried on many numbers from one address: the per-address
/// rule stops it, whatever the numbers. (Its limit is lowered here so that
/// the test runs few Argon2 hashes.)
#[actix_web::test]
async fn password_spraying_is_limited_per_address() {
    let config = DEFAULT.replace(
        "name = \"password-per-ip\"\npaths = [\"/login/password\"]\nmethods = [\"POST\"]\nkey = \"ip\"\nlimit = 20",
        "name = \"password-per-ip\"\npaths = [\"/login/password\"]\nmethods = [\"POST\"]\nkey = \"ip\"\nlimit = 3",
    );
    assert_ne!(config, DEFAULT);
    let app = spawn_app(&config).await;
    let user = User::new(&app);
    for n in 0..3 {
        let phone = format!("+1555010003{n}");
        let res = user
            .post(
                "/login/password",
                &[("phone", &phone), ("password", "Summer2024!")],
            )
            .await;
        assert_eq!(res.status(), 400, "{phone}");
    }
    let res = user
        .post(
            "/login/password",
            &[("phone", "+15550100039"), ("password", "Summer2024!")],
        )
        .await;
    assert_eq!(res.status(), 303);
    let location = header(&res, "location").unwrap();
    assert!(
        location.starts_with("/err?rule=password-per-ip&retry_after="),
        "{location}"
    );
}

/// Many password attempts at once: never more than the permitted hashes
/// run together (each takes 19 MiB), the queue behind them is bounded, and
/// what does not fit is refused at once with 503 and Retry-After.
#[actix_web::test]
async fn concurrent_password_attempts_run_a_bounded_number_of_hashes() {
    use floodgate_site::site::password::{HASH_PERMITS, HASH_QUEUE};
    let config = default_with_shadow("password-per-phone").replace(
        "name = \"password-per-ip\"\n",
        "name = \"password-per-ip\"\nmode = \"shadow\"\n",
    );
    let app = spawn_app(&config).await;
    let user = User::new(&app);
    let csrf = user.csrf().await;
    let attempts = HASH_PERMITS + HASH_QUEUE + 8;
    let mut tasks = Vec::new();
    for n in 0..attempts {
        let req = user
            .http
            .post(app.url("/login/password"))
            .form(&[
                ("phone", format!("+1555010{:04}", 2000 + n)),
                ("password", "wrong password".to_string()),
                ("csrf", csrf.clone()),
            ])
            .send();
        tasks.push(actix_web::rt::spawn(req));
    }
    let gauge = |text: &str, name: &str| crate::helpers::metric(text, name).unwrap();
    // Until the queue has refused someone (those past its bound, at once),
    // the hashes running never exceed the permits.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let text = app.metrics().await;
        let peak = gauge(&text, "floodgate_password_hashes_peak");
        assert!(peak <= HASH_PERMITS as u64, "{peak} hashes at once");
        assert!(gauge(&text, "floodgate_password_hashes_waiting") <= HASH_QUEUE as u64);
        if gauge(&text, "floodgate_password_hashes_refused_total") > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no attempt was refused: {text}"
        );
        actix_web::rt::time::sleep(Duration::from_millis(20)).await;
    }
    // The refused ones were answered with 503 and Retry-After, the others
    // (as they finish) with the form error; nothing else.
    let mut refused = 0;
    for task in tasks {
        let res = task.await.unwrap().unwrap();
        match res.status().as_u16() {
            400 => {}
            503 => {
                assert_eq!(header(&res, "retry-after").as_deref(), Some("1"));
                refused += 1;
            }
            other => panic!("status {other}"),
        }
    }
    let text = app.metrics().await;
    assert_eq!(
        gauge(&text, "floodgate_password_hashes_refused_total"),
        refused
    );
    assert!(gauge(&text, "floodgate_password_hashes_peak") <= HASH_PERMITS as u64);
    assert_eq!(gauge(&text, "floodgate_password_hashes_running"), 0);
}

/// However many wrong guesses arrive at once, a code is compared at most
/// five times; after that it is gone, even for the right code.
#[actix_web::test]
async fn concurrent_guesses_try_a_code_at_most_five_times() {
    let config = default_with_shadow("verify-per-phone").replace(
        "name = \"verify-per-ip\"\n",
        "name = \"verify-per-ip\"\nmode = \"shadow\"\n",
    );
    let app = spawn_app(&config).await;
    let user = User::new(&app);
    let phone = "+15550100021";
    assert_eq!(
        user.post("/sms/send", &[("phone", phone)]).await.status(),
        200
    );
    let code = latest_code(&app, phone).await;
    let wrong = if code == "000000" { "111111" } else { "000000" };
    let csrf = user.csrf().await;
    let mut tasks = Vec::new();
    for _ in 0..30 {
        let req = user
            .http
            .post(app.url("/login/sms"))
            .form(&[("phone", phone), ("code", wrong), ("csrf", &csrf)])
            .send();
        tasks.push(actix_web::rt::spawn(req));
    }
    let mut compared = 0;
    for task in tasks {
        let res = task.await.unwrap().unwrap();
        assert_eq!(res.status(), 400);
        if res.text().await.unwrap().contains("That code is not right") {
            compared += 1;
        }
    }
    assert_eq!(compared, 5, "wrong guesses compared with the code");
    let res = user
        .post("/login/sms", &[("phone", phone), ("code", &code)])
        .await;
    assert_eq!(res.status(), 400, "the code is gone");
}

/// Numbers of many countries, each sent a code through the site: every
/// message goes to exactly that number in E.164, and two subscribers whose
/// numbers differ by a digit are two accounts.
#[actix_web::test]
async fn numbers_of_every_country_get_their_own_codes() {
    let app = spawn_app(&default_with_shadow("sms-per-ip")).await;
    let user = User::new(&app);
    for (typed, want) in [
        ("+49 151 12345678", "+4915112345678"),
        ("+49 160 1234567", "+491601234567"),
        ("+49 60 1234567", "+49601234567"),
        ("+49 (0)30 123456", "+4930123456"),
        ("+33 1 23 45 67 89", "+33123456789"),
        ("+44 7400 123456", "+447400123456"),
        ("+55 11 91234 5678", "+5511912345678"),
        ("+86 131 2345 6789", "+8613123456789"),
        ("+82 10 2000 0000", "+821020000000"),
        ("+20 100 123 4567", "+201001234567"),
        ("+61 4 1234 5678", "+61412345678"),
        ("+81 90 1234 5678", "+819012345678"),
        ("+91 81234 56789", "+918123456789"),
        ("+39 02 1234 5678", "+390212345678"),
        ("+7 800 555 35 35", "+78005553535"),
        ("+54 9 11 2345 6789", "+5491123456789"),
        ("+234 802 123 4567", "+2348021234567"),
        ("+1 (201) 555-0123", "+12015550123"),
        ("011 52 222 123 4567", "+522221234567"),
    ] {
        let res = user.post("/sms/send", &[("phone", typed)]).await;
        assert_eq!(res.status(), 200, "{typed}");
        assert_eq!(outbox(&app).await[0]["phone"], want, "{typed}");
    }
    for bad in ["+33 1 23 45 67", "+999 123 456 789", "+44 20 7946 000"] {
        let res = user.post("/sms/send", &[("phone", bad)]).await;
        assert_eq!(res.status(), 400, "{bad}");
    }
    // The code texted to +49 60 1234567 does not sign in +49 160 1234567.
    let other = latest_code(&app, "+49601234567").await;
    if other != latest_code(&app, "+491601234567").await {
        let res = user
            .post(
                "/login/sms",
                &[("phone", "+49 160 1234567"), ("code", &other)],
            )
            .await;
        assert_eq!(res.status(), 400);
    }
    let page = user.sign_in("+49 160 1234567").await;
    assert!(page.contains("+491601234567"), "{page}");
}

/// A stranger's guesses at someone else's code, from their own session
/// (many at once, each from another address): at most 5 are compared,
/// after which the code refuses them even when it is right; the code stays
/// good for the session that asked for it.
#[actix_web::test]
async fn a_strangers_guesses_never_void_someone_elses_code() {
    let app = spawn_app(&default_behind_proxy(DEFAULT)).await;
    let owner = User::new(&app);
    let phone = "+15550100040";
    assert_eq!(
        owner.post("/sms/send", &[("phone", phone)]).await.status(),
        200
    );
    let code = latest_code(&app, phone).await;
    let wrong = if code == "000000" { "111111" } else { "000000" };
    let stranger = User::new(&app);
    let csrf = stranger.csrf().await;
    let mut tasks = Vec::new();
    for n in 0..20 {
        let req = stranger
            .http
            .post(app.url("/login/sms"))
            .header("x-forwarded-for", format!("203.0.113.{n}"))
            .form(&[("phone", phone), ("code", wrong), ("csrf", &csrf)])
            .send();
        tasks.push(actix_web::rt::spawn(req));
    }
    let mut compared = 0;
    for task in tasks {
        let res = task.await.unwrap().unwrap();
        assert_eq!(res.status(), 400);
        if res.text().await.unwrap().contains("That code is not right") {
            compared += 1;
        }
    }
    assert_eq!(compared, 5, "strangers' guesses compared with the code");
    // The right code, from the stranger's session or another one: refused.
    for who in [&stranger, &User::new(&app)] {
        let csrf = who.csrf().await;
        let res = who
            .http
            .post(app.url("/login/sms"))
            .header("x-forwarded-for", "203.0.113.99")
            .form(&[("phone", phone), ("code", &code), ("csrf", &csrf)])
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 400, "a stranger signs in with the code");
    }
    // The owner signs in with it.
    let res = owner
        .post("/login/sms", &[("phone", phone), ("code", &code)])
        .await;
    assert_eq!(res.status(), 303);
    assert_eq!(header(&res, "location").as_deref(), Some("/account"));
}

/// A reset code is bound to its session the same way.
#[actix_web::test]
async fn a_strangers_guesses_never_void_someone_elses_reset_code() {
    let app = spawn_app(&default_with_shadow("verify-per-phone")).await;
    let phone = "+15550100042";
    let owner = User::new(&app);
    owner.sign_in(phone).await;
    assert_eq!(
        owner
            .post("/password/reset", &[("phone", phone)])
            .await
            .status(),
        200
    );
    let code = latest_code(&app, phone).await;
    let wrong = if code == "000000" { "111111" } else { "000000" };
    let stranger = User::new(&app);
    let new_password = "correct horse battery";
    for _ in 0..6 {
        let res = stranger
            .post(
                "/password/reset/confirm",
                &[
                    ("phone", phone),
                    ("code", wrong),
                    ("password", new_password),
                ],
            )
            .await;
        assert_eq!(res.status(), 400);
    }
    let res = stranger
        .post(
            "/password/reset/confirm",
            &[
                ("phone", phone),
                ("code", &code),
                ("password", new_password),
            ],
        )
        .await;
    assert_eq!(res.status(), 400, "a stranger resets with the code");
    let res = owner
        .post(
            "/password/reset/confirm",
            &[
                ("phone", phone),
                ("code", &code),
                ("password", new_password),
            ],
        )
        .await;
    assert_eq!(res.status(), 303);
}

/// `/dev/outbox` answers loopback clients only (the address behind a
/// trusted proxy counts, not the proxy's); `[site] public_outbox = true`
/// opens it to everyone.
#[actix_web::test]
async fn the_outbox_is_for_loopback_clients_only() {
    let config = default_behind_proxy(DEFAULT);
    let app = spawn_app(&config).await;
    let user = User::new(&app);
    user.post("/sms/send", &[("phone", "+15550100043")]).await;
    for from in ["203.0.113.7", "10.1.2.3", "2001:db8::1"] {
        for accept in ["application/json", "text/html"] {
            let res = app
                .client
                .get(app.url("/dev/outbox"))
                .header("accept", accept)
                .header("x-forwarded-for", from)
                .send()
                .await
                .unwrap();
            assert_eq!(res.status(), 404, "{from} {accept}");
            let text = res.text().await.unwrap();
            assert!(!text.contains("+15550100043"), "{text}");
        }
    }
    // A client's own loopback claims: the proxy appended its address to
    // X-Forwarded-For, or the headers disagree, or a hop is unreadable.
    for headers in [
        &[("x-forwarded-for", "127.0.0.1, 203.0.113.7")][..],
        &[
            ("forwarded", "for=127.0.0.1"),
            ("x-forwarded-for", "203.0.113.7"),
        ][..],
        &[("x-forwarded-for", "unknown")][..],
        &[("forwarded", "for=unknown")][..],
    ] {
        let mut req = app.client.get(app.url("/dev/outbox"));
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        assert_eq!(req.send().await.unwrap().status(), 404, "{headers:?}");
    }
    assert_eq!(outbox(&app).await.len(), 1, "loopback reads it");
    assert_eq!(app.get("/dev/outbox").await.status(), 200);
    drop(app);

    let open = config.replace("public_outbox = false", "public_outbox = true");
    assert_ne!(open, config);
    let app = spawn_app(&open).await;
    let res = app
        .client
        .get(app.url("/dev/outbox"))
        .header("accept", "application/json")
        .header("x-forwarded-for", "203.0.113.7")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
}

/// Every sign-in adds a session, but an account keeps at most
/// `MAX_SESSIONS`: the oldest are signed out, and Redis holds no more.
#[actix_web::test]
async fn an_account_keeps_a_bounded_number_of_sessions() {
    use floodgate_site::site::store::MAX_SESSIONS;
    let app = spawn_app(&default_with_shadow("sms-per-phone")).await;
    let phone = "+15550100044";
    let mut users = Vec::new();
    for _ in 0..MAX_SESSIONS + 2 {
        let user = User::new(&app);
        user.sign_in(phone).await;
        users.push(user);
    }
    for (n, user) in users.iter().enumerate() {
        let res = user.get("/account").await;
        if n < 2 {
            assert_eq!(res.status(), 303, "session {n} is signed out");
            assert_eq!(header(&res, "location").as_deref(), Some("/login"));
        } else {
            assert_eq!(res.status(), 200, "session {n} is signed in");
        }
    }
    assert_eq!(
        app.redis.keys("floodgate:@site:session:*").len(),
        MAX_SESSIONS
    );
}

/// A reload that changes `[defaults] region` changes how the site reads
/// numbers written without `+`, as it changes the rules.
#[actix_web::test]
async fn a_reload_changes_how_the_site_reads_numbers() {
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("site-region-{}.toml", std::process::id()));
    std::fs::write(&path, DEFAULT).unwrap();
    let at = path.clone();
    let app = crate::helpers::spawn_app_with(DEFAULT, move |c| c.filter.path = at).await;
    let user = User::new(&app);
    let london = "020 7946 0000";
    let res = user.post("/sms/send", &[("phone", london)]).await;
    assert_eq!(res.status(), 400, "no US number");
    std::fs::write(&path, DEFAULT.replace("region = \"US\"", "region = \"GB\"")).unwrap();
    app.reloader.reload().unwrap();
    let res = user.post("/sms/send", &[("phone", london)]).await;
    assert_eq!(res.status(), 200, "a GB number now");
    assert_eq!(outbox(&app).await[0]["phone"], "+442079460000");
    // The rules read it the same way.
    let keys = app.redis.keys("floodgate:sms-per-phone:*");
    assert!(
        keys.iter().any(|k| k.contains("+442079460000|")),
        "{keys:?}"
    );
    let _ = std::fs::remove_file(&path);
}

#[actix_web::test]
async fn the_json_api_takes_only_a_type_the_filter_reads_the_phone_of() {
    // `application/json ; x=y` (a space before the `;`) is no media type
    // to actix-web, so the filter keys such a request by its address alone:
    // the API must not send a code for it, or a phone could get codes past
    // its limit.
    let app = spawn_app(DEFAULT).await;
    for ct in ["application/json ; x=y", "application/json\t;charset=utf-8"] {
        let res = app
            .client
            .post(app.url("/api/sms/send"))
            .header("content-type", ct)
            .header("accept", "application/json")
            .body(r#"{"phone":"+15550100041"}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 415, "{ct}");
    }
    assert_eq!(outbox(&app).await.len(), 0);
}

#[actix_web::test]
async fn the_json_api_sends_codes_under_the_forms_limits_and_counters() {
    let app = spawn_app(DEFAULT).await;
    let user = User::new(&app);
    let api = |body: &'static str, content_type: &'static str| {
        app.client
            .post(app.url("/api/sms/send"))
            .header("content-type", content_type)
            .header("accept", "application/json")
            .body(body)
            .send()
    };
    // Not JSON: 415, whatever the body (a cross-site form cannot send JSON).
    // (The filter still counts a form body by its phone: another number.)
    for ct in [
        "application/x-www-form-urlencoded",
        "text/plain",
        "multipart/form-data",
    ] {
        let res = api("phone=%2B15550100049", ct).await.unwrap();
        assert_eq!(res.status(), 415, "{ct}");
    }
    let res = api(r#"{"phone":"12"}"#, "application/json").await.unwrap();
    assert_eq!(res.status(), 400);
    let v: Value = res.json().await.unwrap();
    assert_eq!(v, serde_json::json!({"error": "invalid_phone"}));
    // Two codes by the form and one by the API use up the three a minute.
    for phone in ["+1 (555) 010-0040", "1-555-010-0040"] {
        assert_eq!(
            user.post("/sms/send", &[("phone", phone)]).await.status(),
            200
        );
    }
    let res = api(r#"{"phone":"+15550100040"}"#, "application/json")
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let v: Value = res.json().await.unwrap();
    assert_eq!(v, serde_json::json!({"sent": true}));
    let res = api(
        r#"{"phone":"555.010.0040"}"#,
        "application/json; charset=utf-8",
    )
    .await
    .unwrap();
    assert_eq!(res.status(), 429);
    let retry: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    let v: Value = res.json().await.unwrap();
    assert_eq!(v["error"], "rate_limited");
    assert_eq!(v["rule"], "sms-per-phone");
    // An app's client that sends no Accept (or */*) gets the same 429 JSON,
    // not a redirect to the error page.
    for accept in [None, Some("*/*")] {
        let mut req = app
            .client
            .post(app.url("/api/sms/send"))
            .header("content-type", "application/json");
        if let Some(a) = accept {
            req = req.header("accept", a);
        }
        let res = req
            .body(r#"{"phone":"+15550100040"}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 429, "Accept {accept:?}");
        let v: Value = res.json().await.unwrap();
        assert_eq!(v["error"], "rate_limited", "Accept {accept:?}");
    }
    // The form is over the limit too: one counter.
    let res = user.post("/sms/send", &[("phone", "+15550100040")]).await;
    assert_eq!(res.status(), 303);
    assert_eq!(outbox(&app).await.len(), 3);
    assert_eq!(
        app.redis
            .llen("floodgate:sms-per-phone:body+ip:+15550100040|127.0.0.1"),
        3
    );
}

/// A load balancer's probe may be a HEAD: `/healthz` and `/readyz` answer
/// it as they answer GET, without the body.
#[actix_web::test]
async fn the_probes_answer_head_as_get() {
    let app = spawn_app(DEFAULT).await;
    for path in ["/healthz", "/readyz"] {
        let res = app.client.head(app.url(path)).send().await.unwrap();
        assert_eq!(res.status(), 200, "HEAD {path}");
        assert_eq!(res.bytes().await.unwrap().len(), 0, "HEAD {path}");
    }
    assert_eq!(app.get("/healthz").await.text().await.unwrap(), "ok\n");
}
