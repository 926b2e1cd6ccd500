//! Sending batches to one server (a URL, or the master the Sentinels
//! name): the dispatcher threads of [`Dispatch::Threads`](crate::limit::Dispatch::Threads),
//! and the per-worker lane's sender.
//!
//! The batch is written straight into one reused `redis::Cmd` (no buffer
//! per argument, as `redis::Script`'s invocation makes); the Script gives
//! the SHA, and on `NOSCRIPT` (after a restart or `SCRIPT FLUSH`) the
//! dispatcher loads the script and sends the same call again: the first
//! call did not run, so nothing is counted twice.

use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::super::conn::{call, no_longer_named, CallError, Conn, Manager, SendError};
use super::super::limiter::Shared;
use super::super::{Check, Decision, LimiterError};
use super::{next_batch, retain_waiting, Job};

use crate::limit::wire::{self, SCRIPT_SOURCE};

pub(crate) struct Dispatcher {
    pub(crate) rx: Arc<Mutex<Receiver<Job>>>,
    /// Opens the dispatcher's own connection (not from the pool: a pool
    /// that failed to connect waits out its back-off before it tries again,
    /// and a decision must not wait for that once Redis is back).
    pub(crate) manager: Manager,
    pub(crate) script: Arc<redis::Script>,
    pub(crate) shared: Arc<Shared>,
    /// See `deadline_margin`.
    pub(crate) margin: Duration,
    pub(crate) conn: Option<Conn>,
    /// The command being sent, kept to reuse its buffers.
    pub(crate) cmd: redis::Cmd,
    /// The command as it goes on the wire, reused likewise.
    pub(crate) packed: Vec<u8>,
}

impl Dispatcher {
    pub(crate) fn run(mut self) {
        while let Some(batch) = self.next_batch() {
            self.process(batch);
        }
    }

    /// Decides one batch with one script call and answers every job.
    /// Blocking.
    pub(crate) fn process(&mut self, mut batch: Vec<Job>) {
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
        let jobs = batch.iter().map(|job| wire::JobArgs {
            now_ms: job.now_ms,
            deadline: clock.redis_ms(job.deadline - margin),
            checks: job.checks.iter(),
        });
        let expected = wire::batch(&mut self.cmd, self.script.get_hash(), jobs);
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
            Ok(mut values) => {
                let redis_us =
                    wire::take_clock(&mut values, expected).map_err(SendError::Failed)?;
                self.shared.clock.sample(redis_us, Instant::now());
                Ok(values)
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

/// Sends every job its decision from the script's reply; returns how many
/// jobs failed alone (the script could not decide one of their checks) and
/// how many the script skipped as late.
fn deliver(batch: Vec<Job>, values: &[i64]) -> (u64, u64) {
    let mut at = 0;
    let (mut failed, mut late) = (0, 0);
    for job in batch {
        let result = wire::job(job.checks.iter(), values, &mut at);
        match result {
            Err(LimiterError::Late) => late += 1,
            Err(_) => failed += 1,
            Ok(_) => {}
        }
        let _ = job.reply.send(result);
    }
    (failed, late)
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
    let mut cmd = redis::Cmd::new();
    let args = jobs.iter().map(|(now_ms, deadline, checks)| wire::JobArgs {
        now_ms: *now_ms,
        deadline: *deadline,
        checks: checks.iter(),
    });
    let expected = wire::batch(&mut cmd, script.get_hash(), args);
    let mut values: Vec<i64> = cmd.query(conn).map_err(LimiterError::from)?;
    wire::take_clock(&mut values, expected)?;
    let mut at = 0;
    Ok(jobs
        .iter()
        .map(|(_, _, checks)| wire::job(checks.iter(), &values, &mut at))
        .collect())
}
