//! The algorithms against reference models, on random schedules that mix
//! reloads (requests under changed parameters, old and new in one batch),
//! backward clock steps, and batches of one or several requests. Each model
//! is a plain in-memory statement of what the limiter promises; every
//! decision (allowed, remaining, wait) and every TTL the script sets must
//! match it, so no schedule admits more than the limit in force allows.
//!
//! The same schedules run against the local fallback (`on_redis_error =
//! "local"`, the process deciding alone) on the same pinned clock: its
//! decisions must match the same models, expiry included (a state is gone
//! when its key's TTL in Redis would have run out). TTLs themselves are
//! Redis's only.
//!
//! Redis's own expiry runs on real time, not on the pinned clock: after each
//! step the test reads the key's TTL (it must be what the model says), then
//! removes it, and expires the key itself when the pinned clock passes the
//! moment the model says Redis would.

mod common;

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

use floodgate_limiter::__private::{decide_batch, LocalLimiter};
use floodgate_limiter::limiter::Check;
use floodgate_limiter::limiter::Decision;
use floodgate_limiter::rule::Algorithm;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestCaseError, TestRunner};

use common::RedisServer;

/// A realistic pinned epoch (ms).
const T0: u64 = 1_700_000_000_000;

fn sliding(limit: u32, window_ms: u64) -> Algorithm {
    Algorithm::sliding_window(limit, Duration::from_millis(window_ms)).unwrap()
}

fn fixed(limit: u32, window_ms: u64) -> Algorithm {
    Algorithm::fixed_window(limit, Duration::from_millis(window_ms)).unwrap()
}

fn bucket(rate: f64, burst: u32) -> Algorithm {
    Algorithm::token_bucket(rate, burst).unwrap()
}

fn gcra(limit: u32, window_ms: u64) -> Algorithm {
    Algorithm::gcra(limit, Duration::from_millis(window_ms)).unwrap()
}

fn counter(limit: u32, window_ms: u64) -> Algorithm {
    Algorithm::sliding_counter(limit, Duration::from_millis(window_ms)).unwrap()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Sliding,
    Fixed,
    Bucket,
    Gcra,
    Counter,
}

/// One moment: the clock moves by `step` ms (backwards too), then the
/// requests, each under one of the schedule's rules, are decided in one
/// batch (`together`) or one call each.
#[derive(Clone, Debug)]
struct Tick {
    step: i64,
    requests: Vec<(usize, u32)>,
    together: bool,
}

#[derive(Clone, Debug)]
struct Schedule {
    /// The versions of the rule that reloads switch between.
    rules: Vec<Algorithm>,
    ticks: Vec<Tick>,
}

fn rule(kind: Kind) -> BoxedStrategy<Algorithm> {
    match kind {
        Kind::Sliding => (1u32..=6, 1u64..=5)
            .prop_map(|(l, w)| sliding(l, w * 1000))
            .boxed(),
        Kind::Fixed => (1u32..=6, 1u64..=5)
            .prop_map(|(l, w)| fixed(l, w * 1000))
            .boxed(),
        Kind::Gcra => (1u32..=6, 1u64..=5)
            .prop_map(|(l, w)| gcra(l, w * 1000))
            .boxed(),
        Kind::Counter => (1u32..=6, 1u64..=5)
            .prop_map(|(l, w)| counter(l, w * 1000))
            .boxed(),
        Kind::Bucket => (
            prop::sample::select(vec![0.25, 0.5, 1.0, 2.0, 4.0]),
            1u32..=6,
        )
            .prop_map(|(rate, burst)| bucket(rate, burst))
            .boxed(),
    }
}

fn tick() -> impl Strategy<Value = Tick> {
    (
        prop_oneof![6 => 0i64..=1500, 2 => 1500i64..=8000, 2 => -4000i64..=-1],
        prop::collection::vec((0usize..3, 1u32..=3), 1..=3),
        any::<bool>(),
    )
        .prop_map(|(step, requests, together)| Tick {
            step,
            requests,
            together,
        })
}

