//! What the limiter and its dispatchers share, as a leaf they all import
//! (the limiter builds it, the transports and the operator listener read
//! it): the shared counters, clock, breaker and denial cache, and the job
//! one request's checks travel in.

use std::sync::atomic::AtomicU64;
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
    pub(crate) top: std::sync::Arc<super::operator::Tally>,
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
