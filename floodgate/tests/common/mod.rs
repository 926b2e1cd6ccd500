//! The library tests' plumbing: a private redis-server per test on a free
//! port (started, stopped, restarted on the same port). No demo site.
#![allow(dead_code)]

pub mod pinned;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Polls `condition` every 10 ms until it holds; panics after `limit`.
/// (Blocking: for sync tests and for conditions that need no async work.)
pub fn wait_until(limit: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !condition() {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The units a sliding-window log holds on any connection (a cluster's
/// too): the sum of its entries' weights (entries are `TIME:TOTAL:UNITS`;
/// one call may merge the requests it admits at one moment into one).
pub fn units_of(conn: &mut impl redis::ConnectionLike, key: &str) -> u64 {
    let entries: Vec<String> = redis::cmd("LRANGE")
        .arg(key)
        .arg(0)
        .arg(-1)
        .query(conn)
        .unwrap();
    entries
        .iter()
        .map(|e| e.rsplit(':').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

/// A redis-server of our own on a free port, without persistence; killed on drop.
pub struct RedisServer {
    /// The port it listens on.
    pub port: u16,
    child: Option<Child>,
    /// Its arguments beyond the port, persistence and directory.
    extra: &'static [&'static str],
}

/// Arguments that rename `FCALL`, `FCALL_RO` and `FUNCTION` away: a server
/// that answers them "unknown command", as Redis 6 does.
const NO_FUNCTIONS: &[&str] = &[
    "--rename-command",
    "FCALL",
    "renamed-fcall",
    "--rename-command",
    "FCALL_RO",
    "renamed-fcall-ro",
    "--rename-command",
    "FUNCTION",
    "renamed-function",
];

impl RedisServer {
    /// Starts one and waits until it answers PING.
    pub fn start() -> RedisServer {
        RedisServer::start_with(&[])
    }

    /// Starts one that knows no functions (as Redis 6; see `NO_FUNCTIONS`).
    #[allow(dead_code)] // Not every test binary that includes this uses it.
    pub fn start_without_functions() -> RedisServer {
        RedisServer::start_with(NO_FUNCTIONS)
    }

    fn start_with(extra: &'static [&'static str]) -> RedisServer {
        for _ in 0..5 {
            let mut server = RedisServer {
                port: free_port(),
                child: None,
                extra,
            };
            if server.launch() {
                return server;
            }
        }
        panic!("redis-server did not start on any of 5 free ports");
    }

    /// Spawns redis-server on `self.port`; true once it answers PING, false
    /// if it exits first (the port was taken meanwhile).
    fn launch(&mut self) -> bool {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--enable-debug-command", "local"])
            .args(["--dir", env!("CARGO_TARGET_TMPDIR")])
            .args(self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed");
        self.child = Some(child);
        // A deadline for a loaded machine, not a speed to meet.
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if self.ping(Duration::from_millis(100)) {
                return true;
            }
            if let Some(child) = self.child.as_mut() {
                if child.try_wait().unwrap().is_some() {
                    self.child = None;
                    return false;
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.stop();
        false
    }

    /// Whether the server answers PING within `within`.
    pub fn ping(&self, within: Duration) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let Ok(mut conn) = client.get_connection_with_timeout(within) else {
            return false;
        };
        conn.set_read_timeout(Some(within)).unwrap();
        redis::cmd("PING")
            .query::<String>(&mut conn)
            .is_ok_and(|p| p == "PONG")
    }

    /// `redis://127.0.0.1:PORT/0`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// A fresh connection (5 s timeouts).
    pub fn connection(&self) -> redis::Connection {
        let client = redis::Client::open(self.url()).unwrap();
        let conn = client
            .get_connection_with_timeout(Duration::from_secs(5))
            .expect("redis answers");
        conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        conn
    }

    /// Sends `signal` (`"STOP"`, `"CONT"`) to the server: a stopped server
    /// keeps its connections open and answers nothing (a stall) until it
    /// is continued, then takes up what was sent meanwhile.
    #[allow(dead_code)]
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("the server runs").id();
        let sent = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .expect("kill runs");
        assert!(sent.success(), "kill -{signal} {pid}");
    }

    /// Kills the server (SIGKILL) and waits for it to go.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server and starts a new, empty one on the same port.
    pub fn restart(&mut self) {
        self.stop();
        assert!(
            self.launch(),
            "redis-server did not restart on port {}",
            self.port
        );
    }

    /// The units a sliding-window log holds (see [`units_of`]).
    pub fn units(&self, key: &str) -> u64 {
        units_of(&mut self.connection(), key)
    }

    /// `LLEN key` (the sliding-window log's length).
    pub fn llen(&self, key: &str) -> u64 {
        redis::cmd("LLEN")
            .arg(key)
            .query(&mut self.connection())
            .unwrap()
    }

    /// `PTTL key` in ms (-2: no such key, -1: no TTL).
    pub fn pttl(&self, key: &str) -> i64 {
        redis::cmd("PTTL")
            .arg(key)
            .query(&mut self.connection())
            .unwrap()
    }

    /// Every key matching `pattern`, sorted.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg(pattern)
            .query(&mut self.connection())
            .unwrap();
        keys.sort();
        keys
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}
