//! Faults (CONTRACT 3.11, 3.13, 4): Redis stopped (allow and deny policies
//! answer within the timeout, /readyz says 503) and restarted on the same
//! port (decisions resume without restarting the app); SCRIPT FLUSH between
//! requests; Redis asleep (answers within the timeout, then exact counts: no
//! late reply is handed to a later request); malformed input of every kind
//! gets a 4xx, never a 5xx, and the app keeps serving.

use std::time::{Duration, Instant};

use crate::helpers::{header, metric, raw_request, remaining, spawn_app, TestApp};

/// The configured Redis timeout, and what a decision may take on top of it.
const TIMEOUT: Duration = Duration::from_millis(200);
const MARGIN: Duration = Duration::from_millis(300);

const TWO_POLICIES: &str = r#"
[redis]
timeout = "200ms"

[[rule]]
name = "soft"
paths = ["/check"]
limit = 3
window = "1m"
deny = "status"
on_redis_error = "allow"

[[rule]]
name = "hard"
paths = ["/api/*"]
limit = 3
window = "1m"
deny = "status"
on_redis_error = "deny"
"#;

/// `GET path`, and how long the answer took.
async fn timed_get(app: &TestApp, path: &str) -> (reqwest::Response, Duration) {
    let started = Instant::now();
    let res = app.get(path).await;
    (res, started.elapsed())
}

