//! What the limiter and its dispatchers share, as a leaf they all import
//! (the limiter builds it, the transports and the operator listener read
//! it): the shared counters, clock, breaker and denial cache, and the job
//! one request's checks travel in.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::breaker::Breaker;
use super::clock::RedisClock;
use super::deny_cache::DenyCache;
#[cfg(feature = "cluster")]
use super::dispatch::cluster::health::MasterHealths;
use super::{Check, Decision, LimiterError};

/// What the limiter and its dispatcher threads share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) errors: AtomicU64,
    /// Jobs the script skipped because their deadline had passed.
    pub(crate) late: AtomicU64,
    pub(crate) clock: RedisClock,
    pub(crate) breaker: Breaker,
    pub(crate) deny_cache: Option<DenyCache>,
    /// Where a dispatcher sends each penalty ban a decision started (the
    /// identity's state key, the ban's length in ms), for the audit trail
    /// (see `operator/list.rs`); `None` when its writer could not start.
    pub(crate) penalties: Option<std::sync::mpsc::Sender<(String, u64)>>,
    /// The bans this process knows of for its local fallback: every ban
    /// Redis answers is taught to it as the decision is concluded, whoever
    /// asked (the filter's rules, Envoy's rate-limit service).
    pub(crate) bans: std::sync::Arc<super::local::Bans>,
    /// Denials not yet written for `floodgate top` (see `operator/top.rs`).
    pub(crate) top: std::sync::Arc<Tally>,
    /// Redis Cluster: each master's breaker and clock, by address.
    #[cfg(feature = "cluster")]
    pub(crate) masters: MasterHealths,
}

/// One request's checks on their way to Redis, and where its caller awaits
/// the answer.
pub(crate) struct Job {
    pub(crate) checks: Vec<Check>,
    /// Pinned clock in ms (tests); `None` = Redis `TIME`.
    pub(crate) now_ms: Option<u64>,
    /// When the caller asked.
    pub(crate) asked: Instant,
    /// When the caller stops waiting.
    pub(crate) deadline: Instant,
    /// Whether this job probes Redis for the open breaker.
    pub(crate) probe: bool,
    pub(crate) reply: oneshot::Sender<Result<Decision, LimiterError>>,
}

impl Job {
    /// Whether its caller still waits for the answer at `now`. A job whose
    /// caller gave up is never sent: it would take quota for a request
    /// that was answered without it.
    pub(crate) fn waiting(&self, now: Instant) -> bool {
        self.deadline > now && !self.reply.is_closed()
    }

    /// The deadline it is sent with, in ms on the Redis clock `clock`
    /// estimates: its caller's, less `margin` for the reply's way back
    /// (see `deadline_margin`). The script skips the job at or after it, so
    /// a late call takes nothing. `None` until the clock is known.
    pub(crate) fn redis_deadline(&self, clock: &RedisClock, margin: Duration) -> Option<i64> {
        clock.redis_ms(self.deadline - margin)
    }
}

/// Identities one process tallies between two writes.
pub(crate) const TALLY_MOST: usize = 20_000;

/// Denials by identity (its state key, which names its rule).
pub(crate) type Counts = HashMap<String, u64>;

/// Denials by rule and identity since the last write, and how many did not
/// fit.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    counts: Mutex<(Counts, u64)>,
}

impl Tally {
    /// Counts one denial of the identity whose state key is `key`.
    pub(crate) fn add(&self, key: &str) {
        let mut guard = match self.counts.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let (counts, dropped) = &mut *guard;
        if let Some(n) = counts.get_mut(key) {
            *n += 1;
        } else if counts.len() < TALLY_MOST {
            counts.insert(key.to_string(), 1);
        } else {
            *dropped += 1;
        }
    }

    pub(crate) fn take(&self) -> (Counts, u64) {
        let mut guard = match self.counts.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        std::mem::take(&mut *guard)
    }
}
