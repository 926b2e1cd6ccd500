//! What docs/monitoring ships, checked against a live app: every metric
//! the Grafana dashboard and the Prometheus alert rules read is one the
//! app's `/metrics` serves, and Prometheus's own `promtool` accepts the
//! alert rules, each dashboard query and the `/metrics` text itself.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::helpers::spawn_app_with;

const RULES: &str = r#"
[[rule]]
name = "check"
paths = ["/check"]
limit = 1
window = "1h"
deny = "status"
penalty = { after = 1, within = "10m", ban = "1m", max = "4m" }
"#;

fn docs(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("docs/monitoring")
        .join(file)
}

/// Prometheus's `promtool` (scripts/test unpacks Debian's `prometheus`
/// package and sets FLOODGATE_PROMTOOL).
fn promtool() -> PathBuf {
    let path = std::env::var_os("FLOODGATE_PROMTOOL").unwrap_or_else(|| {
        panic!("FLOODGATE_PROMTOOL is not set: it names Prometheus's promtool (scripts/test unpacks it)")
    });
    PathBuf::from(path)
}

/// Runs promtool with `args`, `input` on its standard input; its output when
/// it succeeds.
fn run_promtool(args: &[&str], input: &str) -> String {
    let mut child = Command::new(promtool())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}: {text}");
    text
}

/// Every `floodgate_*` metric named in `expr`, a histogram's series named
/// by the histogram.
fn metrics_in(expr: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("floodgate_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name);
        found.insert(base.to_string());
    }
    found
}

/// Every label name `expr` selects on or groups by (`{name=..}`,
/// `by (a, b)`), and that a legend (`{{name}}`) shows.
fn labels_in(expr: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let name = |s: &str| -> String {
        s.trim()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut rest = expr;
    while let Some(open) = rest.find('{') {
        let Some(close) = rest[open..].find('}') else {
            break;
        };
        let inside = &rest[open + 1..open + close];
        let inside = inside.trim_start_matches('{');
        for part in inside.split(',') {
            let n = name(part);
            if !n.is_empty() {
                found.insert(n);
            }
        }
        rest = &rest[open + close + 1..];
    }
    for word in ["by (", "without ("] {
        let mut rest = expr;
        while let Some(at) = rest.find(word) {
            let after = &rest[at + word.len()..];
            let list = after.split(')').next().unwrap_or("");
            found.extend(list.split(',').map(name).filter(|n| !n.is_empty()));
            rest = after;
        }
    }
    found
}

#[actix_web::test]
async fn the_dashboard_and_alerts_read_metrics_the_app_serves() {
    let app = spawn_app_with(RULES, |_| {}).await;
    // A decision of each kind the panels show: allowed, denied, a penalty's ban.
    for _ in 0..3 {
        app.client.get(app.url("/check")).send().await.unwrap();
    }
    let text = app.metrics().await;
    let served: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    // The exposition format itself passes Prometheus's lint.
    run_promtool(&["check", "metrics"], &text);

    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(docs("grafana-dashboard.json")).unwrap())
            .unwrap();
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .map(|t| t["expr"].as_str().unwrap().to_string())
        .collect();
    assert!(exprs.len() >= 8, "{exprs:?}");
    let alerts_text = std::fs::read_to_string(docs("prometheus-alerts.yml")).unwrap();
    let alerts: serde_yaml_ng::Value = serde_yaml_ng::from_str(&alerts_text).unwrap();
    let rules = alerts["groups"][0]["rules"].as_sequence().unwrap();
    assert!(rules.len() >= 5);
    let mut read = BTreeSet::new();
    for expr in exprs
        .iter()
        .map(String::as_str)
        .chain(rules.iter().map(|r| r["expr"].as_str().unwrap()))
    {
        let names = metrics_in(expr);
        assert!(!names.is_empty(), "{expr} reads no floodgate metric");
        read.extend(names);
    }
    let missing: Vec<&String> = read.difference(&served).collect();
    assert!(missing.is_empty(), "not served: {missing:?}\n{text}");
    // ...and only labels that the app's series carry (or that Prometheus
    // adds: instance, job), in selectors, groupings and legends alike.
    let mut labelled: BTreeSet<String> = ["instance", "job"].map(String::from).into();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        if let (Some(open), Some(close)) = (line.find('{'), line.find('}')) {
            labelled.extend(
                line[open + 1..close]
                    .split(',')
                    .filter_map(|kv| kv.split('=').next())
                    .map(str::to_string),
            );
        }
    }
    let legends = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter())
        .filter_map(|t| t["legendFormat"].as_str());
    for expr in exprs
        .iter()
        .map(String::as_str)
        .chain(rules.iter().map(|r| r["expr"].as_str().unwrap()))
        .chain(legends)
    {
        let unknown: Vec<String> = labels_in(expr).difference(&labelled).cloned().collect();
        assert!(
            unknown.is_empty(),
            "{expr}: no series has {unknown:?}\n{text}"
        );
    }
    for needed in ["floodgate_bans_active", "floodgate_overrides_active"] {
        assert!(
            read.contains(needed),
            "{needed} is read by no panel or alert"
        );
    }

    // promtool accepts the alert rules, and each dashboard query (as a
    // recording rule, Grafana's variables given values).
    let file = std::env::temp_dir().join(format!("fg-alerts-{}.yml", std::process::id()));
    std::fs::write(&file, &alerts_text).unwrap();
    run_promtool(&["check", "rules", file.to_str().unwrap()], "");
    let mut recorded = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, expr) in exprs.iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$instance", ".*");
        recorded.push_str(&format!(
            "      - record: dashboard:panel_{i}\n        expr: {}\n",
            serde_json::to_string(&expr).unwrap()
        ));
    }
    std::fs::write(&file, recorded).unwrap();
    run_promtool(&["check", "rules", file.to_str().unwrap()], "");
    std::fs::remove_file(&file).unwrap();
}
