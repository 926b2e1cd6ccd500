//! Operators: the `floodgate inspect | reset | ban | unban | override`
//! commands (their output and exit codes), their effect on every serving
//! process sharing the Redis (denial caches included), overrides, escalating
//! bans exact under concurrency, bans taking no quota from other rules, and
//! the admin HTTP API; on one server, a Cluster and Sentinel.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use floodgate::limiter::Limiter;
use floodgate::limiter::{Action, Check, LimiterOptions};
use floodgate::rule::{Algorithm, Penalty};
use serde_json::{json, Value};

use crate::cluster_helpers::{Cluster, Sentinel, MASTER_NAME};
use crate::helpers::{
    free_port, raw_request, spawn_app_with, wait_until, RawResponse, RedisServer, TestApp,
};

const CHECK: &str = r#"
[server]
workers = 1

[[rule]]
name = "check"
paths = ["/check"]
methods = ["GET"]
limit = 3
window = "1h"
deny = "status"

[[rule]]
name = "sms"
paths = ["/sms/send"]
methods = ["POST"]
key = ["form:phone", "ip"]
normalize = "e164"
limit = 3
window = "1m"
"#;

fn config_file(name: &str, toml: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("operator-{name}-{}.toml", std::process::id()));
    std::fs::write(&path, toml).unwrap();
    path
}

