//! Faults: Redis stopped (allow and deny policies answer within the
//! timeout, /readyz says 503, and the first decision and page after it
//! returns succeed); Redis restarted while the app was idle (no decision,
//! page, code or readiness check fails on a connection that broke meanwhile,
//! and every admission is counted once); a reply lost after the script ran
//! (the call is never repeated); FUNCTION FLUSH or SCRIPT FLUSH between
//! requests, and a Redis that refuses functions; Redis asleep
//! (answers within the timeout, then exact counts: no late reply is handed
//! to a later request); malformed input of every kind gets a 4xx, never a
//! 5xx, and the app keeps serving.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::helpers::pinned::{check, sliding};
use floodgate::limiter::Limiter;
use floodgate::limiter::LimiterError;
use floodgate::limiter::LimiterOptions;
use floodgate_site::config::Config;

use crate::helpers::{
    decisions, header, is_script_call, metric, raw_request, remaining, spawn_app, RedisServer,
    Relay, TestApp, ToClient, ToRedis,
};

/// The configured Redis timeout, and what a decision may take on top of it.
/// The margin is room for a loaded machine's scheduling, not a speed to
/// meet: what it tells apart is a decision that waited for Redis, which here
/// would take the whole stall (3 s, far above both) or a retry loop's
/// seconds.
const TIMEOUT: Duration = Duration::from_millis(200);
const MARGIN: Duration = Duration::from_millis(800);

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

[[rule]]
name = "probe"
paths = ["/probe"]
limit = 100000
window = "1m"
"#;

/// Sends `GET path` until Redis decides it (its rule's `RateLimit` field is
/// there): after a failure the breaker holds calls back for its period, and
/// the first call after that probes Redis. Panics after 30 s (a deadline
/// for a loaded machine; Redis decides within a breaker period when well).
pub async fn until_redis_decides(app: &TestApp, path: &str, rule: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if remaining(&app.get(path).await, rule).is_some() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "Redis did not decide {path} again within 30 s"
        );
        actix_web::rt::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `GET path`, and how long the answer took.
async fn timed_get(app: &TestApp, path: &str) -> (reqwest::Response, Duration) {
    let started = Instant::now();
    let res = app.get(path).await;
    (res, started.elapsed())
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
    let m = |rule: &str, d: &str| decisions(&metrics, rule, d);
    assert_eq!(m("soft", "error_allowed"), Some(4), "{metrics}");
    assert_eq!(m("hard", "error_denied"), Some(4), "{metrics}");
    // The first failure opens the breaker; the requests after it are not
    // sent to Redis at all.
    assert!(
        metric(&metrics, "floodgate_redis_errors_total").unwrap() >= 1,
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "floodgate_breaker_open"),
        Some(1),
        "{metrics}"
    );

    let (res, took) = timed_get(&app, "/dev/outbox").await;
    assert_eq!(
        res.status(),
        503,
        "a page that needs Redis while it is down"
    );
    assert!(took <= TIMEOUT + MARGIN, "/dev/outbox took {took:?}");

    // Back on the same port, empty: once the breaker's probe finds Redis
    // answering, requests are decided by Redis again (no restart of the
    // app, no failed decision), the limits hold exactly, and the pages work
    // again.
    app.redis.restart();
    until_redis_decides(&app, "/probe", "probe").await;
    assert_eq!(
        metric(&app.metrics().await, "floodgate_breaker_open"),
        Some(0)
    );
    for (path, rule) in [("/check", "soft"), ("/api/ping", "hard")] {
        assert_exactly_left(&app, path, rule, 3).await;
    }
    assert_eq!(app.get("/readyz").await.status(), 200);
    assert_eq!(app.get("/dev/outbox").await.status(), 200);
    assert_eq!(app.redis.llen("floodgate:soft:ip:127.0.0.1"), 3);
    assert_eq!(app.redis.llen("floodgate:hard:ip:127.0.0.1"), 3);
}

