//! [`Limiter`]: what the filter asks for decisions, and what it is made of
//! (the pool, the dispatchers, the breaker, the shared counters).
//!
//! By default ([`Dispatch::Worker`]) each worker thread (actix's, or a tokio
//! runtime's) sends the decisions of one scheduler tick itself (see `lane.rs`); otherwise [`Limiter::decide`]
//! puts a job (the checks of one request and a oneshot sender) on a bounded
//! channel that dispatcher threads drain (see `dispatch/`), with the other
//! jobs of its worker's tick (`tick.rs`), and awaits the oneshot. A
//! decision is sent a second time only when the first attempt provably
//! never reached Redis; `dispatch/single.rs` spells out the rule.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::breaker::{Breaker, Gate, PROBE_WAIT};
use super::clock::{deadline_margin, RedisClock};
use super::conn::{manager, pool_of, spoils, Manager, Pool};
use super::deny_cache::{DenyCache, Remembered};
#[cfg(feature = "cluster")]
use super::dispatch::cluster::health::MasterHealths;
use super::dispatch::single::Single;
use super::join::Joined;
use super::local::LocalLimiter;
use super::program::Program;
use super::shared::{Job, Shared};
use super::topology::RedisConn;
use super::DISPATCHERS;
use super::{Check, Decision, Dispatch, LimiterError, LimiterOptions, RedisConfig};
use crate::units::MAX_BREAKER;

/// Messages (one job, or the jobs of one worker's tick) that may wait for a
/// dispatcher before new ones are refused.
const QUEUE: usize = 16_384;

/// Decides checks against Redis. Cheap to share (`Arc`); dropping the last
/// handle stops the dispatcher threads.
pub struct Limiter {
    queue: SyncSender<Vec<Job>>,
    pool: Pool,
    pub(crate) timeout: Duration,
    pub(crate) shared: Arc<Shared>,
    local: LocalLimiter,
    dispatch: Dispatch,
    /// Tells this limiter's worker lanes apart from other limiters'.
    pub(crate) id: u64,
    /// What a worker lane is made of.
    pub(crate) manager: Manager,
    /// The batch script, as a library and as a script.
    pub(crate) program: &'static Program,
    /// Redis Cluster mode: keys carry hash tags, and batches go by slot.
    cluster: bool,
    /// Where operator changes are published (see `operator/`).
    channel: String,
}

/// `FLOODGATE_DISPATCH=threads` (or `worker`) overrides the dispatch the
/// options ask for: for comparing the two on one build (`scripts/bench`).
fn dispatch(asked: Dispatch) -> Dispatch {
    match std::env::var("FLOODGATE_DISPATCH").as_deref() {
        Ok("threads") => Dispatch::Threads,
        Ok("worker") => Dispatch::Worker,
        _ => asked,
    }
}

