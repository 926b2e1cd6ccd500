//! Talking to Redis: the r2d2 pool of synchronous connections, the Lua
//! script, and the dispatcher threads that batch pending decisions.
//!
//! Actix workers never touch a Redis connection. [`Limiter::decide`] puts a
//! job (the checks of one request and a oneshot sender) on a bounded
//! channel and awaits the oneshot. A few dispatcher threads, each holding
//! one pooled connection, take the first waiting job, drain whatever else
//! is already queued (never waiting to fill a batch) and send the whole
//! batch as ONE `EVALSHA`; the script decides every job in order and
//! returns one flat array. One reply per batch means a silent server costs
//! one read timeout, not one per job.
//!
//! The batch is written straight into one reused `redis::Cmd` (no buffer
//! per argument, as `redis::Script`'s invocation makes); the Script gives
//! the SHA, and on `NOSCRIPT` (after a restart or `SCRIPT FLUSH`) the
//! dispatcher loads the script and sends the same call again: the first
//! call did not run, so nothing is counted twice.
//!
//! Broken connections (see [`Conn`]): a connection that saw an I/O error
//! is never used again (not even after a read timeout, so a later call
//! never waits behind a late reply), and one that has been idle is checked
//! with a PING before anything is sent on it, because a connection whose
//! server went away while it sat idle fails only AFTER the next command has
//! been written, when nobody can tell any more whether that command ran.
//! A decision is sent a second time only when the first attempt provably
//! never reached Redis; the dispatcher's `send` spells out the exact rule.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::ConnectionLike as _;
use tokio::sync::oneshot;

use super::deny_cache::DenyCache;
use super::local::LocalLimiter;
#[cfg(feature = "cluster")]
use super::masters::MasterHealths;
use super::source::{Master, RedisConn, Source};
use super::{
    Algorithm, Check, Decision, Dispatch, LimiterError, LimiterOptions, Outcome, RedisConfig,
};

/// The Lua that Redis runs: one function per algorithm, then the batch driver.
pub const SCRIPT_SOURCE: &str = lua_with_algorithms!("lua/batch.lua");

/// Dispatcher threads; two let one gather a batch while the other waits on Redis.
pub(super) const DISPATCHERS: usize = 2;
/// Most jobs sent in one script call.
const MAX_BATCH: usize = 256;
/// Jobs that may wait for a dispatcher before new ones are refused.
const QUEUE: usize = 16_384;

/// A connection that has not been answered on for this long is checked with
/// a PING before it is used. Shorter than any server restart (a process
/// that dies, and a new one that starts and listens, takes milliseconds),
/// so a connection that broke while Redis was away is always checked; and
/// under load, when batches follow each other, no PING is added.
const IDLE_CHECK: Duration = Duration::from_millis(1);

/// The r2d2 pool of synchronous Redis connections, for the site's own Redis
/// work and `/readyz`. (The dispatcher threads open their own.)
pub(crate) type Pool = r2d2::Pool<Manager>;

pub(super) struct Job {
    pub(super) checks: Vec<Check>,
    /// Pinned clock in ms (tests); `None` = Redis `TIME`.
    pub(super) now_ms: Option<u64>,
    /// When the caller stops waiting.
    pub(super) deadline: Instant,
    /// Whether this job probes Redis for the open breaker.
    pub(super) probe: bool,
    pub(super) reply: oneshot::Sender<Result<Decision, LimiterError>>,
}

/// How much earlier than its caller's deadline a job's deadline in Redis
/// time is set: the time a reply may take to travel back and be handed
/// over. A script that runs before the deadline it was sent answers in
/// time; one that runs after it decides nothing.
fn deadline_margin(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(2), Duration::from_millis(25))
}

/// The dispatchers' estimate of Redis's clock: the offset from the local
/// monotonic clock, taken from the last reply that carried Redis's time.
/// It is a lower bound: Redis read its clock before the reply arrived, so
/// Redis's clock at any later local instant is at least the local instant
/// plus the offset (unless Redis's clock is stepped back).
#[derive(Debug)]
pub(super) struct RedisClock {
    epoch: Instant,
    offset_us: AtomicI64,
    known: AtomicBool,
}

