//! One decision's cost is bounded whatever the limit and however many
//! entries expire at once (measured by Redis's own SLOWLOG), and one rule
//! cannot hurt another: a check the script cannot decide fails its own
//! request, and the rest of its batch is decided normally. (The demo's
//! tests check the same over HTTP: its error policy per rule.)

mod common;

use floodgate_limiter::__private::decide_batch;
use floodgate_limiter::limiter::Decision;
use floodgate_limiter::limiter::LimiterError;

use common::pinned::{bucket, check, fixed, pinned_limiter, sliding, T0};
use common::RedisServer;

// ---------------------------------------------------------------------------
// Bounded worst case
// ---------------------------------------------------------------------------

const MAX: u32 = 100_000;

/// Fills `key` with MAX entries of one unit each, one ms apart and newest
/// first: T0 + MAX at the head down to T0 + 1 at the tail (as MAX
/// admissions would; each entry is `TIME:TOTAL:UNITS`).
fn fill(conn: &mut redis::Connection, key: &str) {
    let times: Vec<String> = (0..u64::from(MAX))
        .map(|i| format!("{}:{}:1", T0 + u64::from(MAX) - i, u64::from(MAX) - i))
        .collect();
    for chunk in times.chunks(1000) {
        redis::cmd("RPUSH")
            .arg(key)
            .arg(chunk)
            .query::<()>(conn)
            .unwrap();
    }
}

/// The longest decision (FCALL of the batch function) in the slow log, in µs.
fn slowest_decision(conn: &mut redis::Connection) -> i64 {
    let entries: Vec<(i64, i64, i64, Vec<String>, String, String)> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(1000)
        .query(conn)
        .unwrap();
    let durations: Vec<i64> = entries
        .iter()
        .filter(|e| e.3.first().is_some_and(|c| c.eq_ignore_ascii_case("fcall")))
        .map(|e| e.2)
        .collect();
    assert!(!durations.is_empty(), "no FCALL in the slow log");
    durations.into_iter().max().unwrap()
}

#[actix_web::test]
async fn one_decision_holds_redis_briefly_at_the_largest_limit() {
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let mut conn = redis.connection();
    // Load the script before measuring.
    limiter
        .decide_at(T0, vec![check("floodgate:warm:ip:1", sliding(1, 1000), 1)])
        .await
        .unwrap();
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(0)
        .query::<()>(&mut conn)
        .unwrap();
    redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-max-len")
        .arg(1000)
        .query::<()>(&mut conn)
        .unwrap();
    let minute = sliding(MAX, 60_000);
    let hour = sliding(MAX, 3_600_000);
    // (what, key, ms after T0, algorithm, cost, expected allowed, remaining, length after)
    let cases = [
        (
            "60 000 entries expire",
            "a",
            120_000,
            minute,
            1,
            true,
            59_999,
            40_001,
        ),
        (
            "all but one expire",
            "b",
            159_999,
            minute,
            1,
            true,
            99_998,
            2,
        ),
        ("all expire", "c", 160_000, minute, 1, true, 99_999, 1),
        (
            "full, none expire",
            "d",
            100_000,
            hour,
            1,
            false,
            0,
            100_000,
        ),
        (
            "a limit lowered to 10",
            "e",
            100_000,
            sliding(10, 3_600_000),
            1,
            false,
            0,
            100_000,
        ),
        // A request's units cost one entry, whatever their number.
        (
            "one request of 10 000 units",
            "f",
            0,
            minute,
            10_000,
            true,
            90_000,
            1,
        ),
    ];
    for (what, id, t, algorithm, cost, allowed, left, len) in cases {
        let key = format!("floodgate:huge:ip:{id}");
        if id != "f" {
            fill(&mut conn, &key);
        }
        redis::cmd("SLOWLOG")
            .arg("RESET")
            .query::<()>(&mut conn)
            .unwrap();
        let decision = limiter
            .decide_at(T0 + t, vec![check(&key, algorithm, cost)])
            .await
            .unwrap();
        let slowest = slowest_decision(&mut conn);
        println!("{what}: {slowest} µs");
        let o = decision.outcomes[0];
        assert_eq!((o.allowed, o.remaining), (allowed, left), "{what}");
        assert_eq!(redis.llen(&key), len, "{what}");
        assert!(redis.pttl(&key) > 0, "{what}: no TTL");
        // Sized so no speed of machine crosses it: about 25 times the slowest
        // case here (under 1 ms), a fifth of what popping 60 000 entries one
        // by one took (100 ms).
        assert!(
            slowest < 20_000,
            "{what}: the decision held Redis for {slowest} µs"
        );
    }
}

// ---------------------------------------------------------------------------
// One rule cannot hurt another
// ---------------------------------------------------------------------------

fn error_text(result: &Result<Decision, LimiterError>) -> String {
    match result {
        Err(LimiterError::Check(text)) => text.clone(),
        other => panic!("expected a failed check, got {other:?}"),
    }
}