/// What one command did.
struct Ran {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Ran {
    fn json(&self) -> Value {
        assert_eq!(self.code, 0, "stderr: {}", self.stderr);
        serde_json::from_str(self.stdout.trim()).unwrap_or_else(|e| panic!("{e}: {}", self.stdout))
    }
}

/// `floodgate ARGS` with the config file and Redis URL given.
fn floodgate(config: &PathBuf, redis: &str, args: &[&str]) -> Ran {
    let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(&args[..1])
        .arg("--config")
        .arg(config)
        .args(&args[1..])
        .env("FLOODGATE_REDIS_URL", redis)
        .env_remove("FLOODGATE_CONFIG")
        .env_remove("FLOODGATE_ADMIN_TOKEN")
        .output()
        .unwrap();
    Ran {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A `floodgate serve` process on `redis`.
struct Serving {
    child: Child,
    port: u16,
    log: Arc<Mutex<Vec<String>>>,
}

impl Serving {
    fn start(config: &std::path::Path, redis: &str) -> Serving {
        let port = free_port();
        let (child, log) =
            crate::helpers::serve_binary(config, &format!("127.0.0.1:{port}"), redis, "info");
        let mut serving = Serving { child, port, log };
        wait_until(
            Duration::from_secs(20),
            "GET /healthz to answer 200",
            || {
                if let Some(status) = serving.child.try_wait().unwrap() {
                    panic!(
                        "floodgate exited with {status}: {:?}",
                        serving.log.lock().unwrap()
                    );
                }
                std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                    && serving.get("/healthz").status == 200
            },
        );
        serving
    }

    fn get(&self, path: &str) -> RawResponse {
        let request =
            format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        raw_request(self.port, request.as_bytes())
    }
}

/// Sends `GET /check` to each process until it is allowed (once it has
/// heard of `change`), and answers how many requests were admitted.
fn admitted_once_heard(processes: &[&Serving], change: &str) -> u64 {
    let mut admitted = 0;
    for p in processes {
        wait_until(
            Duration::from_secs(10),
            &format!("{change} to reach the process"),
            || {
                let ok = p.get("/check").status == 200;
                admitted += u64::from(ok);
                ok
            },
        );
    }
    admitted
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn retry_after(res: &RawResponse) -> Option<u64> {
    res.head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("retry-after")
            .then(|| v.trim().parse().ok())
            .flatten()
    })
}

/// A `session` rule keys the signed-in account by its ID; an operator
/// names the account by its phone number (any spelling), or by that ID.
#[test]
fn a_session_rules_account_is_named_by_its_phone_number() {
    let redis = RedisServer::start();
    let config = config_file(
        "session",
        "[[rule]]\nname = \"pw\"\npaths = [\"/account/password\"]\nkey = \"session\"\nlimit = 3\nwindow = \"1h\"\n",
    );
    let url = redis.url();
    let id = "0123456789abcdef0123456789abcdef";
    let _: () = redis::cmd("HSET")
        .arg("floodgate:@site:account:+15550101234")
        .arg("id")
        .arg(id)
        .arg("phone")
        .arg("+15550101234")
        .query(&mut redis.connection())
        .unwrap();
    let key = format!("floodgate:pw:session:{id}");
    let ran = floodgate(
        &config,
        &url,
        &["ban", "pw", "+1 (555) 010-1234", "--for", "1m"],
    );
    assert_eq!(ran.code, 0, "{}", ran.stderr);
    assert_eq!(ran.json()["key"], key.as_str());
    let seen = floodgate(&config, &url, &["inspect", "pw", id]).json();
    assert_eq!(
        (seen["key"].as_str(), seen["banned_s"].as_u64()),
        (Some(key.as_str()), Some(60))
    );
    let upper = floodgate(&config, &url, &["inspect", "pw", &id.to_uppercase()]).json();
    assert_eq!(upper["key"], key.as_str());
    // An address names no account.
    let ran = floodgate(&config, &url, &["inspect", "pw", "2001:db8::7"]);
    assert_eq!(ran.code, 2);
    assert!(ran.stderr.contains("is an address"), "{}", ran.stderr);
    let ran = floodgate(&config, &url, &["unban", "--all-rules", "+15550101234"]);
    assert_eq!(ran.code, 0, "{}", ran.stderr);
    assert_eq!(ran.json()["key"], key.as_str());
    // A phone with no account, or a value that is neither: refused.
    let ran = floodgate(&config, &url, &["inspect", "pw", "+15550109999"]);
    assert_eq!(ran.code, 2);
    assert!(
        ran.stderr
            .contains("no account has the phone number +15550109999"),
        "{}",
        ran.stderr
    );
    let ran = floodgate(&config, &url, &["inspect", "pw", "somebody"]);
    assert_eq!(ran.code, 2);
    assert!(ran.stderr.contains("names no account"), "{}", ran.stderr);
    // `find` by the phone number finds the account's identity.
    let _ = floodgate(&config, &url, &["ban", "pw", id, "--for", "1m"]);
    let found = floodgate(&config, &url, &["find", "+1 555 010 1234"]);
    assert_eq!(found.code, 0, "{}", found.stderr);
    assert!(found.stdout.contains(&key), "{}", found.stdout);
}

#[test]
fn operator_commands_print_the_rules_view_and_exit_0_2_or_1() {
    let redis = RedisServer::start();
    let config = config_file("commands", CHECK);
    let url = redis.url();

    let seen = floodgate(&config, &url, &["inspect", "check", "127.0.0.1"]).json();
    assert_eq!(
        seen,
        serde_json::json!({"rule":"check","key":"floodgate:check:ip:127.0.0.1",
            "algorithm":"sliding_window","limit":3,"window_s":3600,"used":0,"remaining":3,
            "reset_s":3600,"banned_s":0,"override":null})
    );
    // Values are written as requests carry them: one identity either way.
    let a = floodgate(
        &config,
        &url,
        &["inspect", "sms", "+1 (555) 010-9999", "203.0.113.7"],
    );
    let b = floodgate(
        &config,
        &url,
        &["inspect", "sms", "+15550109999", "203.0.113.7"],
    );
    assert_eq!(
        a.json()["key"],
        "floodgate:sms:form+ip:+15550109999|203.0.113.7"
    );
    assert_eq!(a.json(), b.json());
    // IPv6 by its /64.
    let v6 = floodgate(&config, &url, &["inspect", "check", "2001:db8::7"]).json();
    assert_eq!(v6["key"], "floodgate:check:ip:2001:db8::/64");

    let banned = floodgate(
        &config,
        &url,
        &["ban", "check", "127.0.0.1", "--for", "10m"],
    )
    .json();
    assert!(
        (590..=600).contains(&banned["banned_s"].as_u64().unwrap()),
        "{banned}"
    );
    let over = floodgate(
        &config,
        &url,
        &[
            "override",
            "check",
            "127.0.0.1",
            "--limit",
            "10",
            "--window",
            "2m",
            "--for",
            "1h",
        ],
    )
    .json();
    assert_eq!(over["limit"], 10);
    assert_eq!(over["window_s"], 120);
    assert_eq!(over["override"]["limit"], 10);
    assert_eq!(over["override"]["window_s"], 120);
    assert!((3590..=3600).contains(&over["override"]["expires_s"].as_u64().unwrap()));
    let unbanned = floodgate(&config, &url, &["unban", "check", "127.0.0.1"]).json();
    assert_eq!(unbanned["banned_s"], 0);
    assert_eq!(
        unbanned["override"]["limit"], 10,
        "unban leaves the override"
    );
    let cleared = floodgate(
        &config,
        &url,
        &["override", "check", "127.0.0.1", "--clear"],
    )
    .json();
    assert_eq!(cleared["override"], Value::Null);
    assert_eq!(cleared["limit"], 3);
    let reset = floodgate(&config, &url, &["reset", "check", "127.0.0.1"]).json();
    assert_eq!(reset["used"], 0);
    // Nothing is left but the audit trail of what was done.
    assert_eq!(redis.keys("*"), vec!["floodgate:audit".to_string()]);
    // Which expires too, 400 days after its newest entry.
    let ttl = redis.pttl("floodgate:audit");
    assert!(
        ttl > 399 * 24 * 3600 * 1000 && ttl <= 400 * 24 * 3600 * 1000,
        "{ttl}"
    );

    // Bad input: exit 2, one line on stderr, nothing on stdout.
    for args in [
        &["inspect", "nope", "127.0.0.1"][..],
        &["inspect", "check"],
        &["inspect", "check", "1.2.3.4", "5.6.7.8"],
        &["inspect", "check", "not-an-address"],
        &["inspect", "sms", "12", "1.2.3.4"],
        &["ban", "check", "1.2.3.4"],
        &["ban", "check", "1.2.3.4", "--for", "10 minutes"],
        &["ban", "check", "1.2.3.4", "--for", "367d"],
        &["ban", "check", "1.2.3.4", "--for", "0s"],
        &["override", "check", "1.2.3.4"],
        &["override", "check", "1.2.3.4", "--limit", "0"],
        &["override", "check", "1.2.3.4", "--limit", "ten"],
        &["override", "check", "1.2.3.4", "--limit", "1000001"],
        &["override", "check", "1.2.3.4", "--limit", "5", "--clear"],
        &["reset", "check", "1.2.3.4", "--for", "1m"],
        &["unban", "check", "1.2.3.4", "--bogus"],
        // An option twice: which one was meant cannot be known.
        &["ban", "check", "1.2.3.4", "--for", "1h", "--for", "2h"],
        &["override", "check", "1.2.3.4", "--limit", "3", "--limit=4"],
        &["override", "check", "1.2.3.4", "--clear", "--clear"],
    ] {
        let ran = floodgate(&config, &url, args);
        assert_eq!(ran.code, 2, "{args:?}: {}", ran.stderr);
        assert_eq!(
            ran.stderr.trim().lines().count(),
            1,
            "{args:?}: {}",
            ran.stderr
        );
        assert!(ran.stdout.is_empty(), "{args:?}: {}", ran.stdout);
    }
    assert_eq!(
        redis.keys("*"),
        vec!["floodgate:audit".to_string()],
        "bad input wrote nothing"
    );

    // Redis unreachable: exit 1 with one line.
    let closed = format!("redis://127.0.0.1:{}/0", free_port());
    for args in [
        &["inspect", "check", "1.2.3.4"][..],
        &["ban", "check", "1.2.3.4", "--for", "1m"],
    ] {
        let ran = floodgate(&config, &closed, args);
        assert_eq!(ran.code, 1, "{args:?}: {}", ran.stderr);
        assert_eq!(ran.stderr.trim().lines().count(), 1, "{}", ran.stderr);
    }
    let _ = std::fs::remove_file(&config);
}

#[test]
fn a_ban_unban_and_reset_reach_every_serving_process_and_their_cached_denials() {
    let redis = RedisServer::start();
    let config = config_file("processes", CHECK);
    let url = redis.url();
    let a = Serving::start(&config, &url);
    let b = Serving::start(&config, &url);
    let used =
        || floodgate(&config, &url, &["inspect", "check", "127.0.0.1"]).json()["used"].clone();

    // A ban is read by the deciding call itself: the very next request to
    // either process is denied, for the ban's time.
    floodgate(
        &config,
        &url,
        &["ban", "check", "127.0.0.1", "--for", "10m"],
    )
    .json();
    for p in [&a, &b] {
        for _ in 0..3 {
            let res = p.get("/check");
            assert_eq!(res.status, 429);
            assert!(retry_after(&res).unwrap() > 500, "{}", res.head);
        }
    }
    assert_eq!(used(), 0, "banned requests take no quota");

    // Both processes now remember the ban's denial for 10 minutes; an unban
    // makes them forget it.
    floodgate(&config, &url, &["unban", "check", "127.0.0.1"]).json();
    let admitted = admitted_once_heard(&[&a, &b], "the unban");
    assert_eq!(used(), admitted);

    // Use up the limit, so both remember an hour-long denial; a reset
    // makes them forget it.
    while a.get("/check").status == 200 {}
    assert_eq!(a.get("/check").status, 429);
    assert_eq!(b.get("/check").status, 429);
    assert_eq!(used(), 3);
    floodgate(&config, &url, &["reset", "check", "127.0.0.1"]).json();
    let admitted = admitted_once_heard(&[&a, &b], "the reset");
    // Every admission after the reset was decided by Redis: counted.
    assert_eq!(used(), admitted);

    // An override that lowers the limit applies at the next decision.
    floodgate(
        &config,
        &url,
        &["override", "check", "127.0.0.1", "--limit", "1"],
    )
    .json();
    for p in [&a, &b] {
        assert_eq!(p.get("/check").status, 429);
    }
    let _ = std::fs::remove_file(&config);
}

fn window_check(key: &str, limit: u32, penalty: Option<Penalty>) -> Check {
    Check::new(
        key,
        Algorithm::sliding_window(limit, Duration::from_secs(3600)).unwrap(),
    )
    .with_penalty(penalty)
}

fn penalty(after: u32) -> Penalty {
    let secs = Duration::from_secs;
    Penalty::new(after, secs(600), secs(10), secs(40)).unwrap()
}

#[test]
fn a_penalty_bans_after_n_denials_and_each_ban_doubles_up_to_max() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let check = window_check("floodgate:p:ip:198.51.100.1", 1, Some(penalty(3)));
    let mut at = |ms: u64| {
        let mut r =
            floodgate::__private::decide_batch(&mut conn, vec![(Some(ms), vec![check.clone()])])
                .unwrap();
        r.remove(0).unwrap().outcomes[0]
    };
    let t0 = 1_800_000_000_000u64;
    assert!(at(t0).allowed);
    // Two denials by the limit, then the third bans for 10 s.
    for i in 1..=2 {
        let o = at(t0 + i);
        assert!(!o.allowed && !o.banned, "{o:?}");
    }
    let o = at(t0 + 3);
    assert!(o.banned && o.ban_started, "{o:?}");
    assert_eq!(o.wait, Duration::from_secs(10));
    // While banned: denied for the time left, nothing counted.
    let o = at(t0 + 5_003);
    assert!(o.banned && !o.ban_started);
    assert_eq!(o.wait, Duration::from_secs(5));
    // After the ban, three more denials: 20 s, then 40 s, then 40 s (max).
    let mut t = t0 + 10_003;
    for expected in [20, 40, 40] {
        for _ in 0..2 {
            let o = at(t);
            assert!(!o.allowed && !o.banned, "at {t}: {o:?}");
            t += 1;
        }
        let o = at(t);
        assert!(o.ban_started, "at {t}: {o:?}");
        assert_eq!(o.wait, Duration::from_secs(expected));
        t += expected * 1000;
    }
    // Once the last ban is forgotten (max after its end), bans start over.
    t += 40_000;
    for _ in 0..2 {
        assert!(!at(t).banned);
        t += 1;
    }
    let o = at(t);
    assert_eq!((o.ban_started, o.wait), (true, Duration::from_secs(10)));
    // The record expires with its last part.
    let ttl = redis.pttl("!floodgate:p:ip:198.51.100.1");
    assert!(ttl > 0, "{ttl}");
}

#[test]
fn a_penalty_counts_only_its_own_identitys_denials() {
    // The batch function keeps its state from call to call: what one
    // identity's penalty writes must never reach another's, by the path of
    // one rule or of several.
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let t0 = 1_800_000_000_000u64;
    for rules in [1, 2] {
        let job = |who: &str| -> Vec<Check> {
            let mut checks = vec![window_check(
                &format!("floodgate:p{rules}:ip:{who}"),
                1,
                Some(penalty(3)),
            )];
            if rules == 2 {
                checks.push(window_check(&format!("floodgate:q:ip:{who}"), 100, None));
            }
            checks
        };
        let mut at = |who: &str, ms: u64| {
            let mut r =
                floodgate::__private::decide_batch(&mut conn, vec![(Some(ms), job(who))]).unwrap();
            r.remove(0).unwrap().outcomes[0]
        };
        // One identity: allowed, two denials, banned by the third.
        assert!(at("a", t0).allowed);
        for i in 1..=2 {
            assert!(!at("a", t0 + i).banned);
        }
        assert!(at("a", t0 + 3).ban_started);
        // Another, with no record yet: the same three denials to a ban.
        assert!(at("b", t0 + 4).allowed);
        for i in 5..=6 {
            let o = at("b", t0 + i);
            assert!(!o.allowed && !o.banned, "{rules} rule(s): {o:?}");
        }
        assert!(at("b", t0 + 7).ban_started, "{rules} rule(s)");
    }
}

#[actix_web::test]
async fn a_penalty_is_exact_under_concurrent_denials() {
    let redis = RedisServer::start();
    let config = floodgate::config::Config::parse("", std::path::Path::new("x.toml")).unwrap();
    let mut redis_config = config.redis.clone();
    redis_config.url = redis.url();
    let limiter = Arc::new(Limiter::new(&redis_config, LimiterOptions::default()).unwrap());
    let check = window_check("floodgate:c:ip:198.51.100.2", 1, Some(penalty(5)));
    // 40 requests at once: 1 admitted, 4 denied by the limit, the 5th
    // denial bans, and the other 34 meet the ban.
    let decisions = futures_util::future::join_all((0..40).map(|_| {
        let limiter = Arc::clone(&limiter);
        let check = check.clone();
        async move { limiter.decide(vec![check]).await.unwrap().outcomes[0] }
    }))
    .await;
    let allowed = decisions.iter().filter(|o| o.allowed).count();
    let limited = decisions.iter().filter(|o| !o.allowed && !o.banned).count();
    let started = decisions.iter().filter(|o| o.ban_started).count();
    let banned = decisions.iter().filter(|o| o.banned).count();
    assert_eq!((allowed, limited, started, banned), (1, 4, 1, 35));
    assert_eq!(redis.llen("floodgate:c:ip:198.51.100.2"), 1);
}

const TWO_RULES: &str = r#"
[admin]
token = "s3cret-token-for-tests"

[[rule]]
name = "check"
paths = ["/check"]
limit = 3
window = "1h"
deny = "status"

[[rule]]
name = "guess"
paths = ["/guess"]
limit = 1
window = "1h"
deny = "status"
penalty = { after = 2, within = "10m", ban = "1m", max = "4m" }

[[rule]]
name = "site"
paths = ["/", "/check", "/guess", "/admin", "/admin/*"]
key = "global"
limit = 1000
window = "1h"
deny = "status"
"#;

async fn inspect(app: &TestApp, rule: &str, values: &[&str]) -> floodgate::limiter::Inspection {
    app.filter
        .operate(rule, values, Action::Inspect)
        .await
        .unwrap()
}

async fn status(app: &TestApp, path: &str) -> u16 {
    app.client
        .get(app.url(path))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[actix_web::test]
async fn a_banned_request_takes_no_quota_from_any_rule() {
    let app = spawn_app_with(TWO_RULES, |_| {}).await;
    app.filter
        .operate(
            "check",
            &["127.0.0.1"],
            Action::Ban(Duration::from_secs(600)),
        )
        .await
        .unwrap();
    for _ in 0..5 {
        assert_eq!(status(&app, "/check").await, 429);
    }
    assert_eq!(inspect(&app, "site", &[]).await.used, 0);
    assert_eq!(inspect(&app, "check", &["127.0.0.1"]).await.used, 0);
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("floodgate_decisions_total{rule=\"check\",decision=\"banned\"} 5"),
        "{metrics}"
    );
    assert!(metrics.contains("floodgate_bans_total{rule=\"check\",source=\"operator\"} 1"));
    // Another page is not under the ban.
    assert_eq!(status(&app, "/").await, 200);
    assert_eq!(inspect(&app, "site", &[]).await.used, 1);
}

#[actix_web::test]
async fn an_override_raises_and_lowers_a_limit_and_counts_are_kept() {
    let app = spawn_app_with(TWO_RULES, |_| {}).await;
    let ip = ["127.0.0.1"];
    for _ in 0..2 {
        assert_eq!(status(&app, "/check").await, 200);
    }
    let raise = Action::Override {
        limit: 5,
        window: None,
        lasts: Some(Duration::from_secs(3600)),
    };
    let seen = app.filter.operate("check", &ip, raise).await.unwrap();
    assert_eq!((seen.limit, seen.used, seen.remaining), (5, 2, 3));
    for _ in 0..3 {
        assert_eq!(status(&app, "/check").await, 200);
    }
    assert_eq!(status(&app, "/check").await, 429);
    // Lowered below what was used: denied until enough leaves.
    let lower = Action::Override {
        limit: 2,
        window: None,
        lasts: None,
    };
    let seen = app.filter.operate("check", &ip, lower).await.unwrap();
    assert_eq!((seen.limit, seen.used, seen.remaining), (2, 5, 0));
    assert_eq!(seen.override_state.unwrap().expires_s, None);
    assert_eq!(status(&app, "/check").await, 429);
    // A reload keeps it (it lives in Redis).
    app.filter.replace_rules(app.filter.rules().to_vec());
    assert_eq!(inspect(&app, "check", &ip).await.limit, 2);
    let seen = app
        .filter
        .operate("check", &ip, Action::Clear)
        .await
        .unwrap();
    assert_eq!((seen.limit, seen.used, seen.override_state), (3, 5, None));
    // Another identity never had it.
    assert_eq!(inspect(&app, "check", &["192.0.2.1"]).await.limit, 3);
}

#[actix_web::test]
async fn a_token_bucket_override_is_the_burst_and_the_rate_scales() {
    let toml = r#"
[[rule]]
name = "api"
paths = ["/api/ping"]
algorithm = "token_bucket"
rate = 1.0
burst = 2
deny = "status"
"#;
    let app = spawn_app_with(toml, |_| {}).await;
    let over = Action::Override {
        limit: 10,
        window: None,
        lasts: None,
    };
    let seen = app
        .filter
        .operate("api", &["127.0.0.1"], over)
        .await
        .unwrap();
    // Burst 10 at rate 5/s: 2 s to refill from empty, as the rule's 2 at 1/s.
    assert_eq!((seen.limit, seen.window_s, seen.remaining), (10, 2, 10));
    assert_eq!(seen.reset_s, 0, "a full bucket");
    for _ in 0..10 {
        assert_eq!(status(&app, "/api/ping").await, 200);
    }
    // Emptied: full again within the 2 s a whole refill takes (what it
    // holds, not what one more request would leave).
    let seen = inspect(&app, "api", &["127.0.0.1"]).await;
    assert!(seen.reset_s <= 2, "{seen:?}");
}

/// `POST /admin/ACTION` with `body`, as `token` (None: no Authorization).
async fn admin(
    app: &TestApp,
    action: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, Value, String) {
    let mut req = app
        .client
        .post(app.url(&format!("/admin/{action}")))
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let res = req.send().await.unwrap();
    let status = res.status().as_u16();
    let cache = res
        .headers()
        .get("cache-control")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let text = res.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::Null),
        cache,
    )
}