impl RedisClock {
    pub(super) fn new() -> RedisClock {
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
    pub(super) fn sample(&self, redis_us: i64, received: Instant) {
        // One microsecond off for the local reading's rounding.
        let offset = redis_us - self.local_us(received) - 1;
        self.offset_us.store(offset, Ordering::Relaxed);
        self.known.store(true, Ordering::Release);
    }

    /// Redis's clock at local instant `at`, in ms, at least (`None` until
    /// Redis has told its time once).
    pub(super) fn redis_ms(&self, at: Instant) -> Option<i64> {
        if !self.known.load(Ordering::Acquire) {
            return None;
        }
        let us = self.local_us(at) + self.offset_us.load(Ordering::Relaxed);
        Some(us.div_euclid(1000))
    }
}

/// The breaker: after a call failed (timeout, refused, broken), no call is
/// made for `period`; then one request's call probes Redis, and its answer
/// closes the breaker (or its failure opens it for another period).
///
/// The right to probe is a [`Probing`] guard: it is given back when the
/// guard is dropped, whatever became of the call (answered, failed, or its
/// caller gone while it waited), so a probe can never keep the breaker
/// from probing again.
#[derive(Debug)]
pub(super) struct Breaker {
    period: Duration,
    epoch: Instant,
    /// µs after `epoch` until which no call is made; 0 = closed.
    open_until: AtomicU64,
    /// A probe is on its way.
    probing: AtomicBool,
}

/// What the breaker lets a request do.
pub(super) enum Gate<B: Deref<Target = Breaker>> {
    /// Ask Redis.
    Closed,
    /// Ask Redis, as the probe: keep the guard until the call has come to
    /// something (no one else probes meanwhile).
    Probe(Probing<B>),
    /// Do not ask.
    Open,
}

/// The right to probe an open breaker, held while the probe is on its way;
/// dropping it (however the probe ended) lets the next one probe.
pub(super) struct Probing<B: Deref<Target = Breaker>>(B);

impl<B: Deref<Target = Breaker>> Drop for Probing<B> {
    fn drop(&mut self) {
        self.0.probing.store(false, Ordering::Release);
    }
}

impl Breaker {
    pub(super) fn new(period: Duration) -> Breaker {
        Breaker {
            period,
            epoch: Instant::now(),
            open_until: AtomicU64::new(0),
            probing: AtomicBool::new(false),
        }
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// What `breaker` lets a call do now.
    pub(super) fn gate<B: Deref<Target = Breaker>>(breaker: B) -> Gate<B> {
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
            Err(_) => Gate::Open,
        }
    }

    /// Whether calls are held back now (the period has not run out).
    fn holding(&self) -> bool {
        let until = self.open_until.load(Ordering::Acquire);
        until != 0 && self.now_us() < until
    }

    /// Whether the next call would probe: open, its period over, and no
    /// probe on its way.
    #[cfg(feature = "cluster")]
    pub(super) fn probe_due(&self) -> bool {
        let until = self.open_until.load(Ordering::Acquire);
        until != 0 && self.now_us() >= until && !self.probing.load(Ordering::Acquire)
    }

    pub(super) fn is_open(&self) -> bool {
        self.open_until.load(Ordering::Acquire) != 0
    }

    pub(super) fn trip(&self, why: &LimiterError) {
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

    pub(super) fn close(&self) {
        if self.open_until.swap(0, Ordering::AcqRel) != 0 {
            log::info!("redis answers again; breaker closed");
        }
    }

    /// Moves the breaker on what a call came to.
    fn observe(&self, result: &Result<Decision, LimiterError>, probe: bool) {
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
                | LimiterError::Unsupported(_),
            ) => {}
        }
    }
}

/// What the limiter and its dispatcher threads share.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) errors: AtomicU64,
    /// Jobs the script skipped because their deadline had passed.
    pub(super) late: AtomicU64,
    pub(super) clock: RedisClock,
    breaker: Breaker,
    pub(super) deny_cache: Option<DenyCache>,
    /// Redis Cluster: each master's breaker and clock, by address.
    #[cfg(feature = "cluster")]
    pub(super) masters: MasterHealths,
}

/// Decides checks against Redis. Cheap to share (`Arc`); dropping the last
/// handle stops the dispatcher threads.
pub struct Limiter {
    queue: SyncSender<Job>,
    pool: Pool,
    timeout: Duration,
    pub(super) shared: Arc<Shared>,
    local: LocalLimiter,
    dispatch: Dispatch,
    /// Tells this limiter's worker lanes apart from other limiters'.
    id: u64,
    /// What a worker lane is made of.
    rx: Arc<Mutex<Receiver<Job>>>,
    manager: Manager,
    script: Arc<redis::Script>,
    /// Redis Cluster mode: keys carry hash tags, and batches go by slot.
    cluster: bool,
    /// Where operator changes are published (see `operator.rs`).
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

thread_local! {
    /// This thread's worker lane of each limiter used on it.
    static LANES: RefCell<HashMap<u64, Rc<Lane>>> = RefCell::new(HashMap::new());
}

/// One actix worker's way to Redis ([`Dispatch::Worker`]): the jobs of the
/// current scheduler tick, and a connection of its own.
struct Lane {
    queue: RefCell<Vec<Job>>,
    /// A task that will send the queue is spawned and has not run yet.
    scheduled: Cell<bool>,
    sender: RefCell<Dispatcher>,
}

impl Lane {
    /// Sends what the tick gathered: ONE script call per [`MAX_BATCH`]
    /// jobs, blocking this worker for the round trip.
    fn flush(&self) {
        self.scheduled.set(false);
        let mut jobs = std::mem::take(&mut *self.queue.borrow_mut());
        let Ok(mut sender) = self.sender.try_borrow_mut() else {
            // Not reachable: a flush runs to its end before another starts.
            self.queue.borrow_mut().append(&mut jobs);
            return;
        };
        while !jobs.is_empty() {
            let rest = jobs.split_off(jobs.len().min(MAX_BATCH));
            sender.process(jobs);
            jobs = rest;
        }
    }
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// A Redis connection that knows when Redis last answered on it and
/// whether an error has left it in an unknown state. Derefs to the
/// [`RedisConn`] (one server, or a cluster).
pub(crate) struct Conn {
    inner: RedisConn,
    /// When Redis last answered on this connection (or when it was opened).
    answered: Instant,
    /// An I/O error (or an unparsable reply) left the connection in an
    /// unknown state: it goes back to nobody.
    spoiled: bool,
    /// Sentinel mode: the master it was opened to. Before each use it is
    /// compared with the master the Sentinels name now (see
    /// [`Source::still_named`]).
    master: Option<Master>,
}

impl Conn {
    /// Wraps a connection to one server, just opened (a cluster master's).
    #[cfg(feature = "cluster")]
    pub(super) fn single(conn: redis::Connection) -> Conn {
        Conn {
            inner: RedisConn::Single(conn),
            answered: Instant::now(),
            spoiled: false,
            master: None,
        }
    }

