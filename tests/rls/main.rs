//! `floodgate rls` end to end: the real binary on free ports, each test
//! with its own redis-server, answered to a gRPC client of the crate's own
//! (`grpc`), to Python's grpcio with Envoy's generated protos (`python`),
//! and to Envoy itself (`envoy`).

// The library's own test helpers (floodgate/tests/common) name it by its
// package's crate name.
extern crate floodgate as floodgate_limiter;

#[allow(dead_code)]
#[path = "../api/cluster_helpers.rs"]
mod cluster_helpers;
#[path = "../../floodgate/tests/common/mod.rs"]
mod common;
/// What cluster_helpers reads from its sibling module.
mod helpers {
    pub use crate::common::{free_port, wait_until};
}

mod envoy;
mod grpc;
mod operators;
mod python;
mod topology;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use common::{free_port, wait_until, RedisServer};
use floodgate_site::rls::proto::{
    Entry, RateLimitClient, RateLimitDescriptor, RateLimitRequest, RateLimitResponse,
};

/// Long enough for a loaded machine; never a speed to meet.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// A `floodgate rls` process of the test's own, its files and its ports.
pub struct Service {
    child: Option<Child>,
    /// gRPC port.
    pub grpc: u16,
    /// HTTP port (`/healthz`, `/metrics`, admin).
    pub http: u16,
    /// Its folder: `rls.toml` and `descriptors/`.
    pub dir: PathBuf,
    lines: Arc<Mutex<Vec<String>>>,
}

static DIRS: AtomicU64 = AtomicU64::new(0);

/// A fresh folder under the target's temporary directory.
pub fn fresh_dir(what: &str) -> PathBuf {
    let n = DIRS.fetch_add(1, Ordering::Relaxed);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "rls-{what}-{}-{n}-{}",
        std::process::id(),
        free_port()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("descriptors")).unwrap();
    dir
}

/// Writes the service's `rls.toml` in `dir`: `[rls]` with `rls_extra`
/// lines, then `extra` sections.
pub fn write_config(
    dir: &Path,
    redis: &RedisServer,
    grpc: u16,
    http: u16,
    rls_extra: &str,
    extra: &str,
) -> PathBuf {
    let redis = format!("url = \"{}\"", redis.url());
    write_config_on(dir, &redis, grpc, http, rls_extra, extra)
}

/// As [`write_config`], with `[redis]` lines of the caller's (a Cluster's
/// seeds, a Sentinel).
pub fn write_config_on(
    dir: &Path,
    redis: &str,
    grpc: u16,
    http: u16,
    rls_extra: &str,
    extra: &str,
) -> PathBuf {
    let toml = format!(
        "[rls]\nbind = \"127.0.0.1:{grpc}\"\nhttp_bind = \"127.0.0.1:{http}\"\ndescriptors = \"{}\"\n{rls_extra}\n\n[redis]\n{redis}\ntimeout = \"500ms\"\n\n[limiter]\nbreaker = \"200ms\"\n{extra}\n",
        dir.join("descriptors").display(),
    );
    let path = dir.join("rls.toml");
    std::fs::write(&path, toml).unwrap();
    path
}

impl Service {
    /// Starts the service on `redis` with the descriptor files `files`
    /// (name, YAML), `rls_extra` lines in `[rls]` and `extra` sections.
    pub fn start(
        redis: &RedisServer,
        files: &[(&str, &str)],
        rls_extra: &str,
        extra: &str,
    ) -> Service {
        Service::start_on(
            &format!("url = \"{}\"", redis.url()),
            files,
            rls_extra,
            extra,
        )
    }

