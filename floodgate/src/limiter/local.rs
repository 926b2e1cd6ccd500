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
//! `operator.rs`), each until its end.
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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::deny_cache::DenyCache;
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

/// A key's state, as the Lua scripts keep it in Redis (times in ms on the
/// limiter's clock).
#[derive(Debug)]
enum State {
    /// Nothing: the key expired (its TTL in Redis would have run out), or
    /// a reload changed its algorithm.
    Gone,
    /// Admission times, oldest first, one per unit.
    Sliding(VecDeque<u64>),
    /// The window opened at `start` with `used` units taken, under a window
    /// of `window` ms (the one in force when it was last decided).
    Fixed { start: u64, used: u64, window: u64 },
    /// GCRA: the theoretical arrival time, whole ms and fraction.
    Gcra { ms: i64, frac: f64 },
    /// Sliding counter: the window opened at `ws` (epoch-aligned) with
    /// `cur` units, the one before with `prev`, under a window of `win` ms.
    Counter {
        ws: u64,
        cur: f64,
        prev: f64,
        win: u64,
    },
    /// `tokens` left at `at`, refilling under `rate` and `burst`.
    Bucket {
        tokens: f64,
        at: u64,
        rate: f64,
        burst: f64,
    },
}

#[derive(Debug)]
struct Slot {
    state: State,
    /// The last moment the state exists (ms): what the key's TTL in Redis
    /// would say. After it, the state is gone.
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

    /// Sets the TTL as the scripts' `set_ttl` does: `ms` from `now`,
    /// rounded up, at least 1.
    fn set_ttl(&mut self, now: u64, ms: f64) {
        self.expires = now + (ms.ceil() as u64).max(1);
    }
}

#[derive(Debug, Default)]
struct Inner {
    slots: HashMap<Arc<str>, Slot>,
    /// Every key of `slots`, once, in the order of its turn to be pushed out.
    queue: VecDeque<Arc<str>>,
    bytes: usize,
}

/// What this process knows of bans, for the local fallback: those Redis
/// answered (a decision denied as banned) and those announced on the
/// operator channel, each until the ban's end (bounded as the denial
/// cache is: 32768 keys, the ones that end soonest dropped first). And the
/// operator bans this process claimed to count in its metrics.
#[derive(Debug, Default)]
pub(crate) struct Bans {
    known: DenyCache,
    /// Whether metrics are served from this process (a filter watches the
    /// limiter): only then does it claim operator bans to count them.
    counting: AtomicBool,
    /// Operator bans claimed here, per rule.
    counted: Mutex<BTreeMap<String, u64>>,
}

impl Bans {
    /// Remembers that `key` is banned for `wait`, as Redis answered a call
    /// sent at `sent` and answered at `answered` (or as a message heard at
    /// `answered` said: then both are that moment). Not remembered when
    /// the key's ban was ended (or reset) after `sent`.
    pub(crate) fn learn(&self, key: &str, wait: Duration, sent: Instant, answered: Instant) {
        self.known.remember_ban(key, wait, sent, answered);
    }

    /// The ban of `key` ended, or may have: forget it (and a ban Redis
    /// answered for a call sent before now).
    pub(crate) fn forget(&self, key: &str) {
        self.known.forget(key);
    }

    /// Forgets every ban (the operator channel may have missed an unban).
    pub(crate) fn clear(&self) {
        self.known.clear();
    }

    /// How long `key` stays banned, if it is at `now`.
    pub(crate) fn banned(&self, key: &str, now: Instant) -> Option<Duration> {
        self.known.denial(key, 1, now).map(|d| d.wait)
    }

    /// From now on this process counts the operator bans it claims.
    pub(crate) fn count_here(&self) {
        self.counting.store(true, Ordering::Relaxed);
    }

    /// Whether this process counts the operator bans it claims.
    pub(crate) fn counting(&self) -> bool {
        self.counting.load(Ordering::Relaxed)
    }

    /// Counts one operator ban under `rule`, claimed by this process.
    pub(crate) fn count(&self, rule: &str) {
        let mut counted = match self.counted.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        *counted.entry(rule.to_string()).or_default() += 1;
    }

