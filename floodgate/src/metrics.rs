//! Prometheus counters for `/metrics`: decisions per rule and outcome,
//! denials answered from the denial cache, Redis errors, the breaker, and a
//! histogram of decision times.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use crate::limiter::Limiter;

/// What happened to a request under one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum DecisionKind {
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
    /// Redis failed; `on_redis_error = "local"`: this process allowed it.
    LocalAllowed,
    /// Redis failed; `on_redis_error = "local"`: this process denied it.
    LocalDenied,
    /// The identity is banned under the rule (by an operator or a penalty).
    Banned,
}

impl DecisionKind {
    /// The `decision` label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            DecisionKind::Allowed => "allowed",
            DecisionKind::Denied => "denied",
            DecisionKind::ShadowDenied => "shadow_denied",
            DecisionKind::ErrorAllowed => "error_allowed",
            DecisionKind::ErrorDenied => "error_denied",
            DecisionKind::LocalAllowed => "local_allowed",
            DecisionKind::LocalDenied => "local_denied",
            DecisionKind::Banned => "banned",
        }
    }
}

/// Upper bounds of the decision-time histogram, in seconds.
const BUCKETS: [f64; 12] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// Outcomes in label order, for rendering.
const OUTCOMES: [DecisionKind; 8] = [
    DecisionKind::Allowed,
    DecisionKind::Denied,
    DecisionKind::Banned,
    DecisionKind::ShadowDenied,
    DecisionKind::ErrorAllowed,
    DecisionKind::ErrorDenied,
    DecisionKind::LocalAllowed,
    DecisionKind::LocalDenied,
];

/// The slot after the outcomes: denials answered from the denial cache.
const CACHE_HITS: usize = OUTCOMES.len();

/// Then bans started, by an operator and by a penalty.
const BANS: [(usize, &str); 2] = [(CACHE_HITS + 1, "operator"), (CACHE_HITS + 2, "penalty")];

/// One rule's counters, one per outcome, then cache hits, then bans.
type RuleCounters = [AtomicU64; OUTCOMES.len() + 3];

/// All counters of the process.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Per rule; a rule's counters are created on its first decision, then
    /// counted with a read lock and an atomic add (no allocation).
    decisions: RwLock<BTreeMap<String, RuleCounters>>,
    /// Observations per bucket, not cumulative (one add per observation).
    buckets: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
    /// The limiter whose breaker and late decisions are shown.
    limiter: OnceLock<Arc<Limiter>>,
}

impl Metrics {
    /// Shows `limiter`'s breaker state and skipped late decisions (the
    /// first limiter attached stays).
    ///
    /// From then on the limiter's process counts the operator bans it
    /// claims (one process of those sharing the Redis counts each: see
    /// [`Limiter::operate`]), and they are shown here.
    pub fn watch(&self, limiter: &Arc<Limiter>) {
        if self.limiter.set(Arc::clone(limiter)).is_ok() {
            limiter.local().bans().count_here();
        }
    }

    /// Each rule's decisions so far, every outcome together (what a chart
    /// of decisions over time samples), rules in name order.
    pub fn decisions_by_rule(&self) -> Vec<(String, u64)> {
        let map = match self.decisions.read() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        map.iter()
            .map(|(rule, counters)| {
                let n = OUTCOMES
                    .iter()
                    .map(|o| counters[*o as usize].load(Ordering::Relaxed))
                    .sum();
                (rule.clone(), n)
            })
            .collect()
    }

    /// Counts one rule's outcome for one request.
    pub(crate) fn decision(&self, rule: &str, outcome: DecisionKind) {
        self.add(rule, outcome as usize);
    }

    /// Counts one request denied from the denial cache under `rule`.
    pub(crate) fn deny_cache_hit(&self, rule: &str) {
        self.add(rule, CACHE_HITS);
    }

    /// Counts one ban started under `rule` by `source` (`operator` or
    /// `penalty`).
    pub(crate) fn ban(&self, rule: &str, source: &str) {
        if let Some((slot, _)) = BANS.iter().find(|(_, s)| *s == source) {
            self.add(rule, *slot);
        }
    }

