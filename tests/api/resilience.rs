//! Under flood and failure: a call that reaches Redis after its caller gave
//! up decides nothing; a denied key is answered from memory without a Redis
//! call until its retry time; after a failure the breaker answers at once
//! without calling Redis; `on_redis_error = "local"` enforces the limit in
//! the process while Redis is away, and Redis decides again once it answers;
//! a probe whose caller gives up does not keep the breaker open; once
//! `/readyz` says ready, Redis decides the next request.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::helpers::pinned::{check, sliding};
use floodgate::__private::decide_batch_with_deadlines;
use floodgate::limiter::Limiter;
use floodgate::limiter::LimiterError;
use floodgate::limiter::LimiterOptions;
use floodgate_site::config::Config;

use crate::faults::until_redis_decides;
use crate::helpers::{
    header, is_script_call, metric, remaining, spawn_app, spawn_app_with, unguarded_never_waits,
    wait_until, RedisServer, Relay, TestApp, ToClient, ToRedis,
};

/// `cmdstat_NAME:calls=N` from `INFO commandstats`: how many times Redis ran NAME.
fn calls(redis: &RedisServer, name: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut redis.connection())
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// Pauses every client of `redis` for `ms` (from a connection of its own).
fn pause(redis: &RedisServer, ms: u64) {
    redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(ms)
        .arg("ALL")
        .exec(&mut redis.connection())
        .unwrap();
}

#[test]
fn a_job_past_its_deadline_in_redis_time_decides_nothing() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let (secs, micros): (i64, i64) = redis::cmd("TIME").query(&mut conn).unwrap();
    let now_ms = secs * 1000 + micros / 1000;
    let one = |key: &str| check(key, sliding(5, 60_000), 1);
    let decided = decide_batch_with_deadlines(
        &mut conn,
        vec![
            (None, Some(now_ms - 1), vec![one("late")]),
            (None, Some(now_ms + 60_000), vec![one("in_time")]),
            (None, None, vec![one("no_deadline")]),
        ],
    )
    .unwrap();
    assert_eq!(decided[0], Err(LimiterError::Late));
    assert!(decided[1].as_ref().unwrap().allowed);
    assert!(decided[2].as_ref().unwrap().allowed);
    assert_eq!(redis.llen("late"), 0, "a late job records nothing");
    assert_eq!(redis.llen("in_time"), 1);
    assert_eq!(redis.llen("no_deadline"), 1);
}

/// A relay in front of Redis that, while `armed`, holds each script call
/// for `hold` before passing it on (the network, or a stalled Redis, made it
/// late), and keeps the call going to Redis even when the client has hung
/// up by then. Everything else passes at once.
fn late_relay(redis: &RedisServer, hold: Duration, armed: &Arc<AtomicBool>) -> Relay {
    let armed = Arc::clone(armed);
    Relay::start(redis, move || {
        let armed = Arc::clone(&armed);
        let to_redis: ToRedis = Box::new(move |chunk| {
            if is_script_call(chunk) && armed.load(Ordering::SeqCst) {
                // The simulated delay on the way to Redis.
                std::thread::sleep(hold);
            }
        });
        let to_client: ToClient = Box::new(|_| true);
        (to_redis, to_client)
    })
}

#[actix_web::test]
async fn a_call_that_reaches_redis_after_its_caller_gave_up_takes_nothing() {
    let redis = RedisServer::start();
    let armed = Arc::new(AtomicBool::new(false));
    let relay = late_relay(&redis, Duration::from_millis(500), &armed);
    let mut config = Config::parse("", Path::new("test.toml")).unwrap();
    config.filter.redis.url = relay.url();
    config.filter.redis.timeout = Duration::from_millis(200);
    let limiter = Limiter::new(&config.filter.redis, LimiterOptions::default()).unwrap();
    let key = "floodgate:late:ip:127.0.0.1";
    let checks = || vec![check(key, sliding(10, 60_000), 1)];
    // Redis's clock is known from the first call.
    assert_eq!(
        limiter.decide(checks()).await.unwrap().outcomes[0].remaining,
        9
    );
    let before = calls(&redis, "fcall");

    armed.store(true, Ordering::SeqCst);
    let late = limiter.decide(checks()).await;
    assert_eq!(late, Err(LimiterError::Timeout));
    // The call reaches Redis after its caller gave up: it decides nothing.
    wait_until(Duration::from_secs(5), "the late call to run", || {
        calls(&redis, "fcall") > before
    });
    assert_eq!(redis.llen(key), 1, "the late call took quota");
}

