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

use tokio::sync::oneshot;

use super::super::conn::{call, no_longer_named, CallError, Conn, Manager, SendError};
use super::super::limiter::Shared;
use super::super::{Algorithm, Check, Decision, LimiterError, Outcome};
use super::{next_batch, retain_waiting, Job};

pub use crate::limit::wire::SCRIPT_SOURCE;

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
