//! `floodgate::gate`, the decision the doors take, for a front end of one's
//! own: all-or-nothing through Redis, a remembered denial without it, each
//! limit's `on_redis_error` when Redis is gone, and every outcome counted
//! under its limit's name. Against a real redis-server.

mod common;

use std::path::Path;
use std::time::Duration;

use floodgate_limiter::config::Config;
use floodgate_limiter::gate::{self, Named, Verdict};
use floodgate_limiter::limiter::{Check, Limiter, LimiterOptions};
use floodgate_limiter::metrics::Metrics;
use floodgate_limiter::rule::{Algorithm, OnRedisError};

use common::RedisServer;

fn limiter(redis: &RedisServer) -> Limiter {
    let mut config = Config::parse("", Path::new("test.toml")).unwrap();
    config.redis.url = redis.url();
    config.redis.timeout = Duration::from_millis(500);
    let options = LimiterOptions {
        breaker: Duration::from_secs(60),
        ..LimiterOptions::default()
    };
    Limiter::new(&config.redis, options).unwrap()
}

fn count(metrics: &Metrics, rule: &str, decision: &str) -> u64 {
    let line = format!("floodgate_decisions_total{{rule=\"{rule}\",decision=\"{decision}\"}} ");
    metrics
        .render(0)
        .lines()
        .find_map(|l| l.strip_prefix(&line)?.trim().parse().ok())
        .unwrap_or(0)
}

fn per_hour(limit: u32) -> Algorithm {
    Algorithm::sliding_window(limit, Duration::from_secs(3600)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decides_counts_and_falls_back_as_the_doors_do() {
    let mut redis = RedisServer::start();
    let limiter = limiter(&redis);
    let metrics = Metrics::default();
    // Two limits on one request: 2 per hour per user, 5 per hour per
    // tenant; a third that only watches (shadow), 1 per hour.
    let checks = [
        Check::new("gate:user:1", per_hour(2)),
        Check::new("gate:tenant:a", per_hour(5)),
        Check::new("gate:watch:1", per_hour(1)).with_enforce(false),
    ];
    let limits = [
        Named::new("user", OnRedisError::Local),
        Named::new("tenant", OnRedisError::Allow),
        Named::new("watch", OnRedisError::Allow),
    ];
    let mut allowed = 0;
    for _ in 0..2 {
        match gate::decide(&limiter, &metrics, &limits, &checks).await {
            Verdict::Redis(d) => {
                assert!(d.allowed, "{d:?}");
                allowed += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(allowed, 2);
    // The third is over the user's limit: nothing is charged, the tenant's
    // count stays at 2.
    match gate::decide(&limiter, &metrics, &limits, &checks).await {
        Verdict::Redis(d) => {
            assert!(!d.allowed);
            assert!(!d.outcomes[0].allowed && d.outcomes[1].allowed);
            assert_eq!(d.outcomes[1].remaining, 2, "{d:?}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(redis.units("gate:tenant:a"), 2);
    // The fourth is remembered: no Redis call.
    let calls = |redis: &RedisServer| -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query(&mut redis.connection())
            .unwrap();
        info.lines()
            .filter(|l| l.starts_with("cmdstat_fcall:") || l.starts_with("cmdstat_evalsha:"))
            .filter_map(|l| {
                l.split("calls=")
                    .nth(1)?
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum()
    };
    let before = calls(&redis);
    match gate::decide(&limiter, &metrics, &limits, &checks).await {
        Verdict::Remembered(r) => {
            assert_eq!(r.index, 0);
            assert!(!r.banned && r.wait > Duration::from_secs(3000), "{r:?}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(calls(&redis), before, "a remembered denial calls Redis");
    // Counted as the filter counts: the allowed requests under every limit,
    // the denials under the limit that denied, and the watching limit's
    // overs (its second and third, over its 1 per hour, the third in a
    // denied request); a denied request's other limits took nothing.
    assert_eq!(count(&metrics, "user", "allowed"), 2);
    assert_eq!(count(&metrics, "user", "denied"), 2);
    assert_eq!(count(&metrics, "tenant", "allowed"), 2);
    assert_eq!(count(&metrics, "tenant", "denied"), 0);
    assert_eq!(count(&metrics, "watch", "allowed"), 1);
    assert_eq!(count(&metrics, "watch", "shadow_denied"), 2);
    assert!(metrics
        .render(0)
        .contains("floodgate_deny_cache_hits_total{rule=\"user\"} 1"));

    // Redis gone. A new user: `local` decides the user's limit here (2 per
    // hour), `allow` lets the tenant's pass.
    redis.stop();
    let fresh = [
        Check::new("gate:user:2", per_hour(2)),
        Check::new("gate:tenant:a", per_hour(5)),
    ];
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        match gate::decide(&limiter, &metrics, &limits[..2], &fresh).await {
            Verdict::Fallback(f) => {
                assert_eq!(f.local, [0]);
                assert_eq!(f.checks[0].key(), "gate:user:2");
                outcomes.push(f.decision.allowed);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(outcomes, [true, true, false]);
    assert_eq!(count(&metrics, "user", "local_allowed"), 2);
    assert_eq!(count(&metrics, "user", "local_denied"), 1);
    assert_eq!(count(&metrics, "tenant", "error_allowed"), 3);
    // An enforcing limit that says `deny` refuses the request, whatever the
    // others say; one that only watches does not.
    let strict = [Named::new("strict", OnRedisError::Deny)];
    let one = [Check::new("gate:strict", per_hour(5))];
    assert!(matches!(
        gate::decide(&limiter, &metrics, &strict, &one).await,
        Verdict::Unavailable(_)
    ));
    assert_eq!(count(&metrics, "strict", "error_denied"), 1);
    let watching = [Check::new("gate:strict", per_hour(5)).with_enforce(false)];
    match gate::decide(&limiter, &metrics, &strict, &watching).await {
        Verdict::Fallback(f) => assert!(f.decision.allowed && f.local.is_empty()),
        other => panic!("{other:?}"),
    }
    // A limit the caller refuses without a check.
    gate::count_refused(&metrics, "zero", true);
    gate::count_refused(&metrics, "zero", false);
    assert_eq!(count(&metrics, "zero", "denied"), 1);
    assert_eq!(count(&metrics, "zero", "shadow_denied"), 1);
}
