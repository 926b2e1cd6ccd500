//! Where connections come from: one server at a URL, the master that the
//! Sentinels name, or a Redis Cluster. The pool, `/readyz` and the site
//! use [`RedisConn`] whatever the mode; the limiter's own dispatchers use a
//! plain connection (single server, Sentinel) or their own cluster
//! connection (see `dispatch/cluster/`).

use std::time::Duration;

#[cfg(feature = "cluster")]
use redis::cluster::{ClusterClient, ClusterConnection};
use redis::{ConnectionLike, RedisResult, Value};

use crate::limiter::RedisConfig;

#[cfg(feature = "sentinel")]
mod sentinel;
#[cfg(feature = "sentinel")]
use self::sentinel::Sentinels;

/// A connection to Redis: to one server, or to a whole cluster. Commands
/// go through [`redis::ConnectionLike`] (`redis::cmd(..).query(conn)`); on
/// a cluster each goes to the master of its key's slot.
pub struct RedisConn(pub(crate) Link);

/// What a [`RedisConn`] holds.
pub(crate) enum Link {
    /// One server (a single node, or the master the Sentinels named).
    Single(redis::Connection),
    /// A cluster: every command goes to the master of its key's slot, and
    /// MOVED / ASK redirections are followed (the `cluster` feature).
    #[cfg(feature = "cluster")]
    Cluster(Box<ClusterConnection>),
}

/// `$body` on whichever connection `$conn` holds, as `$c`.
macro_rules! on_either {
    ($conn:expr, $c:ident => $body:expr) => {
        match $conn {
            RedisConn(Link::Single($c)) => $body,
            #[cfg(feature = "cluster")]
            RedisConn(Link::Cluster($c)) => $body,
        }
    };
}

impl RedisConn {
    /// Writes a packed command without reading its reply (one server only:
    /// the limiter's single-server dispatcher uses it).
    pub(crate) fn send_packed_command(&mut self, cmd: &[u8]) -> RedisResult<()> {
        self.single()?.send_packed_command(cmd)
    }

    /// Reads one reply (one server only).
    pub(crate) fn recv_response(&mut self) -> RedisResult<Value> {
        self.single()?.recv_response()
    }

    /// The one server's connection; an error on a cluster.
    fn single(&mut self) -> RedisResult<&mut redis::Connection> {
        match self {
            RedisConn(Link::Single(c)) => Ok(c),
            #[cfg(feature = "cluster")]
            RedisConn(Link::Cluster(_)) => Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "raw commands are not sent on a cluster connection",
            ))),
        }
    }

    /// Bounds every read.
    pub(crate) fn set_read_timeout(&self, dur: Option<Duration>) -> RedisResult<()> {
        on_either!(self, c => c.set_read_timeout(dur))
    }

    /// Bounds every write.
    pub(crate) fn set_write_timeout(&self, dur: Option<Duration>) -> RedisResult<()> {
        on_either!(self, c => c.set_write_timeout(dur))
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        on_either!(self, c => c.req_packed_command(cmd))
    }

    /// A pipeline on a cluster goes whole to the master of its first key's
    /// slot (MULTI/EXEC included). The site keeps every key one pipeline
    /// touches under one hash tag, so that master holds them all.
    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        on_either!(self, c => c.req_packed_commands(cmd, offset, count))
    }

    fn req_command(&mut self, cmd: &redis::Cmd) -> RedisResult<Value> {
        on_either!(self, c => c.req_command(cmd))
    }

    fn get_db(&self) -> i64 {
        on_either!(self, c => c.get_db())
    }

    /// Pipelines work on both (see `req_packed_commands`).
    fn supports_pipelining(&self) -> bool {
        true
    }

    fn check_connection(&mut self) -> bool {
        on_either!(self, c => c.check_connection())
    }

    fn is_open(&self) -> bool {
        on_either!(self, c => c.is_open())
    }
}