fn schedule() -> impl Strategy<Value = Schedule> {
    prop_oneof![
        Just(Kind::Sliding),
        Just(Kind::Fixed),
        Just(Kind::Bucket),
        Just(Kind::Gcra),
        Just(Kind::Counter)
    ]
    .prop_flat_map(|kind| {
        (
            prop::collection::vec(rule(kind), 1..=3),
            prop::collection::vec(tick(), 1..=40),
        )
            .prop_map(|(rules, ticks)| Schedule { rules, ticks })
    })
}

// ---------------------------------------------------------------------------
// The models
// ---------------------------------------------------------------------------

/// What one decision answers: allowed, remaining, wait (ms).
type Answer = (bool, u64, u64);

/// The state one key holds, as each algorithm defines it.
#[derive(Debug, Default)]
struct Model {
    /// Sliding window: admission times (one per unit), newest first.
    log: Vec<i64>,
    /// Fixed window: start, used, the window it was last decided under.
    window: Option<(i64, i64, i64)>,
    /// Token bucket: tokens at ts, ts, and the rate and burst it refills under.
    bucket: Option<(f64, i64, f64, f64)>,
    /// GCRA: the theoretical arrival time, exactly, as (numerator,
    /// denominator) ms.
    tat: Option<(i128, i128)>,
    /// Sliding counter: the current window's start, its count, the
    /// previous window's count, the window length.
    counter: Option<(i64, i64, i64, i64)>,
    /// When Redis would drop the key (absolute ms on the pinned clock).
    expire_at: Option<i64>,
    /// Whether the current step set the key's TTL.
    ttl_set: bool,
}

fn gcd(a: i128, b: i128) -> i128 {
    if b == 0 {
        a.abs().max(1)
    } else {
        gcd(b, a % b)
    }
}

fn ceil_ms(ms: f64) -> i64 {
    (ms.ceil() as i64).max(1)
}

impl Model {
    fn exists(&self) -> bool {
        !self.log.is_empty()
            || self.window.is_some()
            || self.bucket.is_some()
            || self.tat.is_some()
            || self.counter.is_some()
    }

    fn set_ttl(&mut self, now: i64, ms: f64) {
        self.expire_at = Some(now + ceil_ms(ms));
        self.ttl_set = true;
    }

    fn decide(&mut self, now: i64, algorithm: Algorithm, cost: u32) -> Answer {
        match algorithm {
            Algorithm::SlidingWindow { limit, window, .. } => {
                self.sliding(now, i64::from(limit.get()), window.as_millis() as i64, cost)
            }
            Algorithm::FixedWindow { limit, window, .. } => {
                self.fixed(now, i64::from(limit.get()), window.as_millis() as i64, cost)
            }
            Algorithm::TokenBucket { rate, burst, .. } => {
                self.bucket(now, rate, f64::from(burst.get()), cost)
            }
            Algorithm::Gcra { limit, window, .. } => self.gcra(
                now,
                i128::from(limit.get()),
                window.as_millis() as i128,
                cost,
            ),
            Algorithm::SlidingCounter { limit, window, .. } => {
                self.counter(now, i64::from(limit.get()), window.as_millis() as i64, cost)
            }
        }
    }