const TOKEN: &str = "s3cret-token-for-tests";

/// The admin API names a `session` rule's account by its phone number too.
#[actix_web::test]
async fn the_admin_api_names_an_account_by_its_phone_number() {
    let toml = format!(
        "{TWO_RULES}\n[[rule]]\nname = \"pw\"\npaths = [\"/account/password\"]\nkey = \"session\"\nlimit = 3\nwindow = \"1h\"\n"
    );
    let app = spawn_app_with(&toml, |_| {}).await;
    let id = "00112233445566778899aabbccddeeff";
    let _: () = redis::cmd("HSET")
        .arg("floodgate:@site:account:+15550101234")
        .arg("id")
        .arg(id)
        .query(&mut app.redis.connection())
        .unwrap();
    let body = r#"{"rule":"pw","values":["+1 555 010 1234"]}"#;
    let (status, v, _) = admin(&app, "inspect", Some(TOKEN), body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["key"], format!("floodgate:pw:session:{id}").as_str());
    let body = r#"{"rule":"pw","values":["+1 555 010 9999"]}"#;
    let (status, v, _) = admin(&app, "inspect", Some(TOKEN), body).await;
    assert_eq!(status, 400, "{v}");
}

#[actix_web::test]
async fn the_admin_api_needs_its_token_and_an_allowed_address_and_is_never_counted() {
    let app = spawn_app_with(TWO_RULES, |_| {}).await;
    let body = r#"{"rule":"check","values":["127.0.0.1"]}"#;
    assert_eq!(admin(&app, "inspect", None, body).await.0, 401);
    assert_eq!(
        admin(&app, "inspect", Some("s3cret-token-for-testz"), body)
            .await
            .0,
        401
    );
    let (code, seen, cache) = admin(&app, "inspect", Some(TOKEN), body).await;
    assert_eq!((code, cache.as_str()), (200, "no-store"));
    assert_eq!(seen["key"], "floodgate:check:ip:127.0.0.1");

    let (code, seen, _) = admin(
        &app,
        "ban",
        Some(TOKEN),
        r#"{"rule":"check","values":["127.0.0.1"],"for":"10m"}"#,
    )
    .await;
    assert_eq!(code, 200);
    assert!(seen["banned_s"].as_u64().unwrap() > 590);
    assert_eq!(status(&app, "/check").await, 429);
    assert_eq!(admin(&app, "unban", Some(TOKEN), body).await.0, 200);
    assert_eq!(status(&app, "/check").await, 200);
    let (code, seen, _) = admin(
        &app,
        "override",
        Some(TOKEN),
        r#"{"rule":"check","values":["127.0.0.1"],"limit":100,"window":"1m","for":"1d"}"#,
    )
    .await;
    assert_eq!((code, seen["limit"].as_u64()), (200, Some(100)));
    assert_eq!(seen["override"]["expires_s"], 86_400);
    let (code, seen, _) = admin(
        &app,
        "override",
        Some(TOKEN),
        r#"{"rule":"check","values":["127.0.0.1"],"clear":true}"#,
    )
    .await;
    assert_eq!((code, &seen["override"]), (200, &Value::Null));
    let (code, seen, _) = admin(&app, "reset", Some(TOKEN), body).await;
    assert_eq!((code, seen["used"].as_u64()), (200, Some(0)));

    for (action, bad) in [
        ("inspect", r#"{"rule":"nope","values":["127.0.0.1"]}"#),
        ("inspect", r#"{"rule":"check","values":[]}"#),
        ("inspect", r#"{"rule":"check","values":["x"]}"#),
        (
            "ban",
            r#"{"rule":"check","values":["127.0.0.1"],"for":"forever"}"#,
        ),
        (
            "ban",
            r#"{"rule":"check","values":["127.0.0.1"],"for":"400d"}"#,
        ),
        (
            "override",
            r#"{"rule":"check","values":["127.0.0.1"],"limit":0}"#,
        ),
        ("override", r#"{"rule":"check","values":["127.0.0.1"]}"#),
        ("inspect", "not json"),
    ] {
        let (code, seen, cache) = admin(&app, action, Some(TOKEN), bad).await;
        assert_eq!(code, 400, "{bad}");
        assert!(seen["error"].is_string(), "{bad}: {seen}");
        assert_eq!(cache, "no-store");
    }
    assert_eq!(admin(&app, "nothing", Some(TOKEN), body).await.0, 404);

    // Dozens of admin requests, and the catch-all rule counted none of them.
    for _ in 0..30 {
        assert_eq!(admin(&app, "inspect", Some(TOKEN), body).await.0, 200);
    }
    assert_eq!(
        inspect(&app, "site", &[]).await.used,
        1,
        "only the one GET /check admitted"
    );
}

/// Behind trusted proxies the admin API fails closed: a request from a
/// trusted proxy that carries a forwarding header naming no client beyond
/// it, of either kind, is refused, as is a client outside `[admin] allow`.
#[actix_web::test]
async fn the_admin_api_behind_a_proxy_takes_no_header_for_the_proxy_itself() {
    let body = r#"{"rule":"check","values":["127.0.0.1"]}"#;
    for header in ["x-forwarded-for", "forwarded"] {
        let toml = format!(
            "[server]\ntrusted_proxies = [\"127.0.0.1\"]\nproxy_header = \"{header}\"\n{TWO_RULES}"
        );
        let app = spawn_app_with(&toml, |_| {}).await;
        // The proxy's own request.
        assert_eq!(admin(&app, "inspect", Some(TOKEN), body).await.0, 200);
        for (name, value) in [
            ("x-forwarded-for", "198.51.100.7"),
            ("forwarded", "for=198.51.100.7"),
        ] {
            let res = app
                .client
                .post(app.url("/admin/inspect"))
                .header("content-type", "application/json")
                .header(name, value)
                .bearer_auth(TOKEN)
                .body(body)
                .send()
                .await
                .unwrap();
            assert_eq!(res.status().as_u16(), 403, "{header}: {name}");
        }
    }
}

#[actix_web::test]
async fn a_path_the_router_keeps_from_the_admin_api_is_guarded() {
    let toml = r#"
[admin]
token = "s3cret-token-for-tests"

[[rule]]
name = "all"
paths = ["/*"]
key = "global"
limit = 1000
window = "1h"
deny = "status"
"#;
    let app = spawn_app_with(toml, |_| {}).await;
    // The start-up's own GET /healthz, counted.
    let before = inspect(&app, "all", &[]).await.used;
    // actix routes `%2F` encoded: none of these reaches the admin API (they
    // get the 404 page), and the `/*` rule counts every one.
    for path in [
        "/admin%2Fhome",
        "/admin%2F",
        "/%61dmin%2Finspect",
        "/admin%2finspect",
    ] {
        assert_eq!(status(&app, path).await, 404, "{path}");
    }
    assert_eq!(inspect(&app, "all", &[]).await.used, before + 4);
    // What the router does send to the admin API (`%61` is `a`) is not counted.
    let res = app
        .client
        .post(app.url("/%61dmin/inspect"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(r#"{"rule":"all","values":[]}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(inspect(&app, "all", &[]).await.used, before + 4);
}

/// The admin API behind a trusted proxy on 127.0.0.1, allowing the proxy's
/// own address and 203.0.113.0/24.
async fn behind_a_proxy() -> TestApp {
    let toml = format!(
        "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n{}",
        TWO_RULES.replace(
            "[admin]",
            "[admin]\nallow = [\"127.0.0.1\", \"203.0.113.0/24\"]"
        )
    );
    spawn_app_with(&toml, |_| {}).await
}

/// `POST /admin/inspect` through the proxy for `client` (its
/// `X-Forwarded-For`; `None`: the proxy's own request), with `token`.
async fn inspect_as(app: &TestApp, client: Option<&str>, token: Option<&str>) -> reqwest::Response {
    let mut req = app
        .client
        .post(app.url("/admin/inspect"))
        .header("content-type", "application/json")
        .body(r#"{"rule":"check","values":["127.0.0.1"]}"#);
    if let Some(c) = client {
        req = req.header("x-forwarded-for", c);
    }
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    req.send().await.unwrap()
}

#[actix_web::test]
async fn behind_a_proxy_the_admin_api_answers_only_clients_the_proxy_named() {
    let app = behind_a_proxy().await;
    assert_eq!(
        inspect_as(&app, Some("203.0.113.9"), Some(TOKEN))
            .await
            .status(),
        200
    );
    assert_eq!(
        inspect_as(&app, Some("198.51.100.1, 203.0.113.9"), Some(TOKEN))
            .await
            .status(),
        200
    );
    // The proxy's own request (no forwarding header) is from its address.
    assert_eq!(inspect_as(&app, None, Some(TOKEN)).await.status(), 200);
    // A hop the proxy could not name, or only trusted hops: no client
    // address at all, and so none allowed (the proxy's is not the client's).
    for hops in [
        "unknown",
        "203.0.113.9, unknown",
        "_hidden",
        "198.51.100.1, 203.0.113.9:x",
        "127.0.0.1",
        "",
    ] {
        let res = inspect_as(&app, Some(hops), Some(TOKEN)).await;
        assert_eq!(res.status(), 403, "{hops:?}");
        let body: Value = res.json().await.unwrap();
        assert_eq!(body["error"], "forbidden", "{hops:?}");
    }
}

#[actix_web::test]
async fn failed_admin_authentications_are_limited_per_remote_address_and_the_token_never_is() {
    let app = behind_a_proxy().await;
    let a = Some("203.0.113.9");
    for wrong in [
        Some("s3cret-token-for-testz"),
        None,
        Some("x"),
        None,
        Some("y"),
    ] {
        assert_eq!(inspect_as(&app, a, wrong).await.status(), 401);
    }
    for wrong in [Some("s3cret-token-for-testz"), None] {
        let res = inspect_as(&app, a, wrong).await;
        assert_eq!(res.status(), 429);
        let retry: u64 = res.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((1..=60).contains(&retry), "{retry}");
        assert_eq!(res.headers()["cache-control"], "no-store");
        let body: Value = res.json().await.unwrap();
        assert_eq!(body["error"], "rate_limited");
        assert_eq!(body["retry_after"], retry);
    }
    // The token itself is never limited, nor counted.
    for _ in 0..10 {
        assert_eq!(inspect_as(&app, a, Some(TOKEN)).await.status(), 200);
    }
    assert_eq!(inspect_as(&app, a, None).await.status(), 429);
    // Another address has its own count; right tokens take none of it.
    let b = Some("203.0.113.10");
    for _ in 0..10 {
        assert_eq!(inspect_as(&app, b, Some(TOKEN)).await.status(), 200);
    }
    for _ in 0..5 {
        assert_eq!(inspect_as(&app, b, None).await.status(), 401);
    }
    assert_eq!(inspect_as(&app, b, None).await.status(), 429);
    // A loopback client (the proxy's own requests here) is never limited:
    // this machine's scripts always see a wrong token as 401.
    for wrong in [None, Some("x"), None, Some("y"), None, Some("z"), None] {
        assert_eq!(inspect_as(&app, None, wrong).await.status(), 401);
    }
}

#[actix_web::test]
async fn each_admin_action_takes_exactly_its_own_fields_as_the_command_line_does() {
    let app = spawn_app_with(TWO_RULES, |_| {}).await;
    let ip = r#""rule":"check","values":["127.0.0.1"]"#;
    for (action, extra) in [
        ("inspect", r#""for":"1m""#),
        ("inspect", r#""limit":5"#),
        ("inspect", r#""window":"1m""#),
        ("inspect", r#""clear":true"#),
        ("reset", r#""limit":5"#),
        ("unban", r#""for":"1m""#),
        ("unban", r#""clear":false"#),
        ("ban", r#""for":"1m","limit":5"#),
        ("ban", r#""for":"1m","window":"1m""#),
        ("ban", r#""for":"1m","clear":true"#),
        ("override", r#""clear":true,"for":"1m""#),
        ("override", r#""clear":true,"limit":5"#),
        ("override", r#""clear":true,"window":"1m""#),
    ] {
        let body = format!("{{{ip},{extra}}}");
        let (code, seen, cache) = admin(&app, action, Some(TOKEN), &body).await;
        assert_eq!(code, 400, "{action} {body}");
        assert!(
            seen["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{body}: {seen}"
        );
        assert_eq!(cache, "no-store");
    }
    // Nothing was banned nor overridden on the way.
    let seen = inspect(&app, "check", &["127.0.0.1"]).await;
    assert_eq!((seen.banned_s, seen.limit), (0, 3));
    assert_eq!(seen.override_state, None);
    // What each action does take is still taken.
    for (action, extra) in [
        ("ban", r#""for":"1m""#),
        ("override", r#""limit":5,"window":"1m","for":"1m""#),
        ("override", r#""clear":true"#),
        ("override", r#""clear":false,"limit":5"#),
    ] {
        let body = format!("{{{ip},{extra}}}");
        assert_eq!(
            admin(&app, action, Some(TOKEN), &body).await.0,
            200,
            "{body}"
        );
    }
}

#[actix_web::test]
async fn the_admin_api_checks_the_address_and_token_before_reading_a_body() {
    let app = spawn_app_with(TWO_RULES, |_| {}).await;
    let big = format!(
        r#"{{"rule":"check","values":["127.0.0.1"],"pad":"{}"}}"#,
        "x".repeat(300 * 1024)
    );
    let (code, seen, _) = admin(&app, "inspect", None, &big).await;
    assert_eq!((code, &seen["error"]), (401, &Value::from("unauthorized")));
    let (code, seen, _) = admin(&app, "inspect", Some(TOKEN), &big).await;
    assert_eq!(code, 413);
    assert!(seen["error"].is_string(), "{seen}");
    let elsewhere = spawn_app_with(
        &TWO_RULES.replace("[admin]", "[admin]\nallow = [\"10.0.0.0/8\"]"),
        |_| {},
    )
    .await;
    assert_eq!(admin(&elsewhere, "inspect", Some(TOKEN), &big).await.0, 403);
}

#[actix_web::test]
async fn without_a_token_every_admin_path_is_404_and_other_addresses_get_403() {
    let none = spawn_app_with(
        &TWO_RULES.replace("token = \"s3cret-token-for-tests\"", ""),
        |_| {},
    )
    .await;
    let body = r#"{"rule":"check","values":["127.0.0.1"]}"#;
    assert_eq!(admin(&none, "inspect", Some(TOKEN), body).await.0, 404);
    assert_eq!(status(&none, "/admin").await, 404);
    assert_eq!(status(&none, "/admin/x/y").await, 404);

    let elsewhere = spawn_app_with(
        &TWO_RULES.replace("[admin]", "[admin]\nallow = [\"10.0.0.0/8\"]"),
        |_| {},
    )
    .await;
    assert_eq!(admin(&elsewhere, "inspect", Some(TOKEN), body).await.0, 403);
}

#[actix_web::test]
async fn limits_shows_the_viewers_own_ban_and_override() {
    let app = spawn_app_with(TWO_RULES, |_| {}).await;
    let ip = ["127.0.0.1"];
    app.filter
        .operate("check", &ip, Action::Ban(Duration::from_secs(600)))
        .await
        .unwrap();
    let over = Action::Override {
        limit: 7,
        window: None,
        lasts: None,
    };
    app.filter.operate("site", &[], over).await.unwrap();
    let page = app.get("/limits").await.text().await.unwrap();
    assert!(page.contains("banned"), "{page}");
    assert!(page.contains("your own limit: 7"), "{page}");
}

/// Two apps (each with its own limiter and denial cache, as two processes
/// have) on one Cluster or one Sentinel-watched master.
async fn shared_pair(
    edit: impl Fn(&mut floodgate_site::config::Config) + Clone,
) -> (TestApp, TestApp) {
    let a = spawn_app_with(TWO_RULES, edit.clone()).await;
    let b = spawn_app_with(TWO_RULES, edit).await;
    (a, b)
}

async fn ban_reset_across(a: &TestApp, b: &TestApp) {
    let ip = ["127.0.0.1"];
    a.filter
        .operate("check", &ip, Action::Ban(Duration::from_secs(600)))
        .await
        .unwrap();
    for app in [a, b] {
        assert_eq!(status(app, "/check").await, 429);
    }
    assert_eq!(inspect(a, "site", &[]).await.used, 0);
    a.filter.operate("check", &ip, Action::Unban).await.unwrap();
    for app in [a, b] {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while status(app, "/check").await != 200 {
            assert!(
                std::time::Instant::now() < deadline,
                "the unban did not arrive"
            );
            actix_web::rt::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // The limit used up, both remember the denial; a reset from one
    // reaches the other.
    while status(a, "/check").await == 200 {}
    assert_eq!(status(b, "/check").await, 429);
    b.filter.operate("check", &ip, Action::Reset).await.unwrap();
    for app in [a, b] {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while status(app, "/check").await != 200 {
            assert!(
                std::time::Instant::now() < deadline,
                "the reset did not arrive"
            );
            actix_web::rt::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[actix_web::test]
async fn on_a_cluster_operator_records_share_the_identitys_slot_and_reach_every_process() {
    let cluster = Cluster::start();
    let seeds = cluster.seeds();
    let (a, b) = shared_pair(move |c| c.filter.redis.cluster = seeds.clone()).await;
    ban_reset_across(&a, &b).await;
    let seen = inspect(&a, "check", &["127.0.0.1"]).await;
    assert_eq!(seen.key, "floodgate:check:ip:{127.0.0.1}");
    let mut conn = cluster.connection();
    let mut slot = |k: &str| -> u16 {
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(k)
            .query(&mut conn)
            .unwrap()
    };
    assert_eq!(slot(&seen.key), slot(&format!("!{}", seen.key)));
    // An override set through one process applies in the other.
    let over = Action::Override {
        limit: 1,
        window: None,
        lasts: None,
    };
    a.filter
        .operate("check", &["127.0.0.1"], over)
        .await
        .unwrap();
    assert_eq!(status(&b, "/check").await, 429);
    penalty_bans(&a, &b).await;
    // Listed from every master, the hash tags taken off the IDs.
    let limiter = Arc::clone(a.filter.limiter());
    let listed = actix_web::web::block(move || limiter.listed_blocking("floodgate"))
        .await
        .unwrap()
        .unwrap();
    let found: Vec<(&str, &str, bool, bool)> = listed
        .iter()
        .map(|l| {
            (
                l.rule.as_str(),
                l.id.as_str(),
                l.banned_ms > 0,
                l.override_state.is_some(),
            )
        })
        .collect();
    assert_eq!(
        found,
        vec![
            ("check", "127.0.0.1", false, true),
            ("guess", "127.0.0.1", true, false)
        ]
    );
}

/// The `guess` rule (1 per hour, banned for 1 min at the 2nd denial): one
/// admission, one denial, then the ban, whichever process asks.
async fn penalty_bans(a: &TestApp, b: &TestApp) {
    assert_eq!(status(a, "/guess").await, 404, "admitted (no such page)");
    assert_eq!(status(b, "/guess").await, 429);
    let res = a
        .client
        .get(a.url("/guess"))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 429);
    let retry: u64 = res.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((50..=60).contains(&retry), "{retry}");
    let seen = inspect(b, "guess", &["127.0.0.1"]).await;
    assert!((50..=60).contains(&seen.banned_s), "{seen:?}");
    assert_eq!(seen.used, 1);
    assert!(a
        .metrics()
        .await
        .contains("floodgate_bans_total{rule=\"guess\",source=\"penalty\"} 1"));
}

#[actix_web::test]
async fn on_sentinel_operator_actions_reach_every_process() {
    let sentinel = Sentinel::start();
    let url = sentinel.url();
    let (a, b) = shared_pair(move |c| {
        c.filter.redis.sentinel = vec![url.clone()];
        c.filter.redis.sentinel_master = MASTER_NAME.into();
    })
    .await;
    ban_reset_across(&a, &b).await;
    penalty_bans(&a, &b).await;
}

#[actix_web::test]
async fn after_a_redis_restart_operator_changes_still_reach_the_denial_cache() {
    let mut app = spawn_app_with(TWO_RULES, |_| {}).await;
    let ip = ["127.0.0.1"];
    let ban = Action::Ban(Duration::from_secs(600));
    app.filter.operate("check", &ip, ban).await.unwrap();
    assert_eq!(status(&app, "/check").await, 429);
    // A new, empty server: the ban is gone with it, and the listener,
    // subscribed again, forgets what it may have missed.
    app.redis.restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while status(&app, "/check").await != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "the cached ban outlived the server"
        );
        actix_web::rt::time::sleep(Duration::from_millis(50)).await;
    }
    // Subscribed again: a new ban and its unban arrive.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        app.filter.operate("check", &ip, ban).await.unwrap();
        assert_eq!(status(&app, "/check").await, 429);
        app.filter
            .operate("check", &ip, Action::Unban)
            .await
            .unwrap();
        let mut tries = 0;
        while status(&app, "/check").await != 200 && tries < 20 {
            tries += 1;
            actix_web::rt::time::sleep(Duration::from_millis(50)).await;
        }
        if tries < 20 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the unban never arrived"
        );
    }
}

#[actix_web::test]
async fn after_a_sentinel_failover_operator_changes_still_reach_the_denial_cache() {
    let mut sentinel = Sentinel::start();
    let url = sentinel.url();
    // No decision without Redis: a request allowed during the failover
    // must not pass for one the unban let through.
    let toml = format!("[defaults]\non_redis_error = \"deny\"\n{}", TWO_RULES);
    let app = spawn_app_with(&toml, move |c| {
        c.filter.redis.sentinel = vec![url];
        c.filter.redis.sentinel_master = MASTER_NAME.into();
    })
    .await;
    let ip = ["127.0.0.1"];
    let ban = Action::Ban(Duration::from_secs(600));
    let seen = app.filter.operate("check", &ip, ban).await.unwrap();
    let record = format!("!{}", seen.key);
    wait_until(
        Duration::from_secs(10),
        "the ban to reach the replica",
        || {
            sentinel
                .replica
                .query::<bool>(redis::cmd("EXISTS").arg(&record))
                .unwrap_or(false)
        },
    );
    assert_eq!(status(&app, "/check").await, 429, "remembered from here on");
    sentinel.fail_master();
    // The new master holds the ban too; once decisions reach it, unban there.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if app
            .filter
            .operate("check", &ip, Action::Unban)
            .await
            .is_ok()
            && status(&app, "/check").await == 200
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the unban never reached the denial cache after the failover"
        );
        actix_web::rt::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn get(app: &TestApp, path: &str) -> reqwest::Response {
    app.client
        .get(app.url(path))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap()
}

fn header(res: &reqwest::Response, name: &str) -> String {
    res.headers()[name].to_str().unwrap().to_string()
}

/// An identity under an override is answered with the override's numbers
/// (not the rule's) in its RateLimit fields; and a denial under a lowered
/// override that ends soon asks to wait no longer than until it ends, when
/// the rule's own limit would then allow.
async fn override_numbers(app: &TestApp) {
    let ip = ["127.0.0.1"];
    let raise = Action::Override {
        limit: 7,
        window: Some(Duration::from_secs(120)),
        lasts: None,
    };
    app.filter.operate("check", &ip, raise).await.unwrap();
    let res = get(app, "/check").await;
    assert_eq!(res.status(), 200);
    let policy = header(&res, "ratelimit-policy");
    assert!(policy.contains("\"check\";q=7;w=120"), "{policy}");
    assert!(policy.contains("\"site\";q=1000;w=3600"), "{policy}");
    assert!(header(&res, "ratelimit").contains("\"check\";r=6;"));

    // Lowered to 1 (one unit used) for 2 s: denied, but the rule's own
    // limit (3 per hour) would allow once the override ends.
    let lower = Action::Override {
        limit: 1,
        window: None,
        lasts: Some(Duration::from_secs(2)),
    };
    app.filter.operate("check", &ip, lower).await.unwrap();
    for i in 0..2 {
        // Decided by Redis, then answered by the denial cache.
        let res = get(app, "/check").await;
        assert_eq!(res.status(), 429);
        let retry: u64 = header(&res, "retry-after").parse().unwrap();
        assert!(retry <= 3, "Retry-After {retry} outlives the override");
        // The remembered denial (i = 1) shows the override's numbers too.
        let policy = header(&res, "ratelimit-policy");
        assert!(policy.contains("\"check\";q=1;w=3600"), "{i}: {policy}");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while status(app, "/check").await != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "still denied after the override ended"
        );
        actix_web::rt::time::sleep(Duration::from_millis(20)).await;
    }
    let res = get(app, "/check").await;
    assert!(header(&res, "ratelimit-policy").contains("\"check\";q=3;w=3600"));
}

#[actix_web::test]
async fn an_override_gives_its_own_numbers_and_its_denial_ends_with_it() {
    let app = spawn_app_with(TWO_RULES, |_| {}).await;
    override_numbers(&app).await;
}

#[actix_web::test]
async fn on_a_cluster_an_override_gives_its_own_numbers_and_its_denial_ends_with_it() {
    let cluster = Cluster::start();
    let seeds = cluster.seeds();
    let app = spawn_app_with(TWO_RULES, move |c| c.filter.redis.cluster = seeds.clone()).await;
    override_numbers(&app).await;
}

/// Subscribers of the operator channel on `redis`.
fn subscribers(redis: &RedisServer) -> i64 {
    let (_, n): (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg("floodgate:operator")
        .query(&mut redis.connection())
        .unwrap();
    n
}

#[actix_web::test]
async fn a_command_line_ban_is_counted_once_by_the_serving_processes() {
    let a = spawn_app_with(TWO_RULES, |_| {}).await;
    let url = a.redis.url();
    let b = spawn_app_with(TWO_RULES, move |c| c.filter.redis.url = url).await;
    wait_until(Duration::from_secs(30), "both apps subscribed", || {
        subscribers(&a.redis) >= 2
    });
    // Each app remembers a denial of 127.0.0.1 (the test's address): its
    // listener forgetting it later shows that it heard what came before.
    while status(&a, "/check").await == 200 {}
    assert_eq!(status(&b, "/check").await, 429);
    let config = config_file("counted", TWO_RULES);
    let url = a.redis.url();
    floodgate(
        &config,
        &url,
        &["ban", "check", "203.0.113.9", "--for", "10m"],
    )
    .json();
    floodgate(&config, &url, &["reset", "check", "127.0.0.1"]).json();
    for app in [&a, &b] {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while status(app, "/check").await != 200 {
            assert!(
                std::time::Instant::now() < deadline,
                "the reset did not arrive"
            );
            actix_web::rt::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // Both heard the ban before the reset; one of them claimed it.
    let name = "floodgate_bans_total{rule=\"check\",source=\"operator\"}";
    let counted = |text: &str| crate::helpers::metric(text, name).unwrap_or(0);
    let (in_a, in_b) = (counted(&a.metrics().await), counted(&b.metrics().await));
    assert_eq!(in_a + in_b, 1, "a counted {in_a}, b counted {in_b}");
    // The admin API's own ban: counted once too, by the process that made it.
    b.filter
        .operate(
            "check",
            &["203.0.113.10"],
            Action::Ban(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    let (again_a, again_b) = (counted(&a.metrics().await), counted(&b.metrics().await));
    assert_eq!((again_a, again_b), (in_a, in_b + 1));
    std::fs::remove_file(config).unwrap();
}

/// A ban or an override under a shadow rule would never be enforced: the
/// command line refuses it (exit 2) and so does the admin API (400);
/// inspecting and resetting stay allowed.
#[actix_web::test]
async fn a_ban_or_override_under_a_shadow_rule_is_refused() {
    const SHADOW: &str = r#"
[admin]
token = "s3cret-token-for-tests"

[[rule]]
name = "watch"
paths = ["/check"]
limit = 3
window = "1h"
mode = "shadow"
"#;
    let redis = RedisServer::start();
    let config = config_file("shadow", SHADOW);
    let url = redis.url();
    for args in [
        &["ban", "watch", "127.0.0.1", "--for", "10m"][..],
        &["override", "watch", "127.0.0.1", "--limit", "10"][..],
    ] {
        let ran = floodgate(&config, &url, args);
        assert_eq!(ran.code, 2, "{args:?}: {}", ran.stdout);
        let what = if args[0] == "ban" {
            "so a ban under it"
        } else {
            "so an override under it"
        };
        assert!(ran.stderr.contains(what), "{}", ran.stderr);
    }
    assert_eq!(
        floodgate(&config, &url, &["reset", "watch", "127.0.0.1"]).code,
        0
    );

    let app = spawn_app_with(SHADOW, |_| {}).await;
    for (action, body) in [
        (
            "ban",
            r#"{"rule":"watch","values":["127.0.0.1"],"for":"10m"}"#,
        ),
        (
            "override",
            r#"{"rule":"watch","values":["127.0.0.1"],"limit":10}"#,
        ),
    ] {
        let (code, seen, _) = admin(&app, action, Some(TOKEN), body).await;
        assert_eq!(code, 400, "{action}: {seen}");
        assert!(seen["error"].as_str().unwrap().contains("shadow"), "{seen}");
    }
    let (code, seen, _) = admin(
        &app,
        "inspect",
        Some(TOKEN),
        r#"{"rule":"watch","values":["127.0.0.1"]}"#,
    )
    .await;
    assert_eq!((code, seen["banned_s"].as_u64()), (200, Some(0)));
}

/// `GET /admin/LISTING` as the operator, the JSON array it answers.
async fn admin_list(app: &TestApp, listing: &str) -> (u16, Value) {
    let res = app
        .client
        .get(app.url(&format!("/admin/{listing}")))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    (status, res.json().await.unwrap_or(Value::Null))
}

/// Bans (an operator's and a penalty's) and overrides are listed without
/// knowing their keys, by the command line (one object per line) and the
/// admin API (an array), one rule or all; every action but `inspect` is in
/// the audit trail, newest first, with who did it.
#[actix_web::test]
async fn bans_overrides_and_the_audit_trail_are_listed() {
    let app = spawn_app_with(TWO_RULES, |_| {}).await;
    let config = config_file("listings", TWO_RULES);
    let url = app.redis.url();
    let cli = |args: &[&str]| floodgate(&config, &url, args);
    let lines = |ran: Ran| -> Vec<Value> {
        assert_eq!(ran.code, 0, "stderr: {}", ran.stderr);
        ran.stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    assert!(lines(cli(&["bans"])).is_empty());

    let banned = cli(&["ban", "check", "192.0.2.7", "--for", "10m"]);
    // The action is logged at info, on the command's stderr, as one line.
    let logged: Vec<&str> = banned.stderr.lines().collect();
    assert_eq!(logged.len(), 1, "{}", banned.stderr);
    assert!(logged[0].contains(" INFO "), "{}", banned.stderr);
    assert!(
        logged[0].contains("ban under rule check of 192.0.2.7 by cli:"),
        "{}",
        banned.stderr
    );
    banned.json();
    let inspected = cli(&["inspect", "check", "192.0.2.8"]);
    assert_eq!(
        inspected.stderr, "",
        "inspect changes nothing, logs nothing"
    );
    inspected.json();
    cli(&[
        "override",
        "check",
        "192.0.2.9",
        "--limit",
        "10",
        "--for",
        "1h",
    ])
    .json();
    let (code, _, _) = admin(
        &app,
        "override",
        Some(TOKEN),
        r#"{"rule":"site","values":[],"limit":500,"window":"2m"}"#,
    )
    .await;
    assert_eq!(code, 200);
    // A penalty's ban: one admission, then the second denial bans.
    assert_eq!(status(&app, "/guess").await, 404);
    assert_eq!(status(&app, "/guess").await, 429);
    assert_eq!(status(&app, "/guess").await, 429);

    let bans = lines(cli(&["bans"]));
    assert_eq!(bans.len(), 2, "{bans:?}");
    assert_eq!(bans[0]["rule"], "check");
    assert_eq!(bans[0]["id"], "192.0.2.7");
    assert_eq!(bans[0]["source"], "operator");
    // (A wide margin: the commands between the ban and the listing take
    // however long a loaded machine makes them.)
    assert!((300..=600).contains(&bans[0]["banned_s"].as_u64().unwrap()));
    assert_eq!(bans[1]["rule"], "guess");
    assert_eq!(bans[1]["id"], "127.0.0.1");
    assert_eq!(bans[1]["source"], "penalty");
    assert_eq!(bans[1]["level"], 1);
    assert_eq!(lines(cli(&["bans", "guess"])), vec![bans[1].clone()]);
    let unknown = cli(&["bans", "nosuch"]);
    assert_eq!(unknown.code, 2, "{}", unknown.stderr);

    let overrides = lines(cli(&["overrides"]));
    assert_eq!(overrides.len(), 2, "{overrides:?}");
    assert_eq!(
        (
            &overrides[0]["rule"],
            &overrides[0]["id"],
            &overrides[0]["limit"]
        ),
        (&json!("check"), &json!("192.0.2.9"), &json!(10))
    );
    // The rule's window (1h) when the override sets none.
    assert_eq!(overrides[0]["window_s"], 3600);
    assert!((3300..=3600).contains(&overrides[0]["expires_s"].as_u64().unwrap()));
    assert_eq!(
        (
            &overrides[1]["rule"],
            &overrides[1]["id"],
            &overrides[1]["window_s"]
        ),
        (&json!("site"), &json!("all"), &json!(120))
    );
    assert_eq!(overrides[1]["expires_s"], Value::Null);

    // The same over the admin API.
    assert_eq!(
        admin_list(&app, "bans").await,
        (200, Value::Array(bans.clone()))
    );
    assert_eq!(
        admin_list(&app, "overrides?rule=site").await,
        (200, json!([overrides[1].clone()]))
    );
    assert_eq!(admin_list(&app, "bans?rule=nosuch").await.0, 400);
    // And as gauges, per rule.
    let metrics = app.metrics().await;
    for line in [
        "floodgate_bans_active{rule=\"check\"} 1",
        "floodgate_bans_active{rule=\"guess\"} 1",
        "floodgate_bans_active{rule=\"site\"} 0",
        "floodgate_overrides_active{rule=\"check\"} 1",
        "floodgate_overrides_active{rule=\"site\"} 1",
        "floodgate_overrides_active{rule=\"guess\"} 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    assert_eq!(admin_list(&app, "bans?color=red").await.0, 400);
    // A bad duration is named as the API names it, not as the command does.
    let (code, answer) = admin_list(&app, "audit?since=bad").await;
    assert_eq!(code, 400);
    let message = answer["error"].as_str().unwrap();
    assert!(message.starts_with("since: invalid duration"), "{message}");

    // The trail: newest first; inspect is not in it; the penalty's ban is
    // written off the request's path, so it is awaited.
    let mut trail = Vec::new();
    wait_until(
        Duration::from_secs(10),
        "the penalty ban in the trail",
        || {
            trail = lines(cli(&["audit"]));
            trail.len() == 4
        },
    );
    let actions: Vec<(&str, &str, &str)> = trail
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap(),
                e["rule"].as_str().unwrap(),
                e["id"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        actions,
        vec![
            ("penalty", "guess", "127.0.0.1"),
            ("override", "site", "all"),
            ("override", "check", "192.0.2.9"),
            ("ban", "check", "192.0.2.7"),
        ]
    );
    assert_eq!(
        (&trail[0]["by"], &trail[0]["detail"]),
        (&json!("penalty"), &json!("for 1m"))
    );
    assert_eq!(trail[1]["by"], "127.0.0.1");
    assert_eq!(trail[1]["detail"], "limit 500 window 2m until cleared");
    assert!(trail[2]["by"].as_str().unwrap().starts_with("cli:"));
    assert_eq!(trail[3]["detail"], "for 10m");
    assert!(trail[0]["at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(lines(cli(&["audit", "--since", "1h"])).len(), 4);
    let (code, api_trail) = admin_list(&app, "audit?since=10m").await;
    assert_eq!((code, api_trail), (200, Value::Array(trail)));
    assert_eq!(cli(&["audit", "check"]).code, 2);
}

/// `--all-rules VALUE` acts under every enforce rule keyed by that one kind
/// of value: an address under every `ip` rule (not a shadow one, not a
/// rule keyed by two values), a path under the `path` rules, a phone under
/// the rules keyed by a field.
#[test]
fn all_rules_bans_one_value_under_every_rule_keyed_by_it() {
    const RULES: &str = r#"
[[rule]]
name = "check"
paths = ["/check"]
limit = 3
window = "1h"

[[rule]]
name = "login"
paths = ["/login"]
limit = 5
window = "1m"

[[rule]]
name = "watch"
paths = ["/check"]
limit = 1
window = "1m"
mode = "shadow"

[[rule]]
name = "pair"
paths = ["/sms/send"]
key = ["form:phone", "ip"]
normalize = "e164"
limit = 3
window = "1m"

[[rule]]
name = "phone"
paths = ["/api/sms/send"]
key = "body:phone"
normalize = "e164"
limit = 1
window = "1m"

[[rule]]
name = "page"
paths = ["/user/:id"]
key = "path"
limit = 9
window = "1m"
"#;
    let redis = RedisServer::start();
    let config = config_file("all-rules", RULES);
    let url = redis.url();
    let objects = |ran: Ran| -> Vec<Value> {
        assert_eq!(ran.code, 0, "stderr: {}", ran.stderr);
        ran.stdout
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let rules = |seen: &[Value]| -> Vec<String> {
        seen.iter()
            .map(|o| o["rule"].as_str().unwrap().to_string())
            .collect()
    };
    let banned = objects(floodgate(
        &config,
        &url,
        &["ban", "--all-rules", "203.0.113.7", "--for", "10m"],
    ));
    assert_eq!(rules(&banned), ["check", "login"]);
    assert!(banned.iter().all(|o| o["banned_s"].as_u64().unwrap() > 300));
    let phone = objects(floodgate(
        &config,
        &url,
        &["ban", "--all-rules", "+1 (555) 010-9999", "--for", "1m"],
    ));
    assert_eq!(rules(&phone), ["phone"]);
    assert_eq!(phone[0]["key"], "floodgate:phone:body:+15550109999");
    // A path goes to the rules keyed by the path, not to the field rules.
    let path = objects(floodgate(
        &config,
        &url,
        &["ban", "--all-rules", "/user/42", "--for", "1m"],
    ));
    assert_eq!(rules(&path), ["page"]);
    assert_eq!(path[0]["key"], "floodgate:page:path:/user/42");
    let unbanned = objects(floodgate(
        &config,
        &url,
        &["unban", "--all-rules", "203.0.113.7"],
    ));
    assert_eq!(rules(&unbanned), ["check", "login"]);
    assert!(unbanned.iter().all(|o| o["banned_s"] == 0));
    for args in [
        &["inspect", "--all-rules", "203.0.113.7"][..],
        &["ban", "--all-rules", "203.0.113.7", "check", "--for", "1m"],
        &["ban", "--all-rules", "nobody-like-this", "--for", "1m"],
    ] {
        assert_eq!(floodgate(&config, &url, args).code, 2, "{args:?}");
    }
}

/// `find VALUE` names every rule's identities that hold the value as one of
/// their parts, written as a request carries it, counted or only banned.
#[actix_web::test]
async fn find_names_every_identity_holding_a_value() {
    let redis = RedisServer::start();
    let config = config_file("find", CHECK);
    let url = redis.url();
    let found = |value: &str| -> Vec<(String, String)> {
        let ran = floodgate(&config, &url, &["find", value]);
        assert_eq!(ran.code, 0, "stderr: {}", ran.stderr);
        ran.stdout
            .lines()
            .map(|l| {
                let o: Value = serde_json::from_str(l).unwrap();
                (
                    o["rule"].as_str().unwrap().to_string(),
                    o["key"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    floodgate(
        &config,
        &url,
        &[
            "ban",
            "sms",
            "+1 (555) 010-9999",
            "203.0.113.7",
            "--for",
            "1m",
        ],
    )
    .json();
    floodgate(
        &config,
        &url,
        &["ban", "check", "203.0.113.7", "--for", "1m"],
    )
    .json();
    // Counted, not banned: a state key alone.
    let mut conn = redis.connection();
    let _: () = redis::cmd("RPUSH")
        .arg("floodgate:check:ip:198.51.100.9")
        .arg("1:1:1")
        .query(&mut conn)
        .unwrap();
    let sms = "floodgate:sms:form+ip:+15550109999|203.0.113.7".to_string();
    assert_eq!(
        found("+1 555-010-9999"),
        vec![("sms".to_string(), sms.clone())]
    );
    assert_eq!(
        found("203.0.113.7"),
        vec![
            (
                "check".to_string(),
                "floodgate:check:ip:203.0.113.7".to_string()
            ),
            ("sms".to_string(), sms)
        ]
    );
    // A request without a phone is keyed by its address under `sms`.
    let _: () = redis::cmd("RPUSH")
        .arg("floodgate:sms:ip:198.51.100.9")
        .arg("1:1:1")
        .query(&mut conn)
        .unwrap();
    assert_eq!(
        found("198.51.100.9"),
        vec![
            (
                "check".to_string(),
                "floodgate:check:ip:198.51.100.9".to_string()
            ),
            (
                "sms".to_string(),
                "floodgate:sms:ip:198.51.100.9".to_string()
            )
        ]
    );
    assert!(found("nobody").is_empty());
    assert_eq!(floodgate(&config, &url, &["find"]).code, 2);

    let app = spawn_app_with(TWO_RULES, |_| {}).await;
    assert_eq!(status(&app, "/check").await, 200);
    let (code, objects) = admin_list(&app, "find?value=127.0.0.1").await;
    assert_eq!(code, 200);
    let rules: Vec<&str> = objects
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["rule"].as_str().unwrap())
        .collect();
    assert_eq!(rules, ["check"]);
    assert_eq!(objects[0]["used"], 1);
    assert_eq!(admin_list(&app, "find").await.0, 400);
}

/// `top RULE` names the identities denied most under a rule, those the
/// denial cache answered included, as every process wrote them, within
/// seconds of the denials.
#[actix_web::test]
async fn top_names_the_most_denied_identities_of_a_rule() {
    let app = spawn_app_with(TWO_RULES, |_| {}).await;
    let config = config_file("top", TWO_RULES);
    let url = app.redis.url();
    for _ in 0..3 {
        assert_eq!(status(&app, "/check").await, 200);
    }
    for _ in 0..4 {
        assert_eq!(status(&app, "/check").await, 429);
    }
    let mut top = Vec::new();
    wait_until(Duration::from_secs(10), "the denials in top", || {
        let ran = floodgate(&config, &url, &["top", "check", "--since", "1h"]);
        assert_eq!(ran.code, 0, "{}", ran.stderr);
        top = ran
            .stdout
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .collect();
        top.first().is_some_and(|t| t["denied"] == 4)
    });
    assert_eq!(top.len(), 1, "{top:?}");
    assert_eq!(
        (&top[0]["rule"], &top[0]["id"]),
        (&json!("check"), &json!("127.0.0.1"))
    );
    assert!(top[0]["last_s"].as_u64().unwrap() < 60);
    let (code, api) = admin_list(&app, "top?rule=check&since=10m").await;
    assert_eq!((code, api), (200, Value::Array(top)));
    // No denial under the other rules.
    assert_eq!(admin_list(&app, "top?rule=site").await, (200, json!([])));
    for args in [
        &["top", "nosuch"][..],
        &["top"],
        &["top", "check", "--since", "25h"],
    ] {
        assert_eq!(floodgate(&config, &url, args).code, 2, "{args:?}");
    }
    assert_eq!(admin_list(&app, "top").await.0, 400);
}

/// A banned identity's denial says so: `"error":"banned"` in the JSON, a
/// page that says the client is blocked, and `banned=1` on the way to the
/// error page; from Redis and from the denial cache alike.
#[actix_web::test]
async fn a_banned_identitys_denial_says_it_is_blocked() {
    const RULES: &str = r#"
[[rule]]
name = "check"
paths = ["/check"]
limit = 3
window = "1h"
deny = "status"

[[rule]]
name = "page"
paths = ["/limits"]
limit = 3
window = "1h"
deny = "redirect"
"#;
    let app = spawn_app_with(RULES, |_| {}).await;
    let ban = Action::Ban(Duration::from_secs(600));
    for rule in ["check", "page"] {
        app.filter.operate(rule, &["127.0.0.1"], ban).await.unwrap();
    }
    let get = |path: &'static str, accept: &'static str| {
        let req = app.client.get(app.url(path));
        let req = if accept.is_empty() {
            req
        } else {
            req.header("accept", accept)
        };
        req.send()
    };
    // Twice: Redis answers the first, the denial cache the second.
    for _ in 0..2 {
        let res = get("/check", "").await.unwrap();
        assert_eq!(res.status(), 429);
        let body: Value = res.json().await.unwrap();
        assert_eq!(body["error"], "banned", "{body}");
        assert_eq!(body["rule"], "check");
        assert!(body["retry_after"].as_u64().unwrap() > 300);
    }
    let page = get("/check", "text/html").await.unwrap();
    assert_eq!(page.status(), 429);
    let text = page.text().await.unwrap();
    assert!(text.contains("You are blocked"), "{text}");
    assert!(!text.contains("You reached a limit"), "{text}");

    let redirected = get("/limits", "text/html").await.unwrap();
    assert_eq!(redirected.status(), 303);
    let location = redirected.headers()["location"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(location.ends_with("&banned=1"), "{location}");
    let shown = app.client.get(app.url(&location)).send().await.unwrap();
    let text = shown.text().await.unwrap();
    assert!(text.contains("<h1>Blocked</h1>"), "{text}");
    // Over the limit only: the usual words.
    let plain = app
        .client
        .get(app.url("/err?rule=check&retry_after=5"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(plain.contains("Slow down") && !plain.contains("Blocked"));
}
