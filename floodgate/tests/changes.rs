//! Rule changes (reloads) and clock steps meet state already in Redis: a
//! lowered limit forgets nothing still in the window, a changed window or
//! rate applies to the state from the key's next decision on, the outcome of
//! a batch does not depend on how requests were batched, and a clock that
//! steps back admits nothing the state has no room for. Pinned-clock tests
//! run the real script (the demo's tests reload over HTTP).

mod common;

use floodgate_limiter::__private::decide_batch;
use floodgate_limiter::limiter::Check;
use floodgate_limiter::limiter::Decision;
use floodgate_limiter::limiter::Limiter;
use floodgate_limiter::limiter::LimiterError;
use floodgate_limiter::rule::Algorithm;

use common::RedisServer;

use common::pinned::{bucket, check, fixed, pinned_limiter, sliding, T0};

/// (allowed, remaining, wait in ms) of a one-check decision.
fn one(decision: Decision) -> (bool, u64, u64) {
    let o = decision.outcomes[0];
    (o.allowed, o.remaining, o.wait.as_millis() as u64)
}

/// Decides one check at `t` (ms after T0).
async fn at(
    limiter: &Limiter,
    t: u64,
    key: &str,
    algorithm: Algorithm,
    cost: u32,
) -> (bool, u64, u64) {
    one(limiter
        .decide_at(T0 + t, vec![check(key, algorithm, cost)])
        .await
        .unwrap())
}