    /// GCRA, exactly: with T = W / L and tau = (L - 1) T, admitted when
    /// TAT + (c - 1) T - tau <= now, then TAT = max(TAT, now) + c T.
    fn gcra(&mut self, now: i64, l: i128, w: i128, cost: u32) -> Answer {
        let c = i128::from(cost);
        let now = i128::from(now);
        // TAT - now, in ms * L * den: everything times L and den stays whole.
        let (num, den) = self.tat.unwrap_or((now, 1));
        let (num, den) = if num < now * den {
            (now * den, den)
        } else {
            (num, den)
        };
        let ahead = num - now * den; // (TAT - now) * den
        let ceil = |a: i128, b: i128| (a + b - 1).div_euclid(b);
        let floor = |a: i128, b: i128| a.div_euclid(b);
        // Allowed: (TAT - now) * L <= (L - c) * W.
        if ahead * l <= (l - c) * w * den {
            // TAT' = TAT + c W / L, over den * L.
            let (n2, d2) = (num * l + c * w * den, den * l);
            let ahead2 = n2 - now * d2;
            let g = gcd(n2, d2);
            self.tat = Some((n2 / g, d2 / g));
            let ttl = ceil(ahead2, d2);
            self.expire_at = Some(now as i64 + ttl.max(1) as i64);
            self.ttl_set = true;
            let remaining = floor(l * d2 * w - ahead2 * l, d2 * w).max(0);
            return (true, remaining as u64, ttl.max(0) as u64);
        }
        let remaining = floor(l * den * w - ahead * l, den * w).max(0);
        // Wait: TAT - now - (L - c) W / L.
        let wait = ceil(ahead * l - (l - c) * w * den, den * l);
        (false, remaining as u64, wait.max(0) as u64)
    }

    /// The sliding counter: windows aligned to the epoch; the previous
    /// window's count weighted by its part still inside the sliding
    /// window, plus the current count, stays within the limit.
    fn counter(&mut self, now: i64, l: i64, w: i64, cost: u32) -> Answer {
        let c = i64::from(cost);
        let mut now_eff = now;
        let mut stored = None;
        if let Some((ws, cur, prev, win)) = self.counter {
            now_eff = now.max(ws);
            if win == w {
                stored = Some((ws, cur, prev));
            } else {
                // A changed window keeps what was used: the old windows'
                // estimate, rounded up, is the new window's count.
                let ows = now_eff - now_eff.rem_euclid(win);
                let (oc, op) = if ows == ws {
                    (cur, prev)
                } else if ows == ws + win {
                    (0, cur)
                } else {
                    (0, 0)
                };
                let scaled = op * (win - (now_eff - ows)) + oc * win;
                let used = (scaled + win - 1).div_euclid(win);
                stored = Some((now_eff - now_eff.rem_euclid(w), used, 0));
            }
        }
        let ws = now_eff - now_eff.rem_euclid(w);
        let (cur, prev) = match stored {
            Some((at, cur, prev)) if at == ws => (cur, prev),
            Some((at, cur, _)) if ws == at + w => (0, cur),
            _ => (0, 0),
        };
        let e = now_eff - ws;
        let weighted = prev * (w - e);
        if cur + c <= l && weighted <= (l - c - cur) * w {
            self.counter = Some((ws, cur + c, prev, w));
            self.set_ttl(now, (ws + 2 * w - now) as f64);
            let remaining = ((l - cur - c) * w - weighted).div_euclid(w).max(0);
            return (true, remaining as u64, (ws + 2 * w - now) as u64);
        }
        let remaining = ((l - cur) * w - weighted).div_euclid(w).max(0);
        // The first moment the same request fits, with no other traffic.
        let mut at = ws + w;
        for t in now_eff + 1..=ws + 3 * w {
            let wt = t - t.rem_euclid(w);
            let (cu, pr) = if wt == ws {
                (cur, prev)
            } else if wt == ws + w {
                (0, cur)
            } else {
                (0, 0)
            };
            if cu + c <= l && pr * (w - (t - wt)) <= (l - c - cu) * w {
                at = t;
                break;
            }
        }
        (false, remaining as u64, (at - now) as u64)
    }

    /// At most `limit` units in any window on the state's clock, which never
    /// runs earlier than its newest entry; entries out of the window are
    /// forgotten when an admission moves the state's clock past them.
    fn sliding(&mut self, now: i64, limit: i64, window: i64, cost: u32) -> Answer {
        let cost = i64::from(cost);
        let now_eff = self.log.first().map_or(now, |&newest| now.max(newest));
        let live: Vec<i64> = self
            .log
            .iter()
            .copied()
            .filter(|&t| t > now_eff - window)
            .collect();
        let used = live.len() as i64;
        if let (Some(&newest), true) = (self.log.first(), used > 0) {
            self.set_ttl(now, (newest + window - now) as f64);
        }
        if used + cost <= limit {
            let oldest = live.last().copied().unwrap_or(now_eff);
            self.log = live;
            for _ in 0..cost {
                self.log.insert(0, now_eff);
            }
            self.set_ttl(now, (now_eff + window - now) as f64);
            return (
                true,
                (limit - used - cost) as u64,
                (oldest + window - now) as u64,
            );
        }
        let freeing = live[(limit - cost) as usize];
        (
            false,
            (limit - used).max(0) as u64,
            (freeing + window - now) as u64,
        )
    }