    /// Whether Redis answered on it so recently that it needs no check.
    pub(super) fn recently_answered(&self) -> bool {
        self.answered.elapsed() < IDLE_CHECK
    }

    /// PING: safe to send as often as needed. Records the outcome.
    pub(crate) fn ping(&mut self) -> redis::RedisResult<()> {
        let result = redis::cmd("PING")
            .query::<String>(&mut self.inner)
            .and_then(|pong| match pong.as_str() {
                "PONG" => Ok(()),
                _ => Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "PING answered",
                    pong,
                ))),
            });
        self.note(&result);
        result
    }

    /// `TIME`: like a PING (safe to send as often as needed), and it tells
    /// `clock` Redis's time. Records the outcome.
    pub(super) fn time(&mut self, clock: &RedisClock) -> redis::RedisResult<()> {
        let result = redis::cmd("TIME").query::<(i64, i64)>(&mut self.inner);
        let received = Instant::now();
        self.note(&result);
        let (secs, micros) = result?;
        clock.sample(secs * 1_000_000 + micros, received);
        Ok(())
    }

    /// Records what using the connection came to: an answer refreshes it;
    /// an error that may have left it out of step with Redis (I/O, a reply
    /// that could not be read) spoils it, and it is then dropped rather than
    /// reused. An error reply from Redis is an answer like any other.
    pub(crate) fn note<T>(&mut self, result: &redis::RedisResult<T>) {
        match result {
            Err(e) if spoils(e) => self.spoiled = true,
            _ => self.answered = Instant::now(),
        }
    }

    /// Marks the connection as not to be used again.
    pub(super) fn spoil(&mut self) {
        self.spoiled = true;
    }

    /// Whether it may be used again.
    fn usable(&self) -> bool {
        !self.spoiled && self.inner.is_open()
    }
}

impl Deref for Conn {
    type Target = RedisConn;

    fn deref(&self) -> &RedisConn {
        &self.inner
    }
}

impl DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut RedisConn {
        &mut self.inner
    }
}

/// Whether an error leaves the connection in an unknown state, or pointed
/// at the wrong server: any I/O error (refused, reset, EOF, broken pipe,
/// timeout: after a timeout the late reply is still on its way), a reply
/// that could not be parsed, or a server that is no longer the master
/// (READONLY: a failover demoted it; the next connection asks the
/// Sentinels again) or no longer serves the slot.
pub(super) fn spoils(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::ReadOnly
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::Moved
                    | ServerErrorKind::Ask
                    | ServerErrorKind::ClusterDown
            )
        )
}

/// Opens [`Conn`]s for the pool and the dispatchers: every connect is bounded
/// by the timeout (a server that does not answer SYNs cannot hold a thread
/// for minutes), every connection gets read and write timeouts, and a
/// connection taken from the pool after sitting idle is checked with a PING
/// (and replaced by the pool when the PING fails).
///
/// In Sentinel mode, a connection is also checked before every use, busy or
/// not, against the master the Sentinels name ([`Manager::still_named`]):
/// after a switchover the old master answers PINGs, as a master, until the
/// Sentinels demote it, and whatever is written to it meanwhile is lost
/// with the demotion.
#[derive(Debug, Clone)]
pub(crate) struct Manager {
    source: Source,
    timeout: Duration,
}

impl Manager {
    /// A new connection, open within `within` (at most the timeout).
    fn open(&self, within: Duration) -> redis::RedisResult<Conn> {
        let within = within.min(self.timeout).max(Duration::from_millis(1));
        let (inner, master) = self.source.open(within, self.timeout)?;
        Ok(Conn {
            inner,
            answered: Instant::now(),
            spoiled: false,
            master,
        })
    }

    /// Whether `conn` goes to the master the Sentinels name now (always
    /// true outside Sentinel mode, and while no Sentinel answers). One that
    /// does not is spoiled: it is not used again.
    fn still_named(&self, conn: &mut Conn) -> bool {
        if self.source.still_named(conn.master.as_ref()) {
            return true;
        }
        conn.spoil();
        false
    }
}

impl r2d2::ManageConnection for Manager {
    type Connection = Conn;
    type Error = redis::RedisError;

    fn connect(&self) -> Result<Conn, redis::RedisError> {
        self.open(self.timeout)
    }

    /// Run at every checkout: a connection answered on a moment ago is
    /// taken as is; any other gets a PING first. A dead one (Redis restarted
    /// or closed it while it sat in the pool) fails the PING, and the pool
    /// drops it and hands out another or a new one: nothing the caller
    /// sends ever goes to a connection that broke while it was idle. In
    /// Sentinel mode, one to a server the Sentinels no longer name as
    /// master is dropped likewise, however recently it was answered on.
    fn is_valid(&self, conn: &mut Conn) -> Result<(), redis::RedisError> {
        if !self.still_named(conn) {
            return Err(no_longer_named(conn));
        }
        if conn.recently_answered() {
            return Ok(());
        }
        conn.ping()
    }

    /// Run when a connection comes back: a spoiled or closed one is dropped.
    fn has_broken(&self, conn: &mut Conn) -> bool {
        !conn.usable()
    }
}

