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
//! call did not run, so nothing is counted twice. After a read timeout
//! redis-rs keeps the connection usable and discards the late reply itself,
//! so a later batch never reads an earlier batch's answer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::{Algorithm, Check, Decision, Outcome};
use crate::config::RedisConfig;

/// The Lua that Redis runs: one function per algorithm, then the batch driver.
pub const SCRIPT_SOURCE: &str = concat!(
    include_str!("lua/common.lua"),
    "\n",
    include_str!("lua/sliding_window.lua"),
    "\n",
    include_str!("lua/fixed_window.lua"),
    "\n",
    include_str!("lua/token_bucket.lua"),
    "\n",
    include_str!("lua/batch.lua"),
);

/// Dispatcher threads; two let one gather a batch while the other waits on Redis.
const DISPATCHERS: usize = 2;
/// Most jobs sent in one script call.
const MAX_BATCH: usize = 256;
/// Jobs that may wait for a dispatcher before new ones are refused.
const QUEUE: usize = 16_384;

/// The r2d2 pool of synchronous Redis connections.
pub type Pool = r2d2::Pool<redis::Client>;

/// Why a decision could not be made. The filter applies `on_redis_error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimiterError {
    /// Redis refused, failed or returned something unexpected.
    Redis(String),
    /// Redis answered, but could not decide this request: one of its rules
    /// has state or parameters the script cannot use. The other requests
    /// of the same batch were decided normally, so this says nothing about
    /// Redis's health.
    Check(String),
    /// No answer within `redis.timeout`.
    Timeout,
    /// Too many requests are already waiting for Redis.
    Overloaded,
    /// The dispatcher threads are gone (the process is stopping).
    Stopped,
}

impl std::fmt::Display for LimiterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LimiterError::Redis(e) => write!(f, "redis: {e}"),
            LimiterError::Check(e) => write!(f, "undecidable check: {e}"),
            LimiterError::Timeout => f.write_str("redis did not answer in time"),
            LimiterError::Overloaded => f.write_str("too many decisions waiting for redis"),
            LimiterError::Stopped => f.write_str("the limiter is stopped"),
        }
    }
}

impl std::error::Error for LimiterError {}

struct Job {
    checks: Vec<Check>,
    /// Pinned clock in ms (tests); `None` = Redis `TIME`.
    now_ms: Option<u64>,
    deadline: Instant,
    reply: oneshot::Sender<Result<Decision, LimiterError>>,
}

/// Decides checks against Redis. Cheap to share (`Arc`); dropping the last
/// handle stops the dispatcher threads.
pub struct Limiter {
    queue: SyncSender<Job>,
    pool: Pool,
    timeout: Duration,
    errors: Arc<AtomicU64>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Sets read and write timeouts on every new pooled connection.
#[derive(Debug)]
struct Timeouts(Duration);

impl r2d2::CustomizeConnection<redis::Connection, redis::RedisError> for Timeouts {
    fn on_acquire(&self, conn: &mut redis::Connection) -> Result<(), redis::RedisError> {
        conn.set_read_timeout(Some(self.0))?;
        conn.set_write_timeout(Some(self.0))
    }
}

/// Builds the pool without connecting: the site starts even while Redis is
/// down, and connects when it returns.
pub fn build_pool(config: &RedisConfig) -> Result<Pool, LimiterError> {
    let client =
        redis::Client::open(config.url.as_str()).map_err(|e| LimiterError::Redis(e.to_string()))?;
    Ok(r2d2::Pool::builder()
        .max_size(config.pool_size)
        .min_idle(Some(0))
        .test_on_check_out(false)
        .connection_timeout(config.timeout)
        .connection_customizer(Box::new(Timeouts(config.timeout)))
        .build_unchecked(client))
}

impl Limiter {
    /// Builds the pool and starts the dispatcher threads.
    pub fn new(config: &RedisConfig) -> Result<Limiter, LimiterError> {
        let pool = build_pool(config)?;
        let (queue, rx) = sync_channel::<Job>(QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        let script = Arc::new(redis::Script::new(SCRIPT_SOURCE));
        let errors = Arc::new(AtomicU64::new(0));
        for i in 0..DISPATCHERS {
            let dispatcher = Dispatcher {
                rx: Arc::clone(&rx),
                pool: pool.clone(),
                script: Arc::clone(&script),
                errors: Arc::clone(&errors),
                conn: None,
                cmd: redis::Cmd::new(),
            };
            std::thread::Builder::new()
                .name(format!("floodgate-redis-{i}"))
                .spawn(move || dispatcher.run())
                .map_err(|e| LimiterError::Redis(format!("cannot start a dispatcher: {e}")))?;
        }
        Ok(Limiter {
            queue,
            pool,
            timeout: config.timeout,
            errors,
        })
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
        let (reply, answer) = oneshot::channel();
        let job = Job {
            checks,
            now_ms,
            deadline: Instant::now() + self.timeout,
            reply,
        };
        match self.queue.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(self.count(LimiterError::Overloaded)),
            Err(TrySendError::Disconnected(_)) => return Err(LimiterError::Stopped),
        }
        match tokio::time::timeout(self.timeout, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(LimiterError::Stopped),
            Err(_) => Err(self.count(LimiterError::Timeout)),
        }
    }

    fn count(&self, e: LimiterError) -> LimiterError {
        self.errors.fetch_add(1, Ordering::Relaxed);
        e
    }