#[actix_web::test]
async fn a_denied_key_is_answered_from_memory_until_its_retry_time() {
    let app = spawn_app(
        r#"
[[rule]]
name = "flood"
paths = ["/check"]
limit = 2
window = "5s"
deny = "status"

[[rule]]
name = "other"
paths = ["/other"]
limit = 1000
window = "1m"
"#,
    )
    .await;
    assert_eq!(app.get("/check").await.status(), 200);
    assert_eq!(app.get("/check").await.status(), 200);
    // Redis denies once; the process remembers it.
    // The window (5 s) is far longer than the 53 requests take on any
    // machine, so every one of them falls inside it.
    let res = app.get_json("/check").await;
    assert_eq!(res.status(), 429);
    let before = calls(&app.redis, "fcall");
    let mut retry = 0;
    for _ in 0..50 {
        let res = app.get_json("/check").await;
        assert_eq!(res.status(), 429);
        retry = header(&res, "retry-after").unwrap().parse().unwrap();
        assert!((1..=5).contains(&retry), "Retry-After: {retry}");
        assert_eq!(header(&res, "cache-control").as_deref(), Some("no-store"));
        assert_eq!(
            res.text().await.unwrap(),
            format!(r#"{{"error":"rate_limited","rule":"flood","retry_after":{retry}}}"#)
        );
    }
    assert_eq!(
        calls(&app.redis, "fcall"),
        before,
        "a remembered denial makes no Redis call"
    );
    // Another key still goes to Redis.
    assert_eq!(remaining(&app.get("/other").await, "other"), Some(999));
    assert_eq!(calls(&app.redis, "fcall"), before + 1);
    let metrics = app.metrics().await;
    assert_eq!(
        metric(&metrics, "floodgate_deny_cache_hits_total{rule=\"flood\"}"),
        Some(50),
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "floodgate_decisions_total{rule=\"flood\",decision=\"denied\"}"
        ),
        Some(51),
        "{metrics}"
    );
    // After the retry time the same request is allowed (by Redis).
    // Sleeping is the subject here: the wait the server asked for.
    actix_web::rt::time::sleep(Duration::from_secs(retry)).await;
    let res = app.get("/check").await;
    assert_eq!(res.status(), 200);
    // Decided by Redis (the field is there); the second admission may still
    // be inside the window when the rounded-up wait ran out.
    let left = remaining(&res, "flood");
    assert!(matches!(left, Some(0 | 1)), "remaining {left:?}");
}