/// With Redis down, the JSON API's own failure (the code cannot be stored)
/// is answered in JSON too: its clients read no page.
#[actix_web::test]
async fn the_json_api_answers_json_when_redis_fails_it() {
    let mut app = spawn_app("[redis]\ntimeout = \"200ms\"\n").await;
    app.redis.stop();
    let res = app
        .client
        .post(app.url("/api/sms/send"))
        .header("content-type", "application/json")
        .header("accept", "application/json")
        .body(r#"{"phone":"+15550100077"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(header(&res, "retry-after").as_deref(), Some("1"));
    let v: serde_json::Value = res.json().await.unwrap();
    assert_eq!(v, serde_json::json!({"error": "unavailable"}));
}

// Connections, not cached denials, are what these tests are about: a
// denial remembered before a restart would still deny after it (by design).
const RESTARTED: &str = r#"
[redis]
timeout = "250ms"

[limiter]
deny_cache = false

[[rule]]
name = "exact"
paths = ["/check"]
limit = 5
window = "1m"
deny = "status"
on_redis_error = "deny"

[[rule]]
name = "codes"
paths = ["/sms/send"]
methods = ["POST"]
key = "form:phone"
normalize = "digits"
limit = 3
window = "1m"
deny = "status"
on_redis_error = "deny"
"#;

/// Leaves the app holding as many connections as it will: both dispatcher
/// threads decide (sequential requests alternate between them) and the
/// site's pool is filled by concurrent pages. All of them then sit idle.
async fn use_every_connection(app: &TestApp) {
    for _ in 0..4 {
        assert_eq!(app.get("/check").await.status(), 200);
    }
    let pages: Vec<_> = (0..12)
        .map(|i| {
            let path = if i % 3 == 0 { "/readyz" } else { "/dev/outbox" };
            actix_web::rt::spawn(app.client.get(app.url(path)).send())
        })
        .collect();
    for page in pages {
        assert_eq!(page.await.unwrap().unwrap().status(), 200);
    }
}

#[actix_web::test]
async fn an_idle_redis_restart_fails_no_decision_and_counts_each_admission_once() {
    let mut app = spawn_app(RESTARTED).await;
    use_every_connection(&app).await;
    // Killed and started again, empty, with no request in between: every
    // connection the app holds is dead, and Redis answers.
    app.redis.restart();
    // Exactly the limit is admitted after the restart: no decision fails
    // (that would be a 503), and none is counted twice.
    assert_exactly_left(&app, "/check", "exact", 5).await;
    assert_eq!(app.redis.llen("floodgate:exact:ip:127.0.0.1"), 5);
    // And again after a second restart, with the connections of the first.
    app.redis.restart();
    assert_exactly_left(&app, "/check", "exact", 5).await;
    assert_eq!(app.redis.llen("floodgate:exact:ip:127.0.0.1"), 5);
}

/// A stalled Redis gets `/readyz` its 503 within the timeout, even when the
/// pool holds idle connections (whose check at checkout, and then the
/// PING, could each take the whole timeout).
#[actix_web::test]
async fn readiness_is_answered_within_the_timeout_when_redis_stalls() {
    let app = spawn_app(RESTARTED).await;
    use_every_connection(&app).await;
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(3000)
        .arg("ALL")
        .query(&mut app.redis.connection())
        .unwrap();
    for _ in 0..2 {
        let (res, took) = timed_get(&app, "/readyz").await;
        assert_eq!(res.status(), 503);
        // (250 ms: the config's timeout.)
        assert!(
            took <= Duration::from_millis(250 + 150),
            "/readyz took {took:?}"
        );
    }
}

/// After an outage, the first request once the breaker's period is over
/// probes Redis; the requests that come while that probe is on its way wait
/// for it, and are decided by the Redis that is back instead of failing.
#[actix_web::test]
async fn requests_beside_the_breakers_probe_are_decided_once_redis_is_back() {
    let mut app = spawn_app(
        r#"
[redis]
timeout = "250ms"

[limiter]
breaker = "200ms"

[[rule]]
name = "many"
paths = ["/check"]
limit = 1000
window = "1m"
deny = "status"
on_redis_error = "deny"
"#,
    )
    .await;
    assert_eq!(app.get("/check").await.status(), 200);
    app.redis.stop();
    assert_eq!(app.get("/check").await.status(), 503, "the outage");
    app.redis.restart();
    // The breaker's period, started by the failure above, runs out.
    actix_web::rt::time::sleep(Duration::from_millis(400)).await;
    let burst: Vec<_> = (0..24)
        .map(|_| actix_web::rt::spawn(app.client.get(app.url("/check")).send()))
        .collect();
    let mut statuses = Vec::new();
    for res in burst {
        statuses.push(res.await.unwrap().unwrap().status().as_u16());
    }
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    // Each of them counted once, on the Redis that is back.
    assert_eq!(remaining(&app.get("/check").await, "many"), Some(1000 - 25));
}

#[actix_web::test]
async fn an_idle_redis_restart_fails_no_page_and_no_readiness_check() {
    let mut app = spawn_app(RESTARTED).await;
    use_every_connection(&app).await;
    app.redis.restart();
    // More pages than the pool holds connections, so that every one of the
    // dead connections is checked out.
    for i in 0..20 {
        let res = app.get_json("/dev/outbox").await;
        assert_eq!(res.status(), 200, "/dev/outbox #{i} after the restart");
    }
    use_every_connection(&app).await;
    app.redis.restart();
    for i in 0..20 {
        assert_eq!(app.get("/readyz").await.status(), 200, "/readyz #{i}");
    }
}

/// The CSRF token on the sign-in page, for a client with a cookie jar.
async fn csrf(app: &TestApp, client: &reqwest::Client) -> String {
    let page = client
        .get(app.url("/login"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let at = page.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
    page[at..at + 64].to_string()
}

#[actix_web::test]
async fn an_idle_redis_restart_fails_no_code_sent_and_counts_each_code_once() {
    let mut app = spawn_app(RESTARTED).await;
    let user = reqwest::Client::builder()
        .cookie_store(true)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let token = csrf(&app, &user).await;
    let url = app.url("/sms/send");
    let send = |phone: &'static str| {
        user.post(&url)
            .form(&[("phone", phone), ("csrf", token.as_str())])
            .send()
    };
    assert_eq!(send("+1 555 010 7001").await.unwrap().status(), 200);
    use_every_connection(&app).await;
    app.redis.restart();
    // A code takes a decision and the site's own Redis work (the code, the
    // outbox): the first three both succeed, the fourth is the limit.
    for i in 0..3 {
        let res = send("+1 555 010 7002").await.unwrap();
        assert_eq!(res.status(), 200, "code #{i} after the restart");
        assert_eq!(remaining(&res, "codes"), Some(2 - i), "code #{i}");
    }
    assert_eq!(send("+1 555 010 7002").await.unwrap().status(), 429);
    assert_eq!(app.redis.llen("floodgate:codes:form:15550107002"), 3);
    let outbox: serde_json::Value = app.get_json("/dev/outbox").await.json().await.unwrap();
    let texts = outbox
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["phone"] == "+15550107002")
        .count();
    assert_eq!(texts, 3, "{outbox}");
}

/// A relay in front of Redis that, once `lose_next` is set, loses the reply
/// to the next script call: it passes the call on, waits for Redis's answer
/// (so the call has run), and then closes the client's connection instead
/// of answering.
fn reply_losing_relay(redis: &RedisServer, lose_next: &Arc<AtomicBool>) -> Relay {
    let armed = Arc::clone(lose_next);
    Relay::start(redis, move || {
        // This connection carries the call whose reply goes unanswered.
        let doomed = Arc::new(AtomicBool::new(false));
        let (armed, mark) = (Arc::clone(&armed), Arc::clone(&doomed));
        let to_redis: ToRedis = Box::new(move |chunk| {
            if is_script_call(chunk) && armed.swap(false, Ordering::SeqCst) {
                mark.store(true, Ordering::SeqCst);
            }
        });
        let to_client: ToClient = Box::new(move |_| !doomed.load(Ordering::SeqCst));
        (to_redis, to_client)
    })
}

#[actix_web::test]
async fn a_script_call_whose_reply_is_lost_is_never_sent_twice() {
    let redis = RedisServer::start();
    let lose_next_script_reply = Arc::new(AtomicBool::new(false));
    let relay = reply_losing_relay(&redis, &lose_next_script_reply);
    let mut config = Config::parse("", Path::new("test.toml")).unwrap();
    config.filter.redis.url = relay.url();
    config.filter.redis.timeout = Duration::from_secs(2);
    // No breaker period: the next decision probes Redis at once.
    let options = LimiterOptions {
        breaker: Duration::ZERO,
        ..LimiterOptions::default()
    };
    let limiter = Limiter::new(&config.filter.redis, options).unwrap();
    let key = "floodgate:lost:ip:127.0.0.1";
    let checks = || vec![check(key, sliding(10, 60_000), 1)];
    // Loads the script, so that the lost reply is the script's own.
    let first = limiter.decide(checks()).await.unwrap();
    assert_eq!(first.outcomes[0].remaining, 9);

    lose_next_script_reply.store(true, Ordering::SeqCst);
    let lost = limiter.decide(checks()).await;
    assert!(matches!(lost, Err(LimiterError::Redis(_))), "{lost:?}");
    assert!(!lose_next_script_reply.load(Ordering::SeqCst));
    // Redis ran the call once; the limiter did not send it again.
    assert_eq!(redis.llen(key), 2);

    // The next decision goes through on a new connection.
    let next = limiter.decide(checks()).await.unwrap();
    assert_eq!(next.outcomes[0].remaining, 7);
    assert_eq!(redis.llen(key), 3);
}

#[actix_web::test]
async fn function_flush_changes_nothing() {
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
    // The library is gone after every request: the next call finds its
    // function missing, loads it and is sent again, counted once.
    admitted_exactly_through(&app, "flushed", 5, &["FUNCTION", "FLUSH"]).await;
    let mut conn = app.redis.connection();
    // Every decision was a call of the library's function.
    let libraries: Vec<redis::Value> = redis::cmd("FUNCTION").arg("LIST").query(&mut conn).unwrap();
    assert_eq!(libraries.len(), 1, "{libraries:?}");
    assert_eq!(command_calls(&app.redis, "evalsha"), 0);
}

#[actix_web::test]
async fn a_redis_that_refuses_functions_decides_with_scripts() {
    // A user that may not call functions (as on Redis 6, which has none).
    decided_with_scripts(&["-fcall", "-fcall_ro", "-function"]).await;
}

#[actix_web::test]
async fn a_redis_that_refuses_to_load_the_library_decides_with_scripts() {
    // A user that may call functions but not load them, on a Redis that
    // has not got the library.
    decided_with_scripts(&["-function"]).await;
}

/// The limiter, as a user denied `denied` commands, falls back to EVALSHA,
/// and counts stay exact through a SCRIPT FLUSH.
async fn decided_with_scripts(denied: &[&str]) {
    let app = crate::helpers::spawn_app_with(
        r#"
[[rule]]
name = "scripted"
paths = ["/check"]
limit = 3
window = "1m"
deny = "status"
"#,
        |config| {
            let mut conn = redis::Client::open(config.filter.redis.url.as_str())
                .unwrap()
                .get_connection()
                .unwrap();
            redis::cmd("ACL")
                .arg(&["SETUSER", "scripts", "on", ">secret", "~*", "&*", "+@all"])
                .arg(denied)
                .exec(&mut conn)
                .unwrap();
            config.filter.redis.url = config
                .filter
                .redis
                .url
                .replace("redis://", "redis://scripts:secret@");
        },
    )
    .await;
    admitted_exactly_through(&app, "scripted", 3, &["SCRIPT", "FLUSH"]).await;
    assert_eq!(command_calls(&app.redis, "evalsha"), 4);
    assert_eq!(command_calls(&app.redis, "fcall"), 0);
}

/// `GET /check` until `rule` (limit `limit`, keyed by address) denies,
/// running `flush` on Redis after each allowed request: each request is
/// allowed with one unit fewer left, then the next is denied, and the log
/// holds exactly `limit` entries.
async fn admitted_exactly_through(app: &TestApp, rule: &str, limit: u64, flush: &[&str]) {
    let mut conn = app.redis.connection();
    for expected in (0..limit).rev() {
        let res = app.get("/check").await;
        assert_eq!(res.status(), 200);
        assert_eq!(remaining(&res, rule), Some(expected));
        redis::cmd(flush[0])
            .arg(&flush[1..])
            .exec(&mut conn)
            .unwrap();
    }
    let res = app.get("/check").await;
    assert_eq!(res.status(), 429);
    assert_eq!(
        app.redis.llen(&format!("floodgate:{rule}:ip:127.0.0.1")),
        limit
    );
}

/// Calls of Redis command `name` (lower case) that ran and succeeded,
/// from `INFO commandstats`.
fn command_calls(redis: &RedisServer, name: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis.connection())
        .unwrap();
    let Some(line) = info
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:")))
    else {
        return 0;
    };
    let field = |name: &str| -> u64 {
        line.split(',')
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .map_or(0, |n| n.trim().parse().unwrap())
    };
    field("calls") - field("failed_calls")
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
            .arg(3)
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
    until_redis_decides(&app, "/api/ping", "during").await;
    // The late answers to the calls above arrive after their callers gave
    // up: none may be taken for the answer to a later call.
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
            "invalid UTF-8 in a query key value",
            get_raw(b"/check?q=%ff%fe&x=%zz", b""),
            &[400],
        ),
        (
            "invalid UTF-8 in another query parameter",
            get_raw(b"/check?q=1&x=%ff%fe%zz", b""),
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
            "invalid UTF-8 in a form key value",
            form(b"phone=%ff%fe&x=%zz"),
            &[400],
        ),
        (
            "invalid UTF-8 in another form value",
            form(b"phone=1&x=%ff%fe%zz"),
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

    // A form value that is not UTF-8 (and not a key) still reaches the handler intact.
    let body = b"phone=1&x=%ff%fe%zz";
    let res = raw_request(app.port, &form(body));
    assert_eq!(res.body, body);

    // Still serving, and still deciding.
    assert_eq!(app.get("/healthz").await.status(), 200);
    let res = app.get("/check?q=fine").await;
    assert_eq!(res.status(), 200);
    assert!(header(&res, "ratelimit").is_some());
}