    /// Redis errors and timeouts seen so far (for `/metrics`).
    pub fn error_count(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// The connection pool, for the site's own Redis work (use it from
    /// `web::block`, never on a worker thread).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The configured bound on every Redis operation.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// PING through the pool, bounded by the timeout. Blocking.
    pub fn ping(&self) -> Result<(), LimiterError> {
        let mut conn = self
            .pool
            .get_timeout(self.timeout)
            .map_err(|e| LimiterError::Redis(e.to_string()))?;
        redis::cmd("PING")
            .query::<String>(&mut *conn)
            .map(|_| ())
            .map_err(|e| LimiterError::Redis(e.to_string()))
    }
}

struct Dispatcher {
    rx: Arc<Mutex<Receiver<Job>>>,
    pool: Pool,
    script: Arc<redis::Script>,
    errors: Arc<AtomicU64>,
    conn: Option<r2d2::PooledConnection<redis::Client>>,
    /// The command being sent, kept to reuse its buffers.
    cmd: redis::Cmd,
}

impl Dispatcher {
    fn run(mut self) {
        loop {
            let Some(mut batch) = self.next_batch() else {
                return;
            };
            let now = Instant::now();
            // Jobs whose caller has already given up are not decided: they
            // would take quota for a request that was answered without it.
            batch.retain(|j| j.deadline > now && !j.reply.is_closed());
            if batch.is_empty() {
                continue;
            }
            match self.send(&batch) {
                Ok(values) => {
                    let failed = deliver(batch, &values);
                    self.errors.fetch_add(failed, Ordering::Relaxed);
                }
                Err(e) => {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    log::warn!("redis error, {} decisions affected: {e}", batch.len());
                    for job in batch {
                        let _ = job.reply.send(Err(e.clone()));
                    }
                }
            }
        }
    }

    /// Blocks for the first job, then takes whatever else is already queued.
    fn next_batch(&self) -> Option<Vec<Job>> {
        let rx = match self.rx.lock() {
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

    /// One script call for the whole batch.
    fn send(&mut self, batch: &[Job]) -> Result<Vec<i64>, LimiterError> {
        if self.conn.is_none() {
            self.conn = Some(
                self.pool
                    .get()
                    .map_err(|e| LimiterError::Redis(e.to_string()))?,
            );
        }
        let expected = write_batch(&mut self.cmd, self.script.get_hash(), batch);
        let Some(conn) = self.conn.as_mut() else {
            return Err(LimiterError::Stopped);
        };
        let result: Result<Vec<i64>, redis::RedisError> = match self.cmd.query(&mut **conn) {
            // The script is not loaded (a new server, or SCRIPT FLUSH): the
            // call did not run, so load it and send the same batch again.
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                match self.script.load(&mut **conn) {
                    Ok(_) => self.cmd.query(&mut **conn),
                    Err(e) => Err(e),
                }
            }
            other => other,
        };
        match result {
            Ok(values) if values.len() == expected => Ok(values),
            Ok(values) => Err(LimiterError::Redis(format!(
                "the script returned {} values, expected {expected}",
                values.len()
            ))),
            Err(e) => {
                if e.is_timeout() {
                    return Err(LimiterError::Timeout);
                }
                if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
                    // Let the pool open a fresh connection next time.
                    self.conn = None;
                }
                Err(LimiterError::Redis(e.to_string()))
            }
        }
    }
}

/// Writes a batch as one `EVALSHA sha` into `cmd`, reusing its two buffers
/// (not one allocation per argument, as a `ScriptInvocation` makes). KEYS
/// and ARGV are laid out as `lua/batch.lua` reads them. Returns the number
/// of values the reply must hold.
fn write_batch(cmd: &mut redis::Cmd, sha: &str, batch: &[Job]) -> usize {
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
            cmd.arg(c.cost).arg(u8::from(c.enforce));
        }
    }
    3 * keys
}

/// Sends every job its decision from the script's reply; returns how many
/// jobs failed alone (the script could not decide one of their checks).
fn deliver(batch: Vec<Job>, values: &[i64]) -> u64 {
    let mut at = 0;
    let mut failed = 0;
    for job in batch {
        let result = decision(&job.checks, values, &mut at);
        if result.is_err() {
            failed += 1;
        }
        let _ = job.reply.send(result);
    }
    failed
}

/// Reads the decision for `checks` from the reply at `at` (three values per
/// check, laid out as `lua/batch.lua` writes them) and moves `at` past it.
fn decision(checks: &[Check], values: &[i64], at: &mut usize) -> Result<Decision, LimiterError> {
    let start = *at;
    *at += 3 * checks.len();
    let Some(values) = values.get(start..*at) else {
        return Err(LimiterError::Redis(
            "the script's reply is too short".into(),
        ));
    };
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
        let outcome = Outcome {
            allowed: v[0] == 1,
            remaining: v[1].max(0) as u64,
            wait: Duration::from_millis(v[2].max(0) as u64),
        };
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
    let script = redis::Script::new(SCRIPT_SOURCE);
    script
        .load(conn)
        .map_err(|e| LimiterError::Redis(e.to_string()))?;
    let batch: Vec<Job> = jobs
        .into_iter()
        .map(|(now_ms, checks)| Job {
            checks,
            now_ms,
            deadline: Instant::now(),
            reply: oneshot::channel().0,
        })
        .collect();
    let mut cmd = redis::Cmd::new();
    let expected = write_batch(&mut cmd, script.get_hash(), &batch);
    let values: Vec<i64> = cmd
        .query(conn)
        .map_err(|e| LimiterError::Redis(e.to_string()))?;
    if values.len() != expected {
        return Err(LimiterError::Redis(format!(
            "the script returned {} values, expected {expected}",
            values.len()
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
            reply,
        }
    }

    fn check(key: &str, algorithm: Algorithm, cost: u32, enforce: bool) -> Check {
        Check {
            key: key.to_string(),
            algorithm,
            cost,
            enforce,
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
        let expected_values = write_batch(&mut cmd, "SHA", &batch);
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
            Err(LimiterError::Redis(_))
        ));
    }
}
