//! The local limiter: while Redis cannot decide, a rule with
//! `on_redis_error = "local"` is enforced by this process alone, with the
//! same algorithms, limits and answers as the Lua scripts, on the process's
//! own monotonic clock. Each state is what the script keeps in Redis, and
//! lives as long as its key would there: it is gone once its TTL would
//! have run out, a window or bucket takes on a reload's parameters at its
//! next decision as the scripts do (a window still open under the window it
//! was opened with, a bucket refilling at its old rate until then), and a
//! clock that steps back meets the state's own time. `tests/model.rs`
//! holds it to the same reference models as the scripts, on a pinned clock
//! ([`LocalLimiter::decide_at`]).
//!
//! A banned identity is denied as Redis would deny it (the ban's time left,
//! nothing taken) while this process knows of the ban: [`Bans`] keeps those
//! Redis answered and those announced on the operator channel (see
//! `operator/listener.rs`), each until its end.
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

use super::{Check, Decision, Outcome};

mod bans;
mod state;

pub(crate) use self::bans::Bans;
use self::state::{peek, Commit, Peek, Slot, State};

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
    bans: Arc<Bans>,
}

impl Default for LocalLimiter {
    fn default() -> Self {
        LocalLimiter::with_max_bytes(MAX_BYTES)
    }
}

impl LocalLimiter {
    /// A limiter holding at most about `max_bytes` (by its estimate).
    pub fn with_max_bytes(max_bytes: usize) -> LocalLimiter {
        LocalLimiter {
            inner: Mutex::new(Inner::default()),
            epoch: Instant::now(),
            max_bytes: max_bytes.max(SLOT_BYTES),
            bans: Arc::default(),
        }
    }

    /// The bans this process knows of (shared with the operator listener).
    pub(crate) fn bans(&self) -> &Arc<Bans> {
        &self.bans
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
        (self.decide_at(now, checks), now)
    }

    /// As [`LocalLimiter::decide`], with the algorithms' clock pinned to
    /// `now_ms` (any scale; it may step back): for the tests that hold the
    /// local fallback to the same reference models as the scripts. Bans
    /// are timed on the real clock.
    #[doc(hidden)]
    pub fn decide_at(&self, now_ms: u64, checks: &[Check]) -> Decision {
        let now = now_ms;
        let real_now = Instant::now();
        let mut inner = self.lock();
        let mut peeks = Vec::with_capacity(checks.len());
        for c in checks {
            if let Some(wait) = self.bans.banned(&c.key, real_now) {
                // Denied as Redis would: the ban's time left, nothing read.
                peeks.push(Peek {
                    allowed: false,
                    remaining: 0,
                    wait_ms: wait.as_millis() as f64,
                    banned: true,
                    commit: Commit::Nothing,
                });
                continue;
            }
            let peek = match inner.slots.get_mut(c.key.as_str()) {
                Some(slot) => {
                    // Asked for again, allowed or not: keep it.
                    slot.used = true;
                    let before = slot.bytes(c.key.len());
                    let peek = peek(slot, c, now);
                    let after = slot.bytes(c.key.len());
                    inner.bytes = (inner.bytes + after).saturating_sub(before);
                    peek
                }
                None => {
                    let mut gone = Slot {
                        state: State::Gone,
                        expires: now,
                        used: true,
                    };
                    peek(&mut gone, c, now)
                }
            };
            peeks.push(peek);
        }
        let allowed = checks
            .iter()
            .zip(&peeks)
            .all(|(c, p)| p.allowed || !c.enforce);
        if allowed {
            for (c, p) in checks.iter().zip(&peeks) {
                if p.allowed {
                    self.commit(&mut inner, c, &p.commit, now);
                }
            }
        }
        let outcomes = peeks
            .iter()
            .map(|p| Outcome {
                allowed: p.allowed,
                remaining: p.remaining,
                wait: Duration::from_millis(p.wait_ms.max(0.0).ceil() as u64),
                banned: p.banned,
                ban_started: false,
                quota: None,
            })
            .collect();
        Decision { outcomes, allowed }
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
        let now = self.now_ms();
        state::give_back(slot, check, at, now);
    }

    fn commit(&self, inner: &mut Inner, c: &Check, commit: &Commit, now: u64) {
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
                    state: State::Gone,
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
        state::apply(slot, c, *commit, now);
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
            if slot.used && slot.expires >= now && chances < SECOND_CHANCES {
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

    /// Forgets every count (the rules changed). The bans stay: they end
    /// by themselves, whatever the rules.
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

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::rule::Algorithm;

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
