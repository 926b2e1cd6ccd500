//! Each algorithm's state in the local limiter, as its Lua script keeps it
//! in Redis: what a decision reads (peek), what an admission writes
//! (apply), and what a give-back returns. A new algorithm adds its state,
//! its peek, its commit and its give-back here.

use std::collections::VecDeque;

use super::SLOT_BYTES;
use crate::limiter::Check;
use crate::rule::Algorithm;

/// A key's state, as the Lua scripts keep it in Redis (times in ms on the
/// limiter's clock).
#[derive(Debug)]
pub(super) enum State {
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
pub(super) struct Slot {
    pub(super) state: State,
    /// The last moment the state exists (ms): what the key's TTL in Redis
    /// would say. After it, the state is gone.
    pub(super) expires: u64,
    /// Used since its turn in the eviction queue last came.
    pub(super) used: bool,
}

impl Slot {
    /// The estimate of what this state holds, with its key of `key_len`.
    pub(super) fn bytes(&self, key_len: usize) -> usize {
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
    pub(super) fn set_ttl(&mut self, now: u64, ms: f64) {
        self.expires = now + (ms.ceil() as u64).max(1);
    }
}

/// What a check's algorithm sees: its peek, before anything is recorded,
/// and what a commit then writes.
pub(super) struct Peek {
    pub(super) allowed: bool,
    pub(super) remaining: u64,
    pub(super) wait_ms: f64,
    pub(super) banned: bool,
    pub(super) commit: Commit,
}

/// What an admission writes, as the peek found it.
#[derive(Clone, Copy)]
pub(super) enum Commit {
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
pub(super) const GCRA_SLACK: f64 = 1e-6;

/// Reads `slot` for `c` at `now` as the algorithm's peek in Lua does, and
/// writes what that peek writes in Redis even when nothing is admitted:
/// a state gone past its TTL or of another algorithm is dropped, and a
/// window or bucket decided under changed parameters takes them on.
pub(super) fn peek(slot: &mut Slot, c: &Check, now: u64) -> Peek {
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
                now_eff = now.max(ws);
                if win == w {
                    stored = Some((ws, cur, prev));
                } else if win > 0 {
                    // A changed window keeps what was used: the old
                    // windows' estimate, rounded up, is the new window's
                    // count (sliding_counter.lua).
                    let ows = now_eff - now_eff % win;
                    let (oc, op) = if ows == ws {
                        (cur, prev)
                    } else if ows == ws + win {
                        (0.0, cur)
                    } else {
                        (0.0, 0.0)
                    };
                    let used = op * (win - (now_eff - ows)) as f64 / win as f64 + oc;
                    stored = Some((now_eff - now_eff % w, (used - 1e-9).ceil(), 0.0));
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
                    tokens = t;
                    if *was_rate != rate || *was_burst != burst {
                        // What was used still counts (token_bucket.lua).
                        tokens = burst - (*was_burst - t);
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
                    remaining: (tokens + 1e-9).floor().max(0.0) as u64,
                    wait_ms: now_eff as f64 + (cost - tokens) * 1000.0 / rate - now as f64,
                    banned: false,
                    commit: Commit::Nothing,
                }
            }
        }
    }
}

/// Writes what an admission `commit` found for `c` into `slot`, and its
/// TTL, as the algorithm's script does.
pub(super) fn apply(slot: &mut Slot, c: &Check, commit: Commit, now: u64) {
    let cost = u64::from(c.cost);
    match (commit, c.algorithm) {
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
}

/// Gives back `check.cost` units admitted at `at` to `slot`, as the
/// algorithm's give-back script does (`now`: the limiter's clock).
pub(super) fn give_back(slot: &mut Slot, check: &Check, at: u64, now: u64) {
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
            let now = now as i64;
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