#[actix_web::test]
async fn while_the_breaker_is_open_decisions_are_immediate_and_never_reach_redis() {
    let app = spawn_app(
        r#"
[redis]
timeout = "1s"

[limiter]
breaker = "1m"

[[rule]]
name = "soft"
paths = ["/check"]
limit = 100
window = "1m"
deny = "status"
on_redis_error = "allow"

[[rule]]
name = "hard"
paths = ["/api/*"]
limit = 100
window = "1m"
deny = "status"
on_redis_error = "deny"
"#,
    )
    .await;
    assert_eq!(remaining(&app.get("/check").await, "soft"), Some(99));
    let before = calls(&app.redis, "fcall");
    // Paused far longer than the 40 requests below take on any machine.
    pause(&app.redis, 6000);
    // The first decision waits out the timeout and opens the breaker.
    let res = app.get("/check").await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "ratelimit"), None);
    let started = Instant::now();
    for _ in 0..20 {
        let res = app.get("/check").await;
        assert_eq!(res.status(), 200);
        assert_eq!(header(&res, "ratelimit"), None);
        let res = app.get("/api/ping").await;
        assert_eq!(res.status(), 503);
        assert_eq!(header(&res, "retry-after").as_deref(), Some("1"));
    }
    let during = started.elapsed();
    let metrics = app.metrics().await;
    assert_eq!(metric(&metrics, "floodgate_breaker_open"), Some(1));
    assert_eq!(
        metric(
            &metrics,
            "floodgate_decisions_total{rule=\"soft\",decision=\"error_allowed\"}"
        ),
        Some(21)
    );
    assert_eq!(
        metric(
            &metrics,
            "floodgate_decisions_total{rule=\"hard\",decision=\"error_denied\"}"
        ),
        Some(20)
    );
    // None of the 40 waited for Redis: 40 timeouts would take 40 s, and the
    // pause (6 s) has not even ended while they were answered.
    assert!(during < Duration::from_secs(6), "{during:?}");
    // The decisions under 250 ms: the 40 answered while the breaker held,
    // and the one before the pause (the first after it waited 1 s).
    assert_eq!(
        metric(
            &metrics,
            "floodgate_decision_duration_seconds_bucket{le=\"0.25\"}"
        ),
        Some(41),
        "{metrics}"
    );
    // Once Redis resumes, at most the call made before the breaker opened
    // has reached it (a paused client that hung up is not run at all).
    wait_until(Duration::from_secs(20), "Redis to resume", || {
        app.redis.ping(Duration::from_millis(100))
    });
    assert!(calls(&app.redis, "fcall") <= before + 1);
    assert_eq!(app.redis.llen("floodgate:hard:ip:127.0.0.1"), 0);
}

const LOCAL: &str = r#"
[redis]
timeout = "200ms"

[limiter]
breaker = "200ms"

[[rule]]
name = "local"
paths = ["/check"]
limit = 3
window = "1m"
deny = "status"
on_redis_error = "local"

[[rule]]
name = "probe"
paths = ["/probe"]
limit = 100000
window = "1m"
"#;

#[actix_web::test]
async fn local_enforces_the_limit_while_redis_is_down_and_redis_decides_once_it_answers() {
    let mut app = spawn_app(LOCAL).await;
    assert_eq!(remaining(&app.get("/check").await, "local"), Some(2));

    app.redis.stop();
    // This process alone counts now, from nothing, with the same answers.
    for left in [2, 1, 0] {
        let res = app.get("/check").await;
        assert_eq!(res.status(), 200);
        assert_eq!(remaining(&res, "local"), Some(left));
        assert_eq!(
            header(&res, "ratelimit-policy").as_deref(),
            Some("\"local\";q=3;w=60")
        );
    }
    let res = app.get_json("/check").await;
    assert_eq!(res.status(), 429);
    let retry: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
    assert!((59..=60).contains(&retry), "{retry}");
    assert_eq!(
        res.text().await.unwrap(),
        format!(r#"{{"error":"rate_limited","rule":"local","retry_after":{retry}}}"#)
    );
    let metrics = app.metrics().await;
    let m = |d: &str| {
        metric(
            &metrics,
            &format!("floodgate_decisions_total{{rule=\"local\",decision=\"{d}\"}}"),
        )
    };
    assert_eq!(m("local_allowed"), Some(3), "{metrics}");
    assert_eq!(m("local_denied"), Some(1), "{metrics}");
    assert_eq!(m("error_allowed"), None, "{metrics}");

    // Redis returns, empty: once the probe finds it, Redis decides again
    // and none of the local admissions were written to it.
    app.redis.restart();
    until_redis_decides(&app, "/probe", "probe").await;
    let res = app.get("/check").await;
    assert_eq!(res.status(), 200);
    assert_eq!(remaining(&res, "local"), Some(2));
    assert_eq!(app.redis.llen("floodgate:local:ip:127.0.0.1"), 1);
    assert_eq!(
        metric(&app.metrics().await, "floodgate_breaker_open"),
        Some(0)
    );
}

#[actix_web::test]
async fn an_undecidable_check_does_not_open_the_breaker() {
    let app = spawn_app(
        r#"
[redis]
timeout = "200ms"

[limiter]
breaker = "1m"

[[rule]]
name = "broken"
paths = ["/broken"]
limit = 5
window = "1m"

[[rule]]
name = "fine"
paths = ["/check"]
limit = 5
window = "1m"
deny = "status"
"#,
    )
    .await;
    // A key of a type no algorithm writes: the script cannot decide it.
    redis::cmd("SADD")
        .arg("floodgate:broken:ip:127.0.0.1")
        .arg("x")
        .exec(&mut app.redis.connection())
        .unwrap();
    let res = app.get("/broken").await;
    assert_eq!(
        res.status(),
        404,
        "allowed by its error policy, then routed"
    );
    assert_eq!(header(&res, "ratelimit"), None);
    let metrics = app.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "floodgate_decisions_total{rule=\"broken\",decision=\"error_allowed\"}"
        ),
        Some(1),
        "{metrics}"
    );
    // Redis answered: the very next request is decided by Redis.
    assert_eq!(metric(&metrics, "floodgate_breaker_open"), Some(0));
    assert_eq!(remaining(&app.get("/check").await, "fine"), Some(4));
}

