//! gcra and sliding_counter at their largest limits, and the figures the
//! README gives for them: bytes per key in Redis, and the sliding
//! counter's over-admission against the exact log on a bursty trace
//! (printed; run with `--nocapture` to read them, nothing is timed).

mod common;

use std::time::Duration;

use floodgate_limiter::__private::decide_batch;
use floodgate_limiter::limiter::{Check, Decision};
use floodgate_limiter::rule::Algorithm;

use common::RedisServer;

const T0: u64 = 1_700_000_000_000;

fn check(key: &str, algorithm: Algorithm, cost: u32) -> Check {
    Check::new(key, algorithm).with_cost(cost).unwrap()
}

fn decide(conn: &mut redis::Connection, now: u64, c: &Check) -> Decision {
    decide_batch(conn, vec![(Some(now), vec![c.clone()])])
        .unwrap()
        .remove(0)
        .unwrap()
}

#[test]
fn gcra_and_sliding_counter_work_at_a_limit_of_a_billion() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let window = Duration::from_secs(1);
    // GCRA: the whole billion at once, then one every microsecond.
    let g = Algorithm::gcra(1_000_000_000, window).unwrap();
    let d = decide(&mut conn, T0, &check("p:g:ip:1", g, 999_999_999));
    assert!(d.allowed);
    assert_eq!(d.outcomes[0].remaining, 1);
    assert!(decide(&mut conn, T0, &check("p:g:ip:1", g, 1)).allowed);
    let d = decide(&mut conn, T0, &check("p:g:ip:1", g, 1));
    assert!(!d.allowed, "{d:?}");
    assert_eq!(d.outcomes[0].remaining, 0);
    // 1 ms later, a million intervals have passed: a million units fit,
    // not one more.
    assert!(!decide(&mut conn, T0 + 1, &check("p:g:ip:1", g, 1_000_001)).allowed);
    let d = decide(&mut conn, T0 + 1, &check("p:g:ip:1", g, 1_000_000));
    assert!(d.allowed, "{d:?}");
    assert!(!decide(&mut conn, T0 + 1, &check("p:g:ip:1", g, 1)).allowed);
    // The sliding counter: a billion in one window, not one more.
    let s = Algorithm::sliding_counter(1_000_000_000, window).unwrap();
    let d = decide(&mut conn, T0, &check("p:s:ip:1", s, 1_000_000_000));
    assert!(d.allowed);
    let d = decide(&mut conn, T0, &check("p:s:ip:1", s, 1));
    assert!(!d.allowed);
    let retry = d.outcomes[0].wait.as_millis() as u64;
    assert!(decide(&mut conn, T0 + retry, &check("p:s:ip:1", s, 1)).allowed);
}

fn memory(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .arg("SAMPLES")
        .arg(0)
        .query(conn)
        .unwrap()
}

#[test]
fn bytes_per_key() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let window = Duration::from_secs(60);
    for limit in [10u32, 100_000, 1_000_000_000] {
        let mut line = format!("limit {limit}:");
        let kinds: [(&str, Algorithm); 3] = [
            (
                "sliding_window",
                Algorithm::sliding_window(limit.min(100_000), window).unwrap(),
            ),
            ("gcra", Algorithm::gcra(limit, window).unwrap()),
            (
                "sliding_counter",
                Algorithm::sliding_counter(limit, window).unwrap(),
            ),
        ];
        for (name, a) in kinds {
            if name == "sliding_window" && limit > 100_000 {
                continue;
            }
            let key = format!("p:{name}:ip:{limit}");
            // Full: the whole limit taken by one request.
            let cost = a.quota();
            let d = decide(&mut conn, T0, &check(&key, a, cost));
            assert!(d.allowed);
            line.push_str(&format!(" {name} {} B", memory(&mut conn, &key)));
            if name == "sliding_window" {
                // The log holds one entry per admitted request: the whole
                // limit taken by one-unit requests, 1000 to a call.
                let key = format!("p:{name}:units:{limit}");
                let one = check(&key, a, 1);
                for _ in 0..cost.div_ceil(1000) {
                    let n = (cost as usize).min(1000);
                    let jobs = vec![(Some(T0), vec![one.clone()]); n];
                    for d in decide_batch(&mut conn, jobs).unwrap() {
                        assert!(d.unwrap().allowed);
                    }
                }
                line.push_str(&format!(
                    " (in one-unit requests {} B)",
                    memory(&mut conn, &key)
                ));
            }
        }
        println!("{line}");
    }
}

#[test]
fn sliding_counter_over_admission_on_bursts_at_window_edges() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let (limit, window) = (100u32, Duration::from_secs(10));
    let log = Algorithm::sliding_window(limit, window).unwrap();
    let counter = Algorithm::sliding_counter(limit, window).unwrap();
    // Aligned to the counter's windows: bursts of 150 requests in the last
    // second of a window and the first of the next, and a trickle between.
    let start = T0 - T0 % 10_000;
    let mut times = Vec::new();
    for w in 0..50u64 {
        let base = start + w * 10_000;
        for i in 0..150 {
            times.push(base + 9_000 + i * 6);
        }
        for i in 0..150 {
            times.push(base + 10_000 + i * 6);
        }
        for i in 0..20 {
            times.push(base + 11_000 + i * 400);
        }
    }
    let (mut exact, mut approx, mut beyond) = (0u64, 0u64, 0u64);
    for &t in &times {
        let a = decide(&mut conn, t, &check("p:log:ip:1", log, 1)).allowed;
        let b = decide(&mut conn, t, &check("p:ctr:ip:1", counter, 1)).allowed;
        exact += u64::from(a);
        approx += u64::from(b);
        beyond += u64::from(b && !a);
    }
    println!(
        "{} requests: the log admitted {exact}, the counter {approx}; admitted by the counter and not the log: {beyond} ({:.2}% of requests)",
        times.len(),
        100.0 * beyond as f64 / times.len() as f64
    );
    assert!(approx <= exact * 2);
}

/// A check cannot ask for more units than its algorithm's quota (it could
/// never fit, and Redis refuses to decide it): `Check::with_cost` refuses
/// it, as a rule's `cost` is refused; the whole quota fits at once.
#[test]
fn a_cost_above_the_quota_cannot_be_asked() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let minute = Duration::from_secs(60);
    let algorithms = [
        Algorithm::sliding_window(5, minute).unwrap(),
        Algorithm::fixed_window(5, minute).unwrap(),
        Algorithm::token_bucket(1.0, 5).unwrap(),
        Algorithm::gcra(5, minute).unwrap(),
        Algorithm::sliding_counter(5, minute).unwrap(),
    ];
    for (i, a) in algorithms.into_iter().enumerate() {
        let key = format!("p:over{i}:ip:1");
        let refused = Check::new(key.as_str(), a).with_cost(6).unwrap_err();
        assert!(
            refused
                .to_string()
                .starts_with("cost must be between 1 and 5"),
            "{a:?}: {refused}"
        );
        let d = decide(&mut conn, T0, &check(&key, a, 5));
        assert!(d.allowed, "{a:?}: {d:?}");
        assert_eq!(d.outcomes[0].remaining, 0, "{a:?}: {d:?}");
    }
}