#[actix_web::test]
async fn a_broken_rule_fails_alone_in_its_batch() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let set = |conn: &mut redis::Connection, args: &[&str]| {
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query::<()>(conn).unwrap();
    };
    // Keys no algorithm could have left: a hash of other fields, a set, and
    // states of the right type that are not numbers.
    set(&mut conn, &["HSET", "floodgate:broken:ip:1", "x", "1"]);
    set(&mut conn, &["SADD", "floodgate:broken:ip:2", "x"]);
    set(
        &mut conn,
        &[
            "HSET",
            "floodgate:garbled:ip:1",
            "start",
            "soon",
            "used",
            "1",
        ],
    );
    set(&mut conn, &["RPUSH", "floodgate:garbled:ip:2", "yesterday"]);
    let w = sliding(3, 60_000);
    let jobs = vec![
        (Some(T0), vec![check("floodgate:ok:ip:1", w, 1)]),
        (Some(T0), vec![check("floodgate:broken:ip:1", w, 1)]),
        // A request under a healthy rule and a broken one: it fails whole,
        // and the healthy rule records nothing.
        (
            Some(T0),
            vec![
                check("floodgate:ok:ip:2", w, 1),
                check("floodgate:broken:ip:1", w, 1),
            ],
        ),
        // Parameters out of range (a cost over the limit).
        (
            Some(T0),
            vec![floodgate_limiter::__private::unchecked_check(
                "floodgate:ok:ip:3",
                sliding(2, 1000),
                3,
            )],
        ),
        (
            Some(T0),
            vec![check("floodgate:broken:ip:2", bucket(1.0, 3), 1)],
        ),
        (
            Some(T0),
            vec![check("floodgate:garbled:ip:1", fixed(3, 1000), 1)],
        ),
        (Some(T0), vec![check("floodgate:garbled:ip:2", w, 1)]),
        (Some(T0 + 1), vec![check("floodgate:ok:ip:1", w, 1)]),
    ];
    let results = decide_batch(&mut conn, jobs).unwrap();
    assert_eq!(results.len(), 8);
    assert_eq!(results[0].as_ref().unwrap().outcomes[0].remaining, 2);
    assert!(error_text(&results[1]).contains("floodgate:broken:ip:1"));
    assert!(error_text(&results[1]).contains("type"));
    assert!(error_text(&results[2]).contains("floodgate:broken:ip:1"));
    assert!(error_text(&results[3]).contains("parameters"));
    assert!(error_text(&results[4]).contains("floodgate:broken:ip:2"));
    assert!(error_text(&results[5]).contains("not made of numbers"));
    assert!(error_text(&results[6]).contains("floodgate:garbled:ip:2"));
    // The last request was decided as if the failed ones had not been there.
    let last = results[7].as_ref().unwrap();
    assert!(last.allowed);
    assert_eq!(last.outcomes[0].remaining, 1);
    assert_eq!(redis.llen("floodgate:ok:ip:1"), 2);
    // Nothing was recorded for the failed requests, and the broken keys are
    // as they were.
    assert_eq!(
        redis.keys("floodgate:ok:*"),
        vec!["floodgate:ok:ip:1".to_string()]
    );
    let hash: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg("floodgate:broken:ip:1")
        .query(&mut conn)
        .unwrap();
    assert_eq!(hash, vec![("x".to_string(), "1".to_string())]);
    assert_eq!(redis.pttl("floodgate:broken:ip:1"), -1);
    // Every key the limiter wrote has a TTL.
    let ttl = redis.pttl("floodgate:ok:ip:1");
    assert!(ttl > 0 && ttl <= 60_000, "PTTL {ttl}");
}

fn memory_usage(conn: &mut redis::Connection, key: &str) -> u64 {
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .query(conn)
        .unwrap()
}

#[actix_web::test]
async fn a_requests_cost_costs_redis_one_entry_whatever_its_units() {
    // Limit 100 000, requests of 50 000 units: each admission is one entry
    // carrying its weight, and the answers are those of one unit each.
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let mut conn = redis.connection();
    let key = "floodgate:heavy:ip:1";
    let minute = sliding(MAX, 60_000);
    let at = |t: u64| {
        let decided = limiter.decide_at(T0 + t, vec![check(key, minute, 50_000)]);
        async move {
            let o = decided.await.unwrap().outcomes[0];
            (o.allowed, o.remaining, o.wait.as_millis() as u64)
        }
    };
    assert_eq!(at(0).await, (true, 50_000, 60_000));
    assert_eq!(at(1000).await, (true, 0, 59_000));
    // Full: the first request's units must leave, at 60 s.
    assert_eq!(at(2000).await, (false, 0, 58_000));
    assert_eq!(redis.llen(key), 2);
    let bytes = memory_usage(&mut conn, key);
    assert!(bytes < 1000, "{bytes} bytes for two requests");
    // The first leaves; the second's units still count.
    assert_eq!(at(60_000).await, (true, 0, 1000));
    assert_eq!(at(60_500).await, (false, 0, 500));
    assert_eq!(redis.llen(key), 2);
}

#[actix_web::test]
async fn a_log_of_plain_times_is_read_as_its_live_units() {
    // A list written one plain time per unit (before entries carried their
    // weight): its live units count, as one entry at its newest time.
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let mut conn = redis.connection();
    let key = "floodgate:plain:ip:1";
    let times: Vec<u64> = (1..=10).rev().map(|i| T0 + i * 1000).collect();
    redis::cmd("RPUSH")
        .arg(key)
        .arg(&times)
        .query::<()>(&mut conn)
        .unwrap();
    // At 15 s under a 10 s window, the entries at 6..10 s are live: 5 units.
    let d = limiter
        .decide_at(T0 + 15_000, vec![check(key, sliding(8, 10_000), 1)])
        .await
        .unwrap();
    let o = d.outcomes[0];
    assert_eq!((o.allowed, o.remaining), (true, 2));
    assert_eq!(redis.llen(key), 2);
    assert!(redis.pttl(key) > 0);
    // They count until the newest of them leaves (at 20 s): never fewer.
    let d = limiter
        .decide_at(T0 + 19_999, vec![check(key, sliding(8, 10_000), 3)])
        .await
        .unwrap();
    assert!(!d.outcomes[0].allowed);
}
