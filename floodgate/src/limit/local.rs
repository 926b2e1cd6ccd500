//! The local limiter: while Redis cannot decide, a rule with
//! `on_redis_error = "local"` is enforced by this process alone, with the
//! same algorithms, limits and answers as the Lua scripts, on the process's
//! own monotonic clock.
//!
//! Its counts are this process's only: several processes each admit up to
//! the limit, and what was counted in Redis before the outage is not seen.
//! The state stays after Redis returns (a later outage starts from it) until
//! it expires, is pushed out, or the rules change.
//!
//! Memory is bounded by an estimate of the bytes held, [`MAX_BYTES`]
//! (16 MiB): [`SLOT_BYTES`] per key (the map's entry, the key's own
//! allocation, its place in the eviction queue) plus the key's length,
//! plus 8 bytes per allocated place of a sliding-window log and its
//! allocation's header. When a
//! decision takes it over the bound, states are pushed out one at a time,
//! oldest first, CLOCK style: a state that was used (allowed or denied)
//! since its turn last came gets a second chance at the back of the queue,
//! an expired or unused one goes. The work is bounded per decision (a few
//! second chances, then the oldest goes whatever its bit), never a sweep
//! of the whole table: a flood of new keys pushes out the keys nobody
//! asks for again, while a key under attack, asked for again and again,
//! keeps its count. One lock for everything: a decision over several rules
//! is all-or-nothing, exactly as in Redis.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Algorithm, Check, Decision, Outcome};

/// Most bytes held at once, by the estimate [`LocalLimiter::bytes`] keeps.
pub(crate) const MAX_BYTES: usize = 16 << 20;

/// What one key costs besides its name and its log, in the estimate: the
/// map's entry and its share of empty buckets (a table is at most 7/8 full
/// and grows by doubling), the key's allocation and its allocator header,
/// and its place in the eviction queue. Set from a measurement of the
/// process's resident memory (64-bit Linux, glibc), not from the sizes of
/// the types alone, which come to about half of it.
pub(crate) const SLOT_BYTES: usize = 320;

/// Second chances given per decision before the oldest state goes anyway.
const SECOND_CHANCES: usize = 32;

#[derive(Debug)]
enum State {
    /// Admission times in ms, oldest first, one per unit.
    Sliding(VecDeque<u64>),
    Fixed {
        start: u64,
        used: u64,
    },
    Bucket {
        tokens: f64,
        at: u64,
    },
}

#[derive(Debug)]
struct Slot {
    state: State,
    /// When the state holds nothing any more (ms).
    expires: u64,
    /// Used since its turn in the eviction queue last came.
    used: bool,
}

impl Slot {
    /// The estimate of what this state holds, with its key of `key_len`.
    fn bytes(&self, key_len: usize) -> usize {
        SLOT_BYTES
            + key_len
            + match &self.state {
                // The allocation, and its allocator header.
                State::Sliding(log) if log.capacity() > 0 => {
                    log.capacity() * std::mem::size_of::<u64>() + 16
                }
                _ => 0,
            }
    }
}

#[derive(Debug, Default)]
struct Inner {
    slots: HashMap<Arc<str>, Slot>,
    /// Every key of `slots`, once, in the order of its turn to be pushed out.
    queue: VecDeque<Arc<str>>,
    bytes: usize,
}

/// Rules enforced in memory while Redis is away.
#[derive(Debug)]
pub struct LocalLimiter {
    inner: Mutex<Inner>,
    epoch: Instant,
    max_bytes: usize,
}

impl Default for LocalLimiter {
    fn default() -> Self {
        LocalLimiter::with_max_bytes(MAX_BYTES)
    }
}

/// What a check's algorithm sees: its peek, before anything is recorded.
struct Peek {
    allowed: bool,
    remaining: u64,
    wait_ms: f64,
}