/// Source of [`Limiter`] ids.
static LIMITERS: AtomicU64 = AtomicU64::new(0);

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl Limiter {
    /// Builds the pool and starts the dispatcher threads.
    ///
    /// Refuses, as [`LimiterError::Other`], what a configuration file could
    /// not hold either: a pool of fewer than 3 or more than 1024
    /// connections, a timeout of 0 or over a minute, an unusable key
    /// prefix, a breaker period over 10 minutes. (A breaker period of 0,
    /// which the file does not take, means no breaker: every decision
    /// tries Redis.)
    pub fn new(config: &RedisConfig, options: LimiterOptions) -> Result<Limiter, LimiterError> {
        if let Some((place, what)) = config.refused() {
            return Err(LimiterError::Other(format!("{place}: {what}")));
        }
        if options.breaker > MAX_BREAKER {
            return Err(LimiterError::Other(format!(
                "[limiter] breaker: must be at most 10 minutes, got {:?}",
                options.breaker
            )));
        }
        // One source for the pool and the dispatchers: in Sentinel mode they
        // share what the Sentinels said last.
        let manager = manager(config)?;
        let pool = pool_of(config, manager.clone());
        let (queue, rx) = sync_channel::<Vec<Job>>(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let program = Program::batch();
        let id = LIMITERS.fetch_add(1, Ordering::Relaxed);
        let local = LocalLimiter::default();
        let top = Arc::new(super::shared::Tally::default());
        super::operator::start_top_writer(&top, pool.clone(), &config.key_prefix);
        let shared = Arc::new(Shared {
            top,
            bans: Arc::clone(local.bans()),
            errors: AtomicU64::new(0),
            late: AtomicU64::new(0),
            clock: RedisClock::new(),
            breaker: Breaker::new(options.breaker),
            deny_cache: options.deny_cache.then(DenyCache::default),
            penalties: super::operator::penalty_writer(pool.clone(), &config.key_prefix),
            #[cfg(feature = "cluster")]
            masters: MasterHealths::new(config, options.breaker),
        });
        let cluster = !config.cluster.is_empty();
        #[cfg(feature = "cluster")]
        if cluster {
            // A cluster's batches are split by slot: see `dispatch/cluster/`.
            super::dispatch::cluster::start(
                config,
                &rx,
                &shared,
                deadline_margin(config.timeout),
                DISPATCHERS,
            )?;
        }
        for i in 0..if cluster { 0 } else { DISPATCHERS } {
            let transport = Single::new(
                manager.clone(),
                program,
                Arc::clone(&shared),
                deadline_margin(config.timeout),
            );
            super::dispatch::spawn(format!("floodgate-redis-{i}"), &rx, transport)?;
        }
        super::operator::listen(config, manager.source.clone(), &shared, local.bans());
        Ok(Limiter {
            channel: super::operator::channel(&config.key_prefix),
            queue,
            pool,
            timeout: config.timeout,
            shared,
            local,
            // A cluster's batches need the slot-aware dispatcher threads.
            dispatch: if cluster {
                Dispatch::Threads
            } else {
                dispatch(options.dispatch)
            },
            id,
            manager,
            program,
            cluster,
        })
    }

    /// Of the checks that `eligible` (by index) lets the denial cache
    /// answer, the remembered denial that frees last, with its index, and
    /// tallied for [`Limiter::top_blocking`]; `None`: Redis must decide (or
    /// the cache is off). Nothing is asked of Redis.
    pub(crate) fn remembered_denial(
        &self,
        checks: &[Check],
        eligible: impl Fn(usize) -> bool,
        now: Instant,
    ) -> Option<(usize, Remembered)> {
        let cache = self.deny_cache()?;
        let (i, denial) = checks
            .iter()
            .enumerate()
            .filter(|(i, _)| eligible(*i))
            .filter_map(|(i, c)| cache.denial(&c.key, c.cost, now).map(|d| (i, d)))
            .max_by_key(|(_, d)| d.wait)?;
        self.tally_denial(&checks[i].key);
        Some((i, denial))
    }

    /// Remembers the denials Redis answered for `checks` (those `eligible`
    /// lets the cache answer), asked at `asked`: a ban until it ends, a
    /// denial until the request would fit, but not the denials of a check
    /// with a penalty (each of them counts in Redis towards a ban).
    pub(crate) fn remember_denials(
        &self,
        checks: &[Check],
        decision: &Decision,
        eligible: impl Fn(usize) -> bool,
        asked: Instant,
    ) {
        let Some(cache) = self.deny_cache() else {
            return;
        };
        let answered = Instant::now();
        for (i, (c, o)) in checks.iter().zip(&decision.outcomes).enumerate() {
            if o.allowed || !eligible(i) {
                continue;
            }
            if o.banned {
                // Until the ban ends; an operator's change is published,
                // and every process forgets it.
                cache.remember_ban(&c.key, o.wait, asked, answered);
            } else if c.penalty.is_none() {
                cache.remember(&c.key, c.cost, o.wait, o.quota, asked, answered);
            }
        }
    }

    /// The denial cache, when `deny_cache` is on.
    pub(crate) fn deny_cache(&self) -> Option<&DenyCache> {
        self.shared.deny_cache.as_ref()
    }

    /// The in-process limiter for `on_redis_error = "local"`.
    pub(crate) fn local(&self) -> &LocalLimiter {
        &self.local
    }

    /// Decides `checks` with this process's own counts, as the filter does
    /// under `on_redis_error = "local"` when Redis cannot decide: the same
    /// limits, each counted here alone, all charged or none; a ban this
    /// process has learnt from Redis still denies until it ends. Never
    /// waits. Checks on one key are joined as [`Limiter::decide`] joins them.
    pub(crate) fn decide_here(&self, checks: &[Check]) -> Result<Decision, LimiterError> {
        let (checks, joined) = Joined::new(checks.to_vec())?;
        Ok(joined.decision(self.local.decide(&checks)))
    }

    /// Forgets what the process remembers about keys (cached denials and
    /// local counts): the rules changed.
    #[doc(hidden)] // the floodgate binary's, not part of the API
    pub fn forget_keys(&self) {
        if let Some(cache) = self.deny_cache() {
            cache.clear();
        }
        self.local.clear();
    }

    /// Whether the breaker is open (Redis failed and has not answered
    /// since); on a cluster, whether any master's is.
    pub fn breaker_open(&self) -> bool {
        #[cfg(feature = "cluster")]
        if self.shared.masters.any_open() {
            return true;
        }
        self.shared.breaker.is_open()
    }

    /// Decisions the script skipped because their caller had given up.
    pub fn late_count(&self) -> u64 {
        self.shared.late.load(Ordering::Relaxed)
    }

    /// Decides the checks of one request, atomically: either every check is
    /// recorded (the request is allowed by every enforce check) or none is.
    /// Answers within `redis.timeout` (plus scheduling) whatever Redis does.
    ///
    /// Checks on the same key are decided as one check of their summed
    /// cost (each gets its outcome), so together they never take more than
    /// the limit holds; they must ask the same question of it (algorithm,
    /// mode, penalty) and their costs must fit in its quota together, else
    /// [`LimiterError::Check`].
    pub async fn decide(&self, checks: Vec<Check>) -> Result<Decision, LimiterError> {
        self.submit(checks, None).await
    }

    /// As [`Limiter::decide`], with the clock pinned to `now_ms` (ms since the
    /// epoch) instead of Redis `TIME`: for property tests of the algorithms.
    #[cfg(feature = "__internals")]
    #[doc(hidden)]
    pub async fn decide_at(
        &self,
        now_ms: u64,
        checks: Vec<Check>,
    ) -> Result<Decision, LimiterError> {
        self.submit(checks, Some(now_ms)).await
    }

    async fn submit(
        &self,
        checks: Vec<Check>,
        now_ms: Option<u64>,
    ) -> Result<Decision, LimiterError> {
        if checks.is_empty() {
            return Ok(Decision {
                outcomes: Vec::new(),
                allowed: true,
            });
        }
        let (checks, joined) = Joined::new(checks)?;
        self.submit_joined(checks, now_ms)
            .await
            .map(|d| joined.decision(d))
    }

    async fn submit_joined(
        &self,
        checks: Vec<Check>,
        now_ms: Option<u64>,
    ) -> Result<Decision, LimiterError> {
        if self.cluster {
            // A cluster's breakers are per master, and only the
            // dispatchers know which master a key is on.
            return self.call(checks, now_ms, false).await;
        }
        let breaker = &self.shared.breaker;
        // Held across the call: if this future is dropped while it waits
        // (its client went away), the guard still lets the next one probe.
        let probing = match Breaker::gate(breaker) {
            Gate::Closed => None,
            Gate::Probe(probing) => Some(probing),
            Gate::Open => return Err(LimiterError::BreakerOpen),
            Gate::Probing => {
                // Another request probes Redis: what it comes to decides
                // this one's way (a Redis that is back fails no decision).
                breaker.await_probe(PROBE_WAIT.min(self.timeout)).await;
                match Breaker::gate(breaker) {
                    Gate::Closed => None,
                    Gate::Probe(probing) => Some(probing),
                    Gate::Open | Gate::Probing => return Err(LimiterError::BreakerOpen),
                }
            }
        };
        let result = self.call(checks, now_ms, probing.is_some()).await;
        breaker.observe(&result, probing.is_some());
        drop(probing);
        result
    }

    async fn call(
        &self,
        checks: Vec<Check>,
        now_ms: Option<u64>,
        probe: bool,
    ) -> Result<Decision, LimiterError> {
        let (reply, mut answer) = oneshot::channel();
        let asked = Instant::now();
        let deadline = asked + self.timeout;
        let job = Job {
            checks,
            now_ms,
            asked,
            deadline,
            probe,
            reply,
        };
        // The probe of an open breaker goes through the dispatcher threads,
        // alone: if Redis is still stalled, no worker waits for it.
        let on_worker = !probe && super::tick::on_runtime();
        if self.dispatch == Dispatch::Worker && on_worker {
            let lane = self.lane();
            let queued = lane.flushes();
            if lane.gathered.add(job) {
                // Every request made ready in this tick joins the batch.
                let (counted, lane) = (Arc::clone(&lane), Arc::clone(&lane));
                super::tick::after_tick(move || counted.gathered.len(), move || lane.flush());
            }
            // Most answers come in the flush itself: those need no timer.
            match Self::lane_answer(&mut answer, &lane, queued).await {
                Some(Ok(result)) => return result,
                Some(Err(_)) => return Err(LimiterError::Stopped),
                None => {}
            }
        } else if on_worker {
            super::tick::push(self.id, job, &self.queue, &self.shared);
        } else {
            super::tick::hand_over(&self.queue, &self.shared, vec![job]);
        }
        self.wait_for_answer(answer, deadline).await
    }

    /// Awaits a job's answer until `deadline` (see [`answered_by`]).
    async fn wait_for_answer(
        &self,
        answer: oneshot::Receiver<Result<Decision, LimiterError>>,
        deadline: Instant,
    ) -> Result<Decision, LimiterError> {
        match answered_by(answer, deadline).await {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(LimiterError::Stopped),
            None => Err(self.count(LimiterError::Timeout)),
        }
    }

    fn count(&self, e: LimiterError) -> LimiterError {
        self.shared.errors.fetch_add(1, Ordering::Relaxed);
        e
    }

    /// Redis errors and timeouts seen so far (for `/metrics`).
    pub fn error_count(&self) -> u64 {
        self.shared.errors.load(Ordering::Relaxed)
    }

    /// The connection pool (the site's and `/readyz`'s own Redis work goes
    /// through [`Limiter::with_redis`]).
    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Runs `work` once on a connection from the limiter's pool, for an
    /// application's own data in the same Redis (whatever the mode: one
    /// server, Sentinel or Cluster). It runs on the runtime's blocking threads,
    /// never on a worker thread. The checkout hands out only a connection
    /// Redis answers on (one that sat idle is checked with a PING first);
    /// `work` is never repeated, since after a failure nobody can tell
    /// which of its commands ran, and a connection that saw an I/O error is
    /// dropped instead of going back to the pool. On a Cluster, keep the
    /// keys of one pipeline or transaction in one hash slot.
    ///
    /// The outer error says no connection was had in time (or the blocking
    /// pool is gone); the inner result is what `work` returned.
    pub async fn with_redis<T, F>(&self, work: F) -> Result<redis::RedisResult<T>, LimiterError>
    where
        F: FnOnce(&mut RedisConn) -> redis::RedisResult<T> + Send + 'static,
        T: Send + 'static,
    {
        let pool = self.pool.clone();
        tokio::task::spawn_blocking(move || {
            let mut conn = pool
                .get()
                .map_err(|e| LimiterError::Other(format!("redis pool: {e}")))?;
            let result = work(&mut conn);
            conn.note(&result);
            Ok(result)
        })
        .await
        .map_err(|e| LimiterError::Other(e.to_string()))?
    }

    /// Whether keys carry a hash tag (Redis Cluster mode): the rules of one
    /// identity then share a slot, so their all-or-nothing stays one call.
    #[doc(hidden)] // the floodgate binary's, not part of the API
    pub fn hash_tags(&self) -> bool {
        self.cluster
    }

    /// The channel operator changes are published on.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// The configured bound on every Redis operation.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// [`Limiter::ping`] on the runtime's blocking threads, answered within
    /// the timeout whatever the PING takes (on a stalled Redis, a pooled
    /// connection's check at checkout and then the PING can each take the
    /// whole timeout): what a readiness endpoint asks. Past the timeout,
    /// [`LimiterError::Timeout`].
    pub async fn ready(self: &Arc<Self>) -> Result<(), LimiterError> {
        let limiter = Arc::clone(self);
        let ping = tokio::task::spawn_blocking(move || limiter.ping());
        match tokio::time::timeout(self.timeout, ping).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => Err(LimiterError::Other(e.to_string())),
            Err(_) => Err(LimiterError::Timeout),
        }
    }

    /// Whether Redis is ready for decisions: PING through the pool, bounded
    /// by the timeout. Blocking.
    ///
    /// It agrees with the breaker: a PING answered while the breaker is
    /// open closes it, so that once this answers `Ok` the next decision is
    /// asked of Redis; and while the breaker stays open this is an error.
    /// On a cluster, each master whose breaker is open is sent a PING of
    /// its own too.
    pub fn ping(&self) -> Result<(), LimiterError> {
        self.ping_pool()?;
        #[cfg(feature = "cluster")]
        if self.cluster {
            return self.shared.masters.ping_open(self.timeout);
        }
        self.shared.breaker.close();
        Ok(())
    }

    /// PING through the pool, bounded by the timeout. Blocking.
    ///
    /// The checkout already replaces a pooled connection that died while
    /// idle. If the PING still fails on a broken connection (it broke a
    /// moment ago), it is sent once more on another connection: a PING can
    /// be repeated safely. A checkout that timed out is not retried (Redis
    /// is away, and the answer must come within the timeout).
    fn ping_pool(&self) -> Result<(), LimiterError> {
        let deadline = Instant::now() + self.timeout;
        let mut retried = false;
        loop {
            let wait = deadline.saturating_duration_since(Instant::now());
            let mut conn = self
                .pool
                .get_timeout(wait)
                .map_err(|e| LimiterError::Other(e.to_string()))?;
            match conn.ping() {
                Ok(()) => return Ok(()),
                Err(e) if spoils(&e) && !retried && Instant::now() < deadline => {
                    log::debug!("readiness PING on a broken connection ({e}); trying another");
                    retried = true;
                }
                Err(e) => return Err(LimiterError::from(e)),
            }
        }
    }
}

