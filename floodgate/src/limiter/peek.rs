//! Looking at a key without touching it: [`Limiter::peek`] answers what a
//! decision would answer now, through the decision script's own algorithm
//! functions run in read-only mode (`lua/peek.lua`), so a page that shows
//! usage has no key layout or refill arithmetic of its own.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::conn::Pool;
use super::wire::{self, Args as _, PEEK_SOURCE};
use super::{Check, Limiter, LimiterError, Outcome};

fn script() -> &'static redis::Script {
    static SCRIPT: OnceLock<redis::Script> = OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(PEEK_SOURCE))
}

impl Limiter {
    /// What [`Limiter::decide`] would answer for each check on its own,
    /// now, without recording anything: allowed, remaining and wait exactly
    /// as a decision of that check alone would give them, and not one byte
    /// of Redis changed (no entry, count, parameter or TTL; a key that a
    /// reload left with other parameters or another algorithm's state is
    /// answered for as the decision would see it, and left as it is).
    ///
    /// Every check is answered alone (`enforce` plays no part), in the
    /// order given. Uses a pooled connection and answers within
    /// `redis.timeout`; on a cluster, each key is one call to its master.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use floodgate_limiter::config::RedisConfig;
    /// use floodgate_limiter::limiter::{Check, Limiter, LimiterOptions};
    /// use floodgate_limiter::rule::Algorithm;
    ///
    /// # async fn show(config: &RedisConfig) -> Result<(), Box<dyn std::error::Error>> {
    /// let limiter = Limiter::new(config, LimiterOptions::default())?;
    /// let algorithm = Algorithm::sliding_window(5, Duration::from_secs(10))?;
    /// let check = Check::new("floodgate:check:ip:192.0.2.7", algorithm);
    /// let now = limiter.peek(vec![check]).await?;
    /// // A request now would leave `remaining`; nothing was counted.
    /// println!("allowed {}, {} left", now[0].allowed, now[0].remaining);
    /// # Ok(()) }
    /// ```
    pub async fn peek(&self, checks: Vec<Check>) -> Result<Vec<Outcome>, LimiterError> {
        self.peek_with(checks, None).await
    }

    /// As [`Limiter::peek`], with the clock pinned to `now_ms` (ms since the
    /// epoch) instead of Redis `TIME`, as `Limiter::decide_at` pins it.
    #[cfg(feature = "__internals")]
    #[doc(hidden)]
    pub async fn peek_at(
        &self,
        now_ms: u64,
        checks: Vec<Check>,
    ) -> Result<Vec<Outcome>, LimiterError> {
        self.peek_with(checks, Some(now_ms)).await
    }

    async fn peek_with(
        &self,
        checks: Vec<Check>,
        now_ms: Option<u64>,
    ) -> Result<Vec<Outcome>, LimiterError> {
        if checks.is_empty() {
            return Ok(Vec::new());
        }
        let (checks, joined) = super::join::Joined::new(checks)?;
        let pool = self.pool().clone();
        let timeout = self.timeout();
        let one_per_call = self.hash_tags();
        let work = tokio::task::spawn_blocking(move || {
            peek_blocking(&pool, timeout, one_per_call, &checks, now_ms)
        });
        match tokio::time::timeout(timeout, work).await {
            Ok(Ok(result)) => result.map(|outcomes| joined.spread(outcomes)),
            Ok(Err(e)) => Err(LimiterError::Other(format!("the peek did not finish: {e}"))),
            Err(_) => Err(LimiterError::Timeout),
        }
    }
}

/// Runs the peek on a pooled connection: one call for all the checks, or
/// one per check (a cluster, whose keys live on different masters).
fn peek_blocking(
    pool: &Pool,
    timeout: Duration,
    one_per_call: bool,
    checks: &[Check],
    now_ms: Option<u64>,
) -> Result<Vec<Outcome>, LimiterError> {
    let deadline = Instant::now() + timeout;
    let mut conn = pool
        .get_timeout(timeout)
        .map_err(|e| LimiterError::Other(format!("redis pool: {e}")))?;
    let groups: Vec<&[Check]> = if one_per_call {
        checks.chunks(1).collect()
    } else {
        vec![checks]
    };
    let mut outcomes = Vec::with_capacity(checks.len());
    for group in groups {
        if Instant::now() >= deadline {
            return Err(LimiterError::Timeout);
        }
        let mut call = script().prepare_invoke();
        call.put_opt(now_ms);
        for check in group {
            call.key(&check.key);
            wire::algorithm(&mut call, &check.algorithm);
            call.arg(check.cost);
        }
        // A peek writes nothing, so the reload after NOSCRIPT that `invoke`
        // does (sending the call again) can never count anything twice.
        let result: redis::RedisResult<Vec<i64>> = call.invoke(&mut **conn);
        conn.note(&result);
        let values = result.map_err(LimiterError::from)?;
        wire::peek(group, &values, &mut outcomes)?;
    }
    Ok(outcomes)
}