#[actix_web::test]
async fn local_give_backs_stay_in_the_process() {
    let mut app = spawn_app(
        r#"
[redis]
timeout = "200ms"

[[rule]]
name = "failures"
paths = ["/healthz", "/missing"]
limit = 2
window = "1m"
deny = "status"
count = "failures"
on_redis_error = "local"
"#,
    )
    .await;
    app.redis.stop();
    // Successes give their unit back to the local count: never denied.
    for _ in 0..5 {
        let res = app.get("/healthz").await;
        assert_eq!(res.status(), 200);
        assert_eq!(remaining(&res, "failures"), Some(2));
    }
    // Failures keep theirs.
    assert_eq!(app.get("/missing").await.status(), 404);
    assert_eq!(app.get("/missing").await.status(), 404);
    assert_eq!(app.get("/missing").await.status(), 429);
    let metrics = app.metrics().await;
    assert_eq!(
        metric(
            &metrics,
            "floodgate_decisions_total{rule=\"failures\",decision=\"local_allowed\"}"
        ),
        Some(7),
        "{metrics}"
    );
}

#[actix_web::test]
async fn a_flood_of_new_keys_stays_within_the_local_bound_and_a_hot_key_keeps_its_limit() {
    let redis = RedisServer::start();
    let limiter = crate::helpers::pinned::pinned_limiter(&redis);
    let local = floodgate::__private::local(&limiter);
    let hot = check("floodgate:local:ip:192.0.2.1", sliding(100, 3_600_000), 1);
    let mut allowed = 0;
    // Far more keys than the bound holds, each asked for once; the hot
    // key is asked for between them, 300 times for a limit of 100.
    for i in 0..200_000u32 {
        let key = format!(
            "floodgate:local:ip:10.{}.{}.{}",
            i >> 16,
            (i >> 8) & 255,
            i & 255
        );
        local.decide(&[check(&key, sliding(100, 3_600_000), 1)]);
        if i % 666 == 0 && local.decide(std::slice::from_ref(&hot)).allowed {
            allowed += 1;
        }
        if i % 10_000 == 0 {
            assert!(
                local.bytes() <= local.max_bytes(),
                "{} bytes",
                local.bytes()
            );
        }
    }
    assert_eq!(allowed, 100, "the hot key's limit held exactly");
    assert!(local.bytes() <= local.max_bytes());
    assert!(local.max_bytes() <= 16 << 20, "the bound the README states");
    // Each key costs a few hundred bytes in the estimate: the count of keys
    // stays far below the 200 000 asked for, and the bound is used.
    let keys = local.len();
    assert!(keys * 300 <= local.max_bytes(), "{keys} keys");
    assert!(keys * 1000 > local.max_bytes(), "{keys} keys");
}