    /// A window opens at the first admission and lasts the window in force
    /// when it is decided; a window is closed once it closed under the
    /// window it was last decided under, or under the one in force.
    fn fixed(&mut self, now: i64, limit: i64, window: i64, cost: u32) -> Answer {
        let cost = i64::from(cost);
        let mut open = None;
        if let Some((start, used, was)) = self.window {
            let now_eff = now.max(start);
            if now_eff < start + was && now_eff < start + window {
                if was != window {
                    self.window = Some((start, used, window));
                    self.set_ttl(now, (start + window - now) as f64);
                }
                open = Some((start, used));
            }
        }
        let (start, used) = open.unwrap_or((now, 0));
        let closes = start + window;
        if used + cost <= limit {
            self.window = Some((start, used + cost, window));
            self.set_ttl(now, (closes - now) as f64);
            return (true, (limit - used - cost) as u64, (closes - now) as u64);
        }
        (false, (limit - used).max(0) as u64, (closes - now) as u64)
    }

    /// Tokens refill under the parameters the bucket was last decided
    /// under until it is decided again; a bucket full then is full.
    fn bucket(&mut self, now: i64, rate: f64, burst: f64, cost: u32) -> Answer {
        let cost = f64::from(cost);
        let (mut tokens, mut now_eff) = (burst, now);
        if let Some((left, ts, was_rate, was_burst)) = self.bucket {
            now_eff = now.max(ts);
            let t = left + (now_eff - ts) as f64 * was_rate / 1000.0;
            if t < was_burst {
                tokens = t;
                if was_rate != rate || was_burst != burst {
                    // What was used still counts.
                    tokens = burst - (was_burst - t);
                    self.bucket = Some((tokens, now_eff, rate, burst));
                    self.set_ttl(
                        now,
                        now_eff as f64 + (burst - tokens) * 1000.0 / rate - now as f64,
                    );
                }
            }
        }
        let secs = |x: f64| x.ceil().max(0.0) as u64;
        if tokens + 1e-9 >= cost {
            let left = (tokens - cost).max(0.0);
            let wait = now_eff as f64 + (burst - left) * 1000.0 / rate - now as f64;
            self.bucket = Some((left, now_eff, rate, burst));
            self.set_ttl(now, wait);
            return (true, (left + 1e-9).floor() as u64, secs(wait));
        }
        let wait = now_eff as f64 + (cost - tokens) * 1000.0 / rate - now as f64;
        (false, (tokens + 1e-9).floor().max(0.0) as u64, secs(wait))
    }
}

// ---------------------------------------------------------------------------
// The test
// ---------------------------------------------------------------------------

fn answer(decision: &Decision) -> Answer {
    let o = decision.outcomes[0];
    (o.allowed, o.remaining, o.wait.as_millis() as u64)
}

fn quota(algorithm: &Algorithm) -> u32 {
    algorithm.quota()
}

/// What decides the schedule's requests.
enum Backend<'a> {
    /// The scripts on a real Redis (the key's TTL is checked too).
    Redis(&'a mut redis::Connection),
    /// The local fallback, on the same pinned clock.
    Local(LocalLimiter),
}

