//! Bans under `on_redis_error = "local"`: while Redis cannot be reached, the
//! process goes on denying the identities it knows to be banned (announced
//! on the operator channel, or answered by Redis as banned), with the ban's
//! time left as `Retry-After`, takes no local quota for them, and lets
//! every other identity through under the rule's local limit. An unban
//! heard before the outage clears the ban. Against a real redis-server,
//! killed for the outage.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{test, web, App, HttpResponse};
use floodgate_limiter::config::Config;
use floodgate_limiter::limiter::Limiter;
use floodgate_limiter::limiter::{Action, Dispatch, LimiterOptions};
use floodgate_limiter::operator_check;
use floodgate_limiter::Filter;

use common::{wait_until, RedisServer};

/// One request in an hour per address; a denial bans for 10 minutes.
const RULES: &str = r#"
[[rule]]
name = "check"
paths = ["/check"]
limit = 1
window = "1h"
deny = "status"
on_redis_error = "local"
penalty = { after = 1, within = "10m", ban = "10m", max = "1h" }
"#;

const BANS: &str = "floodgate_bans_total{rule=\"check\",source=\"operator\"}";

fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .map_or(0, |v| v.trim().parse().unwrap())
}

fn subscribers(redis: &RedisServer) -> i64 {
    let (_, n): (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg("floodgate:operator")
        .query(&mut redis.connection())
        .unwrap();
    n
}

/// What a command-line process does: an action through a limiter of its
/// own, whose metrics nobody reads.
struct Operator {
    config: Config,
    limiter: Limiter,
}

impl Operator {
    fn new(text: &str) -> Operator {
        let config = Config::parse(text, Path::new("app.toml")).unwrap();
        let options = LimiterOptions {
            deny_cache: false,
            dispatch: Dispatch::Threads,
            ..LimiterOptions::default()
        };
        let limiter = Limiter::new(&config.redis, options).unwrap();
        Operator { config, limiter }
    }

    fn act(&self, ip: &str, action: Action) {
        let check = operator_check(
            &self.config.rules,
            &self.config.redis.key_prefix,
            false,
            "check",
            &[ip],
            &action,
        )
        .unwrap();
        self.limiter.operate_blocking(&check, action).unwrap();
    }
}

fn from(ip: &str) -> test::TestRequest {
    let peer: SocketAddr = format!("{ip}:40000").parse().unwrap();
    test::TestRequest::get().uri("/check").peer_addr(peer)
}

fn retry_after<B>(res: &actix_web::dev::ServiceResponse<B>) -> u64 {
    res.headers()
        .get("retry-after")
        .expect("a Retry-After")
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

#[actix_web::test]
async fn bans_known_before_an_outage_are_enforced_by_the_local_fallback() {
    let mut redis = RedisServer::start();
    let text = format!(
        "[redis]\nurl = \"{}\"\ntimeout = \"250ms\"\n{RULES}",
        redis.url()
    );
    let filter = Filter::from_toml_str(&text, "app.toml").unwrap();
    let operator = Operator::new(&text);
    let app = test::init_service(
        App::new()
            .wrap(filter.clone())
            .route("/check", web::get().to(HttpResponse::Ok)),
    )
    .await;
    let bans = || {
        let text = filter.metrics().render(filter.limiter().error_count());
        metric(&text, BANS)
    };
    // Both listeners hear what is published from here on.
    wait_until(Duration::from_secs(30), "two subscribers", || {
        subscribers(&redis) >= 2
    });

    // Announced: the serving process hears each ban (and claims it to
    // count it, which tells the test it was heard).
    operator.act("10.0.0.1", Action::Ban(Duration::from_secs(3600)));
    wait_until(Duration::from_secs(30), "the first ban heard", || {
        bans() == 1
    });
    operator.act("10.0.0.3", Action::Ban(Duration::from_secs(3600)));
    wait_until(Duration::from_secs(30), "the second ban heard", || {
        bans() == 2
    });
    operator.act("10.0.0.3", Action::Unban);
    // Heard in order: once this one is, so is the unban before it.
    operator.act("10.0.0.4", Action::Ban(Duration::from_secs(1800)));
    wait_until(Duration::from_secs(30), "the third ban heard", || {
        bans() == 3
    });

    // Answered by Redis: a penalty's ban (never published).
    let res = test::call_service(&app, from("10.0.0.5").to_request()).await;
    assert_eq!(res.status(), StatusCode::OK);
    let res = test::call_service(&app, from("10.0.0.5").to_request()).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);

    redis.stop();

    for (ip, ban) in [("10.0.0.1", 3600), ("10.0.0.4", 1800), ("10.0.0.5", 600)] {
        for _ in 0..3 {
            let res = test::call_service(&app, from(ip).to_request()).await;
            assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{ip}");
            let retry = retry_after(&res);
            // The ban's time left: no machine takes a minute to get here.
            assert!(
                retry <= ban && retry > ban - 60,
                "{ip}: Retry-After {retry}"
            );
        }
    }
    // Others are decided here, under the rule's own limit.
    for ip in ["10.0.0.2", "10.0.0.3"] {
        let res = test::call_service(&app, from(ip).to_request()).await;
        assert_eq!(res.status(), StatusCode::OK, "{ip}");
        let res = test::call_service(&app, from(ip).to_request()).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{ip}");
        assert!(retry_after(&res) > 3500, "{ip}: the local limit's wait");
    }
    // The banned took nothing: only the two others hold a local state.
    assert_eq!(
        floodgate_limiter::__private::local(filter.limiter()).len(),
        2
    );
    let text = filter.metrics().render(filter.limiter().error_count());
    let decisions = |d: &str| {
        metric(
            &text,
            &format!("floodgate_decisions_total{{rule=\"check\",decision=\"{d}\"}}"),
        )
    };
    // One denial by Redis (the penalty's), nine here.
    assert_eq!(decisions("banned"), 10, "{text}");
    assert_eq!(decisions("local_allowed"), 2, "{text}");
    assert_eq!(decisions("local_denied"), 2, "{text}");
}
