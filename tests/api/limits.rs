//! The limiter's arithmetic: exactness
//! under concurrency; the sliding-window property (never more than the limit
//! in any window, and never a denial unless the window is full) on a pinned
//! clock and over HTTP in real time; Retry-After honoured by all three
//! algorithms; all-or-nothing across rules; key format, TTLs and hashed
//! IDs; fixed window and token bucket basics; shadow mode.

use std::path::Path;
use std::time::{Duration, Instant};

use floodgate::limiter::Check;
use floodgate::limiter::Limiter;
use floodgate::limiter::LimiterOptions;
use floodgate::rule::Algorithm;
use floodgate_site::config::Config;

use crate::helpers::{header, metric, remaining, spawn_app, RedisServer};

/// A tiny deterministic PRNG (xorshift64*).
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..=max`.
    fn upto(&mut self, max: u64) -> u64 {
        self.next() % (max + 1)
    }
}

// ---------------------------------------------------------------------------
// Exactness under concurrency
// ---------------------------------------------------------------------------

#[actix_web::test]
async fn concurrent_requests_on_one_key_admit_exactly_the_limit() {
    let app = spawn_app(
        r#"
[redis]
timeout = "3s"

[[rule]]
name = "crowd"
paths = ["/check"]
limit = 50
window = "1m"
deny = "status"
"#,
    )
    .await;
    let pending: Vec<_> = (0..200)
        .map(|_| actix_web::rt::spawn(app.client.get(app.url("/check")).send()))
        .collect();
    let mut allowed_remaining = Vec::new();
    let mut denied = 0;
    for p in pending {
        let res = p.await.unwrap().unwrap();
        match res.status().as_u16() {
            200 => allowed_remaining.push(remaining(&res, "crowd").expect("RateLimit field")),
            429 => denied += 1,
            other => panic!("unexpected status {other}"),
        }
    }
    allowed_remaining.sort_unstable();
    // Exactly 50 admitted, and each saw its own place in the count.
    assert_eq!(allowed_remaining, (0..50).collect::<Vec<u64>>());
    assert_eq!(denied, 150);
    // Fifty units in the log (one call may merge the requests it admits
    // at one moment into one entry).
    assert_eq!(app.redis.units("floodgate:crowd:ip:127.0.0.1"), 50);
    let metrics = app.metrics().await;
    let m = |d: &str| {
        metric(
            &metrics,
            &format!("floodgate_decisions_total{{rule=\"crowd\",decision=\"{d}\"}}"),
        )
    };
    assert_eq!((m("allowed"), m("denied")), (Some(50), Some(150)));
}

// ---------------------------------------------------------------------------
// The sliding-window property on a pinned clock
// ---------------------------------------------------------------------------

/// One decision of the pinned-clock stream.
#[derive(Debug)]
struct Event {
    t: u64,
    allowed: bool,
    remaining: u64,
    wait: u64,
}

/// Units admitted in `[from, to]` by the events before index `before`.
fn units(events: &[Event], before: usize, from: u64, to: u64, cost: u64) -> u64 {
    events[..before]
        .iter()
        .filter(|e| e.allowed && e.t >= from && e.t <= to)
        .count() as u64
        * cost
}

/// Checks a stream of decisions on one key against the definition: an
/// admission at `t` occupies `[t, t + window)`.
fn assert_sliding_window_exact(events: &[Event], limit: u64, window: u64, cost: u64) {
    for (i, e) in events.iter().enumerate() {
        // What the window holds just before this request: admissions in (t - window, t].
        let held = units(events, i, (e.t + 1).saturating_sub(window), e.t, cost);
        if e.allowed {
            // Safe: the admission fits.
            assert!(
                held + cost <= limit,
                "event {i} {e:?}: admitted over the limit ({held} held)"
            );
            assert_eq!(
                e.remaining,
                limit - held - cost,
                "event {i} {e:?}: remaining"
            );
            // Reset: when the oldest admission in the window leaves.
            let oldest = events[..i]
                .iter()
                .filter(|o| o.allowed && o.t + window > e.t)
                .map(|o| o.t)
                .min()
                .unwrap_or(e.t);
            assert_eq!(e.wait, oldest + window - e.t, "event {i} {e:?}: reset");
        } else {
            // Exact: denied only when the window is really full.
            assert!(
                held + cost > limit,
                "event {i} {e:?}: denied with only {held} held"
            );
            assert_eq!(e.remaining, limit - held, "event {i} {e:?}: remaining");
            // Retry-After is the first moment the same request fits (no other traffic).
            let at = e.t + e.wait;
            let held_then = units(events, i, (at + 1).saturating_sub(window), e.t, cost);
            let held_before = units(events, i, at.saturating_sub(window), e.t, cost);
            assert!(e.wait > 0, "event {i} {e:?}");
            assert!(
                held_then + cost <= limit,
                "event {i} {e:?}: still full at t + wait"
            );
            assert!(
                held_before + cost > limit,
                "event {i} {e:?}: could retry earlier"
            );
        }
    }
    // Safety in every interval [t, t + window) that starts at an admission
    // (the fullest intervals start at one).
    for (i, e) in events.iter().enumerate().filter(|(_, e)| e.allowed) {
        let inside = units(events, events.len(), e.t, e.t + window - 1, cost);
        assert!(
            inside <= limit,
            "interval from event {i} holds {inside} > {limit}"
        );
    }
}

#[actix_web::test]
async fn sliding_window_is_exact_on_a_pinned_clock() {
    let redis = RedisServer::start();
    let mut config = Config::parse("", Path::new("test.toml")).unwrap();
    config.filter.redis.url = redis.url();
    config.filter.redis.timeout = Duration::from_secs(5);
    let limiter = Limiter::new(&config.filter.redis, LimiterOptions::default()).unwrap();
    // The clock is pinned but Redis expires keys on its own clock: a key's
    // TTL (until its newest entry leaves the window, on the pinned clock)
    // can be 1 ms when the pinned clock stands just before that moment, and
    // a slow machine then loses the log before the next request. So the key
    // is made persistent after every decision, and if real time expired it
    // before that, its live entries (the admissions still in the window, as
    // the script wrote them) are put back: only the script decides what the
    // log holds. TTLs are tested on their own.
    let window = 60_000;
    for (seed, limit, cost) in [
        (0x9E37_79B9_7F4A_7C15_u64, 5_u64, 1_u64),
        (12_345, 7, 2),
        (777, 1, 1),
        (4_242, 10, 3),
    ] {
        let key = format!("floodgate:prop:ip:{seed}");
        let algorithm =
            Algorithm::sliding_window(limit as u32, Duration::from_millis(window)).unwrap();
        let mut rng = XorShift(seed);
        let mut t = 1_700_000_000_000_u64;
        let mut events = Vec::new();
        let (mut admitted, mut refused) = (0, 0);
        for _ in 0..400 {
            // The edges, where an off-by-one shows: the ms before and the ms
            // at which an admission leaves the window (the last denial's
            // retry time is one of them).
            let mut edges: Vec<u64> = events
                .iter()
                .filter(|e: &&Event| e.allowed && e.t + window + 1 >= t)
                .flat_map(|e| [e.t + window - 1, e.t + window])
                .filter(|&edge| edge >= t)
                .collect();
            edges.sort_unstable();
            edges.truncate(4);
            // Bursts (often in the same ms), a pace near the limit, edges,
            // rare long pauses.
            t = match rng.upto(9) {
                0..=3 => t + rng.upto(3),
                4..=5 => t + rng.upto(2 * window * cost / limit),
                6..=8 if !edges.is_empty() => edges[rng.upto(edges.len() as u64 - 1) as usize],
                _ => t + rng.upto(2 * window),
            };
            let check = Check::new(key.clone(), algorithm)
                .with_cost(cost as u32)
                .unwrap();
            let mut conn = redis.connection();
            let exists: i64 = redis::cmd("EXISTS").arg(&key).query(&mut conn).unwrap();
            if exists == 0 {
                // Oldest first, so that LPUSH leaves the newest at the head.
                for e in events
                    .iter()
                    .filter(|e: &&Event| e.allowed && e.t + window > t)
                {
                    for _ in 0..cost {
                        let _: i64 = redis::cmd("LPUSH")
                            .arg(&key)
                            .arg(e.t)
                            .query(&mut conn)
                            .unwrap();
                    }
                }
            }
            let decision = limiter.decide_at(t, vec![check]).await.unwrap();
            let _: i64 = redis::cmd("PERSIST").arg(&key).query(&mut conn).unwrap();
            let o = decision.outcomes[0];
            assert_eq!(decision.allowed, o.allowed);
            if o.allowed {
                admitted += 1;
            } else {
                refused += 1;
            }
            events.push(Event {
                t,
                allowed: o.allowed,
                remaining: o.remaining,
                wait: o.wait.as_millis() as u64,
            });
        }
        assert!(
            admitted > 50 && refused > 50,
            "seed {seed}: a poor stream ({admitted}/{refused})"
        );
        assert_sliding_window_exact(&events, limit, window, cost);
    }
}

// ---------------------------------------------------------------------------
// The sliding-window property over HTTP, in real time
// ---------------------------------------------------------------------------

#[actix_web::test]
async fn sliding_window_holds_in_real_time_over_http() {
    let limit = 4;
    let window = Duration::from_secs(1);
    let app = spawn_app(
        r#"
[redis]
timeout = "2s"

[[rule]]
name = "live"
paths = ["/check"]
limit = 4
window = "1s"
deny = "status"
"#,
    )
    .await;
    // Redis stamps each decision with its clock (ms, floored) somewhere
    // between our send and receive times; slack covers the flooring.
    let slack = Duration::from_millis(2);
    let mut rng = XorShift(0xDEAD_BEEF);
    // A fixed number of requests with seeded gaps (about 3.5 s in all): the
    // checks below bracket each decision by its own send and receive times,
    // so a slower machine only widens the brackets, never crosses them.
    let mut log: Vec<(Instant, Instant, bool)> = Vec::new();
    for _ in 0..36 {
        let gap = match rng.upto(3) {
            0 => 0,
            _ => rng.upto(300),
        };
        actix_web::rt::time::sleep(Duration::from_millis(gap)).await;
        let sent = Instant::now();
        let res = app.get("/check").await;
        let received = Instant::now();
        let allowed = match res.status().as_u16() {
            200 => true,
            429 => false,
            other => panic!("status {other}"),
        };
        log.push((sent, received, allowed));
    }
    let admitted: Vec<usize> = (0..log.len()).filter(|&i| log[i].2).collect();
    assert!(
        admitted.len() > limit && admitted.len() < log.len(),
        "{log:?}"
    );
    // Safe: the admission `limit` places after another came a full window later.
    for pair in admitted.windows(limit + 1) {
        let (first, last) = (log[pair[0]], log[pair[limit]]);
        assert!(
            last.1 - first.0 + slack >= window,
            "{} admissions within {:?}",
            limit + 1,
            last.1 - first.0
        );
    }
    // Exact: a denial came while the `limit`-th latest admission was in the window.
    for (k, entry) in log.iter().enumerate().filter(|(_, e)| !e.2) {
        let before: Vec<&usize> = admitted.iter().filter(|&&a| a < k).collect();
        assert!(
            before.len() >= limit,
            "request {k} denied after {} admissions",
            before.len()
        );
        let a = log[*before[before.len() - limit]];
        assert!(
            entry.0.duration_since(a.1) < window + slack,
            "request {k} denied {:?} after the admission that should have left",
            entry.0.duration_since(a.1)
        );
    }
}

// ---------------------------------------------------------------------------
// Retry-After
// ---------------------------------------------------------------------------

/// Exhausts the rule `wait` on `/check`, then waits the Retry-After it is
/// given and expects the same request to pass.
async fn retry_after_is_enough(toml: &str, most: u64) {
    let app = spawn_app(toml).await;
    let mut denial = None;
    for _ in 0..10 {
        let res = app.get("/check").await;
        if res.status() == 429 {
            denial = Some(res);
            break;
        }
        assert_eq!(res.status(), 200);
    }
    let res = denial.expect("the limit is reached");
    let n: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
    assert!((1..=most).contains(&n), "Retry-After: {n}");
    // Sleeping is the subject here: the wait the server asked for.
    actix_web::rt::time::sleep(Duration::from_secs(n)).await;
    let res = app.get("/check").await;
    assert_eq!(
        res.status(),
        200,
        "denied again {n} s after Retry-After: {n}"
    );
}

#[actix_web::test]
async fn retry_after_is_enough_for_sliding_window() {
    let toml = r#"
[[rule]]
name = "wait"
paths = ["/check"]
limit = 2
window = "2s"
deny = "status"
"#;
    retry_after_is_enough(toml, 2).await;
}

#[actix_web::test]
async fn retry_after_is_enough_for_fixed_window() {
    let toml = r#"
[[rule]]
name = "wait"
paths = ["/check"]
algorithm = "fixed_window"
limit = 2
window = "2s"
deny = "status"
"#;
    retry_after_is_enough(toml, 2).await;
}

#[actix_web::test]
async fn retry_after_is_enough_for_token_bucket() {
    let toml = r#"
[[rule]]
name = "wait"
paths = ["/check"]
algorithm = "token_bucket"
rate = 0.5
burst = 2
deny = "status"
"#;
    retry_after_is_enough(toml, 2).await;
}

// ---------------------------------------------------------------------------
// All-or-nothing, keys and TTLs
// ---------------------------------------------------------------------------

#[actix_web::test]
async fn a_denied_request_takes_nothing_from_any_rule() {
    let app = spawn_app(
        r#"
[[rule]]
name = "per_ip"
paths = ["/check"]
key = "ip"
limit = 3
window = "1m"
deny = "status"

[[rule]]
name = "per_user"
paths = ["/check"]
key = "header:x-user"
limit = 2
window = "1m"
deny = "status"
"#,
    )
    .await;
    let ip_key = "floodgate:per_ip:ip:127.0.0.1";
    let user_key = |u: &str| format!("floodgate:per_user:header:{u}");
    let as_user = |u: &'static str| {
        app.client
            .get(app.url("/check"))
            .header("x-user", u)
            .header("accept", "application/json")
            .send()
    };
    for _ in 0..2 {
        assert_eq!(as_user("alice").await.unwrap().status(), 200);
    }
    // per_user denies alice: per_ip keeps its count.
    let res = as_user("alice").await.unwrap();
    assert_eq!(res.status(), 429);
    assert!(res.text().await.unwrap().contains("\"rule\":\"per_user\""));
    assert_eq!(app.redis.llen(ip_key), 2);
    assert_eq!(app.redis.llen(&user_key("alice")), 2);
    // bob takes the last per_ip unit; then per_ip denies bob: per_user keeps bob's count.
    assert_eq!(as_user("bob").await.unwrap().status(), 200);
    let res = as_user("bob").await.unwrap();
    assert_eq!(res.status(), 429);
    assert!(res.text().await.unwrap().contains("\"rule\":\"per_ip\""));
    assert_eq!(app.redis.llen(ip_key), 3);
    assert_eq!(app.redis.llen(&user_key("bob")), 1);
    assert_eq!(
        app.redis.keys("floodgate:*"),
        vec![ip_key.to_string(), user_key("alice"), user_key("bob")]
    );
}

#[actix_web::test]
async fn every_key_expires_within_its_window() {
    let app = spawn_app(
        r#"
[redis]
key_prefix = "fgtest"

[[rule]]
name = "sliding"
paths = ["/check"]
limit = 3
window = "20s"
deny = "status"

[[rule]]
name = "fixed"
paths = ["/check"]
algorithm = "fixed_window"
limit = 4
window = "30s"
deny = "status"

[[rule]]
name = "bucket"
paths = ["/check"]
algorithm = "token_bucket"
rate = 0.2
burst = 5
deny = "status"
"#,
    )
    .await;
    // Windows far longer than the test takes on any machine, so no key can
    // expire before its TTL is read.
    // Some allowed, then denied ones (which must not lengthen anything).
    for _ in 0..6 {
        let status = app.get("/check").await.status().as_u16();
        assert!(status == 200 || status == 429, "{status}");
    }
    let longest = [
        ("fgtest:bucket:ip:127.0.0.1", 25_000), // burst / rate
        ("fgtest:fixed:ip:127.0.0.1", 30_000),
        ("fgtest:sliding:ip:127.0.0.1", 20_000),
    ];
    assert_eq!(
        app.redis.keys("*"),
        longest
            .iter()
            .map(|(k, _)| k.to_string())
            .collect::<Vec<_>>()
    );
    for (key, most) in longest {
        let ttl = app.redis.pttl(key);
        assert!(ttl > 0 && ttl <= most, "{key}: PTTL {ttl}, at most {most}");
    }
}

#[actix_web::test]
async fn long_ids_are_hashed_to_at_most_64_bytes() {
    let app = spawn_app(
        r#"
[[rule]]
name = "user"
paths = ["/check"]
key = "header:x-user"
limit = 5
window = "1m"
"#,
    )
    .await;
    let exactly_64 = "a".repeat(64);
    let long_a = "b".repeat(65);
    let long_b = format!("{}c", "b".repeat(199));
    for user in [&exactly_64, &long_a, &long_b, &long_b] {
        let res = app
            .client
            .get(app.url("/check"))
            .header("x-user", user.as_str())
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200);
    }
    let keys = app.redis.keys("floodgate:user:header:*");
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert!(keys.contains(&format!("floodgate:user:header:{exactly_64}")));
    let hashed: Vec<&String> = keys.iter().filter(|k| !k.ends_with(&exactly_64)).collect();
    for key in &hashed {
        let id = key.strip_prefix("floodgate:user:header:").unwrap();
        assert!(id.len() <= 64, "{key}");
        assert!(!id.contains("bbbbbbbbbb"), "{key}: the value is not hashed");
    }
    // The two long values share a prefix but not a key; the repeated one counted twice.
    let counts: Vec<u64> = hashed.iter().map(|k| app.redis.llen(k)).collect();
    let mut sorted = counts.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, vec![1, 2]);
}

// ---------------------------------------------------------------------------
// Fixed window and token bucket
// ---------------------------------------------------------------------------

#[actix_web::test]
async fn fixed_window_opens_at_the_first_request_and_closes_after_window() {
    let app = spawn_app(
        r#"
[[rule]]
name = "fixed"
paths = ["/check"]
algorithm = "fixed_window"
limit = 3
window = "5s"
deny = "status"
"#,
    )
    .await;
    let key = "floodgate:fixed:ip:127.0.0.1";
    for expected in [2, 1, 0] {
        let res = app.get("/check").await;
        assert_eq!(res.status(), 200);
        assert_eq!(remaining(&res, "fixed"), Some(expected));
        assert_eq!(
            header(&res, "ratelimit-policy").as_deref(),
            Some("\"fixed\";q=3;w=5")
        );
    }
    let ttl = app.redis.pttl(key);
    let res = app.get("/check").await;
    assert_eq!(res.status(), 429);
    // The window (5 s) is far longer than these requests take on any machine.
    let retry: u64 = header(&res, "retry-after").unwrap().parse().unwrap();
    assert!((1..=5).contains(&retry), "Retry-After: {retry}");
    // A denial neither counts nor reopens the window.
    assert_eq!(
        redis::cmd("HGET")
            .arg(key)
            .arg("used")
            .query::<String>(&mut app.redis.connection())
            .unwrap(),
        "3"
    );
    assert!(app.redis.pttl(key) <= ttl);
    // Sleeping is the subject here: the wait the server asked for.
    actix_web::rt::time::sleep(Duration::from_secs(retry)).await;
    let res = app.get("/check").await;
    assert_eq!(res.status(), 200);
    assert_eq!(remaining(&res, "fixed"), Some(2));
}

#[actix_web::test]
async fn token_bucket_starts_full_and_refills_at_rate() {
    let redis = RedisServer::start();
    let mut config = Config::parse("", Path::new("test.toml")).unwrap();
    config.filter.redis.url = redis.url();
    config.filter.redis.timeout = Duration::from_secs(5);
    let limiter = Limiter::new(&config.filter.redis, LimiterOptions::default()).unwrap();
    let check = |cost| {
        Check::new(
            "floodgate:bucket:ip:1.2.3.4",
            Algorithm::token_bucket(2.0, 3).unwrap(),
        )
        .with_cost(cost)
        .unwrap()
    };
    let t0 = 1_700_000_000_000_u64;
    let at = |ms: u64, cost: u32| {
        let f = limiter.decide_at(t0 + ms, vec![check(cost)]);
        async move {
            let o = f.await.unwrap().outcomes[0];
            (o.allowed, o.remaining, o.wait.as_millis() as u64)
        }
    };
    // Full: three at once; each allowed answer says when the bucket is full again.
    assert_eq!(at(0, 1).await, (true, 2, 500));
    assert_eq!(at(0, 1).await, (true, 1, 1000));
    assert_eq!(at(0, 1).await, (true, 0, 1500));
    // Empty: one token comes every 500 ms.
    assert_eq!(at(0, 1).await, (false, 0, 500));
    assert_eq!(at(250, 1).await, (false, 0, 250));
    assert_eq!(at(500, 1).await, (true, 0, 1500));
    // Two tokens after 1 s; a cost-2 request fits exactly, a second does not.
    assert_eq!(at(1500, 2).await, (true, 0, 1500));
    assert_eq!(at(1500, 2).await, (false, 0, 1000));
    // Never more than burst, however long the pause.
    assert_eq!(at(100_000, 1).await, (true, 2, 500));
    assert_eq!(at(100_000, 2).await, (true, 0, 1500));
    assert_eq!(at(100_000, 1).await, (false, 0, 500));
    let ttl = redis.pttl("floodgate:bucket:ip:1.2.3.4");
    assert!(ttl > 0 && ttl <= 1500, "PTTL {ttl}");
}

#[actix_web::test]
async fn token_bucket_over_http() {
    let app = spawn_app(
        r#"
[[rule]]
name = "bucket"
paths = ["/check"]
algorithm = "token_bucket"
rate = 0.1
burst = 3
deny = "status"
"#,
    )
    .await;
    for expected in [2, 1, 0] {
        let res = app.get("/check").await;
        assert_eq!(res.status(), 200);
        assert_eq!(remaining(&res, "bucket"), Some(expected));
        assert_eq!(
            header(&res, "ratelimit-policy").as_deref(),
            Some("\"bucket\";q=3;w=30")
        );
    }
    // One token comes back every 10 s, far longer than these requests take
    // on any machine.
    let res = app.get("/check").await;
    assert_eq!(res.status(), 429);
    assert_eq!(header(&res, "retry-after").as_deref(), Some("10"));
}

// ---------------------------------------------------------------------------
// Shadow mode
// ---------------------------------------------------------------------------

#[actix_web::test]
async fn shadow_rules_count_but_never_deny() {
    let app = spawn_app(
        r#"
[[rule]]
name = "quiet"
paths = ["/check"]
limit = 2
window = "1m"
mode = "shadow"
deny = "status"
"#,
    )
    .await;
    for _ in 0..5 {
        let res = app.get("/check").await;
        assert_eq!(res.status(), 200);
        // Only enforce rules announce themselves.
        assert_eq!(header(&res, "ratelimit"), None);
    }
    assert_eq!(app.redis.llen("floodgate:quiet:ip:127.0.0.1"), 2);
    let metrics = app.metrics().await;
    let m = |d: &str| {
        metric(
            &metrics,
            &format!("floodgate_decisions_total{{rule=\"quiet\",decision=\"{d}\"}}"),
        )
    };
    assert_eq!(m("allowed"), Some(2), "{metrics}");
    assert_eq!(m("shadow_denied"), Some(3), "{metrics}");
    assert_eq!(m("denied"), None, "{metrics}");
}