impl LocalLimiter {
    /// A limiter holding at most about `max_bytes` (by its estimate).
    pub fn with_max_bytes(max_bytes: usize) -> LocalLimiter {
        LocalLimiter {
            inner: Mutex::new(Inner::default()),
            epoch: Instant::now(),
            max_bytes: max_bytes.max(SLOT_BYTES),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Decides `checks` together: recorded all, when every enforce check
    /// allows, or none.
    pub fn decide(&self, checks: &[Check]) -> Decision {
        self.decide_stamped(checks).0
    }

    /// As [`LocalLimiter::decide`], with the moment of the decision on the
    /// limiter's clock, for [`LocalLimiter::give_back`].
    pub fn decide_stamped(&self, checks: &[Check]) -> (Decision, u64) {
        let now = self.now_ms();
        let mut inner = self.lock();
        let peeks: Vec<Peek> = checks
            .iter()
            .map(|c| {
                let slot = inner.slots.get_mut(c.key.as_str()).map(|s| {
                    // Asked for again, allowed or not: keep it.
                    s.used = true;
                    &*s
                });
                peek(slot, c, now)
            })
            .collect();
        let allowed = checks
            .iter()
            .zip(&peeks)
            .all(|(c, p)| p.allowed || !c.enforce);
        if allowed {
            for (c, p) in checks.iter().zip(&peeks) {
                if p.allowed {
                    self.commit(&mut inner, c, now);
                }
            }
        }
        let outcomes = peeks
            .iter()
            .map(|p| Outcome {
                allowed: p.allowed,
                remaining: p.remaining,
                wait: Duration::from_millis(p.wait_ms.max(0.0).ceil() as u64),
                banned: false,
                ban_started: false,
                quota: None,
            })
            .collect();
        (Decision { outcomes, allowed }, now)
    }

    /// Gives back `check.cost` units admitted at `at` (from
    /// [`LocalLimiter::decide_stamped`]): a `count = "failures"` request
    /// that succeeded. Units that already left (their window closed, the
    /// state was pushed out) are not given back.
    pub fn give_back(&self, check: &Check, at: u64) {
        let mut inner = self.lock();
        let Some(slot) = inner.slots.get_mut(check.key.as_str()) else {
            return;
        };
        match (&mut slot.state, check.algorithm) {
            (State::Sliding(log), Algorithm::SlidingWindow { .. }) => {
                // The request's own entries, pushed at its decision's time
                // (the log keeps its allocation: the estimate stays).
                for _ in 0..check.cost {
                    match log.iter().rposition(|&t| t == at) {
                        Some(i) => {
                            log.remove(i);
                        }
                        None => break,
                    }
                }
            }
            (State::Fixed { start, used }, Algorithm::FixedWindow { .. }) if *start <= at => {
                *used = used.saturating_sub(u64::from(check.cost));
            }
            (State::Bucket { tokens, .. }, Algorithm::TokenBucket { burst, .. }) => {
                *tokens = (*tokens + f64::from(check.cost)).min(f64::from(burst.get()));
            }
            _ => {}
        }
    }

    fn commit(&self, inner: &mut Inner, c: &Check, now: u64) {
        let cost = u64::from(c.cost);
        let key_len = c.key.len();
        let before = match inner.slots.get(c.key.as_str()) {
            Some(slot) => slot.bytes(key_len),
            None => {
                if inner.slots.capacity() == 0 {
                    // Room for all the keys the bound holds, at once: the
                    // table never grows (and rehashes) during an outage.
                    let keys = self.max_bytes / SLOT_BYTES;
                    inner.slots.reserve(keys);
                    inner.queue.reserve(keys);
                }
                let key: Arc<str> = Arc::from(c.key.as_str());
                inner.queue.push_back(Arc::clone(&key));
                let slot = Slot {
                    state: fresh(c.algorithm, now),
                    expires: now,
                    used: true,
                };
                inner.slots.insert(key, slot);
                0
            }
        };
        let Some(slot) = inner.slots.get_mut(c.key.as_str()) else {
            return;
        };
        slot.used = true;
        if !same_kind(&slot.state, c.algorithm) {
            slot.state = fresh(c.algorithm, now);
        }
        match (&mut slot.state, c.algorithm) {
            (State::Sliding(log), Algorithm::SlidingWindow { window, .. }) => {
                let window = window.as_millis() as u64;
                while log.front().is_some_and(|&t| t + window <= now) {
                    log.pop_front();
                }
                let t = log.back().map_or(now, |&b| b.max(now));
                log.extend(std::iter::repeat_n(t, c.cost as usize));
                // A log that emptied out gives its room back.
                if log.capacity() > 64 && log.len() < log.capacity() / 4 {
                    log.shrink_to(log.len() * 2);
                }
                slot.expires = t + window;
            }
            (State::Fixed { start, used }, Algorithm::FixedWindow { window, .. }) => {
                let window = window.as_millis() as u64;
                if now >= *start + window {
                    *start = now;
                    *used = 0;
                }
                *used += cost;
                slot.expires = *start + window;
            }
            (State::Bucket { tokens, at }, Algorithm::TokenBucket { rate, burst }) => {
                let t = refill(*tokens, *at, now, rate, burst);
                *tokens = (t - f64::from(c.cost)).max(0.0);
                *at = now.max(*at);
                slot.expires = *at + ((f64::from(burst.get()) - *tokens) * 1000.0 / rate) as u64;
            }
            _ => {}
        }
        let after = slot.bytes(key_len);
        inner.bytes = (inner.bytes + after).saturating_sub(before);
        if inner.bytes > self.max_bytes {
            self.evict(inner, now, &c.key);
        }
    }

    /// Pushes states out, oldest first, until the estimate fits again
    /// (never `keep`, the state just written). A live state used since its
    /// turn last came goes to the back instead, at most [`SECOND_CHANCES`]
    /// times per call: the work per decision stays bounded.
    fn evict(&self, inner: &mut Inner, now: u64, keep: &str) {
        let mut chances = 0;
        while inner.bytes > self.max_bytes && inner.slots.len() > 1 {
            let Some(key) = inner.queue.pop_front() else {
                break;
            };
            let Some(slot) = inner.slots.get_mut(&*key) else {
                continue;
            };
            if &*key == keep {
                inner.queue.push_back(key);
                continue;
            }
            if slot.used && slot.expires > now && chances < SECOND_CHANCES {
                slot.used = false;
                chances += 1;
                inner.queue.push_back(key);
                continue;
            }
            if let Some(slot) = inner.slots.remove(&*key) {
                inner.bytes = inner.bytes.saturating_sub(slot.bytes(key.len()));
            }
        }
    }

    /// Forgets everything (the rules changed).
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.slots.clear();
        inner.queue.clear();
        inner.bytes = 0;
    }

    /// The estimate of the bytes held now.
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    /// The bound on [`LocalLimiter::bytes`].
    pub fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// Keys held now.
    pub fn len(&self) -> usize {
        self.lock().slots.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn fresh(algorithm: Algorithm, now: u64) -> State {
    match algorithm {
        Algorithm::SlidingWindow { .. } => State::Sliding(VecDeque::new()),
        Algorithm::FixedWindow { .. } => State::Fixed {
            start: now,
            used: 0,
        },
        Algorithm::TokenBucket { burst, .. } => State::Bucket {
            tokens: f64::from(burst.get()),
            at: now,
        },
    }
}

fn same_kind(state: &State, algorithm: Algorithm) -> bool {
    matches!(
        (state, algorithm),
        (State::Sliding(_), Algorithm::SlidingWindow { .. })
            | (State::Fixed { .. }, Algorithm::FixedWindow { .. })
            | (State::Bucket { .. }, Algorithm::TokenBucket { .. })
    )
}

fn refill(tokens: f64, at: u64, now: u64, rate: f64, burst: std::num::NonZeroU32) -> f64 {
    let elapsed = now.saturating_sub(at) as f64;
    (tokens + elapsed * rate / 1000.0).min(f64::from(burst.get()))
}

fn peek(slot: Option<&Slot>, c: &Check, now: u64) -> Peek {
    let cost = u64::from(c.cost);
    let state = slot.map(|s| &s.state).filter(|s| same_kind(s, c.algorithm));
    match c.algorithm {
        Algorithm::SlidingWindow { limit, window } => {
            let (limit, window) = (u64::from(limit.get()), window.as_millis() as u64);
            // The log is oldest first: its live part is a suffix.
            let empty = VecDeque::new();
            let log = match state {
                Some(State::Sliding(log)) => log,
                _ => &empty,
            };
            let now_eff = log.back().map_or(now, |&b| b.max(now));
            let first = log.partition_point(|&t| t + window <= now_eff);
            let used = (log.len() - first) as u64;
            if used + cost <= limit {
                let oldest = log.get(first).copied().unwrap_or(now);
                Peek {
                    allowed: true,
                    remaining: limit - used - cost,
                    wait_ms: (oldest + window) as f64 - now as f64,
                }
            } else {
                // The entry that must leave last for the request to fit.
                let must_leave = (used + cost - limit) as usize;
                let freeing = log.get(first + must_leave - 1).copied().unwrap_or(now);
                Peek {
                    allowed: false,
                    remaining: limit.saturating_sub(used),
                    wait_ms: (freeing + window) as f64 - now as f64,
                }
            }
        }
        Algorithm::FixedWindow { limit, window } => {
            let (limit, window) = (u64::from(limit.get()), window.as_millis() as u64);
            let (start, used) = match state {
                Some(&State::Fixed { start, used }) if now < start + window => (start, used),
                _ => (now, 0),
            };
            let wait_ms = (start + window) as f64 - now as f64;
            if used + cost <= limit {
                Peek {
                    allowed: true,
                    remaining: limit - used - cost,
                    wait_ms,
                }
            } else {
                Peek {
                    allowed: false,
                    remaining: limit.saturating_sub(used),
                    wait_ms,
                }
            }
        }
        Algorithm::TokenBucket { rate, burst } => {
            let tokens = match state {
                Some(&State::Bucket { tokens, at }) => refill(tokens, at, now, rate, burst),
                _ => f64::from(burst.get()),
            };
            let cost = f64::from(c.cost);
            if tokens + 1e-9 >= cost {
                let left = (tokens - cost).max(0.0);
                Peek {
                    allowed: true,
                    remaining: (left + 1e-9).floor() as u64,
                    wait_ms: (f64::from(burst.get()) - left) * 1000.0 / rate,
                }
            } else {
                Peek {
                    allowed: false,
                    remaining: (tokens + 1e-9).floor() as u64,
                    wait_ms: (cost - tokens) * 1000.0 / rate,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    fn check(key: &str, algorithm: Algorithm, enforce: bool) -> Check {
        Check {
            key: key.into(),
            algorithm,
            cost: 1,
            enforce,
            penalty: None,
        }
    }

    fn sliding(limit: u32) -> Algorithm {
        Algorithm::SlidingWindow {
            limit: NonZeroU32::new(limit).unwrap(),
            window: Duration::from_secs(60),
        }
    }

    #[test]
    fn local_decisions_keep_the_limit_and_are_all_or_nothing() {
        let local = LocalLimiter::default();
        let a = check("a", sliding(3), true);
        for left in (0..3).rev() {
            let d = local.decide(std::slice::from_ref(&a));
            assert!(d.allowed);
            assert_eq!(d.outcomes[0].remaining, left);
        }
        let d = local.decide(std::slice::from_ref(&a));
        assert!(!d.allowed);
        assert!(d.outcomes[0].wait > Duration::from_secs(59));
        // Denied by "a": "b" takes nothing.
        let b = check("b", sliding(1), true);
        assert!(!local.decide(&[a.clone(), b.clone()]).allowed);
        assert!(local.decide(std::slice::from_ref(&b)).allowed);
        // A shadow check's denial does not deny.
        let shadow = check("a", sliding(3), false);
        let c = check("c", sliding(5), true);
        assert!(local.decide(&[shadow, c]).allowed);
    }

    #[test]
    fn local_fixed_window_and_bucket_keep_their_limits() {
        let local = LocalLimiter::default();
        let fixed = check(
            "f",
            Algorithm::FixedWindow {
                limit: NonZeroU32::new(2).unwrap(),
                window: Duration::from_secs(60),
            },
            true,
        );
        let bucket = check(
            "t",
            Algorithm::TokenBucket {
                rate: 0.001,
                burst: NonZeroU32::new(2).unwrap(),
            },
            true,
        );
        for c in [fixed, bucket] {
            let one = std::slice::from_ref(&c);
            assert!(local.decide(one).allowed);
            assert!(local.decide(one).allowed);
            assert!(!local.decide(one).allowed, "{c:?}");
            let (_, at) = local.decide_stamped(&[]);
            local.give_back(&c, at);
            assert!(local.decide(one).allowed, "given back: {c:?}");
        }
    }

    #[test]
    fn local_memory_is_bounded() {
        let local = LocalLimiter::with_max_bytes(100_000);
        for i in 0..10_000 {
            local.decide(&[check(&format!("k{i}"), sliding(10), true)]);
            assert!(local.bytes() <= 100_000, "{}", local.bytes());
        }
        assert!(local.len() * SLOT_BYTES <= 100_000, "{}", local.len());
        assert!(local.len() * SLOT_BYTES > 50_000, "{}", local.len());
        local.clear();
        assert_eq!((local.bytes(), local.len()), (0, 0));
    }
}
