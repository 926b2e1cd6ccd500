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
//! Memory is bounded by [`MAX_UNITS`] stored units (one per sliding-window
//! unit, one per other key); when full, expired states go first, then the
//! ones that would expire soonest. One lock for everything: a decision over
//! several rules is all-or-nothing, exactly as in Redis.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{Algorithm, Check, Decision, Outcome};

/// Most units held at once.
pub const MAX_UNITS: usize = 1_000_000;

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
}

impl Slot {
    fn units(&self) -> usize {
        match &self.state {
            State::Sliding(log) => log.len() + 1,
            _ => 1,
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    slots: HashMap<String, Slot>,
    units: usize,
}

/// Rules enforced in memory while Redis is away.
#[derive(Debug)]
pub struct LocalLimiter {
    inner: Mutex<Inner>,
    epoch: Instant,
    max_units: usize,
}

impl Default for LocalLimiter {
    fn default() -> Self {
        LocalLimiter::with_capacity(MAX_UNITS)
    }
}

/// What a check's algorithm sees: its peek, before anything is recorded.
struct Peek {
    allowed: bool,
    remaining: u64,
    wait_ms: f64,
}

impl LocalLimiter {
    /// A limiter holding at most `max_units` units.
    pub fn with_capacity(max_units: usize) -> LocalLimiter {
        LocalLimiter {
            inner: Mutex::new(Inner::default()),
            epoch: Instant::now(),
            max_units: max_units.max(1),
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
            .map(|c| peek(inner.slots.get_mut(&c.key), c, now))
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
        let Some(slot) = inner.slots.get_mut(&check.key) else {
            return;
        };
        let mut freed = 0;
        match (&mut slot.state, check.algorithm) {
            (State::Sliding(log), Algorithm::SlidingWindow { .. }) => {
                // The request's own entries, pushed at its decision's time.
                for _ in 0..check.cost {
                    match log.iter().rposition(|&t| t == at) {
                        Some(i) => {
                            log.remove(i);
                            freed += 1;
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
        inner.units -= freed;
    }

    fn commit(&self, inner: &mut Inner, c: &Check, now: u64) {
        let cost = u64::from(c.cost);
        let before = inner.slots.get(&c.key).map_or(0, Slot::units);
        let slot = inner.slots.entry(c.key.clone()).or_insert_with(|| Slot {
            state: fresh(c.algorithm, now),
            expires: now,
        });
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
        let after = slot.units();
        inner.units = (inner.units + after).saturating_sub(before);
        if inner.units > self.max_units {
            self.shrink(inner, now, &c.key);
        }
    }

    /// Drops expired states, then those that expire soonest, until the
    /// units fit (never `keep`, the state just written).
    fn shrink(&self, inner: &mut Inner, now: u64, keep: &str) {
        inner.slots.retain(|k, s| s.expires > now || k == keep);
        inner.units = inner.slots.values().map(Slot::units).sum();
        if inner.units <= self.max_units {
            return;
        }
        let mut by_expiry: Vec<(u64, String)> = inner
            .slots
            .iter()
            .filter(|(k, _)| k.as_str() != keep)
            .map(|(k, s)| (s.expires, k.clone()))
            .collect();
        by_expiry.sort_unstable();
        // Free down to three quarters, so a full table is not swept per call.
        let target = self.max_units / 4 * 3;
        for (_, k) in by_expiry {
            if inner.units <= target {
                break;
            }
            if let Some(s) = inner.slots.remove(&k) {
                inner.units -= s.units().min(inner.units);
            }
        }
    }

    /// Forgets everything (the rules changed).
    pub fn clear(&self) {
        let mut inner = self.lock();
        inner.slots.clear();
        inner.units = 0;
    }

    /// Units held now.
    pub fn units(&self) -> usize {
        self.lock().units
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

fn peek(slot: Option<&mut Slot>, c: &Check, now: u64) -> Peek {
    let cost = u64::from(c.cost);
    let state = slot.map(|s| &s.state).filter(|s| same_kind(s, c.algorithm));
    match c.algorithm {
        Algorithm::SlidingWindow { limit, window } => {
            let (limit, window) = (u64::from(limit.get()), window.as_millis() as u64);
            let live: Vec<u64> = match state {
                Some(State::Sliding(log)) => {
                    let now_eff = log.back().map_or(now, |&b| b.max(now));
                    log.iter()
                        .copied()
                        .filter(|&t| t + window > now_eff)
                        .collect()
                }
                _ => Vec::new(),
            };
            let used = live.len() as u64;
            if used + cost <= limit {
                let oldest = live.first().copied().unwrap_or(now);
                Peek {
                    allowed: true,
                    remaining: limit - used - cost,
                    wait_ms: (oldest + window) as f64 - now as f64,
                }
            } else {
                // The entry that must leave last for the request to fit.
                let must_leave = (used + cost - limit) as usize;
                let freeing = live.get(must_leave - 1).copied().unwrap_or(now);
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
        let local = LocalLimiter::with_capacity(1000);
        for i in 0..10_000 {
            local.decide(&[check(&format!("k{i}"), sliding(10), true)]);
        }
        assert!(local.units() <= 1000, "{}", local.units());
        local.clear();
        assert_eq!(local.units(), 0);
    }
}