    /// The operator bans counted here, per rule.
    pub(crate) fn counted(&self) -> BTreeMap<String, u64> {
        match self.counted.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }
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

/// What a check's algorithm sees: its peek, before anything is recorded,
/// and what a commit then writes.
struct Peek {
    allowed: bool,
    remaining: u64,
    wait_ms: f64,
    banned: bool,
    commit: Commit,
}

/// What an admission writes, as the peek found it.
#[derive(Clone, Copy)]
enum Commit {
    Nothing,
    /// Drop the first `expired` entries (out of the window at `now_eff`),
    /// push the cost at `now_eff`.
    Sliding {
        expired: usize,
        now_eff: u64,
    },
    Fixed {
        start: u64,
        used: u64,
    },
    Bucket {
        tokens: f64,
        now_eff: u64,
    },
    /// TAT becomes now + `owed` ms.
    Gcra {
        owed: f64,
        ttl: f64,
    },
    Counter {
        ws: u64,
        cur: f64,
        prev: f64,
    },
}

/// GCRA's slack at exact boundaries, in emission intervals (as `gcra.lua`).
const GCRA_SLACK: f64 = 1e-6;

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
            (State::Fixed { start, used, .. }, Algorithm::FixedWindow { .. }) if *start <= at => {
                *used = used.saturating_sub(u64::from(check.cost));
            }
            (State::Bucket { tokens, .. }, Algorithm::TokenBucket { burst, .. }) => {
                *tokens = (*tokens + f64::from(check.cost)).min(f64::from(burst.get()));
            }
            (State::Gcra { ms, frac }, Algorithm::Gcra { limit, window }) => {
                let now = self.now_ms() as i64;
                let t = window.as_millis() as f64 / f64::from(limit.get());
                let owed = (*ms - now) as f64 + *frac - f64::from(check.cost) * t;
                // At or before now: a fresh key, as an expired one is.
                let whole = owed.max(0.0).floor();
                (*ms, *frac) = (now + whole as i64, owed.max(0.0) - whole);
            }
            (State::Counter { ws, cur, win, .. }, Algorithm::SlidingCounter { .. })
                if at - at % *win == *ws =>
            {
                *cur = (*cur - f64::from(check.cost)).max(0.0);
            }
            _ => {}
        }
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
        let cost = u64::from(c.cost);
        match (*commit, c.algorithm) {
            (Commit::Sliding { expired, now_eff }, Algorithm::SlidingWindow { window, .. }) => {
                let window = window.as_millis() as u64;
                if !matches!(slot.state, State::Sliding(_)) {
                    slot.state = State::Sliding(VecDeque::new());
                }
                if let State::Sliding(log) = &mut slot.state {
                    log.drain(..expired.min(log.len()));
                    log.extend(std::iter::repeat_n(now_eff, c.cost as usize));
                    // A log that emptied out gives its room back.
                    if log.capacity() > 64 && log.len() < log.capacity() / 4 {
                        log.shrink_to(log.len() * 2);
                    }
                }
                slot.set_ttl(now, (now_eff + window - now) as f64);
            }
            (Commit::Fixed { start, used }, Algorithm::FixedWindow { window, .. }) => {
                let window = window.as_millis() as u64;
                slot.state = State::Fixed {
                    start,
                    used: used + cost,
                    window,
                };
                slot.set_ttl(now, (start + window - now) as f64);
            }
            (Commit::Bucket { tokens, now_eff }, Algorithm::TokenBucket { rate, burst }) => {
                let burst = f64::from(burst.get());
                let left = (tokens - f64::from(c.cost)).max(0.0);
                slot.state = State::Bucket {
                    tokens: left,
                    at: now_eff,
                    rate,
                    burst,
                };
                slot.set_ttl(
                    now,
                    now_eff as f64 + (burst - left) * 1000.0 / rate - now as f64,
                );
            }
            (Commit::Gcra { owed, ttl }, Algorithm::Gcra { .. }) => {
                let whole = owed.floor();
                slot.state = State::Gcra {
                    ms: now as i64 + whole as i64,
                    frac: owed - whole,
                };
                slot.set_ttl(now, ttl);
            }
            (Commit::Counter { ws, cur, prev }, Algorithm::SlidingCounter { window, .. }) => {
                let win = window.as_millis() as u64;
                slot.state = State::Counter {
                    ws,
                    cur: cur + f64::from(c.cost),
                    prev,
                    win,
                };
                slot.set_ttl(now, (ws + 2 * win - now) as f64);
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

/// Reads `slot` for `c` at `now` as the algorithm's peek in Lua does, and
/// writes what that peek writes in Redis even when nothing is admitted:
/// a state gone past its TTL or of another algorithm is dropped, and a
/// window or bucket decided under changed parameters takes them on.
fn peek(slot: &mut Slot, c: &Check, now: u64) -> Peek {
    let live = slot.expires >= now;
    let kind = matches!(
        (&slot.state, c.algorithm),
        (State::Sliding(_), Algorithm::SlidingWindow { .. })
            | (State::Fixed { .. }, Algorithm::FixedWindow { .. })
            | (State::Bucket { .. }, Algorithm::TokenBucket { .. })
            | (State::Gcra { .. }, Algorithm::Gcra { .. })
            | (State::Counter { .. }, Algorithm::SlidingCounter { .. })
    );
    if !live || !kind {
        slot.state = State::Gone;
    }
    let cost = u64::from(c.cost);
    match c.algorithm {
        Algorithm::SlidingWindow { limit, window } => {
            let (limit, window) = (u64::from(limit.get()), window.as_millis() as u64);
            // The log is oldest first: its live part is a suffix.
            let empty = VecDeque::new();
            let log = match &slot.state {
                State::Sliding(log) => log,
                _ => &empty,
            };
            let newest = log.back().copied();
            let now_eff = newest.map_or(now, |b| b.max(now));
            let first = log.partition_point(|&t| t + window <= now_eff);
            let used = (log.len() - first) as u64;
            let oldest = log.get(first).copied().unwrap_or(now_eff);
            let freeing = (used + cost)
                .checked_sub(limit + 1)
                .and_then(|i| log.get(first + i as usize).copied());
            if let (Some(newest), true) = (newest, used > 0) {
                // Every decision on a live log sets its TTL again.
                slot.set_ttl(now, (newest + window - now) as f64);
            }
            if used + cost <= limit {
                Peek {
                    allowed: true,
                    remaining: limit - used - cost,
                    wait_ms: (oldest + window) as f64 - now as f64,
                    banned: false,
                    commit: Commit::Sliding {
                        expired: first,
                        now_eff,
                    },
                }
            } else {
                // The entry that must leave last for the request to fit.
                let freeing = freeing.unwrap_or(now_eff);
                Peek {
                    allowed: false,
                    remaining: limit.saturating_sub(used),
                    wait_ms: (freeing + window) as f64 - now as f64,
                    banned: false,
                    commit: Commit::Nothing,
                }
            }
        }
        Algorithm::FixedWindow { limit, window } => {
            let (limit, window) = (u64::from(limit.get()), window.as_millis() as u64);
            let mut open = None;
            let mut adopted = None;
            if let State::Fixed {
                start,
                used,
                window: was,
            } = &mut slot.state
            {
                let now_eff = now.max(*start);
                // Open while open under the window it was decided under
                // and under the one in force.
                if now_eff < *start + *was && now_eff < *start + window {
                    if *was != window {
                        *was = window;
                        adopted = Some(*start + window);
                    }
                    open = Some((*start, *used));
                }
            }
            if let Some(closes) = adopted {
                slot.set_ttl(now, (closes - now) as f64);
            }
            let (start, used) = open.unwrap_or((now, 0));
            let wait_ms = (start + window) as f64 - now as f64;
            if used + cost <= limit {
                Peek {
                    allowed: true,
                    remaining: limit - used - cost,
                    wait_ms,
                    banned: false,
                    commit: Commit::Fixed { start, used },
                }
            } else {
                Peek {
                    allowed: false,
                    remaining: limit.saturating_sub(used),
                    wait_ms,
                    banned: false,
                    commit: Commit::Nothing,
                }
            }
        }
        Algorithm::Gcra { limit, window } => {
            let (l, t) = (
                f64::from(limit.get()),
                window.as_millis() as f64 / f64::from(limit.get()),
            );
            let x = match slot.state {
                State::Gcra { ms, frac } => (((ms - now as i64) as f64 + frac) / t).max(0.0),
                _ => 0.0,
            };
            let cost = f64::from(c.cost);
            if x + cost <= l + GCRA_SLACK {
                let owed = (x + cost) * t;
                Peek {
                    allowed: true,
                    remaining: (l - x - cost + GCRA_SLACK).floor().max(0.0) as u64,
                    wait_ms: owed - GCRA_SLACK * t,
                    banned: false,
                    commit: Commit::Gcra {
                        owed,
                        ttl: owed - GCRA_SLACK * t,
                    },
                }
            } else {
                Peek {
                    allowed: false,
                    remaining: (l - x + GCRA_SLACK).floor().max(0.0) as u64,
                    wait_ms: (x + cost - l - GCRA_SLACK) * t,
                    banned: false,
                    commit: Commit::Nothing,
                }
            }
        }
        Algorithm::SlidingCounter { limit, window } => {
            let (l, w) = (f64::from(limit.get()), window.as_millis() as u64);
            let wf = w as f64;
            let mut now_eff = now;
            let mut stored = None;
            if let State::Counter { ws, cur, prev, win } = slot.state {
                if win == w {
                    now_eff = now.max(ws);
                    stored = Some((ws, cur, prev));
                }
            }
            let ws = now_eff - now_eff % w;
            let (cur, prev) = match stored {
                Some((at, cur, prev)) if at == ws => (cur, prev),
                Some((at, cur, _)) if ws == at + w => (0.0, cur),
                _ => (0.0, 0.0),
            };
            let e = (now_eff - ws) as f64;
            let weighted = prev * (wf - e);
            let cost = f64::from(c.cost);
            if cur + cost <= l && weighted <= (l - cost - cur) * wf {
                Peek {
                    allowed: true,
                    remaining: (((l - cur - cost) * wf - weighted) / wf).floor().max(0.0) as u64,
                    wait_ms: (ws + 2 * w) as f64 - now as f64,
                    banned: false,
                    commit: Commit::Counter { ws, cur, prev },
                }
            } else {
                // The first moment the same request fits (sliding_counter.lua).
                let (mut from, mut cur2, mut prev2) = (ws as f64, cur, prev);
                if cur + cost > l {
                    (from, prev2, cur2) = (from + wf, cur, 0.0);
                }
                let at = if prev2 == 0.0 {
                    from
                } else {
                    from + wf - ((l - cost - cur2) * wf / prev2).floor()
                };
                Peek {
                    allowed: false,
                    remaining: (((l - cur) * wf - weighted) / wf).floor().max(0.0) as u64,
                    wait_ms: at.max(now_eff as f64) - now as f64,
                    banned: false,
                    commit: Commit::Nothing,
                }
            }
        }
        Algorithm::TokenBucket { rate, burst } => {
            let burst = f64::from(burst.get());
            let (mut tokens, mut now_eff) = (burst, now);
            let mut adopted = None;
            if let State::Bucket {
                tokens: left,
                at,
                rate: was_rate,
                burst: was_burst,
            } = &mut slot.state
            {
                now_eff = now.max(*at);
                // It refills under the parameters it was decided under.
                let t = *left + (now_eff - *at) as f64 * *was_rate / 1000.0;
                if t < *was_burst {
                    tokens = t.min(burst);
                    if *was_rate != rate || *was_burst != burst {
                        (*left, *at, *was_rate, *was_burst) = (tokens, now_eff, rate, burst);
                        adopted = Some(now_eff as f64 + (burst - tokens) * 1000.0 / rate);
                    }
                }
            }
            if let Some(full) = adopted {
                slot.set_ttl(now, full - now as f64);
            }
            let cost = f64::from(c.cost);
            if tokens + 1e-9 >= cost {
                let left = (tokens - cost).max(0.0);
                Peek {
                    allowed: true,
                    remaining: (left + 1e-9).floor() as u64,
                    wait_ms: now_eff as f64 + (burst - left) * 1000.0 / rate - now as f64,
                    banned: false,
                    commit: Commit::Bucket { tokens, now_eff },
                }
            } else {
                Peek {
                    allowed: false,
                    remaining: (tokens + 1e-9).floor() as u64,
                    wait_ms: now_eff as f64 + (cost - tokens) * 1000.0 / rate - now as f64,
                    banned: false,
                    commit: Commit::Nothing,
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
