//! Connections: [`Conn`], a connection that knows when Redis last answered
//! on it and whether an error spoiled it; [`Manager`], which opens them
//! (for the r2d2 pool and the dispatchers); and [`call`], one command sent
//! and read so that a write that failed is told apart from a reply lost.
//!
//! Broken connections: a connection that saw an I/O error is never used
//! again (not even after a read timeout, so a later call never waits behind
//! a late reply), and one that has been idle is checked with a PING before
//! anything is sent on it, because a connection whose server went away
//! while it sat idle fails only AFTER the next command has been written,
//! when nobody can tell any more whether that command ran.

use std::ops::{Deref, DerefMut};
use std::time::{Duration, Instant};

use redis::ConnectionLike as _;

use super::clock::RedisClock;
use super::topology::{Master, RedisConn, Source};
use super::{LimiterError, RedisConfig};

/// A connection that has not been answered on for this long is checked with
/// a PING before it is used. Shorter than any server restart (a process
/// that dies, and a new one that starts and listens, takes milliseconds),
/// so a connection that broke while Redis was away is always checked; and
/// under load, when batches follow each other, no PING is added.
pub(crate) const IDLE_CHECK: Duration = Duration::from_millis(1);

/// The r2d2 pool of synchronous Redis connections, for the site's own Redis
/// work and `/readyz`. (The dispatcher threads open their own.)
pub(crate) type Pool = r2d2::Pool<Manager>;

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
    pub(crate) fn single(conn: redis::Connection) -> Conn {
        Conn {
            inner: RedisConn(super::topology::Link::Single(conn)),
            answered: Instant::now(),
            spoiled: false,
            master: None,
        }
    }

    /// Whether Redis answered on it so recently that it needs no check.
    pub(crate) fn recently_answered(&self) -> bool {
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
    pub(crate) fn time(&mut self, clock: &RedisClock) -> redis::RedisResult<()> {
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
    pub(crate) fn spoil(&mut self) {
        self.spoiled = true;
    }

    /// Whether it may be used again.
    pub(crate) fn usable(&self) -> bool {
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
pub(crate) fn spoils(e: &redis::RedisError) -> bool {
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
    pub(crate) source: Source,
    timeout: Duration,
}

impl Manager {
    /// The bound on every connect, read and write (`redis.timeout`).
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A new connection, open within `within` (at most the timeout).
    pub(crate) fn open(&self, within: Duration) -> redis::RedisResult<Conn> {
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
    pub(crate) fn still_named(&self, conn: &mut Conn) -> bool {
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
pub(crate) fn no_longer_named(conn: &Conn) -> redis::RedisError {
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
pub(crate) fn pool_of(config: &RedisConfig, manager: Manager) -> Pool {
    r2d2::Pool::builder()
        .max_size(config.pool_size)
        .min_idle(Some(0))
        .test_on_check_out(true)
        .connection_timeout(config.timeout)
        .error_handler(Box::new(PoolErrors))
        .build_unchecked(manager)
}

/// The pool's own errors (a connection that could not be opened, or failed
/// its check): while Redis is away every checkout meets one, so they are
/// written as a warning that traffic repeats, not one ERROR line each as
/// r2d2's default handler writes them.
#[derive(Debug)]
struct PoolErrors;

impl r2d2::HandleError<redis::RedisError> for PoolErrors {
    fn handle_error(&self, error: redis::RedisError) {
        crate::logging::repeated!(
            &crate::logging::REDIS_CONNECTION,
            "redis connection: {error}"
        );
    }
}

pub(crate) fn manager(config: &RedisConfig) -> Result<Manager, LimiterError> {
    if let Some((key, why)) = config.missing_feature() {
        return Err(LimiterError::Unsupported(format!("{key}: {why}")));
    }
    let source = Source::from_config(config).map_err(LimiterError::from)?;
    Ok(Manager {
        source,
        timeout: config.timeout,
    })
}

/// Why a batch got no decision.
pub(crate) enum SendError {
    /// The call never reached Redis whole, so Redis did not run it: it may
    /// be sent again.
    Unsent(LimiterError),
    /// Anything else: the call may have run, or there is no connection.
    Failed(LimiterError),
}

/// How one call on a connection failed.
pub(crate) enum CallError {
    /// Writing it failed: Redis never received it whole.
    Unsent(redis::RedisError),
    /// Written whole, then no reply could be read: it may have run.
    Unanswered(redis::RedisError),
    /// Redis answered with an error, or with something unreadable.
    Answered(redis::RedisError),
}

impl CallError {
    pub(crate) fn error(&self) -> &redis::RedisError {
        match self {
            CallError::Unsent(e) | CallError::Unanswered(e) | CallError::Answered(e) => e,
        }
    }
}

/// Sends `cmd` on `conn` and reads its reply, telling apart a write that
/// failed (nothing ran) from a reply that never came (it may have run).
/// Records the outcome on the connection.
pub(crate) fn call<T: redis::FromRedisValue>(
    conn: &mut Conn,
    cmd: &redis::Cmd,
    packed: &mut Vec<u8>,
) -> Result<T, CallError> {
    packed.clear();
    cmd.write_packed_command(packed);
    write(conn, packed)?;
    reply(conn)
}

/// Writes `packed` (one command or several) on `conn`. A failed write
/// spoils the connection, and Redis ran nothing of it.
pub(crate) fn write(conn: &mut Conn, packed: &[u8]) -> Result<(), CallError> {
    conn.send_packed_command(packed).map_err(|e| {
        conn.spoil();
        CallError::Unsent(e)
    })
}

/// Reads the reply of a command written whole (see [`call`]).
pub(crate) fn reply<T: redis::FromRedisValue>(conn: &mut Conn) -> Result<T, CallError> {
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

/// How [`wait_briefly`] ended.
pub(crate) enum Brief {
    /// A reply came within the wait.
    Answered,
    /// None came within it; the connection is fine, the reply is still to
    /// come, and the connection skips it when it comes (see [`wait_briefly`]).
    Waiting,
}

/// Reads one reply, whatever it says, waiting at most `wait`, then sets the
/// read timeout back to `timeout`. For a reply nobody needs (a `PING`
/// written just before the call that matters): when it does not come in
/// time, the connection remembers that one reply is owed to a command
/// whose caller stopped reading (redis-rs skips it on the next read), so
/// the next read returns the reply of the command written after it.
/// A read that fails otherwise spoils the connection.
pub(crate) fn wait_briefly(
    conn: &mut Conn,
    wait: Duration,
    timeout: Duration,
) -> Result<Brief, CallError> {
    let set =
        |conn: &Conn, d: Duration| conn.set_read_timeout(Some(d.max(Duration::from_millis(1))));
    if let Err(e) = set(conn, wait) {
        conn.spoil();
        return Err(CallError::Unanswered(e));
    }
    let read = loop {
        match conn.recv_response() {
            Ok(redis::Value::Push { .. }) => continue,
            Ok(_) => break Ok(Brief::Answered),
            Err(e) if e.is_timeout() => break Ok(Brief::Waiting),
            Err(e) => break Err(e),
        }
    };
    match read.and_then(|brief| set(conn, timeout).map(|()| brief)) {
        Ok(brief) => Ok(brief),
        Err(e) => {
            conn.spoil();
            Err(CallError::Unanswered(e))
        }
    }
}

/// Sets the read timeout of a connection whose reply is still to come to
/// what is left until `deadline`, for the thread that waits it out.
pub(crate) fn wait_until(conn: &mut Conn, deadline: Instant) -> Result<(), CallError> {
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    conn.set_read_timeout(Some(left)).map_err(|e| {
        conn.spoil();
        CallError::Unanswered(e)
    })
}