/// Polls `GET path` until a decision comes back from Redis again (the
/// response carries RateLimit fields); returns that response.
async fn await_decisions(app: &TestApp, path: &str) -> reqwest::Response {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let res = app.get(path).await;
        if header(&res, "ratelimit").is_some() {
            return res;
        }
        assert!(
            Instant::now() < deadline,
            "{path}: no decisions 10 s after Redis returned"
        );
        actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends `GET path` until denied: exactly `left` more must be allowed.
async fn assert_exactly_left(app: &TestApp, path: &str, rule: &str, left: u64) {
    for expected in (0..left).rev() {
        let res = app.get(path).await;
        assert_eq!(res.status(), 200, "{path}");
        assert_eq!(remaining(&res, rule), Some(expected), "{path}");
    }
    assert_eq!(app.get(path).await.status(), 429, "{path}");
}

#[actix_web::test]
async fn redis_down_applies_the_error_policy_in_time_and_recovers() {
    let mut app = spawn_app(TWO_POLICIES).await;
    assert_eq!(remaining(&app.get("/check").await, "soft"), Some(2));
    assert_eq!(remaining(&app.get("/api/ping").await, "hard"), Some(2));
    assert_eq!(app.get("/readyz").await.status(), 200);

    app.redis.stop();
    for _ in 0..4 {
        let (res, took) = timed_get(&app, "/check").await;
        assert_eq!(res.status(), 200);
        assert_eq!(header(&res, "ratelimit"), None);
        assert_eq!(header(&res, "ratelimit-policy"), None);
        assert!(took <= TIMEOUT + MARGIN, "allow policy took {took:?}");

        let (res, took) = timed_get(&app, "/api/ping").await;
        assert_eq!(res.status(), 503);
        assert_eq!(header(&res, "retry-after").as_deref(), Some("1"));
        assert!(took <= TIMEOUT + MARGIN, "deny policy took {took:?}");
    }
    let (res, took) = timed_get(&app, "/readyz").await;
    assert_eq!(res.status(), 503);
    assert!(took <= TIMEOUT + MARGIN, "/readyz took {took:?}");
    let metrics = app.metrics().await;
    let m = |rule: &str, d: &str| {
        metric(
            &metrics,
            &format!("floodgate_decisions_total{{rule=\"{rule}\",decision=\"{d}\"}}"),
        )
    };
    assert_eq!(m("soft", "error_allowed"), Some(4), "{metrics}");
    assert_eq!(m("hard", "error_denied"), Some(4), "{metrics}");
    assert!(
        metric(&metrics, "floodgate_redis_errors_total").unwrap() >= 8,
        "{metrics}"
    );

    // Back on the same port, empty: the same app decides again, and enforces.
    app.redis.restart();
    for (path, rule) in [("/check", "soft"), ("/api/ping", "hard")] {
        let res = await_decisions(&app, path).await;
        assert_eq!(res.status(), 200);
        let left = remaining(&res, rule).unwrap();
        assert_exactly_left(&app, path, rule, left).await;
    }
    assert_eq!(app.get("/readyz").await.status(), 200);
    assert_eq!(app.redis.llen("floodgate:soft:ip:127.0.0.1"), 3);
    assert_eq!(app.redis.llen("floodgate:hard:ip:127.0.0.1"), 3);
}

#[actix_web::test]
async fn script_flush_changes_nothing() {
    let app = spawn_app(
        r#"
[[rule]]
name = "flushed"
paths = ["/check"]
limit = 5
window = "1m"
deny = "status"
"#,
    )
    .await;
    let mut conn = app.redis.connection();
    for expected in [4, 3, 2, 1, 0] {
        let res = app.get("/check").await;
        assert_eq!(res.status(), 200);
        assert_eq!(remaining(&res, "flushed"), Some(expected));
        redis::cmd("SCRIPT").arg("FLUSH").exec(&mut conn).unwrap();
    }
    let res = app.get("/check").await;
    assert_eq!(res.status(), 429);
    assert_eq!(app.redis.llen("floodgate:flushed:ip:127.0.0.1"), 5);
}

#[actix_web::test]
async fn a_slow_redis_costs_the_timeout_and_leaves_no_stale_replies() {
    let app = spawn_app(
        r#"
[redis]
timeout = "200ms"

[[rule]]
name = "during"
paths = ["/api/*"]
limit = 100
window = "1m"
deny = "status"

[[rule]]
name = "after"
paths = ["/check"]
limit = 3
window = "1m"
deny = "status"
"#,
    )
    .await;
    // Both dispatchers hold a connection before Redis goes to sleep.
    for _ in 0..4 {
        assert_eq!(app.get("/api/ping").await.status(), 200);
    }
    let mut sleeper = app.redis.connection();
    let asleep = std::thread::spawn(move || {
        redis::cmd("DEBUG")
            .arg("SLEEP")
            .arg(1)
            .exec(&mut sleeper)
            .unwrap();
    });
    crate::helpers::wait_until(Duration::from_secs(2), "Redis to fall asleep", || {
        !app.redis.ping(Duration::from_millis(50))
    });
    for i in 0..3 {
        let (res, took) = timed_get(&app, "/api/ping").await;
        assert_eq!(res.status(), 200);
        assert!(took <= TIMEOUT + MARGIN, "request {i} took {took:?}");
        if i == 0 {
            assert_eq!(header(&res, "ratelimit"), None, "decided while Redis slept");
        }
    }
    asleep.join().unwrap();
    // The late answers to the calls above are still on the dispatchers'
    // connections: none may be taken for the answer to a later call.
    assert_exactly_left(&app, "/check", "after", 3).await;
    assert_eq!(app.redis.llen("floodgate:after:ip:127.0.0.1"), 3);
}

// ---------------------------------------------------------------------------
// Malformed input
// ---------------------------------------------------------------------------

const GUARDED: &str = r#"
[server]
max_form = "1KiB"

[[rule]]
name = "everything"
paths = ["/*"]
limit = 100000
window = "1m"
deny = "status"

[[rule]]
name = "by_query"
paths = ["/check"]
key = "query:q"
limit = 1000
window = "1m"

[[rule]]
name = "by_header"
paths = ["/check"]
key = "header:x-user"
limit = 1000
window = "1m"

[[rule]]
name = "by_form"
paths = ["/echo"]
key = "form:phone"
normalize = "digits"
limit = 1000
window = "1m"
"#;

fn get_raw(target: &[u8], extra: &[u8]) -> Vec<u8> {
    [
        b"GET ".as_slice(),
        target,
        b" HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n",
        extra,
        b"\r\n",
    ]
    .concat()
}

fn post_raw(headers: &[u8], body: &[u8]) -> Vec<u8> {
    [
        b"POST /echo HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n".as_slice(),
        headers,
        b"\r\n",
        body,
    ]
    .concat()
}

const FORM_TYPE: &[u8] = b"Content-Type: application/x-www-form-urlencoded\r\n";

#[actix_web::test]
async fn malformed_input_gets_4xx_never_5xx() {
    let app = spawn_app(GUARDED).await;
    let big_header = [b"X-Big: ".as_slice(), &[b'a'; 100 * 1024], b"\r\n"].concat();
    let fair_header = [b"X-Big: ".as_slice(), &[b'a'; 16 * 1024], b"\r\n"].concat();
    let big_form = [b"phone=1&pad=".as_slice(), &[b'a'; 200 * 1024]].concat();
    let chunked_form = [
        b"400\r\n".as_slice(),
        &[b'a'; 0x400],
        b"\r\n400\r\n",
        &[b'b'; 0x400],
        b"\r\n0\r\n\r\n",
    ]
    .concat();
    let form = |body: &[u8]| {
        let headers = [
            FORM_TYPE,
            format!("Content-Length: {}\r\n", body.len()).as_bytes(),
        ]
        .concat();
        post_raw(&headers, body)
    };
    // (what, request, the statuses it may get)
    let cases: Vec<(&str, Vec<u8>, &[u16])> = vec![
        (
            "bad percent-encoding in the path",
            get_raw(b"/%zz", b""),
            &[404],
        ),
        (
            "invalid UTF-8 in the path",
            get_raw(b"/check%ff", b""),
            &[400],
        ),
        (
            "invalid UTF-8 in a guarded prefix",
            get_raw(b"/%ff/x", b""),
            &[400],
        ),
        (
            "a raw 0xff byte in the path",
            get_raw(b"/\xff", b""),
            &[400, 404],
        ),
        (
            "invalid UTF-8 in the query",
            get_raw(b"/check?q=%ff%fe&x=%zz", b""),
            &[200],
        ),
        (
            "invalid UTF-8 in a header",
            get_raw(b"/check", b"X-User: \xff\xfe\r\n"),
            &[200, 400],
        ),
        (
            "garbage retry_after",
            get_raw(b"/err?rule=%ff&retry_after=%zz", b""),
            &[200],
        ),
        (
            "negative retry_after",
            get_raw(b"/err?retry_after=-5", b""),
            &[200],
        ),
        (
            "huge retry_after",
            get_raw(b"/err?retry_after=99999999999999999999999999", b""),
            &[200],
        ),
        ("a 100 KB header", get_raw(b"/check", &big_header), &[431]),
        (
            "a 16 KB header is fine",
            get_raw(b"/check", &fair_header),
            &[200],
        ),
        (
            "invalid UTF-8 in a form value",
            form(b"phone=%ff%fe&x=%zz"),
            &[200],
        ),
        ("a 200 KB form", form(&big_form), &[413]),
        (
            "a form larger than declared",
            post_raw(
                &[FORM_TYPE, b"Transfer-Encoding: chunked\r\n"].concat(),
                &chunked_form,
            ),
            &[413],
        ),
        (
            "a broken chunked form",
            post_raw(
                &[FORM_TYPE, b"Transfer-Encoding: chunked\r\n"].concat(),
                b"zz\r\nphone=1\r\n0\r\n\r\n",
            ),
            &[400],
        ),
        (
            "a bad Content-Length",
            post_raw(
                &[FORM_TYPE, b"Content-Length: ten\r\n"].concat(),
                b"phone=1",
            ),
            &[400],
        ),
    ];
    let mut wrong = Vec::new();
    for (what, request, expected) in &cases {
        let res = raw_request(app.port, request);
        if !expected.contains(&res.status) {
            wrong.push(format!(
                "{what}: {} (expected one of {expected:?})",
                res.head
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));

    // A form value that is not UTF-8 still reaches the handler intact.
    let body = b"phone=%ff%fe&x=%zz";
    let res = raw_request(app.port, &form(body));
    assert_eq!(res.body, body);

    // Still serving, and still deciding.
    assert_eq!(app.get("/healthz").await.status(), 200);
    let res = app.get("/check?q=fine").await;
    assert_eq!(res.status(), 200);
    assert!(header(&res, "ratelimit").is_some());
}
