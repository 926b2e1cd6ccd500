//! Prometheus counters for `/metrics`: decisions per rule and outcome,
//! Redis errors, and a histogram of decision times.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// What happened to a request under one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// Under the limit.
    Allowed,
    /// Over the limit and denied.
    Denied,
    /// Over the limit, shadow mode: let through.
    ShadowDenied,
    /// Redis failed; `on_redis_error = "allow"` let it through.
    ErrorAllowed,
    /// Redis failed; `on_redis_error = "deny"` answered 503.
    ErrorDenied,
}

impl Outcome {
    /// The `decision` label.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Allowed => "allowed",
            Outcome::Denied => "denied",
            Outcome::ShadowDenied => "shadow_denied",
            Outcome::ErrorAllowed => "error_allowed",
            Outcome::ErrorDenied => "error_denied",
        }
    }
}

/// Upper bounds of the decision-time histogram, in seconds.
const BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// All counters of the process.
#[derive(Debug, Default)]
pub struct Metrics {
    decisions: Mutex<BTreeMap<(String, Outcome), u64>>,
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Metrics {
    /// Counts one rule's outcome for one request.
    pub fn decision(&self, rule: &str, outcome: Outcome) {
        let mut map = match self.decisions.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        *map.entry((rule.to_string(), outcome)).or_insert(0) += 1;
    }

    /// Records how long one decision took.
    pub fn observe(&self, took: Duration) {
        let secs = took.as_secs_f64();
        for (i, bound) in BUCKETS.iter().enumerate() {
            if secs <= *bound {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    /// The Prometheus text exposition; `redis_errors` comes from the limiter.
    pub fn render(&self, redis_errors: u64) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP floodgate_decisions_total Rate-limit decisions by rule and outcome.\n",
        );
        out.push_str("# TYPE floodgate_decisions_total counter\n");
        {
            let map = match self.decisions.lock() {
                Ok(m) => m,
                Err(p) => p.into_inner(),
            };
            for ((rule, outcome), n) in map.iter() {
                let _ = writeln!(
                    out,
                    "floodgate_decisions_total{{rule=\"{rule}\",decision=\"{}\"}} {n}",
                    outcome.label()
                );
            }
        }
        out.push_str("# HELP floodgate_redis_errors_total Redis errors and timeouts.\n");
        out.push_str("# TYPE floodgate_redis_errors_total counter\n");
        let _ = writeln!(out, "floodgate_redis_errors_total {redis_errors}");
        out.push_str(
            "# HELP floodgate_decision_duration_seconds Time to decide a guarded request.\n",
        );
        out.push_str("# TYPE floodgate_decision_duration_seconds histogram\n");
        for (i, bound) in BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "floodgate_decision_duration_seconds_bucket{{le=\"{bound}\"}} {}",
                self.buckets[i].load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "floodgate_decision_duration_seconds_bucket{{le=\"+Inf\"}} {count}"
        );
        let _ = writeln!(
            out,
            "floodgate_decision_duration_seconds_sum {}",
            self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "floodgate_decision_duration_seconds_count {count}");
        out
    }
}