fn run(backend: &mut Backend, schedule: &Schedule, case: u64) -> Result<(), TestCaseError> {
    let key = format!("floodgate:model:ip:{case}");
    let mut model = Model::default();
    let mut now = T0 as i64;
    // A sliding window without reloads must also obey the plain definition
    // on every admission since the key last expired (a log that is never
    // trimmed): the units admitted in the window ending at the state's
    // clock, plus this request, fit the limit exactly when it is allowed.
    let single = schedule.rules.len() == 1;
    let mut admitted: Vec<i64> = Vec::new();
    for (i, tick) in schedule.ticks.iter().enumerate() {
        now += tick.step;
        if model.expire_at.is_some_and(|at| now > at) {
            if let Backend::Redis(conn) = backend {
                redis::cmd("DEL").arg(&key).query::<()>(*conn).unwrap();
            }
            // (The local fallback forgets it by itself.)
            model = Model::default();
            // What Redis dropped is gone for the definition too.
            admitted.clear();
        }
        model.ttl_set = false;
        let requests: Vec<(Algorithm, u32)> = tick
            .requests
            .iter()
            .map(|&(r, cost)| {
                let algorithm = schedule.rules[r % schedule.rules.len()];
                (algorithm, cost.min(quota(&algorithm)))
            })
            .collect();
        let jobs: Vec<(Option<u64>, Vec<Check>)> = requests
            .iter()
            .map(|&(algorithm, cost)| {
                (
                    Some(now as u64),
                    vec![Check::new(key.clone(), algorithm).with_cost(cost).unwrap()],
                )
            })
            .collect();
        let sent = Instant::now();
        let results: Vec<Decision> = match backend {
            Backend::Redis(conn) if tick.together => decide_batch(conn, jobs)
                .unwrap()
                .into_iter()
                .map(Result::unwrap)
                .collect(),
            Backend::Redis(conn) => jobs
                .into_iter()
                .flat_map(|job| decide_batch(conn, vec![job]).unwrap())
                .map(Result::unwrap)
                .collect(),
            Backend::Local(local) => jobs
                .into_iter()
                .map(|(at, checks)| local.decide_at(at.unwrap(), &checks))
                .collect(),
        };
        let ttl: Option<i64> = match backend {
            Backend::Redis(conn) => Some(redis::cmd("PTTL").arg(&key).query(*conn).unwrap()),
            Backend::Local(_) => None,
        };
        let elapsed = sent.elapsed().as_millis() as i64 + 1;
        for (j, (&(algorithm, cost), result)) in requests.iter().zip(&results).enumerate() {
            let got = answer(result);
            if single {
                if let Algorithm::SlidingWindow { limit, window, .. } = algorithm {
                    let window = window.as_millis() as i64;
                    let clock = admitted.first().map_or(now, |&n| now.max(n));
                    let held = admitted.iter().filter(|&&t| t > clock - window).count();
                    let fits = held + cost as usize <= limit.get() as usize;
                    prop_assert_eq!(got.0, fits, "tick {} request {}: {} held", i, j, held);
                    if got.0 {
                        for _ in 0..cost {
                            admitted.insert(0, clock);
                        }
                    }
                }
            }
            let expected = model.decide(now, algorithm, cost);
            prop_assert_eq!(
                got,
                expected,
                "tick {} request {} at {} under {:?} cost {}; model {:?}",
                i,
                j,
                now - T0 as i64,
                algorithm,
                cost,
                model
            );
        }
        let (Some(ttl), Backend::Redis(conn)) = (ttl, &mut *backend) else {
            continue;
        };
        if model.ttl_set {
            let want = model.expire_at.unwrap() - now;
            prop_assert!(
                ttl <= want && ttl >= want - elapsed,
                "tick {}: PTTL {} where the model says {}",
                i,
                ttl,
                want
            );
        } else if model.exists() {
            prop_assert_eq!(
                ttl,
                -1,
                "tick {}: a decision that wrote nothing set a TTL",
                i
            );
        } else {
            prop_assert_eq!(ttl, -2, "tick {}: the key should not exist", i);
        }
        redis::cmd("PERSIST").arg(&key).query::<()>(*conn).unwrap();
    }
    Ok(())
}

/// The failure seeds, beside this file.
fn persistence() -> Option<Box<dyn proptest::test_runner::FailurePersistence>> {
    Some(Box::new(FileFailurePersistence::Direct(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/proptest-regressions/model.txt"
    ))))
}