/// A sliding window's admission times, newest first, one per unit (each
/// entry is `TIME:TOTAL:UNITS`).
fn lrange(redis: &RedisServer, key: &str) -> Vec<u64> {
    let entries: Vec<String> = redis::cmd("LRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query(&mut redis.connection())
        .unwrap();
    entries
        .iter()
        .flat_map(|e| {
            let parts: Vec<u64> = e.split(':').map(|p| p.parse().unwrap()).collect();
            std::iter::repeat_n(parts[0], parts[2] as usize)
        })
        .collect()
}

// ---------------------------------------------------------------------------
// A lowered limit keeps every entry still in the window
// ---------------------------------------------------------------------------

#[actix_web::test]
async fn a_lowered_sliding_limit_denies_until_entries_leave_and_forgets_none() {
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let key = "floodgate:lower:ip:1";
    let (six, three) = (sliding(6, 60_000), sliding(3, 60_000));
    // Six admissions a second apart, then the seventh is denied.
    for i in 0..6 {
        assert!(at(&limiter, i * 1000, key, six, 1).await.0, "admission {i}");
    }
    assert_eq!(at(&limiter, 5000, key, six, 1).await, (false, 0, 55_000));
    // Limit 3: denied until the fourth-newest entry (t = 3 s) leaves.
    assert_eq!(
        at(&limiter, 10_000, key, three, 1).await,
        (false, 0, 53_000)
    );
    assert_eq!(redis.llen(key), 6, "no entry in the window was thrown away");
    // Back to 6: still six in the window, so still denied.
    assert_eq!(at(&limiter, 10_000, key, six, 1).await, (false, 0, 50_000));
    // Limit 3 again once the oldest has left: five remain, still denied...
    assert_eq!(at(&limiter, 60_000, key, three, 1).await, (false, 0, 3000));
    assert!(!at(&limiter, 62_999, key, three, 1).await.0);
    // ...until only two remain.
    assert_eq!(at(&limiter, 63_000, key, three, 1).await, (true, 0, 1000));
    assert_eq!(lrange(&redis, key), vec![T0 + 63_000, T0 + 5000, T0 + 4000]);
}

// ---------------------------------------------------------------------------
// A changed window or rate applies to the state already there
// ---------------------------------------------------------------------------

#[actix_web::test]
async fn a_shorter_fixed_window_applies_to_a_window_already_open() {
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let key = "floodgate:shorter:ip:1";
    let hour = fixed(2, 3_600_000);
    assert_eq!(at(&limiter, 0, key, hour, 1).await, (true, 1, 3_600_000));
    assert_eq!(at(&limiter, 0, key, hour, 1).await, (true, 0, 3_600_000));
    assert_eq!(at(&limiter, 0, key, hour, 1).await, (false, 0, 3_600_000));
    // Reloaded with a 5 s window: 3 s in, the window closes in 2 s, and the
    // key's TTL says so; 6 s in, a new window has opened.
    let five = fixed(2, 5000);
    assert_eq!(at(&limiter, 3000, key, five, 1).await, (false, 0, 2000));
    let ttl = redis.pttl(key);
    assert!(ttl > 0 && ttl <= 2000, "PTTL {ttl}");
    assert_eq!(at(&limiter, 6000, key, five, 1).await, (true, 1, 5000));
    let ttl = redis.pttl(key);
    assert!(ttl > 4000 && ttl <= 5000, "PTTL {ttl}");
}

#[actix_web::test]
async fn a_longer_fixed_window_takes_over_at_the_next_decision() {
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let (five, hour) = (fixed(2, 5000), fixed(2, 3_600_000));
    // Decided again while open: the window now lasts the hour, and so does the key.
    let key = "floodgate:longer:ip:1";
    at(&limiter, 0, key, five, 2).await;
    assert_eq!(
        at(&limiter, 1000, key, hour, 1).await,
        (false, 0, 3_599_000)
    );
    let ttl = redis.pttl(key);
    assert!(ttl > 3_598_000 && ttl <= 3_599_000, "PTTL {ttl}");
    assert_eq!(
        at(&limiter, 6000, key, hour, 1).await,
        (false, 0, 3_594_000)
    );
    // Not decided again before the short window closed (the key's TTL ran
    // out with it): a new window.
    let key = "floodgate:longer:ip:2";
    at(&limiter, 0, key, five, 2).await;
    assert_eq!(at(&limiter, 6000, key, hour, 1).await, (true, 1, 3_600_000));
}

#[actix_web::test]
async fn a_slower_token_bucket_keeps_its_key_until_it_is_full_at_the_new_rate() {
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let key = "floodgate:slower:ip:1";
    // rate 1/s, burst 5: emptied at once; the key lives 5 s.
    assert_eq!(
        at(&limiter, 0, key, bucket(1.0, 5), 5).await,
        (true, 0, 5000)
    );
    // Reloaded at 1/8 per second. At 500 ms the bucket holds half a token
    // (refilled at the old rate until now); from here it refills at the new
    // one, and the key lives until it is full at that rate: 36 s, not the
    // old 5 s.
    let slow = bucket(0.125, 5);
    assert_eq!(at(&limiter, 500, key, slow, 1).await, (false, 0, 4000));
    let ttl = redis.pttl(key);
    assert!(ttl > 35_000 && ttl <= 36_000, "PTTL {ttl}");
    assert!(!at(&limiter, 4499, key, slow, 1).await.0);
    assert_eq!(at(&limiter, 4500, key, slow, 1).await, (true, 0, 40_000));
    // Faster again: from its next decision the bucket refills at 1/s.
    let fast = bucket(1.0, 5);
    assert_eq!(at(&limiter, 5500, key, fast, 1).await, (false, 0, 875));
    assert_eq!(at(&limiter, 6375, key, fast, 1).await, (true, 0, 5000));
}

#[actix_web::test]
async fn a_longer_sliding_window_keeps_the_log_for_the_new_window() {
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let key = "floodgate:wider:ip:1";
    for _ in 0..2 {
        assert!(at(&limiter, 0, key, sliding(2, 1000), 1).await.0);
    }
    // Reloaded with a minute: the two entries count for a minute, and the
    // denial keeps the key alive for as long.
    assert_eq!(
        at(&limiter, 500, key, sliding(2, 60_000), 1).await,
        (false, 0, 59_500)
    );
    let ttl = redis.pttl(key);
    assert!(ttl > 59_000 && ttl <= 59_500, "PTTL {ttl}");
    assert!(!at(&limiter, 59_999, key, sliding(2, 60_000), 1).await.0);
    assert!(at(&limiter, 60_000, key, sliding(2, 60_000), 1).await.0);
}

// ---------------------------------------------------------------------------
// Batches: the outcome does not depend on how requests were batched
// ---------------------------------------------------------------------------

/// The state of `key`: its type and contents as text, and its PTTL.
fn dump(conn: &mut redis::Connection, key: &str) -> (String, i64) {
    let kind: String = redis::cmd("TYPE").arg(key).query(conn).unwrap();
    let contents = match kind.as_str() {
        // A log as its units' times: one call merges the requests it
        // admits at one moment into one entry (`TIME:TOTAL:UNITS`).
        "list" => format!(
            "{:?}",
            redis::cmd("LRANGE")
                .arg(key)
                .arg(0)
                .arg(-1)
                .query::<Vec<String>>(conn)
                .unwrap()
                .iter()
                .flat_map(|e| {
                    let p: Vec<u64> = e.split(':').map(|x| x.parse().unwrap()).collect();
                    std::iter::repeat_n(p[0], p[2] as usize)
                })
                .collect::<Vec<u64>>()
        ),
        "hash" => {
            let mut fields: Vec<(String, String)> =
                redis::cmd("HGETALL").arg(key).query(conn).unwrap();
            fields.sort();
            format!("{fields:?}")
        }
        _ => String::new(),
    };
    let ttl: i64 = redis::cmd("PTTL").arg(key).query(conn).unwrap();
    (format!("{kind} {contents}"), ttl)
}

type Jobs = Vec<(Option<u64>, Vec<Check>)>;

/// A job of one check on `key`, `t` ms after T0.
fn job(key: &str, t: u64, algorithm: Algorithm, cost: u32) -> (Option<u64>, Vec<Check>) {
    (Some(T0 + t), vec![check(key, algorithm, cost)])
}

/// Runs `jobs` as one batch on `a` and one job per batch on `b` (the same
/// key under two names) and expects the same decisions and the same state.
fn same_in_one_batch_and_alone(redis: &RedisServer, jobs: &dyn Fn(&str) -> Jobs) {
    let mut conn = redis.connection();
    let together = decide_batch(&mut conn, jobs("floodgate:mixed:ip:a")).unwrap();
    let mut alone = Vec::new();
    for job in jobs("floodgate:mixed:ip:b") {
        alone.extend(decide_batch(&mut conn, vec![job]).unwrap());
    }
    let errors = |r: &[Result<Decision, LimiterError>]| r.iter().filter(|r| r.is_err()).count();
    assert_eq!(errors(&together), 0, "{together:?}");
    assert_eq!(together, alone);
    let (a, a_ttl) = dump(&mut conn, "floodgate:mixed:ip:a");
    let (b, b_ttl) = dump(&mut conn, "floodgate:mixed:ip:b");
    assert_eq!(a, b);
    // Both TTLs come from the same pinned clock; only the test's own time
    // passed between them (the windows here differ by far more).
    assert!(a_ttl > 0 && b_ttl > 0, "{a_ttl} {b_ttl}");
    assert!((a_ttl - b_ttl).abs() < 10_000, "{a_ttl} {b_ttl}");
}

#[test]
fn a_batch_whose_reply_is_packed_in_several_chunks_answers_each_request() {
    let redis = RedisServer::start();
    // 300 requests (901 values in the reply, which the script packs 500 at
    // a time), the last 50 over the limit.
    same_in_one_batch_and_alone(&redis, &|key| {
        (0..300)
            .map(|i| job(key, i / 3, sliding(250, 60_000), 1))
            .collect()
    });
}

#[actix_web::test]
async fn an_algorithm_change_within_one_batch_decides_as_separate_calls() {
    let redis = RedisServer::start();
    // Requests built from the old rule (sliding window) and the new one
    // (fixed window, then token bucket) land in one batch, on one key.
    same_in_one_batch_and_alone(&redis, &|key| {
        vec![
            job(key, 0, sliding(5, 60_000), 1),
            job(key, 0, sliding(5, 60_000), 1),
            job(key, 0, fixed(5, 30_000), 2),
            job(key, 0, sliding(5, 60_000), 1),
            job(key, 0, fixed(5, 30_000), 1),
            job(key, 0, bucket(1.0, 4), 1),
            job(key, 0, sliding(5, 60_000), 2),
            job(key, 0, sliding(5, 60_000), 1),
        ]
    });
}

#[actix_web::test]
async fn two_windows_for_one_key_in_one_batch_decide_as_separate_calls() {
    let redis = RedisServer::start();
    same_in_one_batch_and_alone(&redis, &|key| {
        vec![
            job(key, 0, sliding(4, 60_000), 1),
            job(key, 0, sliding(4, 60_000), 1),
            job(key, 500, sliding(4, 60_000), 1),
            // The new rule: limit 3 in 20 s (the entries at 0 have left it).
            job(key, 20_200, sliding(3, 20_000), 1),
            job(key, 20_200, sliding(3, 20_000), 1),
            // The old rule again, in flight, then the new one last.
            job(key, 20_200, sliding(4, 60_000), 1),
            job(key, 20_200, sliding(3, 20_000), 1),
        ]
    });
}

#[actix_web::test]
async fn repeats_on_one_key_at_one_moment_decide_as_separate_calls() {
    // A call keeps what it read of a key, and its admissions' writes (one
    // entry for the requests admitted at one moment), for the next request
    // on that key; a read under other numbers in between (a descriptor's
    // own limit, a reload) or a denial must leave the next request decided
    // as a call of its own would decide it.
    let redis = RedisServer::start();
    same_in_one_batch_and_alone(&redis, &|key| {
        vec![
            job(key, 0, sliding(10, 60_000), 3),
            job(key, 40_000, sliding(10, 60_000), 1),
            job(key, 40_000, sliding(10, 60_000), 1),
            // Only the two units at 40 s are in a 30 s window: denied there.
            job(key, 40_000, sliding(2, 30_000), 2),
            // Counted in the 60 s window again: 5 + 1.
            job(key, 40_000, sliding(10, 60_000), 1),
            job(key, 40_000, sliding(10, 60_000), 2),
            job(key, 40_000, sliding(10, 60_000), 2),
            // At the limit: one more unit is denied, then and a moment later.
            job(key, 40_000, sliding(10, 60_000), 1),
            job(key, 40_000, sliding(10, 60_000), 1),
            job(key, 40_001, sliding(10, 60_000), 1),
        ]
    });
}

#[actix_web::test]
async fn repeats_of_two_rules_at_one_moment_decide_as_separate_calls() {
    // The same for requests that two rules check, all or nothing: the
    // second rule runs out first, and its denial charges neither.
    let redis = RedisServer::start();
    same_in_one_batch_and_alone(&redis, &|key| {
        let other = format!("{key}:header");
        let job = |t: u64, cost: u32| {
            (
                Some(T0 + t),
                vec![
                    check(key, sliding(10, 60_000), cost),
                    check(&other, sliding(5, 60_000), cost),
                ],
            )
        };
        vec![
            job(0, 1),
            job(0, 1),
            job(0, 2),
            // 4 of 5 taken on the second: 2 more do not fit, 1 does.
            job(0, 2),
            job(0, 1),
            job(0, 1),
            job(1, 1),
        ]
    });
}

// ---------------------------------------------------------------------------
// A clock that steps back
// ---------------------------------------------------------------------------

#[actix_web::test]
async fn a_token_bucket_gains_nothing_when_the_clock_steps_back() {
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let key = "floodgate:back:ip:1";
    let b = bucket(1.0, 5);
    assert_eq!(at(&limiter, 10_000, key, b, 3).await, (true, 2, 3000));
    // 5 s back: the bucket is as it was at 10 s (2 tokens); waits are on the
    // caller's clock, 5 s behind.
    assert_eq!(at(&limiter, 5000, key, b, 1).await, (true, 1, 9000));
    assert_eq!(at(&limiter, 10_000, key, b, 5).await, (false, 1, 4000));
    assert_eq!(at(&limiter, 14_000, key, b, 5).await, (true, 0, 5000));
}

#[actix_web::test]
async fn a_sliding_window_gains_nothing_when_the_clock_steps_back() {
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let key = "floodgate:back:ip:2";
    let w = sliding(2, 1000);
    assert!(at(&limiter, 0, key, w, 1).await.0);
    assert!(at(&limiter, 0, key, w, 1).await.0);
    assert!(at(&limiter, 1000, key, w, 1).await.0);
    // Back to 500: the state's own time is 1000 (the two entries at 0 have
    // left), so this one counts at 1000, beside the other one there, and the
    // next is denied until 2000, on a clock that now reads 500.
    assert_eq!(at(&limiter, 500, key, w, 1).await, (true, 0, 1500));
    assert_eq!(at(&limiter, 500, key, w, 1).await, (false, 0, 1500));
    assert_eq!(lrange(&redis, key), vec![T0 + 1000, T0 + 1000]);

    // The log stays newest-first: entries are pushed at the state's time.
    let key = "floodgate:back:ip:3";
    let w = sliding(3, 1000);
    for t in [1000, 500, 1500] {
        assert!(at(&limiter, t, key, w, 1).await.0, "at {t}");
    }
    assert_eq!(lrange(&redis, key), vec![T0 + 1500, T0 + 1000, T0 + 1000]);
    assert_eq!(at(&limiter, 1200, key, w, 1).await, (false, 0, 800));
}

#[actix_web::test]
async fn a_fixed_window_gains_nothing_when_the_clock_steps_back() {
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let key = "floodgate:back:ip:4";
    let w = fixed(2, 1000);
    assert_eq!(at(&limiter, 1000, key, w, 1).await, (true, 1, 1000));
    // Back before the window opened: the same window, closing at 2000.
    assert_eq!(at(&limiter, 0, key, w, 1).await, (true, 0, 2000));
    assert_eq!(at(&limiter, 500, key, w, 1).await, (false, 0, 1500));
    assert_eq!(at(&limiter, 2000, key, w, 1).await, (true, 1, 1000));
}

// ---------------------------------------------------------------------------
// State written before windows stored their start
// ---------------------------------------------------------------------------

#[actix_web::test]
async fn a_fixed_window_counter_from_before_keeps_its_count_and_closing_time() {
    let redis = RedisServer::start();
    let limiter = pinned_limiter(&redis);
    let key = "floodgate:legacy:ip:1";
    // The old layout: a plain counter whose TTL was what was left of the window.
    redis::cmd("SET")
        .arg(key)
        .arg(2)
        .arg("PX")
        .arg(30_000)
        .query::<()>(&mut redis.connection())
        .unwrap();
    let (allowed, left, wait) = at(&limiter, 0, key, fixed(3, 60_000), 1).await;
    assert!(allowed);
    assert_eq!(left, 0);
    assert!(wait > 29_000 && wait <= 30_000, "closes in {wait} ms");
    assert!(!at(&limiter, 0, key, fixed(3, 60_000), 1).await.0);
    let ttl = redis.pttl(key);
    assert!(ttl > 29_000 && ttl <= 30_000, "PTTL {ttl}");
}
