//! The real binary, `floodgate serve --config FILE`: the startup line names
//! the file, bind address, Redis target and rule count; decisions are logged
//! at debug level; SIGHUP reloads the rules from the edited file, and keeps
//! them (saying why) when the file is invalid; SIGTERM stops accepting,
//! finishes the request in flight and exits 0; a body that does not arrive
//! within `[server] body_timeout` gets 408 and a closed connection.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::helpers::{
    free_port, parse_response, raw_request, read_response, wait_until, RawResponse, RedisServer,
};

/// `floodgate serve` on a free port with its own Redis; its stderr is collected.
struct Served {
    child: Child,
    port: u16,
    config: PathBuf,
    log: Arc<Mutex<Vec<String>>>,
    redis: RedisServer,
}

impl Served {
    fn start(name: &str, toml: &str) -> Served {
        Served::start_on(name, toml, "127.0.0.1")
    }

    /// As [`Served::start`], listening on `host` (the tests reach it on
    /// 127.0.0.1 either way).
    fn start_on(name: &str, toml: &str, host: &str) -> Served {
        let redis = RedisServer::start();
        let config = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("cli-{name}-{}.toml", std::process::id()));
        write_config(&config, toml);
        let port = free_port();
        let (child, log) = crate::helpers::serve_binary(
            &config,
            &format!("{host}:{port}"),
            &redis.url(),
            "info,floodgate=debug",
        );
        let mut served = Served {
            child,
            port,
            config,
            log,
            redis,
        };
        wait_until(
            Duration::from_secs(20),
            "GET /healthz to answer 200",
            || {
                if let Some(status) = served.child.try_wait().unwrap() {
                    panic!(
                        "floodgate exited with {status}: {:?}",
                        served.log.lock().unwrap()
                    );
                }
                TcpStream::connect(("127.0.0.1", port)).is_ok()
                    && get(port, "/healthz").status == 200
            },
        );
        served
    }

    fn get(&self, path: &str) -> RawResponse {
        get(self.port, path)
    }

    /// Sends a signal with kill(1).
    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{name} failed");
    }

    /// Waits for a log line that `matches`, and returns it.
    fn wait_for_log(&self, what: &str, matches: impl Fn(&str) -> bool) -> String {
        let mut found = None;
        wait_until(Duration::from_secs(10), what, || {
            found = self
                .log
                .lock()
                .unwrap()
                .iter()
                .find(|l| matches(l))
                .cloned();
            found.is_some()
        });
        found.unwrap()
    }

    fn log_lines(&self, matches: impl Fn(&str) -> bool) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|l| matches(l))
            .count()
    }

    /// Waits for the process to exit on its own.
    fn wait_for_exit(&mut self, limit: Duration) -> ExitStatus {
        let mut status = None;
        wait_until(limit, "floodgate to exit", || {
            status = self.child.try_wait().unwrap();
            status.is_some()
        });
        status.unwrap()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.config);
    }
}

/// `GET path` on a connection of its own.
fn get(port: u16, path: &str) -> RawResponse {
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    raw_request(port, request.as_bytes())
}

/// Replaces the file at once (write beside it, then rename).
fn write_config(path: &PathBuf, toml: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, toml).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn field(res: &RawResponse, name: &str) -> Option<String> {
    res.head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
    })
}

fn check_rule(limit: u32) -> String {
    format!(
        r#"
[server]
workers = 1

[[rule]]
name = "check"
paths = ["/check"]
methods = ["GET"]
limit = {limit}
window = "1m"
deny = "status"
"#
    )
}