#[test]
fn random_reloads_and_clock_steps_match_the_reference_models() {
    let redis = RedisServer::start();
    let conn = RefCell::new(redis.connection());
    let cases = Cell::new(0);
    let mut config = Config::with_cases(200);
    config.failure_persistence = persistence();
    let mut runner = TestRunner::new(config);
    let result = runner.run(&schedule(), |schedule| {
        cases.set(cases.get() + 1);
        let mut conn = conn.borrow_mut();
        run(&mut Backend::Redis(&mut conn), &schedule, cases.get())?;
        // The same schedule, decided by the process alone.
        run(
            &mut Backend::Local(LocalLimiter::default()),
            &schedule,
            cases.get(),
        )
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn the_local_fallback_matches_the_reference_models_on_its_own() {
    // More schedules than Redis can run in the time: no server is asked.
    let mut config = Config::with_cases(2000);
    config.failure_persistence = persistence();
    let mut runner = TestRunner::new(config);
    let result = runner.run(&schedule(), |schedule| {
        run(&mut Backend::Local(LocalLimiter::default()), &schedule, 0)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A busy call carries many requests on the same key, each at its own
/// moment: the script then keeps what it read of the key and its writes
/// for the call's end. The same steps decided one call each (the path the
/// models above check) and many to a call, on two keys interleaved, must
/// answer the same and leave the same lists.
#[test]
fn a_sliding_window_decided_in_one_call_answers_as_one_call_each() {
    let redis = RedisServer::start();
    let conn = RefCell::new(redis.connection());
    let steps = prop::collection::vec(
        (
            prop_oneof![
                // (The same moment again: a busy key's requests in one
                // call, which the script decides from what it just wrote.)
                3 => Just(0i64),
                6 => 0i64..=30,
                3 => 30i64..=600,
                1 => 600i64..=6000,
                1 => -900i64..=-1
            ],
            1u32..=3,
            0usize..2,
        ),
        1..=80,
    );
    let mut config = Config::with_cases(150);
    config.failure_persistence = persistence();
    let mut runner = TestRunner::new(config);
    let case = Cell::new(0u64);
    let result = runner.run(
        &(1u32..=60, 1u64..=3000, steps, 2usize..=40),
        |(limit, window, steps, chunk)| {
            case.set(case.get() + 1);
            let mut conn = conn.borrow_mut();
            let conn = &mut *conn;
            let algorithm = sliding(limit, window);
            let keys = |mode: &str| -> [String; 2] {
                [0, 1].map(|k| format!("floodgate:batched:{mode}:{}:{k}", case.get()))
            };
            let (one_each, together) = (keys("one"), keys("all"));
            let jobs = |keys: &[String; 2]| -> Vec<(Option<u64>, Vec<Check>)> {
                let mut now = T0 as i64;
                steps
                    .iter()
                    .map(|&(step, cost, k)| {
                        now += step;
                        let check = Check::new(keys[k].clone(), algorithm)
                            .with_cost(cost.min(limit))
                            .unwrap();
                        (Some(now as u64), vec![check])
                    })
                    .collect()
            };
            let mut answers = Vec::new();
            for job in jobs(&one_each) {
                let key = job.1[0].key().to_string();
                let decided = decide_batch(conn, vec![job]).unwrap();
                answers.push(answer(decided[0].as_ref().unwrap()));
                // Real time must not expire what the pinned clock still counts.
                redis::cmd("PERSIST").arg(&key).query::<()>(conn).unwrap();
            }
            let mut batched: Vec<Answer> = Vec::new();
            for call in jobs(&together).chunks(chunk) {
                let decided = decide_batch(conn, call.to_vec()).unwrap();
                batched.extend(decided.iter().map(|d| answer(d.as_ref().unwrap())));
                for key in &together {
                    redis::cmd("PERSIST").arg(key).query::<()>(conn).unwrap();
                }
            }
            prop_assert_eq!(
                &batched,
                &answers,
                "limit {} window {} ms, {} to a call",
                limit,
                window,
                chunk
            );
            // The same units at the same times (one call merges the
            // requests it admits at one moment into one entry; entries are
            // `TIME:TOTAL:UNITS`).
            for (a, b) in together.iter().zip(&one_each) {
                let mut list = |key: &str| -> Vec<u64> {
                    let entries: Vec<String> = redis::cmd("LRANGE")
                        .arg(key)
                        .arg(0)
                        .arg(-1)
                        .query(conn)
                        .unwrap();
                    entries
                        .iter()
                        .flat_map(|e| {
                            let p: Vec<u64> = e.split(':').map(|x| x.parse().unwrap()).collect();
                            std::iter::repeat_n(p[0], p[2] as usize)
                        })
                        .collect()
                };
                let (a, b) = (list(a), list(b));
                prop_assert_eq!(a, b);
            }
            Ok(())
        },
    );
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// Requests of two rules each (the second a shadow rule, in some cases),
/// decided in calls of many, answer check by check as they do one call
/// each: all or nothing, the same moment again included (a busy
/// identity's requests in one call, which the script decides from what it
/// just wrote), up to and past both limits.
#[test]
fn requests_of_two_rules_decided_in_one_call_answer_as_one_call_each() {
    let redis = RedisServer::start();
    let conn = RefCell::new(redis.connection());
    let steps = prop::collection::vec(
        (
            prop_oneof![4 => Just(0i64), 3 => 0i64..=40, 2 => 40i64..=900, 1 => -300i64..=-1],
            1u32..=2,
        ),
        1..=60,
    );
    let mut config = Config::with_cases(100);
    config.failure_persistence = persistence();
    let mut runner = TestRunner::new(config);
    let case = Cell::new(0u64);
    let result = runner.run(
        &(
            1u32..=12,
            1u32..=12,
            200u64..=2000,
            any::<bool>(),
            steps,
            2usize..=30,
        ),
        |(first, second, window, shadow, steps, chunk)| {
            case.set(case.get() + 1);
            let mut conn = conn.borrow_mut();
            let conn = &mut *conn;
            let rules = [sliding(first, window), sliding(second, window * 2)];
            let keys = |mode: &str| -> [String; 2] {
                [0, 1].map(|k| format!("floodgate:two:{mode}:{}:{k}", case.get()))
            };
            let (one_each, together) = (keys("one"), keys("all"));
            let jobs = |keys: &[String; 2]| -> Vec<(Option<u64>, Vec<Check>)> {
                let mut now = T0 as i64;
                steps
                    .iter()
                    .map(|&(step, cost)| {
                        now += step;
                        let checks = (0..2)
                            .map(|r| {
                                Check::new(keys[r].clone(), rules[r])
                                    .with_cost(cost.min(first).min(second))
                                    .unwrap()
                                    .with_enforce(r == 0 || !shadow)
                            })
                            .collect();
                        (Some(now as u64), checks)
                    })
                    .collect()
            };
            let answers = |d: &Decision| -> (bool, Vec<Answer>) {
                let each = d
                    .outcomes
                    .iter()
                    .map(|o| (o.allowed, o.remaining, o.wait.as_millis() as u64))
                    .collect();
                (d.allowed, each)
            };
            let persist = |conn: &mut redis::Connection, keys: &[String; 2]| {
                for key in keys {
                    redis::cmd("PERSIST").arg(key).query::<()>(conn).unwrap();
                }
            };
            let mut alone = Vec::new();
            for job in jobs(&one_each) {
                let decided = decide_batch(conn, vec![job]).unwrap();
                alone.push(answers(decided[0].as_ref().unwrap()));
                persist(conn, &one_each);
            }
            let mut batched = Vec::new();
            for call in jobs(&together).chunks(chunk) {
                let decided = decide_batch(conn, call.to_vec()).unwrap();
                batched.extend(decided.iter().map(|d| answers(d.as_ref().unwrap())));
                persist(conn, &together);
            }
            prop_assert_eq!(
                &batched,
                &alone,
                "limits {} and {}, window {} ms, shadow {}, {} to a call",
                first,
                second,
                window,
                shadow,
                chunk
            );
            Ok(())
        },
    );
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A sliding window finds where its live entries start however many have
/// left since it was last decided: a few (the entries read with the list's
/// length), a busy key's worth (the reads from its tail), or most of a long
/// list (the search inside it). Every answer is exact: what remains, when
/// the window next frees, and for a request too large, what it must wait.
#[test]
fn a_sliding_window_counts_exactly_however_many_entries_left() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    const LIMIT: u32 = 1000;
    const STEP: u64 = 10;
    let window = u64::from(LIMIT) * STEP;
    let algorithm = sliding(LIMIT, window);
    for gone in [1u32, 2, 3, 7, 20, 60, 120, 200, 500, 999] {
        let check = |cost: u32| {
            Check::new(format!("floodgate:gone:ip:{gone}"), algorithm)
                .with_cost(cost)
                .unwrap()
        };
        // Entry i admitted at T0 + i * STEP: the list is full.
        let fill: Vec<_> = (0..u64::from(LIMIT))
            .map(|i| (Some(T0 + i * STEP), vec![check(1)]))
            .collect();
        for call in fill.chunks(250) {
            let decided = decide_batch(&mut conn, call.to_vec()).unwrap();
            assert!(decided.iter().all(|d| d.as_ref().unwrap().allowed));
        }
        // Real time must not expire what the pinned clock still counts.
        redis::cmd("PERSIST")
            .arg(format!("floodgate:gone:ip:{gone}"))
            .query::<()>(&mut conn)
            .unwrap();
        // `gone` entries (0 .. gone - 1) have left; the oldest live one
        // leaves STEP ms later.
        let now = T0 + u64::from(gone - 1) * STEP + window;
        let decided = decide_batch(
            &mut conn,
            vec![
                (Some(now), vec![check(gone + 1)]),
                (Some(now), vec![check(1)]),
            ],
        )
        .unwrap();
        let too_large = answer(decided[0].as_ref().unwrap());
        let fits = answer(decided[1].as_ref().unwrap());
        assert_eq!(too_large, (false, u64::from(gone), STEP), "{gone} gone");
        assert_eq!(fits, (true, u64::from(gone - 1), STEP), "{gone} gone");
    }
}

/// A call writes each distinct check spec once and checks name theirs by
/// number; past the first 16 a spec may be written again. However many
/// different costs one call carries, each request is charged its own.
#[test]
fn a_call_of_many_different_checks_charges_each_its_own_cost() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let algorithm = sliding(1000, 60_000);
    let key = |k: usize| format!("floodgate:specs:ip:{k}");
    // 40 requests on two keys, costs 1 to 20 twice over.
    let jobs: Vec<_> = (0..40usize)
        .map(|i| {
            let check = Check::new(key(i % 2), algorithm)
                .with_cost((i % 20) as u32 + 1)
                .unwrap();
            (Some(T0), vec![check])
        })
        .collect();
    let decided = decide_batch(&mut conn, jobs.clone()).unwrap();
    let mut used = [0u64; 2];
    for (i, (job, decision)) in jobs.iter().zip(&decided).enumerate() {
        used[i % 2] += u64::from(job.1[0].cost());
        let (allowed, remaining, _) = answer(decision.as_ref().unwrap());
        assert!(allowed, "request {i}");
        assert_eq!(remaining, 1000 - used[i % 2], "request {i}");
    }
    // The newest entry's running total is every unit charged (entries
    // are `TIME:TOTAL:UNITS`).
    for (k, used) in used.iter().enumerate() {
        let len: u64 = redis::cmd("LLEN").arg(key(k)).query(&mut conn).unwrap();
        // One call at one moment: one entry carries every unit.
        assert_eq!(len, 1);
        let newest: String = redis::cmd("LINDEX")
            .arg(key(k))
            .arg(0)
            .query(&mut conn)
            .unwrap();
        assert_eq!(newest.split(':').nth(1), Some(used.to_string().as_str()));
    }
}