#[actix_web::test]
async fn a_probe_whose_caller_gives_up_does_not_leave_the_breaker_open() {
    let redis = RedisServer::start();
    let mut config = Config::parse("", Path::new("test.toml")).unwrap();
    config.filter.redis.url = redis.url();
    config.filter.redis.timeout = Duration::from_millis(300);
    let options = LimiterOptions {
        breaker: Duration::from_millis(100),
        ..LimiterOptions::default()
    };
    let limiter = Limiter::new(&config.filter.redis, options).unwrap();
    let checks = || {
        vec![check(
            "floodgate:probe:ip:127.0.0.1",
            sliding(1000, 60_000),
            1,
        )]
    };
    assert!(limiter.decide(checks()).await.is_ok());

    pause(&redis, 5000);
    assert_eq!(limiter.decide(checks()).await, Err(LimiterError::Timeout));
    // While the breaker holds, the answer comes at once; once its period
    // is over, the next call probes the paused Redis, and its caller gives
    // up on it (the future is dropped while it waits).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answer = tokio::time::timeout(Duration::from_millis(100), limiter.decide(checks()));
        match answer.await {
            Err(_) => break,
            Ok(Err(LimiterError::BreakerOpen)) => {}
            Ok(other) => panic!("while Redis is paused: {other:?}"),
        }
        assert!(Instant::now() < deadline, "no call probed Redis");
        actix_web::rt::time::sleep(Duration::from_millis(10)).await;
    }
    wait_until(Duration::from_secs(10), "Redis to resume", || {
        redis.ping(Duration::from_millis(100))
    });
    // Redis answers again: the breaker lets the next probe through.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match limiter.decide(checks()).await {
            Ok(_) => break,
            Err(e) => assert!(
                Instant::now() < deadline,
                "Redis answers, yet decisions still fail: {e:?}"
            ),
        }
        actix_web::rt::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!limiter.breaker_open());
}