#[test]
fn serve_logs_its_setup_and_reloads_rules_on_sighup() {
    let served = Served::start("sighup", &check_rule(2));

    let startup = served.wait_for_log("the startup line", |l| l.contains(&served.redis.url()));
    for part in [
        served.config.display().to_string(),
        format!("127.0.0.1:{}", served.port),
        served.redis.url(),
        "1 rule".to_string(),
    ] {
        assert!(startup.contains(&part), "{part:?} missing from: {startup}");
    }

    for _ in 0..2 {
        let res = served.get("/check");
        assert_eq!(res.status, 200);
        assert_eq!(
            field(&res, "ratelimit-policy").as_deref(),
            Some("\"check\";q=2;w=60")
        );
    }
    assert_eq!(served.get("/check").status, 429);
    // One debug line per decision.
    served.wait_for_log("the denial's log line", |l| {
        l.contains("/check") && l.contains("denied")
    });
    assert_eq!(served.log_lines(|l| l.contains("GET /check: ")), 3);

    // A larger limit takes effect without a restart.
    write_config(&served.config, &check_rule(5));
    served.signal("HUP");
    served.wait_for_log("the reload", |l| {
        l.contains("SIGHUP") && l.contains("reloaded")
    });
    let res = served.get("/check");
    assert_eq!(res.status, 200);
    assert_eq!(
        field(&res, "ratelimit-policy").as_deref(),
        Some("\"check\";q=5;w=60")
    );
    assert_eq!(
        field(&res, "ratelimit").as_deref().map(|r| &r[..12]),
        Some("\"check\";r=2;")
    );

    // An invalid file: the old rules stay, and the log says why.
    write_config(&served.config, &check_rule(0));
    served.signal("HUP");
    let why = "limit must be between 1 and 100000, got 0";
    let line = served.wait_for_log("the refusal", |l| l.contains(why));
    assert!(
        line.contains(&served.config.display().to_string()),
        "{line}"
    );
    let res = served.get("/check");
    assert_eq!(res.status, 200);
    assert_eq!(
        field(&res, "ratelimit-policy").as_deref(),
        Some("\"check\";q=5;w=60")
    );
    assert_eq!(served.get("/healthz").status, 200);
}

