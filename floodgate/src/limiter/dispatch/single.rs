//! Sending batches to one server (a URL, or the master the Sentinels
//! name): the transport of the dispatcher threads
//! ([`Dispatch::Threads`](crate::limiter::Dispatch::Threads)) and of the
//! per-worker lane.
//!
//! The batch is written straight into one reused `redis::Cmd` (no buffer
//! per argument, as `redis::Script`'s invocation makes), as an `FCALL` of
//! the function library or an `EVALSHA` of the script (see `program.rs`).
//! When Redis answers that it has neither (a new server, `FUNCTION FLUSH`,
//! `SCRIPT FLUSH`) the dispatcher loads it and sends the same call again:
//! the first call did not run, so nothing is counted twice.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{retain_waiting, Job, Transport};
use crate::limiter::conn::{call, no_longer_named, CallError, Conn, Manager, SendError};
use crate::limiter::program::{self, Missing, Program, Shipping};
use crate::limiter::shared::Shared;
use crate::limiter::wire;
use crate::limiter::{Check, Decision, LimiterError};

/// One server, on a connection of the transport's own.
pub(crate) struct Single {
    /// Opens the transport's own connection (not from the pool: a pool
    /// that failed to connect waits out its back-off before it tries again,
    /// and a decision must not wait for that once Redis is back).
    pub(crate) manager: Manager,
    program: &'static Program,
    /// How the batch goes: the library's function until Redis refuses it.
    shipping: Shipping,
    pub(crate) shared: Arc<Shared>,
    /// See `deadline_margin`.
    margin: Duration,
    pub(crate) conn: Option<Conn>,
    /// The command being sent, kept to reuse its buffers.
    pub(crate) cmd: redis::Cmd,
    /// The command as it goes on the wire, reused likewise.
    pub(crate) packed: Vec<u8>,
}

impl Transport for Single {
    fn shared(&self) -> &Shared {
        &self.shared
    }

    fn reset(&mut self) {
        self.conn = None;
    }

    fn holds(&self, _job: &Job) -> bool {
        self.shared.breaker.holding()
    }

    fn send(
        &mut self,
        batch: &mut Vec<Job>,
    ) -> Result<Vec<Result<Decision, LimiterError>>, LimiterError> {
        let mut result = self.call(batch);
        if let Err(SendError::Unsent(e)) = &result {
            // Redis never received the call: send it once more, on a new
            // connection, for the callers still waiting.
            log::info!("redis connection broken before the call was sent ({e}); sending it again on a new connection");
            retain_waiting(batch);
            if batch.is_empty() {
                return Ok(Vec::new());
            }
            result = self.call(batch);
        }
        let reply = result.map_err(|(SendError::Unsent(e) | SendError::Failed(e))| e)?;
        Ok(results(batch, &reply))
    }
}

/// Each job's decision in a batch's reply, in order.
pub(crate) fn results(batch: &[Job], reply: &wire::Replied) -> Vec<Result<Decision, LimiterError>> {
    let mut at = 0;
    batch
        .iter()
        .map(|job| wire::job(job.checks.iter(), reply, &mut at))
        .collect()
}

impl Single {
    /// A transport to the server `manager` opens connections to.
    pub(crate) fn new(
        manager: Manager,
        program: &'static Program,
        shared: Arc<Shared>,
        margin: Duration,
    ) -> Single {
        Single {
            manager,
            program,
            shipping: Shipping::Function,
            shared,
            margin,
            conn: None,
            cmd: redis::Cmd::new(),
            packed: Vec::new(),
        }
    }

    /// Gives up the connection it holds, if any (it is usable: one that is
    /// not is never kept).
    pub(crate) fn take_conn(&mut self) -> Option<Conn> {
        self.conn.take()
    }

    /// What an error answered to the batch says is missing for the way
    /// it was shipped: then the call ran nothing.
    fn missing(&self, e: &redis::RedisError) -> Option<Missing> {
        match (program::missing(e), self.shipping) {
            (Some(Missing::Script), Shipping::Script) => Some(Missing::Script),
            (Some(m @ (Missing::Function | Missing::Functions)), Shipping::Function) => Some(m),
            _ => None,
        }
    }

    /// Writes `batch` as one script call into the reused command; returns
    /// the number of values its reply must hold.
    pub(crate) fn build(&mut self, batch: &[Job]) -> usize {
        let (clock, margin) = (&self.shared.clock, self.margin);
        let jobs = batch.iter().map(|job| wire::JobArgs {
            now_ms: job.now_ms,
            deadline: job.redis_deadline(clock, margin),
            checks: job.checks.iter(),
        });
        wire::batch(&mut self.cmd, self.program.target(self.shipping), jobs)
    }