    fn add(&self, rule: &str, slot: usize) {
        {
            let map = match self.decisions.read() {
                Ok(m) => m,
                Err(p) => p.into_inner(),
            };
            if let Some(counters) = map.get(rule) {
                counters[slot].fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        let mut map = match self.decisions.write() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        };
        map.entry(rule.to_string()).or_default()[slot].fetch_add(1, Ordering::Relaxed);
    }

    /// Records how long one decision took.
    pub(crate) fn observe(&self, took: Duration) {
        // One add in the first bucket that holds it; render sums them up.
        let secs = took.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|bound| secs <= *bound) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
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
            let map = match self.decisions.read() {
                Ok(m) => m,
                Err(p) => p.into_inner(),
            };
            for (rule, counters) in map.iter() {
                for outcome in OUTCOMES {
                    let n = counters[outcome as usize].load(Ordering::Relaxed);
                    if n > 0 {
                        let _ = writeln!(
                            out,
                            "floodgate_decisions_total{{rule=\"{rule}\",decision=\"{}\"}} {n}",
                            outcome.label()
                        );
                    }
                }
            }
        }
        out.push_str(
            "# HELP floodgate_deny_cache_hits_total Denials answered from the denial cache, by rule.\n",
        );
        out.push_str("# TYPE floodgate_deny_cache_hits_total counter\n");
        {
            let map = match self.decisions.read() {
                Ok(m) => m,
                Err(p) => p.into_inner(),
            };
            for (rule, counters) in map.iter() {
                let n = counters[CACHE_HITS].load(Ordering::Relaxed);
                if n > 0 {
                    let _ = writeln!(
                        out,
                        "floodgate_deny_cache_hits_total{{rule=\"{rule}\"}} {n}"
                    );
                }
            }
        }
        out.push_str(
            "# HELP floodgate_bans_total Bans started, by rule and source (operator or penalty).\n",
        );
        out.push_str("# TYPE floodgate_bans_total counter\n");
        {
            // Operator bans are counted where they are claimed (the
            // limiter); the rest here.
            let mut bans: BTreeMap<String, [u64; BANS.len()]> = BTreeMap::new();
            if let Some(limiter) = self.limiter.get() {
                for (rule, n) in limiter.local().bans().counted() {
                    bans.entry(rule).or_default()[0] += n;
                }
            }
            let map = match self.decisions.read() {
                Ok(m) => m,
                Err(p) => p.into_inner(),
            };
            for (rule, counters) in map.iter() {
                for (i, (slot, _)) in BANS.iter().enumerate() {
                    let n = counters[*slot].load(Ordering::Relaxed);
                    if n > 0 {
                        bans.entry(rule.clone()).or_default()[i] += n;
                    }
                }
            }
            for (rule, counts) in &bans {
                for ((_, source), n) in BANS.iter().zip(counts) {
                    if *n > 0 {
                        let _ = writeln!(
                            out,
                            "floodgate_bans_total{{rule=\"{rule}\",source=\"{source}\"}} {n}"
                        );
                    }
                }
            }
        }
        let (open, late) = self
            .limiter
            .get()
            .map_or((false, 0), |l| (l.breaker_open(), l.late_count()));
        out.push_str(
            "# HELP floodgate_breaker_open 1 while Redis is not asked after a failure, else 0.\n",
        );
        out.push_str("# TYPE floodgate_breaker_open gauge\n");
        let _ = writeln!(out, "floodgate_breaker_open {}", u8::from(open));
        out.push_str(
            "# HELP floodgate_late_decisions_skipped_total Calls that reached Redis after their caller gave up; Redis decided nothing for them.\n",
        );
        out.push_str("# TYPE floodgate_late_decisions_skipped_total counter\n");
        let _ = writeln!(out, "floodgate_late_decisions_skipped_total {late}");
        out.push_str("# HELP floodgate_redis_errors_total Redis errors and timeouts.\n");
        out.push_str("# TYPE floodgate_redis_errors_total counter\n");
        let _ = writeln!(out, "floodgate_redis_errors_total {redis_errors}");
        out.push_str(
            "# HELP floodgate_decision_duration_seconds Time to decide a guarded request.\n",
        );
        out.push_str("# TYPE floodgate_decision_duration_seconds histogram\n");
        let mut cumulative = 0;
        for (i, bound) in BUCKETS.iter().enumerate() {
            cumulative += self.buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "floodgate_decision_duration_seconds_bucket{{le=\"{bound}\"}} {cumulative}"
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counts_and_a_cumulative_histogram() {
        let m = Metrics::default();
        m.decision("check", DecisionKind::Allowed);
        m.decision("check", DecisionKind::Allowed);
        m.decision("check", DecisionKind::Denied);
        m.decision("check", DecisionKind::LocalDenied);
        m.deny_cache_hit("check");
        m.deny_cache_hit("check");
        m.observe(Duration::from_micros(50));
        m.observe(Duration::from_millis(3));
        let text = m.render(7);
        assert!(text.contains("floodgate_decisions_total{rule=\"check\",decision=\"allowed\"} 2\n"));
        assert!(text.contains("floodgate_decisions_total{rule=\"check\",decision=\"denied\"} 1\n"));
        assert!(!text.contains("shadow_denied"));
        assert!(text
            .contains("floodgate_decisions_total{rule=\"check\",decision=\"local_denied\"} 1\n"));
        assert!(text.contains("floodgate_deny_cache_hits_total{rule=\"check\"} 2\n"));
        assert!(text.contains("floodgate_breaker_open 0\n"));
        assert!(text.contains("floodgate_redis_errors_total 7\n"));
        assert!(text.contains("floodgate_decision_duration_seconds_bucket{le=\"0.0001\"} 1\n"));
        assert!(text.contains("floodgate_decision_duration_seconds_bucket{le=\"0.0025\"} 1\n"));
        assert!(text.contains("floodgate_decision_duration_seconds_bucket{le=\"0.005\"} 2\n"));
        assert!(text.contains("floodgate_decision_duration_seconds_bucket{le=\"+Inf\"} 2\n"));
        assert!(text.contains("floodgate_decision_duration_seconds_count 2\n"));
    }
}