/// How new connections are opened.
#[derive(Clone)]
pub(crate) enum Source {
    /// One server at a URL.
    Url(redis::Client),
    /// The master the Sentinels name (see [`Sentinels`]): every new
    /// connection goes to the master they name, and a connection to a
    /// server they no longer name is not used again.
    #[cfg(feature = "sentinel")]
    Sentinel(std::sync::Arc<Sentinels>),
    /// A Redis Cluster, from its seed nodes.
    #[cfg(feature = "cluster")]
    Cluster(ClusterClient),
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::Url(_) => "Url",
            #[cfg(feature = "sentinel")]
            Source::Sentinel(_) => "Sentinel",
            #[cfg(feature = "cluster")]
            Source::Cluster(_) => "Cluster",
        })
    }
}

impl Source {
    /// The source `config` names: cluster seeds, Sentinels, or the URL.
    /// A mode this build lacks has been refused before (see
    /// [`RedisConfig::missing_feature`]).
    pub(crate) fn from_config(config: &RedisConfig) -> RedisResult<Source> {
        #[cfg(feature = "cluster")]
        if !config.cluster.is_empty() {
            return cluster_client(config).map(Source::Cluster);
        }
        #[cfg(feature = "sentinel")]
        if !config.sentinel.is_empty() {
            let sentinels = std::sync::Arc::new(Sentinels::from_config(config)?);
            Sentinels::watch(&sentinels)?;
            return Ok(Source::Sentinel(sentinels));
        }
        redis::Client::open(config.url.as_str()).map(Source::Url)
    }

    /// A new connection, open within `within`, with read and write
    /// timeouts of `timeout`, and the master it went to (Sentinel mode only).
    pub(crate) fn open(
        &self,
        within: Duration,
        timeout: Duration,
    ) -> RedisResult<(RedisConn, Option<Master>)> {
        let (conn, master) = match self {
            Source::Url(client) => (
                RedisConn(Link::Single(client.get_connection_with_timeout(within)?)),
                None,
            ),
            #[cfg(feature = "sentinel")]
            Source::Sentinel(sentinels) => {
                let (conn, master) = sentinels.open(within)?;
                (RedisConn(Link::Single(conn)), master)
            }
            #[cfg(feature = "cluster")]
            Source::Cluster(client) => (
                RedisConn(Link::Cluster(Box::new(client.get_connection()?))),
                None,
            ),
        };
        conn.set_read_timeout(Some(timeout))?;
        conn.set_write_timeout(Some(timeout))?;
        Ok((conn, master))
    }

    /// Whether a connection opened to `master` may still be used: always,
    /// except in Sentinel mode when the Sentinels now name another server
    /// (see [`Sentinels::names`]).
    pub(crate) fn still_named(&self, master: Option<&Master>) -> bool {
        match (self, master) {
            #[cfg(feature = "sentinel")]
            (Source::Sentinel(sentinels), Some(master)) => sentinels.names(master),
            _ => true,
        }
    }
}

/// The address of a master, as the Sentinels name it (none is, without
/// the `sentinel` feature).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(not(feature = "sentinel"), allow(dead_code))]
pub(crate) struct Master {
    host: String,
    port: u16,
}

impl std::fmt::Display for Master {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Retries of one command on a cluster (redirections, TRYAGAIN,
/// CLUSTERDOWN), and the waits between them: short, so that a decision
/// still comes within the timeout or fails.
#[cfg(feature = "cluster")]
const CLUSTER_RETRIES: u32 = 5;
#[cfg(feature = "cluster")]
const CLUSTER_MIN_WAIT_MS: u64 = 5;
#[cfg(feature = "cluster")]
const CLUSTER_MAX_WAIT_MS: u64 = 50;

/// A cluster client whose connects and replies are bounded by the timeout.
#[cfg(feature = "cluster")]
pub(crate) fn cluster_client(config: &RedisConfig) -> RedisResult<ClusterClient> {
    ClusterClient::builder(config.cluster.iter().map(String::as_str))
        .connection_timeout(config.timeout)
        .response_timeout(config.timeout)
        .retries(CLUSTER_RETRIES)
        .min_retry_wait(CLUSTER_MIN_WAIT_MS)
        .max_retry_wait(CLUSTER_MAX_WAIT_MS)
        .build()
}