    /// As [`Service::start`], with `[redis]` lines of the caller's.
    pub fn start_on(redis: &str, files: &[(&str, &str)], rls_extra: &str, extra: &str) -> Service {
        let dir = fresh_dir("svc");
        for (name, text) in files {
            std::fs::write(dir.join("descriptors").join(name), text).unwrap();
        }
        let (grpc, http) = (free_port(), free_port());
        let config = write_config_on(&dir, redis, grpc, http, rls_extra, extra);
        let mut child = Command::new(env!("CARGO_BIN_EXE_floodgate"))
            .args(["rls", "--config"])
            .arg(&config)
            .env("RUST_LOG", "info")
            .env_remove("FLOODGATE_CONFIG")
            .env_remove("FLOODGATE_REDIS_URL")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line);
            }
        });
        let mut service = Service {
            child: Some(child),
            grpc,
            http,
            dir,
            lines,
        };
        let deadline = Instant::now() + PATIENCE;
        while !service.log_has("floodgate rls serving") {
            if let Some(status) = service.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("floodgate rls exited ({status}): {:?}", service.log());
            }
            assert!(
                Instant::now() < deadline,
                "floodgate rls did not start: {:?}",
                service.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        service
    }

    /// Its log so far.
    pub fn log(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Whether a log line holds `text`.
    pub fn log_has(&self, text: &str) -> bool {
        self.lines.lock().unwrap().iter().any(|l| l.contains(text))
    }

    /// `http://127.0.0.1:GRPC`
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.grpc)
    }

    /// A connected client.
    pub async fn client(&self) -> RateLimitClient {
        RateLimitClient::connect(self.endpoint()).await.unwrap()
    }

    /// Replaces (or adds) a descriptor file.
    pub fn write_file(&self, name: &str, text: &str) {
        let path = self.dir.join("descriptors").join(name);
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }

    /// Rewrites the descriptor file `name` in place (same inode) with
    /// `text`, then puts its modification time back, as `cp -p` and
    /// `rsync -t --inplace` leave a file.
    pub fn rewrite_in_place(&self, name: &str, text: &str) {
        let path = self.dir.join("descriptors").join(name);
        let was = std::fs::metadata(&path).unwrap().modified().unwrap();
        let file = std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::io::Write::write_all(&mut &file, text.as_bytes()).unwrap();
        file.set_modified(was).unwrap();
    }

    /// Sends `signal` (`TERM`, `HUP`).
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().unwrap().id();
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .unwrap();
        assert!(ok.success());
    }

    /// Waits for it to exit.
    pub fn wait(&mut self) -> ExitStatus {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(s) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "floodgate rls did not stop: {:?}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `GET path` on the HTTP port: status and body.
    pub fn get(&self, path: &str) -> (u16, String) {
        http_request(
            self.http,
            &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        )
    }

    /// `/metrics`.
    pub fn metrics(&self) -> String {
        self.get("/metrics").1
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One raw HTTP/1.1 exchange on 127.0.0.1:`port`: status and body.
pub fn http_request(port: u16, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

/// One raw HTTP/1.1 exchange: status and the head's fields (names lower-case).
pub fn http_head(port: u16, request: &str) -> (u16, Vec<(String, String)>) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let head = out.split_once("\r\n\r\n").map_or(out.as_str(), |(h, _)| h);
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let fields = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, fields)
}

/// A call: `domain`, one descriptor per list of (key, value), `hits`.
pub fn call(domain: &str, descriptors: &[&[(&str, &str)]], hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_string(),
        descriptors: descriptors
            .iter()
            .map(|d| RateLimitDescriptor {
                entries: d
                    .iter()
                    .map(|(k, v)| Entry {
                        key: k.to_string(),
                        value: v.to_string(),
                    })
                    .collect(),
                limit: None,
                hits_addend: None,
            })
            .collect(),
        hits_addend: hits,
    }
}

/// (code, remaining) of each status, codes by name.
pub fn codes(r: &RateLimitResponse) -> Vec<(&'static str, u32)> {
    r.statuses
        .iter()
        .map(|s| (code_name(s.code), s.limit_remaining))
        .collect()
}

/// `OK`, `OVER_LIMIT`, `UNKNOWN`.
pub fn code_name(code: i32) -> &'static str {
    match code {
        1 => "OK",
        2 => "OVER_LIMIT",
        _ => "UNKNOWN",
    }
}

/// A value no other test uses.
pub fn unique() -> String {
    format!(
        "v{}-{}",
        std::process::id(),
        DIRS.fetch_add(1, Ordering::Relaxed)
    )
}
