//! Where connections come from: one server at a URL, the master that the
//! Sentinels name, or a Redis Cluster. The pool, `/readyz` and the site
//! use [`RedisConn`] whatever the mode; the limiter's own dispatchers use a
//! plain connection (single server, Sentinel) or their own cluster
//! connection (see [`super::cluster`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{ConnectionLike, RedisResult, Value};

use crate::config::RedisConfig;

/// A connection to Redis: to one server, or to a whole cluster.
pub enum RedisConn {
    /// One server (a single node, or the master the Sentinels named).
    Single(redis::Connection),
    /// A cluster: every command goes to the master of its key's slot, and
    /// MOVED / ASK redirections are followed.
    Cluster(Box<ClusterConnection>),
}

impl RedisConn {
    /// Writes a packed command without reading its reply (one server only:
    /// the limiter's single-server dispatcher uses it).
    pub fn send_packed_command(&mut self, cmd: &[u8]) -> RedisResult<()> {
        match self {
            RedisConn::Single(c) => c.send_packed_command(cmd),
            RedisConn::Cluster(_) => Err(not_on_a_cluster()),
        }
    }

    /// Reads one reply (one server only).
    pub fn recv_response(&mut self) -> RedisResult<Value> {
        match self {
            RedisConn::Single(c) => c.recv_response(),
            RedisConn::Cluster(_) => Err(not_on_a_cluster()),
        }
    }

    /// Bounds every read.
    pub fn set_read_timeout(&self, dur: Option<Duration>) -> RedisResult<()> {
        match self {
            RedisConn::Single(c) => c.set_read_timeout(dur),
            RedisConn::Cluster(c) => c.set_read_timeout(dur),
        }
    }

    /// Bounds every write.
    pub fn set_write_timeout(&self, dur: Option<Duration>) -> RedisResult<()> {
        match self {
            RedisConn::Single(c) => c.set_write_timeout(dur),
            RedisConn::Cluster(c) => c.set_write_timeout(dur),
        }
    }
}

fn not_on_a_cluster() -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::Client,
        "raw commands are not sent on a cluster connection",
    ))
}

impl ConnectionLike for RedisConn {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
        }
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
        match self {
            RedisConn::Single(c) => c.req_packed_commands(cmd, offset, count),
            RedisConn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn req_command(&mut self, cmd: &redis::Cmd) -> RedisResult<Value> {
        match self {
            RedisConn::Single(c) => c.req_command(cmd),
            RedisConn::Cluster(c) => c.req_command(cmd),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }

    /// Pipelines work on both (see `req_packed_commands`).
    fn supports_pipelining(&self) -> bool {
        true
    }

    fn check_connection(&mut self) -> bool {
        match self {
            RedisConn::Single(c) => c.check_connection(),
            RedisConn::Cluster(c) => c.check_connection(),
        }
    }

    fn is_open(&self) -> bool {
        match self {
            RedisConn::Single(c) => c.is_open(),
            RedisConn::Cluster(c) => c.is_open(),
        }
    }
}

/// How new connections are opened.
#[derive(Clone)]
pub enum Source {
    /// One server at a URL.
    Url(redis::Client),
    /// The master the Sentinels name, asked again for every new connection
    /// (so a connection opened after a failover goes to the new master).
    Sentinel(Arc<Mutex<SentinelClient>>),
    /// A Redis Cluster, from its seed nodes.
    Cluster(ClusterClient),
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::Url(_) => "Url",
            Source::Sentinel(_) => "Sentinel",
            Source::Cluster(_) => "Cluster",
        })
    }
}

/// Retries of one command on a cluster (redirections, TRYAGAIN,
/// CLUSTERDOWN), and the waits between them: short, so that a decision
/// still comes within the timeout or fails.
const CLUSTER_RETRIES: u32 = 5;
const CLUSTER_MIN_WAIT_MS: u64 = 5;
const CLUSTER_MAX_WAIT_MS: u64 = 50;

impl Source {
    /// The source `config` names: cluster seeds, Sentinels, or the URL.
    pub fn from_config(config: &RedisConfig) -> RedisResult<Source> {
        if !config.cluster.is_empty() {
            return cluster_client(config).map(Source::Cluster);
        }
        if !config.sentinel.is_empty() {
            let mut node = redis::sentinel::SentinelNodeConnectionInfo::default();
            // The master's database, user and password come from `url`.
            if let Ok(info) = redis::IntoConnectionInfo::into_connection_info(config.url.as_str()) {
                node = node.set_redis_connection_info(info.redis_settings().clone());
            }
            let client = SentinelClient::build(
                config.sentinel.iter().map(String::as_str).collect(),
                config.sentinel_master.clone(),
                Some(node),
                SentinelServerType::Master,
            )?;
            return Ok(Source::Sentinel(Arc::new(Mutex::new(client))));
        }
        redis::Client::open(config.url.as_str()).map(Source::Url)
    }

    /// A new connection, open within `within`, with read and write
    /// timeouts of `timeout`.
    pub fn open(&self, within: Duration, timeout: Duration) -> RedisResult<RedisConn> {
        let conn = match self {
            Source::Url(client) => RedisConn::Single(client.get_connection_with_timeout(within)?),
            Source::Sentinel(sentinel) => {
                // Which server is master now, confirmed by its own ROLE.
                let client = {
                    let mut sentinel = match sentinel.lock() {
                        Ok(s) => s,
                        Err(poisoned) => poisoned.into_inner(),
                    };
                    sentinel.get_client()?
                };
                RedisConn::Single(client.get_connection_with_timeout(within)?)
            }
            Source::Cluster(client) => RedisConn::Cluster(Box::new(client.get_connection()?)),
        };
        conn.set_read_timeout(Some(timeout))?;
        conn.set_write_timeout(Some(timeout))?;
        Ok(conn)
    }
}

/// A cluster client whose connects and replies are bounded by the timeout.
pub fn cluster_client(config: &RedisConfig) -> RedisResult<ClusterClient> {
    ClusterClient::builder(config.cluster.iter().map(String::as_str))
        .connection_timeout(config.timeout)
        .response_timeout(config.timeout)
        .retries(CLUSTER_RETRIES)
        .min_retry_wait(CLUSTER_MIN_WAIT_MS)
        .max_retry_wait(CLUSTER_MAX_WAIT_MS)
        .build()
}

/// Number of hash slots in a Redis Cluster.
pub const SLOTS: u16 = 16384;

/// The cluster hash slot of a key: CRC16 (XMODEM) of the key, or of its
/// hash tag (the part between the first `{` and the next `}`, when not
/// empty), modulo 16384.
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        },
        None => key,
    };
    crc16(hashed) % SLOTS
}

fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis_cluster() {
        // Values from the Redis Cluster specification and CLUSTER KEYSLOT.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"{user1000}.followers"), key_slot(b"user1000"));
        // An empty tag hashes the whole key; only the first tag counts.
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % SLOTS);
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
    }
}
