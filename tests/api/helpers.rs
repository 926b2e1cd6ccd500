//! Shared test plumbing: a private redis-server per test (started, stopped,
//! restarted on the same port), the app on a free port with an extra
//! `POST /echo` route, raw HTTP over a `TcpStream` for what reqwest will not
//! send, and small readers for headers, Redis keys and `/metrics`.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actix_web::dev::ServerHandle;
use actix_web::{web, HttpResponse};
use floodgate::Filter;
use floodgate_site::config::Config;
use floodgate_site::site::{Application, Reloader};

/// What a [`Relay`] does with one chunk on its way to Redis (it may hold
/// it: a delay), before passing it on.
pub type ToRedis = Box<dyn FnMut(&[u8]) + Send>;
/// Whether a [`Relay`] passes one chunk on its way back to the client
/// (false: the client's connection is closed there instead).
pub type ToClient = Box<dyn FnMut(&[u8]) -> bool + Send>;

/// A TCP relay in front of a test's Redis, for what a real server cannot be
/// made to do: delay a call on its way, lose a reply after the call ran.
/// Each connection gets a fresh pair of taps from `taps`. A client that
/// hangs up only half-closes the way to Redis, so Redis still runs what it
/// received.
pub struct Relay {
    pub port: u16,
}

impl Relay {
    pub fn start(
        redis: &RedisServer,
        taps: impl Fn() -> (ToRedis, ToClient) + Send + 'static,
    ) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let upstream = format!("127.0.0.1:{}", redis.port);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let (mut to_redis, mut to_client) = taps();
                let (mut from, mut to) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 * 1024];
                    while let Ok(n @ 1..) = from.read(&mut buf) {
                        to_redis(&buf[..n]);
                        if to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                });
                let (mut from, mut to) = (server, client);
                std::thread::spawn(move || {
                    let mut buf = [0u8; 16 * 1024];
                    while let Ok(n @ 1..) = from.read(&mut buf) {
                        if !to_client(&buf[..n]) || to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Both);
                    let _ = from.shutdown(Shutdown::Both);
                });
            }
        });
        Relay { port }
    }

    /// `redis://127.0.0.1:PORT/0`, through the relay.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

/// Whether a chunk on its way to Redis holds a decision: a call of the
/// batch function (or of a script).
pub fn is_script_call(chunk: &[u8]) -> bool {
    chunk.windows(5).any(|w| w == b"FCALL") || chunk.windows(7).any(|w| w == b"EVALSHA")
}

// The private redis-server per test and the waits, shared with the
// library's own tests (which build no demo).
#[path = "../../floodgate/tests/common/mod.rs"]
mod common;
// The browser tests include this file too and use only some of them.
#[allow(unused_imports)]
pub use common::{free_port, pinned, units_of, wait_until, RedisServer};

/// The `floodgate` binary serving `config` on `bind` against `redis`, with
/// `RUST_LOG` set to `log`; its stderr lines are collected in the returned
/// log as they come.
pub fn serve_binary(
    config: &Path,
    bind: &str,
    redis: &str,
    log: &str,
) -> (
    std::process::Child,
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
) {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    use std::sync::{Arc, Mutex};
    let mut child = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("serve")
        .arg("--config")
        .arg(config)
        .env("FLOODGATE_BIND", bind)
        .env("FLOODGATE_REDIS_URL", redis)
        .env("RUST_LOG", log)
        .env_remove("FLOODGATE_CONFIG")
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
    (child, lines)
}

/// The app under test, its own Redis, and a client that does not follow redirects.
pub struct TestApp {
    /// `http://127.0.0.1:PORT`
    pub address: String,
    /// The port the app listens on.
    pub port: u16,
    /// A client without redirects.
    pub client: reqwest::Client,
    /// The app's private Redis.
    pub redis: RedisServer,
    /// The app's filter (rules in force).
    pub filter: Filter,
    /// What SIGHUP does (reads the config's `path`).
    pub reloader: Reloader,
    handle: ServerHandle,
}

/// Starts the app for `toml` (bind, Redis URL and 2 workers are set here) with
/// `POST /echo` added behind the filter, on a private Redis.
pub async fn spawn_app(toml: &str) -> TestApp {
    spawn_app_with(toml, |_| {}).await
}

/// [`spawn_app`], with `edit` applied to the config after the private
/// Redis and the workers are set (e.g. to point the app at a cluster or at
/// Sentinels, or to serve on one worker).
pub async fn spawn_app_with(toml: &str, edit: impl FnOnce(&mut Config)) -> TestApp {
    let redis = RedisServer::start();
    let mut config = Config::parse(toml, Path::new("test.toml")).expect("the test config is valid");
    config.filter.redis.url = redis.url();
    config.server.workers = 2;
    edit(&mut config);
    config.server.bind = "127.0.0.1:0".into();
    let app = Application::build_with(config, extra_routes).expect("the app starts");
    let port = app.port();
    let filter = app.filter();
    let reloader = app.reloader();
    let handle = app.handle();
    // The server starts when this task is first polled: wait until it
    // answers, so that tests may then block on raw sockets.
    actix_web::rt::spawn(app.run_until_stopped());
    let app = TestApp {
        address: format!("http://127.0.0.1:{port}"),
        port,
        client: client(),
        redis,
        filter,
        reloader,
        handle,
    };
    // A deadline for a loaded machine, not a speed to meet.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match app.client.get(app.url("/healthz")).send().await {
            Ok(res) if res.status() == 200 => break,
            _ if Instant::now() < deadline => {
                actix_web::rt::time::sleep(Duration::from_millis(10)).await;
            }
            other => panic!("the app does not answer GET /healthz: {other:?}"),
        }
    }
    app
}