/// Awaits `answer` until `deadline`; `None` once it has passed. There the
/// channel is closed before the caller gives up: an answer sent before that
/// is still taken, and one sent after it fails to send, so that the sender
/// knows it undelivered (a dispatcher then gives back what it took).
/// Dropping the receiver when the timer fires would instead lose an answer
/// sent between its last poll and the drop, its units still charged.
async fn answered_by<T>(
    mut answer: oneshot::Receiver<T>,
    deadline: Instant,
) -> Option<Result<T, oneshot::error::RecvError>> {
    if let Ok(received) = tokio::time::timeout_at(deadline.into(), &mut answer).await {
        return Some(received);
    }
    answer.close();
    answer.try_recv().ok().map(Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer sent about when its caller gives up is either taken by
    /// the caller or refused to the sender, never both lost: the sender
    /// can tell every answer that was not taken.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_answer_at_the_deadline_is_taken_or_refused() {
        let (mut taken, mut refused) = (0, 0);
        for i in 0..3000u32 {
            let (tx, rx) = oneshot::channel();
            let deadline = Instant::now() + Duration::from_micros(200);
            // Sent on another thread, spread over the deadline and the
            // timer's millisecond after it; now and then before the wait
            // begins, or only once the caller has given up (so that both
            // ways are met whatever the machine's speed).
            let gave_up = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let seen = Arc::clone(&gave_up);
            let at = deadline + Duration::from_micros(u64::from(i % 64) * 20)
                - Duration::from_micros(40);
            let sender = std::thread::spawn(move || match i % 256 {
                0 => tx.send(i).is_ok(),
                255 => {
                    while !seen.load(Ordering::SeqCst) {
                        std::thread::yield_now();
                    }
                    tx.send(i).is_ok()
                }
                _ => {
                    while Instant::now() < at {
                        std::hint::spin_loop();
                    }
                    tx.send(i).is_ok()
                }
            });
            if i % 256 == 0 {
                // (Sent before the wait begins.)
                while !sender.is_finished() {
                    std::thread::yield_now();
                }
            }
            let got = answered_by(rx, deadline).await;
            gave_up.store(true, Ordering::SeqCst);
            let sent = sender.join().unwrap();
            match got {
                Some(Ok(v)) => {
                    assert_eq!(v, i);
                    assert!(sent);
                    taken += 1;
                }
                Some(Err(_)) => unreachable!("the sender never drops unsent"),
                None => {
                    assert!(!sent, "answer {i} was sent, then lost");
                    refused += 1;
                }
            }
        }
        // Both ways were met (the test would prove nothing otherwise).
        assert!(taken > 0 && refused > 0, "taken {taken}, refused {refused}");
    }
}