    /// Makes sure the dispatcher holds a connection Redis answers on: the one
    /// it has, if Redis answered on it a moment ago or answers a `TIME` now;
    /// else a new one, opened before `deadline`, that answers a `TIME`. The
    /// check is what keeps a decision off a connection that died while idle
    /// (see [`Single::call`]); it costs one round trip, and only after
    /// the dispatcher has been idle for [`IDLE_CHECK`](crate::limiter::conn::IDLE_CHECK). `TIME` (safe to
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
            conn.time(&self.shared.clock).map_err(LimiterError::from)?;
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
    /// - Redis answered that it has not got the script or the library, or
    ///   that it refuses `FCALL`: it ran nothing.
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
    /// idle for [`IDLE_CHECK`](crate::limiter::conn::IDLE_CHECK) gets a PING first (safe to repeat), and a
    /// failed PING means a new connection, before the batch is written.
    /// What remains is a connection that breaks within that last moment:
    /// its batch fails and `on_redis_error` applies; nothing counts twice.
    fn call(&mut self, batch: &[Job]) -> Result<wire::Replied, SendError> {
        let deadline = batch
            .iter()
            .map(|j| j.deadline)
            .max()
            .unwrap_or_else(Instant::now);
        self.connect(deadline).map_err(SendError::Failed)?;
        let expected = self.build(batch);
        let Some(conn) = self.conn.as_mut() else {
            return Err(SendError::Failed(LimiterError::Stopped));
        };
        let first = call(conn, &self.cmd, &mut self.packed);
        self.finish(first, expected, batch)
    }

    /// What a script call came to, `first` being its first reply: when
    /// Redis answers that it has not got the library or the script, that is
    /// loaded and the same call sent again (the first did not run), and
    /// when it refuses the library, `batch` is sent as a script from now
    /// on; a connection left unusable is let go.
    pub(crate) fn finish(
        &mut self,
        first: Result<wire::Values, CallError>,
        mut expected: usize,
        batch: &[Job],
    ) -> Result<wire::Replied, SendError> {
        let result: Result<wire::Values, CallError> = match first {
            Err(CallError::Answered(e)) => match (self.missing(&e), self.conn.take()) {
                (Some(missing), Some(mut conn)) => {
                    // A new server may have lost every key: the denials
                    // remembered from the old one are forgotten.
                    if missing != Missing::Functions {
                        if let Some(cache) = &self.shared.deny_cache {
                            cache.clear();
                        }
                    }
                    let loaded = self.program.load(&mut *conn, missing);
                    conn.note(&loaded);
                    let result = match loaded {
                        Ok(shipping) => {
                            if shipping != self.shipping {
                                self.shipping = shipping;
                                expected = self.build(batch);
                            }
                            call(&mut conn, &self.cmd, &mut self.packed)
                        }
                        Err(e) => Err(CallError::Answered(e)),
                    };
                    self.conn = Some(conn);
                    result
                }
                (_, conn) => {
                    self.conn = conn;
                    Err(CallError::Answered(e))
                }
            },
            other => other,
        };
        if self.conn.as_ref().is_some_and(|c| !c.usable()) {
            // Let the next batch open a fresh connection.
            self.conn = None;
        }
        match result {
            Ok(wire::Values(values)) => {
                let (reply, redis_us) =
                    wire::replied(values, expected).map_err(SendError::Failed)?;
                self.shared.clock.sample(redis_us, Instant::now());
                Ok(reply)
            }
            Err(e) => {
                let limiter_error = LimiterError::from(e.error().clone());
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

/// Decides `jobs` (each a pinned clock in ms or `None` for Redis `TIME`,
/// and its checks) in ONE call of the batch function on `conn` (the
/// library is loaded when Redis has not got it), written and read exactly as a dispatcher does
/// with a batch: for tests of what batching does.
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
    let program = Program::batch();
    let mut cmd = redis::Cmd::new();
    let args = jobs.iter().map(|(now_ms, deadline, checks)| wire::JobArgs {
        now_ms: *now_ms,
        deadline: *deadline,
        checks: checks.iter(),
    });
    let expected = wire::batch(&mut cmd, program.target(Shipping::Function), args);
    // The library is loaded only where it is missing, as the dispatchers
    // do: loading it again would start its state afresh, and what one call
    // leaves to the next is part of what the tests check.
    let wire::Values(values) = match cmd.query(conn) {
        Err(e) if program::missing(&e) == Some(Missing::Function) => {
            program::load_library(conn, program.library()).map_err(LimiterError::from)?;
            cmd.query(conn)
        }
        other => other,
    }
    .map_err(LimiterError::from)?;
    let (reply, _) = wire::replied(values, expected)?;
    let mut at = 0;
    Ok(jobs
        .iter()
        .map(|(_, _, checks)| wire::job(checks.iter(), &reply, &mut at))
        .collect())
}