impl Drop for TestApp {
    fn drop(&mut self) {
        // The stop command is sent at once; awaiting it is not needed.
        drop(self.handle.stop(false));
    }
}

/// A client that does not follow redirects.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

fn extra_routes(cfg: &mut web::ServiceConfig) {
    cfg.route("/echo", web::post().to(echo));
}

/// `POST /echo`: answers with exactly the body it received.
async fn echo(body: web::Bytes) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("application/octet-stream")
        .body(body)
}

impl TestApp {
    /// The full URL of `path`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.address)
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client.get(self.url(path)).send().await.unwrap()
    }

    /// `GET path` with `Accept: application/json`.
    pub async fn get_json(&self, path: &str) -> reqwest::Response {
        self.client
            .get(self.url(path))
            .header("accept", "application/json")
            .send()
            .await
            .unwrap()
    }

    /// `POST /echo` with an urlencoded body, sent byte for byte.
    pub async fn post_form(&self, body: &'static [u8]) -> reqwest::Response {
        self.client
            .post(self.url("/echo"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body)
            .send()
            .await
            .unwrap()
    }

    /// The `/metrics` text.
    pub async fn metrics(&self) -> String {
        self.get("/metrics").await.text().await.unwrap()
    }
}

/// A response header as text.
pub fn header(res: &reqwest::Response, name: &str) -> Option<String> {
    res.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
}

/// The `r` of one rule in a `RateLimit` field: `"NAME";r=R;t=T, ...`.
pub fn remaining(res: &reqwest::Response, rule: &str) -> Option<u64> {
    let field = header(res, "ratelimit")?;
    let item = field
        .split(", ")
        .find(|i| i.starts_with(&format!("\"{rule}\";")))?;
    item.split(';')
        .find_map(|p| p.strip_prefix("r="))
        .map(|r| r.parse().unwrap())
}

/// The value of the sample named exactly `name` (with labels) in a Prometheus text.
pub fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
}

/// `floodgate_decisions_total{rule,decision}` in a Prometheus text.
pub fn decisions(text: &str, rule: &str, decision: &str) -> Option<u64> {
    metric(
        text,
        &format!("floodgate_decisions_total{{rule=\"{rule}\",decision=\"{decision}\"}}"),
    )
}

/// A response read off a raw connection.
#[derive(Debug)]
pub struct RawResponse {
    /// The status code (0 when the server closed without answering).
    pub status: u16,
    /// Status line and headers.
    pub head: String,
    /// Everything after the blank line.
    pub body: Vec<u8>,
}

/// Sends `request` as is on a new connection and reads until the server
/// closes it (send `Connection: close`). Write errors are ignored: a server
/// may answer and close before it has read a request that is too large.
pub fn raw_request(port: u16, request: &[u8]) -> RawResponse {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let _ = stream.write_all(request);
    read_response(&mut stream)
}

/// Reads one response until the server closes the connection.
pub fn read_response(stream: &mut TcpStream) -> RawResponse {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            // A reset after the response was sent still leaves the response.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("reading the response: {e}"),
        }
    }
    parse_response(&bytes)
}

/// Splits raw bytes into status, head and body.
pub fn parse_response(bytes: &[u8]) -> RawResponse {
    let split = bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(bytes.len());
    let head = String::from_utf8_lossy(&bytes[..split]).into_owned();
    let body = bytes.get(split + 4..).unwrap_or_default().to_vec();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    RawResponse { status, head, body }
}

/// Asks `/healthz`, which no rule guards, again and again on `app` until
/// `until` is set (by the guarded requests a stalled Redis holds, when the
/// first of them has its answer), then sets `done` for them. Asserts that
/// every answer was 200 and took less than `limit`: no worker waited for
/// a Redis (`what`) that the route does not need.
pub async fn unguarded_never_waits(
    app: &TestApp,
    until: &AtomicBool,
    done: &AtomicBool,
    limit: Duration,
    what: &str,
) {
    let mut took = Vec::new();
    while !until.load(Ordering::SeqCst) {
        let started = Instant::now();
        let status = app.get("/healthz").await.status().as_u16();
        took.push((status, started.elapsed()));
    }
    done.store(true, Ordering::SeqCst);
    assert!(!took.is_empty());
    for (status, took) in &took {
        assert_eq!(*status, 200);
        assert!(
            *took < limit,
            "/healthz waited {took:?} for {what} it does not need"
        );
    }
}