#[test]
fn sigterm_finishes_the_request_in_flight_and_exits_0() {
    // A form-keyed rule on the home page: the filter waits for the body.
    let mut served = Served::start(
        "sigterm",
        r#"
[[rule]]
name = "form"
paths = ["/"]
methods = ["GET"]
key = "form:x"
limit = 100
window = "1m"
"#,
    );
    let mut stream = TcpStream::connect(("127.0.0.1", served.port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
        .write_all(
            b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
              Content-Type: application/x-www-form-urlencoded\r\n\
              Content-Length: 7\r\nExpect: 100-continue\r\n\r\n",
        )
        .unwrap();
    // "100 Continue" proves the server holds the request and waits for its body.
    let interim = b"HTTP/1.1 100 Continue\r\n\r\n";
    let mut got = vec![0u8; interim.len()];
    stream.read_exact(&mut got).unwrap();
    assert_eq!(got, interim);

    served.signal("TERM");
    let stopped = Instant::now();
    wait_until(
        Duration::from_secs(5),
        "new connections to be refused",
        || TcpStream::connect(("127.0.0.1", served.port)).is_err(),
    );
    assert!(
        served.child.try_wait().unwrap().is_none(),
        "exited with a request in flight"
    );

    stream.write_all(b"x=1&y=2").unwrap();
    let mut bytes = Vec::new();
    stream.read_to_end(&mut bytes).unwrap();
    let res = parse_response(&bytes);
    assert_eq!(res.status, 200, "{}", res.head);
    assert!(field(&res, "ratelimit").is_some(), "{}", res.head);

    let status = served.wait_for_exit(Duration::from_secs(15));
    assert_eq!(status.code(), Some(0), "{:?}", served.log.lock().unwrap());
    assert!(stopped.elapsed() < Duration::from_secs(15));
}

/// Sends `head` and the start of a body that never ends, then waits for
/// the answer; returns it with the time it took.
fn stalled_body(port: u16, head: &str, start: &str) -> (RawResponse, Duration) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
        .write_all(format!("{head}\r\nHost: localhost\r\n{start}").as_bytes())
        .unwrap();
    let sent = Instant::now();
    // Reads until the server closes the connection (a 10 s read timeout
    // fails the test if it never does).
    let res = read_response(&mut stream);
    (res, sent.elapsed())
}

/// A form announced as 100 bytes of which 7 come.
const SHORT_FORM: &str = "Content-Type: application/x-www-form-urlencoded\r\n\
                          Content-Length: 100\r\n\r\nphone=1";

/// A chunked form whose last chunk never comes.
const OPEN_CHUNKS: &str = "Content-Type: application/x-www-form-urlencoded\r\n\
                           Transfer-Encoding: chunked\r\n\r\n7\r\nphone=1\r\n";

const BODY_TIMEOUT: &str = r#"
[server]
workers = 1
body_timeout = "300ms"

[[rule]]
name = "sms"
paths = ["/sms/send"]
methods = ["POST"]
key = "form:phone"
limit = 100
window = "1m"
"#;

#[test]
fn stalled_body_gets_408_and_a_closed_connection_on_guarded_and_unguarded_routes() {
    let served = Served::start("body-timeout", BODY_TIMEOUT);
    // The filter reads the first body for its form:phone key; the handler of
    // /login/password reads the others through its form extractor.
    for (head, body) in [
        ("POST /sms/send HTTP/1.1", SHORT_FORM),
        ("POST /login/password HTTP/1.1", SHORT_FORM),
        ("POST /login/password HTTP/1.1", OPEN_CHUNKS),
    ] {
        let (res, took) = stalled_body(served.port, head, body);
        assert_eq!(res.status, 408, "{head}: {}", res.head);
        assert!(
            took >= Duration::from_millis(300),
            "{head}: answered after {took:?}, before body_timeout"
        );
        assert!(
            field(&res, "connection").is_some_and(|c| c.eq_ignore_ascii_case("close")),
            "{head}: {}",
            res.head
        );
    }
    // A handler that never reads the body (the 405 of a method the address
    // does not take) answers at once; the connection is closed after it
    // rather than kept open to drain a body that never ends.
    let (res, _) = stalled_body(served.port, "POST /healthz HTTP/1.1", OPEN_CHUNKS);
    assert_eq!(res.status, 405, "{}", res.head);
    served.wait_for_log("the 408's log line", |l| {
        l.contains("POST /login/password") && l.contains("408")
    });
    assert_eq!(served.get("/healthz").status, 200);
}

#[test]
fn slow_but_complete_body_within_body_timeout_is_read() {
    // A long body_timeout here: what is checked is that a body sent in
    // parts is read whole, which no speed of machine may turn into a 408.
    let served = Served::start("body-slow", &BODY_TIMEOUT.replace("300ms", "10s"));
    let mut stream = TcpStream::connect(("127.0.0.1", served.port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let body = b"phone=15550109999";
    let head = format!(
        "POST /sms/send HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    // The body in three parts, 50 ms apart: well within 10 s in all.
    for part in body.chunks(6) {
        std::thread::sleep(Duration::from_millis(50));
        stream.write_all(part).unwrap();
    }
    let res = read_response(&mut stream);
    // No CSRF token: the site refuses it, but only after the filter read the
    // whole body and decided (the RateLimit field).
    assert_eq!(res.status, 403, "{}", res.head);
    assert_eq!(
        field(&res, "ratelimit-policy").as_deref(),
        Some("\"sms\";q=100;w=60")
    );
}

/// With the outbox on, listening on an address other than loopback is
/// warned about at startup; on loopback nothing is said about it.
#[test]
fn the_outbox_on_an_address_other_than_loopback_is_warned_about() {
    let toml = "[server]\nworkers = 1\n\n[sms]\nprovider = \"outbox\"\n";
    let open = Served::start_on("outbox-any", toml, "0.0.0.0");
    let line = open.wait_for_log("the outbox warning", |l| l.contains("/dev/outbox"));
    assert!(line.contains("WARN") && line.contains("0.0.0.0"), "{line}");
    let quiet = Served::start("outbox-loopback", toml);
    quiet.wait_for_log("the startup line", |l| l.contains(&quiet.redis.url()));
    assert_eq!(quiet.log_lines(|l| l.contains("/dev/outbox")), 0);
}

/// The count a "held back" line stands for: "N more \"KIND\" lines" (the
/// periodic count) or "(and N more like it" (on the next line of the kind).
fn held_back(line: &str) -> u64 {
    let number_before = |at: usize| -> u64 {
        line[..at]
            .split_whitespace()
            .last()
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    if let Some(at) = line.find(" more like it") {
        return number_before(at);
    }
    if let Some(at) = line.find(" more \"") {
        return number_before(at);
    }
    0
}

#[test]
fn while_redis_is_down_a_repeated_warning_is_one_line_per_period_with_a_count() {
    let mut served = Served::start(
        "warnings",
        r#"
[server]
workers = 1

[redis]
timeout = "200ms"

[[rule]]
name = "check"
paths = ["/check"]
limit = 1000
window = "1m"
on_redis_error = "allow"
"#,
    );
    served.redis.stop();
    let started = Instant::now();
    for _ in 0..200 {
        assert_eq!(
            served.get("/check").status,
            200,
            "allowed by its error policy"
        );
    }
    // Each readiness probe asks the pool for a connection, which tries to
    // open one again and again until its timeout.
    for _ in 0..5 {
        assert_eq!(served.get("/readyz").status, 503);
    }
    let periods = started.elapsed().as_secs() / 10 + 2;
    // The counts still held back are written when the process stops.
    served.signal("TERM");
    assert_eq!(
        served.wait_for_exit(Duration::from_secs(15)).code(),
        Some(0)
    );
    let log = served.log.lock().unwrap().clone();
    // Nothing at ERROR: the pool's failures to connect are a repeated
    // warning too, not a line per attempt.
    let errors: Vec<&String> = log.iter().filter(|l| l.contains(" ERROR ")).collect();
    assert!(errors.is_empty(), "{errors:#?}");
    let warnings: Vec<&String> = log.iter().filter(|l| l.contains(" WARN ")).collect();
    // A handful of kinds, each at most once per period, plus its count.
    assert!(
        warnings.len() as u64 <= 6 * periods,
        "{} WARN lines: {warnings:#?}",
        warnings.len()
    );
    // Every request is accounted for: written, or counted in a later line.
    let no_decision: Vec<&&String> = warnings
        .iter()
        .filter(|l| l.contains("no decision"))
        .collect();
    let written = no_decision
        .iter()
        .filter(|l| l.contains("GET /check: no decision"))
        .count() as u64;
    let counted: u64 = no_decision.iter().map(|l| held_back(l)).sum();
    assert!(counted > 0, "{no_decision:#?}");
    assert_eq!(written + counted, 200, "{no_decision:#?}");
}

#[test]
fn text_from_a_request_cannot_forge_a_log_line() {
    let mut served = Served::start(
        "forged",
        r#"
[redis]
timeout = "200ms"

[[rule]]
name = "any"
paths = ["/f/*"]
limit = 1000
window = "1m"
"#,
    );
    let forged = |log: &[String]| {
        log.iter()
            .filter(|l| !l.starts_with('['))
            .cloned()
            .collect::<Vec<_>>()
    };
    // Decided by Redis: the debug line of the decision.
    for path in ["/f/%0Aforged", "/f/%0D%0Aforged", "/f/%1B[2Kforged"] {
        assert_eq!(served.get(path).status, 404);
    }
    served.wait_for_log("the escaped path", |l| {
        l.contains("GET /f/\\nforged: allowed")
    });
    served.wait_for_log("the escaped CR LF", |l| {
        l.contains("GET /f/\\r\\nforged: allowed")
    });
    served.wait_for_log("the escaped ESC", |l| {
        l.contains("GET /f/\\x1b[2Kforged: allowed")
    });
    // Not decided: the warning names the path too.
    served.redis.stop();
    assert_eq!(served.get("/f/%0Aforged").status, 404);
    served.wait_for_log("the warning", |l| {
        l.contains("GET /f/\\nforged: no decision")
    });
    let log = served.log.lock().unwrap().clone();
    assert_eq!(forged(&log), Vec::<String>::new());
    assert!(
        !log.iter().any(|l| l.contains('\x1b') || l.contains('\r')),
        "{log:#?}"
    );
}
