//! The dispatchers' estimate of Redis's clock, and the deadlines in Redis
//! time that jobs are sent with (see *Late calls* in the README).

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

/// How much earlier than its caller's deadline a job's deadline in Redis
/// time is set: the time a reply may take to travel back and be handed
/// over. A script that runs before the deadline it was sent answers in
/// time; one that runs after it decides nothing.
pub(crate) fn deadline_margin(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(2), Duration::from_millis(25))
}

/// The dispatchers' estimate of Redis's clock: the offset from the local
/// monotonic clock, taken from the last reply that carried Redis's time.
/// It is a lower bound: Redis read its clock before the reply arrived, so
/// Redis's clock at any later local instant is at least the local instant
/// plus the offset (unless Redis's clock is stepped back).
#[derive(Debug)]
pub(crate) struct RedisClock {
    epoch: Instant,
    offset_us: AtomicI64,
    known: AtomicBool,
}

impl RedisClock {
    pub(crate) fn new() -> RedisClock {
        RedisClock {
            epoch: Instant::now(),
            offset_us: AtomicI64::new(0),
            known: AtomicBool::new(false),
        }
    }

    fn local_us(&self, at: Instant) -> i64 {
        at.saturating_duration_since(self.epoch).as_micros() as i64
    }

    /// Redis said its clock read `redis_us` in a reply that arrived at `received`.
    pub(crate) fn sample(&self, redis_us: i64, received: Instant) {
        // One microsecond off for the local reading's rounding.
        let offset = redis_us - self.local_us(received) - 1;
        self.offset_us.store(offset, Ordering::Relaxed);
        self.known.store(true, Ordering::Release);
    }

    /// Redis's clock at local instant `at`, in ms, at least (`None` until
    /// Redis has told its time once).
    pub(crate) fn redis_ms(&self, at: Instant) -> Option<i64> {
        if !self.known.load(Ordering::Acquire) {
            return None;
        }
        let us = self.local_us(at) + self.offset_us.load(Ordering::Relaxed);
        Some(us.div_euclid(1000))
    }
}