#[actix_web::test]
async fn once_readyz_says_ready_the_next_request_is_decided_by_redis() {
    let app = spawn_app(
        r#"
[redis]
timeout = "300ms"

[limiter]
breaker = "1m"

[[rule]]
name = "soft"
paths = ["/check"]
limit = 1000
window = "1m"
on_redis_error = "allow"
"#,
    )
    .await;
    assert!(remaining(&app.get("/check").await, "soft").is_some());
    pause(&app.redis, 1000);
    // The call times out and opens the breaker for a minute.
    let res = app.get("/check").await;
    assert_eq!(res.status(), 200);
    assert_eq!(header(&res, "ratelimit"), None);
    wait_until(Duration::from_secs(10), "Redis to resume", || {
        app.redis.ping(Duration::from_millis(100))
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while app.get("/readyz").await.status() != 200 {
        assert!(Instant::now() < deadline, "/readyz never said ready");
        actix_web::rt::time::sleep(Duration::from_millis(10)).await;
    }
    let res = app.get("/check").await;
    assert!(
        remaining(&res, "soft").is_some(),
        "/readyz said ready, but the next request was not decided by Redis"
    );
    assert_eq!(
        metric(&app.metrics().await, "floodgate_breaker_open"),
        Some(0)
    );
}

#[actix_web::test]
async fn a_probe_whose_client_resets_does_not_leave_the_breaker_open() {
    let app = spawn_app(
        r#"
[redis]
timeout = "300ms"

[limiter]
breaker = "100ms"

[[rule]]
name = "soft"
paths = ["/check"]
limit = 100000
window = "1m"
on_redis_error = "allow"
"#,
    )
    .await;
    assert!(remaining(&app.get("/check").await, "soft").is_some());
    pause(&app.redis, 5000);
    assert_eq!(header(&app.get("/check").await, "ratelimit"), None);
    // A client that resets its connection before Redis could answer: once
    // the breaker's period is over, its request is the probe.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        use actix_web::rt::net::TcpStream;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = TcpStream::connect(("127.0.0.1", app.port)).await.unwrap();
        stream
            .write_all(b"GET /check HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let answer = tokio::time::timeout(Duration::from_millis(100), stream.read(&mut buf));
        if answer.await.is_err() {
            // No answer yet: the request waits on Redis. Reset (RST).
            // (Deprecated because a linger blocks the close; zero does not.)
            #[allow(deprecated)]
            stream.set_linger(Some(Duration::ZERO)).unwrap();
            drop(stream);
            break;
        }
        assert!(Instant::now() < deadline, "no request probed Redis");
        actix_web::rt::time::sleep(Duration::from_millis(10)).await;
    }
    wait_until(Duration::from_secs(10), "Redis to resume", || {
        app.redis.ping(Duration::from_millis(100))
    });
    // (A new client: the server may have closed the old one's idle
    // connections meanwhile.)
    let client = crate::helpers::client();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let res = client.get(app.url("/check")).send().await.unwrap();
        if remaining(&res, "soft").is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "Redis answers, yet requests are not decided by it"
        );
        actix_web::rt::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How the tests below stall Redis.
#[derive(Clone, Copy)]
enum Stall {
    /// SIGSTOP: the server keeps every connection and answers nothing.
    Stopped,
    /// `CLIENT PAUSE WRITE`, as `FAILOVER` does: Redis answers what cannot
    /// write (a PING) and holds every script call.
    WritesPaused,
}

impl Stall {
    fn begin(self, app: &TestApp) {
        match self {
            Stall::Stopped => app.redis.signal("STOP"),
            Stall::WritesPaused => redis::cmd("CLIENT")
                .arg("PAUSE")
                .arg(600_000)
                .arg("WRITE")
                .query::<()>(&mut app.redis.connection())
                .unwrap(),
        }
    }

    fn end(self, app: &TestApp) {
        match self {
            Stall::Stopped => app.redis.signal("CONT"),
            Stall::WritesPaused => redis::cmd("CLIENT")
                .arg("UNPAUSE")
                .query::<()>(&mut app.redis.connection())
                .unwrap(),
        }
    }
}

#[actix_web::test]
async fn a_stalled_redis_holds_no_worker_from_a_route_it_does_not_guard() {
    no_worker_waits_on(Stall::Stopped).await;
}

#[actix_web::test]
async fn redis_holding_its_writes_holds_no_worker_from_a_route_it_does_not_guard() {
    no_worker_waits_on(Stall::WritesPaused).await;
}

async fn no_worker_waits_on(stall: Stall) {
    // Long, so that a worker that waits on Redis always shows: it would
    // hold `/healthz` for most of it, however fast the machine.
    const TIMEOUT: Duration = Duration::from_secs(5);
    let app = spawn_app_with(
        r#"
[[rule]]
name = "stall"
paths = ["/check"]
limit = 100
window = "1h"
on_redis_error = "deny"
"#,
        |config| {
            config.filter.redis.timeout = TIMEOUT;
            // One worker: the guarded and the unguarded requests share it.
            config.server.workers = 1;
        },
    )
    .await;
    let mut decided = 0;
    assert_eq!(remaining(&app.get("/check").await, "stall"), Some(99));
    decided += 1;

    stall.begin(&app);
    let done = AtomicBool::new(false);
    let first_answered = AtomicBool::new(false);
    let guarded = futures_util::future::join_all((0..4).map(|_| async {
        let mut answers = Vec::new();
        while !done.load(Ordering::SeqCst) {
            let started = Instant::now();
            let res = app.get("/check").await;
            first_answered.store(true, Ordering::SeqCst);
            answers.push((
                res.status().as_u16(),
                remaining(&res, "stall"),
                header(&res, "retry-after"),
                started.elapsed(),
            ));
        }
        answers
    }));
    // Until the first guarded requests have their answer (they wait for
    // the stalled Redis until the timeout), `/healthz` is asked again and
    // again on the same worker.
    let unguarded =
        unguarded_never_waits(&app, &first_answered, &done, TIMEOUT / 2, "a stalled Redis");
    let (guarded, ()) = futures_util::future::join(guarded, unguarded).await;
    let guarded: Vec<_> = guarded.into_iter().flatten().collect();
    assert!(guarded.len() >= 4);
    for (status, left, retry, took) in &guarded {
        // Redis answers nothing: each gets the rule's policy, in time.
        assert_eq!((*status, left, retry.as_deref()), (503, &None, Some("1")));
        assert!(*took < TIMEOUT + TIMEOUT / 2, "the policy took {took:?}");
    }

    // Once it goes on, Redis runs what was sent meanwhile: every job in it is
    // past its deadline, so it takes nothing. Redis decides again, and the
    // requests answered by the policy took no quota.
    stall.end(&app);
    until_redis_decides(&app, "/check", "stall").await;
    decided += 1;
    let res = app.get("/check").await;
    decided += 1;
    assert_eq!(remaining(&res, "stall"), Some(100 - decided));
    assert_eq!(app.redis.llen("floodgate:stall:ip:127.0.0.1"), decided);
}