/// Why a connection is dropped at checkout although it works.
fn no_longer_named(conn: &Conn) -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Client,
        "the Sentinels name another master than this connection's",
        conn.master
            .as_ref()
            .map_or_else(String::new, ToString::to_string),
    ))
}

/// Builds the pool without connecting: the site starts even while Redis is
/// down, and connects when it returns.
fn pool_of(config: &RedisConfig, manager: Manager) -> Pool {
    r2d2::Pool::builder()
        .max_size(config.pool_size)
        .min_idle(Some(0))
        .test_on_check_out(true)
        .connection_timeout(config.timeout)
        .build_unchecked(manager)
}

fn manager(config: &RedisConfig) -> Result<Manager, LimiterError> {
    if let Some((key, why)) = config.missing_feature() {
        return Err(LimiterError::Unsupported(format!("{key}: {why}")));
    }
    let source = Source::from_config(config).map_err(LimiterError::from)?;
    Ok(Manager {
        source,
        timeout: config.timeout,
    })
}

impl Limiter {
    /// Builds the pool and starts the dispatcher threads.
    pub fn new(config: &RedisConfig, options: LimiterOptions) -> Result<Limiter, LimiterError> {
        // One source for the pool and the dispatchers: in Sentinel mode they
        // share what the Sentinels said last.
        let manager = manager(config)?;
        let pool = pool_of(config, manager.clone());
        let (queue, rx) = sync_channel::<Job>(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let script = Arc::new(redis::Script::new(SCRIPT_SOURCE));
        let id = LIMITERS.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::new(Shared {
            errors: AtomicU64::new(0),
            late: AtomicU64::new(0),
            clock: RedisClock::new(),
            breaker: Breaker::new(options.breaker),
            deny_cache: options.deny_cache.then(DenyCache::default),
            #[cfg(feature = "cluster")]
            masters: MasterHealths::new(config, options.breaker),
        });
        let cluster = !config.cluster.is_empty();
        #[cfg(feature = "cluster")]
        if cluster {
            // A cluster's batches are split by slot: see `cluster.rs`.
            super::cluster::start(
                config,
                &rx,
                &shared,
                deadline_margin(config.timeout),
                DISPATCHERS,
            )?;
        }
        for i in 0..if cluster { 0 } else { DISPATCHERS } {
            let dispatcher = Dispatcher {
                rx: Arc::clone(&rx),
                manager: manager.clone(),
                script: Arc::clone(&script),
                shared: Arc::clone(&shared),
                margin: deadline_margin(config.timeout),
                conn: None,
                cmd: redis::Cmd::new(),
                packed: Vec::new(),
            };
            std::thread::Builder::new()
                .name(format!("floodgate-redis-{i}"))
                .spawn(move || dispatcher.run())
                .map_err(|e| LimiterError::Other(format!("cannot start a dispatcher: {e}")))?;
        }
        let local = LocalLimiter::default();
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
            rx,
            manager,
            script,
            cluster,
        })
    }

    /// The denial cache, when `deny_cache` is on.
    pub fn deny_cache(&self) -> Option<&DenyCache> {
        self.shared.deny_cache.as_ref()
    }

    /// The in-process limiter for `on_redis_error = "local"`.
    pub fn local(&self) -> &LocalLimiter {
        &self.local
    }

    /// Forgets what the process remembers about keys (cached denials and
    /// local counts): the rules changed.
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
    pub async fn decide(&self, checks: Vec<Check>) -> Result<Decision, LimiterError> {
        self.submit(checks, None).await
    }

    /// As [`Limiter::decide`], with the clock pinned to `now_ms` (ms since the
    /// epoch) instead of Redis `TIME`: for property tests of the algorithms.
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
        let (reply, answer) = oneshot::channel();
        let job = Job {
            checks,
            now_ms,
            deadline: Instant::now() + self.timeout,
            probe,
            reply,
        };
        // The probe of an open breaker goes through the dispatcher threads:
        // if Redis is still stalled, no worker waits for it.
        if self.dispatch == Dispatch::Worker && !probe && actix_rt::Arbiter::try_current().is_some()
        {
            let lane = self.lane();
            lane.queue.borrow_mut().push(job);
            if !lane.scheduled.replace(true) {
                actix_rt::spawn(async move {
                    // Every request made ready in this tick joins the batch.
                    tokio::task::yield_now().await;
                    lane.flush();
                });
            }
        } else {
            match self.queue.try_send(job) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => return Err(self.count(LimiterError::Overloaded)),
                Err(TrySendError::Disconnected(_)) => return Err(LimiterError::Stopped),
            }
        }
        match tokio::time::timeout(self.timeout, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(LimiterError::Stopped),
            Err(_) => Err(self.count(LimiterError::Timeout)),
        }
    }

    /// This thread's lane for this limiter (made on first use).
    fn lane(&self) -> Rc<Lane> {
        LANES.with(|lanes| {
            let mut lanes = lanes.borrow_mut();
            let lane = lanes.entry(self.id).or_insert_with(|| {
                Rc::new(Lane {
                    queue: RefCell::new(Vec::new()),
                    scheduled: Cell::new(false),
                    sender: RefCell::new(Dispatcher {
                        rx: Arc::clone(&self.rx),
                        manager: self.manager.clone(),
                        script: Arc::clone(&self.script),
                        shared: Arc::clone(&self.shared),
                        margin: deadline_margin(self.timeout),
                        conn: None,
                        cmd: redis::Cmd::new(),
                        packed: Vec::new(),
                    }),
                })
            });
            Rc::clone(lane)
        })
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
    /// server, Sentinel or Cluster). It runs on actix's blocking threads,
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
        actix_web::web::block(move || {
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
    pub fn hash_tags(&self) -> bool {
        self.cluster
    }

    /// The channel operator changes are published on.
    pub(super) fn channel(&self) -> &str {
        &self.channel
    }

    /// The configured bound on every Redis operation.
    pub fn timeout(&self) -> Duration {
        self.timeout
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

struct Dispatcher {
    rx: Arc<Mutex<Receiver<Job>>>,
    /// Opens the dispatcher's own connection (not from the pool: a pool
    /// that failed to connect waits out its back-off before it tries again,
    /// and a decision must not wait for that once Redis is back).
    manager: Manager,
    script: Arc<redis::Script>,
    shared: Arc<Shared>,
    /// See [`deadline_margin`].
    margin: Duration,
    conn: Option<Conn>,
    /// The command being sent, kept to reuse its buffers.
    cmd: redis::Cmd,
    /// The command as it goes on the wire, reused likewise.
    packed: Vec<u8>,
}

/// Why a batch got no decision.
enum SendError {
    /// The call never reached Redis whole, so Redis did not run it: it may
    /// be sent again.
    Unsent(LimiterError),
    /// Anything else: the call may have run, or there is no connection.
    Failed(LimiterError),
}

/// How one call on a connection failed.
enum CallError {
    /// Writing it failed: Redis never received it whole.
    Unsent(redis::RedisError),
    /// Written whole, then no reply could be read: it may have run.
    Unanswered(redis::RedisError),
    /// Redis answered with an error, or with something unreadable.
    Answered(redis::RedisError),
}

impl CallError {
    fn error(&self) -> &redis::RedisError {
        match self {
            CallError::Unsent(e) | CallError::Unanswered(e) | CallError::Answered(e) => e,
        }
    }
}

/// Sends `cmd` on `conn` and reads its reply, telling apart a write that
/// failed (nothing ran) from a reply that never came (it may have run).
/// Records the outcome on the connection.
fn call<T: redis::FromRedisValue>(
    conn: &mut Conn,
    cmd: &redis::Cmd,
    packed: &mut Vec<u8>,
) -> Result<T, CallError> {
    packed.clear();
    cmd.write_packed_command(packed);
    if let Err(e) = conn.send_packed_command(packed) {
        conn.spoil();
        return Err(CallError::Unsent(e));
    }
    let reply = loop {
        match conn.recv_response() {
            // Out-of-band RESP3 pushes are no reply.
            Ok(redis::Value::Push { .. }) => continue,
            Ok(value) => break value,
            Err(e) => {
                conn.spoil();
                return Err(CallError::Unanswered(e));
            }
        }
    };
    let result = reply
        .extract_error()
        .and_then(|v| redis::from_redis_value(v).map_err(redis::RedisError::from));
    conn.note(&result);
    result.map_err(CallError::Answered)
}

impl Dispatcher {
    fn run(mut self) {
        while let Some(batch) = self.next_batch() {
            self.process(batch);
        }
    }

    /// Decides one batch with one script call and answers every job.
    /// Blocking.
    fn process(&mut self, mut batch: Vec<Job>) {
        {
            // Jobs whose caller has already given up are not decided: they
            // would take quota for a request that was answered without it.
            retain_waiting(&mut batch);
            if self.shared.breaker.holding() {
                // Redis failed a moment ago: these callers get the error
                // policy now instead of waiting behind it (a probe is sent).
                let (probes, held): (Vec<Job>, Vec<Job>) = batch.into_iter().partition(|j| j.probe);
                for job in held {
                    let _ = job.reply.send(Err(LimiterError::BreakerOpen));
                }
                batch = probes;
            }
            if batch.is_empty() {
                return;
            }
            let mut result = self.send(&batch);
            if let Err(SendError::Unsent(e)) = &result {
                // Redis never received the call: send it once more, on a
                // new connection, for the callers still waiting.
                log::info!("redis connection broken before the call was sent ({e}); sending it again on a new connection");
                retain_waiting(&mut batch);
                if batch.is_empty() {
                    return;
                }
                result = self.send(&batch);
            }
            match result {
                Ok(values) => {
                    let (failed, late) = deliver(batch, &values);
                    self.shared.errors.fetch_add(failed, Ordering::Relaxed);
                    self.shared.late.fetch_add(late, Ordering::Relaxed);
                }
                Err(SendError::Unsent(e) | SendError::Failed(e)) => {
                    self.shared.errors.fetch_add(1, Ordering::Relaxed);
                    crate::logging::repeated!(
                        &crate::logging::REDIS_FAILED,
                        "redis error, {} decisions affected: {}",
                        batch.len(),
                        crate::logging::Escaped(&e.to_string())
                    );
                    for job in batch {
                        let _ = job.reply.send(Err(e.clone()));
                    }
                }
            }
        }
    }

    /// Blocks for the first job, then takes whatever else is already queued.
    fn next_batch(&self) -> Option<Vec<Job>> {
        next_batch(&self.rx)
    }

    /// Makes sure the dispatcher holds a connection Redis answers on: the one
    /// it has, if Redis answered on it a moment ago or answers a `TIME` now;
    /// else a new one, opened before `deadline`, that answers a `TIME`. The
    /// check is what keeps a decision off a connection that died while idle
    /// (see [`Dispatcher::send`]); it costs one round trip, and only after
    /// the dispatcher has been idle for [`IDLE_CHECK`]. `TIME` (safe to
    /// repeat, like PING) also tells Redis's clock, so a job never leaves
    /// without a deadline on it.
    ///
    /// In Sentinel mode the connection must also go to the master the
    /// Sentinels name now, checked before every batch (even one that follows
    /// another at once, which needs no `TIME`): after a switchover, counts
    /// written to the old master would be lost when it is demoted.
    fn connect(&mut self, deadline: Instant) -> Result<(), LimiterError> {
        if let Some(conn) = self.conn.as_mut() {
            if !self.manager.still_named(conn) {
                log::info!(
                    "{}: opening a connection to the master the Sentinels name now",
                    no_longer_named(conn)
                );
                self.conn = None;
            }
        }
        if let Some(conn) = self.conn.as_mut() {
            if !conn.recently_answered() {
                match conn.time(&self.shared.clock) {
                    Ok(()) => {}
                    // Redis is slow, not gone: a new connection would wait
                    // as long again.
                    Err(e) if e.is_timeout() => {
                        self.conn = None;
                        return Err(LimiterError::Timeout);
                    }
                    Err(e) => {
                        log::info!("redis connection found broken ({e}); opening a new one");
                        self.conn = None;
                    }
                }
            }
        }
        if self.conn.is_none() {
            let within = deadline.saturating_duration_since(Instant::now());
            let mut conn = self.manager.open(within).map_err(LimiterError::from)?;
            conn.time(&self.shared.clock).map_err(|e| {
                if e.is_timeout() {
                    LimiterError::Timeout
                } else {
                    LimiterError::Redis(e)
                }
            })?;
            self.conn = Some(conn);
        }
        Ok(())
    }

    /// One script call for the whole batch.
    ///
    /// When may a call be sent again? Only when Redis cannot have run it:
    /// - the write failed (broken pipe, reset, timeout): redis-rs writes the
    ///   whole command or returns the error, and Redis runs only a command it
    ///   received whole; a part it did receive dies with the connection;
    /// - Redis answered `NOSCRIPT`: it did not run the script.
    ///
    /// A read that fails after a complete write (EOF, reset, timeout) is
    /// never repeated, whatever its cause: Redis may have run the script and
    /// then died or dropped the connection before the reply reached us, and
    /// a second call would count those requests twice. That includes the
    /// case of a server that restarted while the connection sat idle: the
    /// dead socket still accepts the write (the kernel buffers it; the
    /// peer's reset comes back later), so the error only shows on the read.
    /// The new server never saw that call, so repeating it would be right,
    /// but from the connection alone it is indistinguishable from a call
    /// that ran. So that case is kept from happening instead: a connection
    /// idle for [`IDLE_CHECK`] gets a PING first (safe to repeat), and a
    /// failed PING means a new connection, before the batch is written.
    /// What remains is a connection that breaks within that last moment:
    /// its batch fails and `on_redis_error` applies; nothing counts twice.
    fn send(&mut self, batch: &[Job]) -> Result<Vec<i64>, SendError> {
        let deadline = batch
            .iter()
            .map(|j| j.deadline)
            .max()
            .unwrap_or_else(Instant::now);
        self.connect(deadline).map_err(SendError::Failed)?;
        let (clock, margin) = (&self.shared.clock, self.margin);
        let expected = write_batch(&mut self.cmd, self.script.get_hash(), batch, |job| {
            clock.redis_ms(job.deadline - margin)
        });
        let Some(conn) = self.conn.as_mut() else {
            return Err(SendError::Failed(LimiterError::Stopped));
        };
        let result: Result<Vec<i64>, CallError> = match call(conn, &self.cmd, &mut self.packed) {
            // The script is not loaded (a new server, or SCRIPT FLUSH): the
            // call did not run, so load it and send the same batch again.
            // A new server may have lost every key: the denials remembered
            // from the old one are forgotten.
            Err(CallError::Answered(e))
                if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                if let Some(cache) = &self.shared.deny_cache {
                    cache.clear();
                }
                let loaded = self.script.load(&mut **conn);
                conn.note(&loaded);
                match loaded {
                    Ok(_) => call(conn, &self.cmd, &mut self.packed),
                    Err(e) => Err(CallError::Answered(e)),
                }
            }
            other => other,
        };
        if self.conn.as_ref().is_some_and(|c| !c.usable()) {
            // Let the next batch open a fresh connection.
            self.conn = None;
        }
        match result {
            Ok(values) if values.len() == expected + 1 => {
                if let Some(&redis_us) = values.last() {
                    self.shared.clock.sample(redis_us, Instant::now());
                }
                Ok(values)
            }
            Ok(values) => Err(SendError::Failed(LimiterError::Other(format!(
                "the script returned {} values, expected {}",
                values.len(),
                expected + 1
            )))),
            Err(e) => {
                let limiter_error = if e.error().is_timeout() {
                    LimiterError::Timeout
                } else {
                    LimiterError::Redis(e.error().clone())
                };
                match e {
                    CallError::Unsent(_) => Err(SendError::Unsent(limiter_error)),
                    CallError::Unanswered(_) | CallError::Answered(_) => {
                        Err(SendError::Failed(limiter_error))
                    }
                }
            }
        }
    }
}

/// Blocks for the first job, then takes whatever else is already queued.
pub(super) fn next_batch(rx: &Mutex<Receiver<Job>>) -> Option<Vec<Job>> {
    let rx = match rx.lock() {
        Ok(rx) => rx,
        Err(poisoned) => poisoned.into_inner(),
    };
    let first = rx.recv().ok()?;
    let mut batch = vec![first];
    while batch.len() < MAX_BATCH {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
    Some(batch)
}

/// Keeps the jobs whose caller is still waiting for the answer.
pub(super) fn retain_waiting(batch: &mut Vec<Job>) {
    let now = Instant::now();
    batch.retain(|j| j.deadline > now && !j.reply.is_closed());
}

/// Writes a batch as one `EVALSHA sha` into `cmd`, reusing its two buffers
/// (not one allocation per argument, as a `ScriptInvocation` makes). KEYS
/// and ARGV are laid out as `lua/batch.lua` reads them; `deadline` gives
/// each job's deadline in ms on Redis's clock (`None`: none). Returns the
/// number of decision values the reply must hold (Redis's clock follows
/// them).
fn write_batch(
    cmd: &mut redis::Cmd,
    sha: &str,
    batch: &[Job],
    deadline: impl Fn(&Job) -> Option<i64>,
) -> usize {
    cmd.clear();
    let keys: usize = batch.iter().map(|j| j.checks.len()).sum();
    cmd.arg("EVALSHA").arg(sha).arg(keys);
    for job in batch {
        for c in &job.checks {
            cmd.arg(c.key.as_str());
        }
    }
    cmd.arg(batch.len());
    for job in batch {
        match job.now_ms {
            Some(ms) => cmd.arg(ms),
            None => cmd.arg(""),
        };
        match deadline(job) {
            Some(ms) => cmd.arg(ms),
            None => cmd.arg(""),
        };
        cmd.arg(job.checks.len());
        for c in &job.checks {
            // Algorithm code, p1, p2 as the algorithm's Lua file names them.
            match c.algorithm {
                Algorithm::SlidingWindow { limit, window } => {
                    cmd.arg(1).arg(limit.get()).arg(window.as_millis() as u64)
                }
                Algorithm::FixedWindow { limit, window } => {
                    cmd.arg(2).arg(limit.get()).arg(window.as_millis() as u64)
                }
                Algorithm::TokenBucket { rate, burst } => cmd.arg(3).arg(rate).arg(burst.get()),
            };
            cmd.arg(c.cost).arg(c.flags().as_ref());
        }
    }
    3 * keys
}

/// Sends every job its decision from the script's reply; returns how many
/// jobs failed alone (the script could not decide one of their checks) and
/// how many the script skipped as late.
fn deliver(batch: Vec<Job>, values: &[i64]) -> (u64, u64) {
    let mut at = 0;
    let (mut failed, mut late) = (0, 0);
    for job in batch {
        let result = decision(&job.checks, values, &mut at);
        match result {
            Err(LimiterError::Late) => late += 1,
            Err(_) => failed += 1,
            Ok(_) => {}
        }
        let _ = job.reply.send(result);
    }
    (failed, late)
}

/// Reads the decision for `checks` from the reply at `at` (three values per
/// check, laid out as `lua/batch.lua` writes them) and moves `at` past it.
fn decision(checks: &[Check], values: &[i64], at: &mut usize) -> Result<Decision, LimiterError> {
    let start = *at;
    *at += 3 * checks.len();
    let Some(values) = values.get(start..*at) else {
        return Err(LimiterError::Other(
            "the script's reply is too short".into(),
        ));
    };
    if let [-2, ..] = *values {
        // Skipped: it reached Redis after its deadline.
        return Err(LimiterError::Late);
    }
    if let [-1, code, index, ..] = *values {
        let key = usize::try_from(index)
            .ok()
            .and_then(|i| checks.get(i))
            .map_or("a key", |c| c.key.as_str());
        return Err(LimiterError::Check(match code {
            1 => format!("{key} holds a Redis type that no rate-limit algorithm writes"),
            2 => format!("the parameters of the check on {key} are out of range"),
            3 => format!("{key} holds state that is not made of numbers"),
            _ => format!("the script failed on {key} (the Redis log says why)"),
        }));
    }
    let mut outcomes = Vec::with_capacity(checks.len());
    let mut allowed = true;
    for (check, v) in checks.iter().zip(values.chunks_exact(3)) {
        let outcome = Outcome::from_reply(v[0], v[1], v[2]);
        if check.enforce && !outcome.allowed {
            allowed = false;
        }
        outcomes.push(outcome);
    }
    Ok(Decision { outcomes, allowed })
}

/// Decides `jobs` (each a pinned clock in ms or `None` for Redis `TIME`,
/// and its checks) in ONE script call on `conn`, written and read exactly
/// as a dispatcher does with a batch: for tests of what batching does.
/// Blocking.
#[doc(hidden)]
pub fn decide_batch(
    conn: &mut redis::Connection,
    jobs: Vec<(Option<u64>, Vec<Check>)>,
) -> Result<Vec<Result<Decision, LimiterError>>, LimiterError> {
    let jobs = jobs
        .into_iter()
        .map(|(now, checks)| (now, None, checks))
        .collect();
    decide_batch_with_deadlines(conn, jobs)
}

/// As [`decide_batch`], each job with a deadline in ms on Redis's clock
/// (`None`: none): a job that reaches Redis at or after it is skipped and
/// comes back as [`LimiterError::Late`]. Blocking.
#[doc(hidden)]
pub fn decide_batch_with_deadlines(
    conn: &mut redis::Connection,
    jobs: Vec<(Option<u64>, Option<i64>, Vec<Check>)>,
) -> Result<Vec<Result<Decision, LimiterError>>, LimiterError> {
    let script = redis::Script::new(SCRIPT_SOURCE);
    script.load(conn).map_err(LimiterError::from)?;
    let deadlines: Vec<Option<i64>> = jobs.iter().map(|j| j.1).collect();
    let batch: Vec<Job> = jobs
        .into_iter()
        .map(|(now_ms, _, checks)| Job {
            checks,
            now_ms,
            deadline: Instant::now(),
            probe: false,
            reply: oneshot::channel().0,
        })
        .collect();
    let mut cmd = redis::Cmd::new();
    let next = std::cell::Cell::new(0);
    let expected = write_batch(&mut cmd, script.get_hash(), &batch, |_| {
        let i = next.get();
        next.set(i + 1);
        deadlines.get(i).copied().flatten()
    });
    let values: Vec<i64> = cmd.query(conn).map_err(LimiterError::from)?;
    if values.len() != expected + 1 {
        return Err(LimiterError::Other(format!(
            "the script returned {} values, expected {}",
            values.len(),
            expected + 1
        )));
    }
    let mut at = 0;
    Ok(batch
        .iter()
        .map(|job| decision(&job.checks, &values, &mut at))
        .collect())
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;
    use crate::limit::Algorithm;

    fn job(now_ms: Option<u64>, checks: Vec<Check>) -> Job {
        let (reply, _) = oneshot::channel();
        Job {
            checks,
            now_ms,
            deadline: Instant::now(),
            probe: false,
            reply,
        }
    }

    fn check(key: &str, algorithm: Algorithm, cost: u32, enforce: bool) -> Check {
        Check {
            key: key.to_string(),
            algorithm,
            cost,
            enforce,
            penalty: None,
        }
    }

    #[test]
    fn a_batch_is_one_evalsha_laid_out_as_batch_lua_reads_it() {
        let n = |v| NonZeroU32::new(v).unwrap();
        let batch = vec![
            job(
                Some(1_700_000_000_123),
                vec![
                    check(
                        "p:a:ip:1",
                        Algorithm::SlidingWindow {
                            limit: n(5),
                            window: Duration::from_secs(10),
                        },
                        1,
                        true,
                    ),
                    check(
                        "p:b:ip:1",
                        Algorithm::TokenBucket {
                            rate: 2.5,
                            burst: n(20),
                        },
                        2,
                        false,
                    ),
                ],
            ),
            job(
                None,
                vec![check(
                    "p:c:global:all",
                    Algorithm::FixedWindow {
                        limit: n(3),
                        window: Duration::from_millis(1500),
                    },
                    1,
                    true,
                )],
            ),
        ];
        let mut cmd = redis::Cmd::new();
        // A reused command starts afresh.
        cmd.arg("LEFTOVER");
        let deadlines = [Some(1_700_000_000_300), None];
        let expected_values = write_batch(&mut cmd, "SHA", &batch, |job| {
            deadlines[usize::from(job.now_ms.is_none())]
        });
        assert_eq!(expected_values, 9);
        let mut expected = redis::Cmd::new();
        for arg in [
            "EVALSHA",
            "SHA",
            "3",
            "p:a:ip:1",
            "p:b:ip:1",
            "p:c:global:all",
            "2",
            "1700000000123",
            "1700000000300",
            "2",
            "1",
            "5",
            "10000",
            "1",
            "1",
            "3",
            "2.5",
            "20",
            "2",
            "0",
            "",
            "",
            "1",
            "2",
            "3",
            "1500",
            "1",
            "1",
        ] {
            expected.arg(arg);
        }
        assert_eq!(
            String::from_utf8_lossy(&cmd.get_packed_command()),
            String::from_utf8_lossy(&expected.get_packed_command())
        );
    }

    #[test]
    fn a_failed_job_is_an_error_naming_its_key_and_the_next_job_is_read_after_it() {
        let n = |v| NonZeroU32::new(v).unwrap();
        let w = Algorithm::SlidingWindow {
            limit: n(5),
            window: Duration::from_secs(1),
        };
        let failed = [check("p:a:ip:1", w, 1, true), check("p:b:ip:1", w, 1, true)];
        let decided = [
            check("p:a:ip:2", w, 1, true),
            check("p:b:ip:2", w, 1, false),
        ];
        // Job one failed on its second check (type error); job two decided.
        let values = [-1, 1, 1, -1, 1, 1, 1, 4, 900, 0, 0, 250];
        let mut at = 0;
        match decision(&failed, &values, &mut at) {
            Err(LimiterError::Check(text)) => assert!(text.contains("p:b:ip:1"), "{text}"),
            other => panic!("{other:?}"),
        }
        let d = decision(&decided, &values, &mut at).unwrap();
        assert!(d.allowed, "a shadow check's denial does not deny");
        assert_eq!(d.outcomes[0].remaining, 4);
        assert_eq!(d.outcomes[1].wait, Duration::from_millis(250));
        assert_eq!(at, values.len());
        // A reply too short for the checks is an error, not a panic.
        assert!(matches!(
            decision(&decided, &values, &mut at),
            Err(LimiterError::Other(_))
        ));
    }
}
