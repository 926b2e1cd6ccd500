//! Giving units back: a rule with `count = "failures"` charges a request
//! like any other (so that concurrent guesses cannot overrun the limit),
//! and when the answer is a success (status below 400) the filter gives the
//! units back with [`Limiter::give_back`].
//!
//! One script call per key (`lua/give_back.lua`), outside the decision
//! batch, through the pool on the blocking thread pool. A give-back that
//! cannot be made safely is skipped: the request then simply stays charged.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::wire::{self, GIVE_BACK_SOURCE};
use super::{Algorithm, Limiter, LimiterError};

/// One key's units to give back.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Refund {
    /// The full Redis key the request was charged under.
    pub key: String,
    /// The rule's algorithm and parameters.
    pub algorithm: Algorithm,
    /// Units the request took.
    pub cost: u32,
    /// The `wait` of its allowed outcome: for a fixed window, how long the
    /// window had left when the request was charged.
    pub window_left: Duration,
}

impl Refund {
    /// Whether giving back now is still safe, `elapsed` after the decision
    /// was asked for (see [`Algorithm::give_back_safe`]).
    fn safe(&self, elapsed: Duration, margin: Duration) -> bool {
        self.algorithm
            .give_back_safe(elapsed, margin, self.window_left)
    }
}

fn script() -> &'static redis::Script {
    static SCRIPT: OnceLock<redis::Script> = OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(GIVE_BACK_SOURCE))
}

impl Limiter {
    /// Gives back the units of a request decided at `decided` (an instant
    /// taken before the decision was asked for). Keys whose give-back is no
    /// longer safe are skipped; returns the units given back. Bounded by the
    /// Redis timeout.
    pub(crate) async fn give_back(
        &self,
        refunds: Vec<Refund>,
        decided: Instant,
    ) -> Result<u64, LimiterError> {
        if refunds.is_empty() {
            return Ok(0);
        }
        let pool = self.pool().clone();
        let shared = std::sync::Arc::clone(&self.shared);
        let timeout = self.timeout();
        // Twice the Redis timeout: checkout plus the call itself.
        let margin = timeout * 2;
        let work = tokio::task::spawn_blocking(move || {
            let mut conn = pool
                .get_timeout(timeout)
                .map_err(|e| LimiterError::Other(e.to_string()))?;
            let mut given = 0u64;
            for r in &refunds {
                // Measured here, just before the call, not when queued.
                if !r.safe(decided.elapsed(), margin) {
                    continue;
                }
                let mut call = script().prepare_invoke();
                call.key(&r.key);
                wire::algorithm(&mut call, &r.algorithm);
                let result: redis::RedisResult<i64> = call.arg(r.cost).invoke(&mut *conn);
                // Given back (or maybe, when the reply was lost): a denial
                // of this key remembered before may no longer hold.
                if let Some(cache) = &shared.deny_cache {
                    cache.forget(&r.key);
                }
                let n = result.map_err(LimiterError::from)?;
                given += n.max(0) as u64;
            }
            Ok(given)
        });
        match tokio::time::timeout(timeout * 4, work).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(LimiterError::Stopped),
            Err(_) => Err(LimiterError::Timeout),
        }
    }
}
