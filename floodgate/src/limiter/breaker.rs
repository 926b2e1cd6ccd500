//! The breaker: after a call failed, no call is made for a while, then one
//! call probes Redis, and the requests that come while it is on its way
//! wait briefly for what it comes to.

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{Decision, LimiterError};

/// The breaker: after a call failed (timeout, refused, broken), no call is
/// made for `period`; then one request's call probes Redis, and its answer
/// closes the breaker (or its failure opens it for another period).
///
/// The right to probe is a [`Probing`] guard: it is given back when the
/// guard is dropped, whatever became of the call (answered, failed, or its
/// caller gone while it waited), so a probe can never keep the breaker
/// from probing again.
///
/// A request that comes while the probe is on its way waits for it, up to
/// [`PROBE_WAIT`] ([`Gate::Probing`]): once Redis is back (a restart, a
/// failover), the probe reconnects and closes the breaker within a few
/// milliseconds, and the requests that came meanwhile are decided by Redis
/// instead of failing. While Redis stays stalled, they get the error policy's
/// answer after that wait.
#[derive(Debug)]
pub(crate) struct Breaker {
    period: Duration,
    epoch: Instant,
    /// µs after `epoch` until which no call is made; 0 = closed.
    open_until: AtomicU64,
    /// A probe is on its way.
    probing: AtomicBool,
    /// Woken when a probe has come to something.
    probed: tokio::sync::Notify,
}

/// The longest a request waits for a probe on its way (or the limiter's
/// timeout, if shorter): a Redis that is back answers a probe, new
/// connection, reloaded script and all, well within it, even on a busy
/// machine; a stalled one holds the requests that come during its probe no
/// longer than this, once per breaker period.
pub(crate) const PROBE_WAIT: Duration = Duration::from_millis(100);

/// What the breaker lets a request do.
pub(crate) enum Gate<B: Deref<Target = Breaker>> {
    /// Ask Redis.
    Closed,
    /// Ask Redis, as the probe: keep the guard until the call has come to
    /// something (no one else probes meanwhile).
    Probe(Probing<B>),
    /// Do not ask.
    Open,
    /// The period is over and a probe is on its way: wait for it
    /// ([`Breaker::await_probe`]), then ask again.
    Probing,
}

/// The right to probe an open breaker, held while the probe is on its way;
/// dropping it (however the probe ended) lets the next one probe.
pub(crate) struct Probing<B: Deref<Target = Breaker>>(B);

impl<B: Deref<Target = Breaker>> Drop for Probing<B> {
    fn drop(&mut self) {
        self.0.probing.store(false, Ordering::Release);
        self.0.probed.notify_waiters();
    }
}

impl Breaker {
    pub(crate) fn new(period: Duration) -> Breaker {
        Breaker {
            period,
            epoch: Instant::now(),
            open_until: AtomicU64::new(0),
            probing: AtomicBool::new(false),
            probed: tokio::sync::Notify::new(),
        }
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// What `breaker` lets a call do now.
    pub(crate) fn gate<B: Deref<Target = Breaker>>(breaker: B) -> Gate<B> {
        let until = breaker.open_until.load(Ordering::Acquire);
        if until == 0 {
            return Gate::Closed;
        }
        if breaker.now_us() < until {
            return Gate::Open;
        }
        match breaker
            .probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Gate::Probe(Probing(breaker)),
            Err(_) => Gate::Probing,
        }
    }

    /// Waits until the probe on its way has come to something, or `wait`
    /// has passed (at once if no probe is on its way).
    pub(crate) async fn await_probe(&self, wait: Duration) {
        let probed = self.probed.notified();
        tokio::pin!(probed);
        // Registered before the look, so a probe ending in between wakes it.
        probed.as_mut().enable();
        if !self.probing.load(Ordering::Acquire) {
            return;
        }
        let _ = tokio::time::timeout(wait, probed).await;
    }

    /// Whether calls are held back now (the period has not run out).
    pub(crate) fn holding(&self) -> bool {
        let until = self.open_until.load(Ordering::Acquire);
        until != 0 && self.now_us() < until
    }

    /// Whether the next call would probe: open, its period over, and no
    /// probe on its way.
    #[cfg(feature = "cluster")]
    pub(crate) fn probe_due(&self) -> bool {
        let until = self.open_until.load(Ordering::Acquire);
        until != 0 && self.now_us() >= until && !self.probing.load(Ordering::Acquire)
    }

    pub(crate) fn is_open(&self) -> bool {
        self.open_until.load(Ordering::Acquire) != 0
    }

    pub(crate) fn trip(&self, why: &LimiterError) {
        let until = (self.now_us() + self.period.as_micros() as u64).max(1);
        let was = self.open_until.swap(until, Ordering::AcqRel);
        if was == 0 {
            crate::logging::repeated!(
                &crate::logging::BREAKER,
                "breaker open for {:?}: {}; rules apply on_redis_error meanwhile",
                self.period,
                crate::logging::Escaped(&why.to_string())
            );
        }
    }

    pub(crate) fn close(&self) {
        if self.open_until.swap(0, Ordering::AcqRel) != 0 {
            log::info!("redis answers again; breaker closed");
        }
    }

    /// Moves the breaker on what a call came to.
    pub(crate) fn observe(&self, result: &Result<Decision, LimiterError>, probe: bool) {
        match result {
            // Redis answered (a check it could not decide, or a job it
            // skipped as late, is an answer too).
            Ok(_) | Err(LimiterError::Check(_) | LimiterError::Late) => {
                if probe || self.is_open() {
                    self.close();
                }
            }
            Err(e @ (LimiterError::Timeout | LimiterError::Redis(_) | LimiterError::Other(_))) => {
                self.trip(e)
            }
            // No call was made: the probe's guard lets the next request
            // probe.
            Err(
                LimiterError::Overloaded
                | LimiterError::Stopped
                | LimiterError::BreakerOpen
                | LimiterError::Unsupported(_)
                | LimiterError::Invalid(_),
            ) => {}
        }
    }
}
