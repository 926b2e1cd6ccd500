//! How a request's checks are decided: from the denial cache when one of
//! them is certainly denied, else by Redis, else (Redis failed, or the
//! breaker is open) by each rule's `on_redis_error`: `deny` answers 503,
//! `local` has this process enforce the rule alone, `allow` lets it pass.

use std::time::{Duration, Instant};

use crate::limiter::{Check, Decision, Limiter, LimiterError, Outcome, Quota};
use crate::metrics::{DecisionKind as Counted, Metrics};
use crate::rule::{Count, Mode, OnRedisError, Rule};

/// What the filter does with a request.
pub(crate) enum Verdict {
    /// Redis decided.
    Redis(Decision),
    /// Denied without a call: the rule (index into the matched rules) that
    /// denies, when the request surely fits again, and the identity's own
    /// quota (an override) it was denied under.
    Cached {
        rule: usize,
        wait: Duration,
        quota: Option<Quota>,
        /// The identity is banned (not only over the limit).
        banned: bool,
    },
    /// Redis did not decide and an enforce rule says `deny`: 503.
    Unavailable(LimiterError),
    /// Redis did not decide; the rules with `local` were decided in this
    /// process (`local`: their indexes, their checks, the decision), the
    /// others let the request pass.
    Fallback {
        error: LimiterError,
        local: Vec<usize>,
        checks: Vec<Check>,
        decision: Decision,
        /// When the local decision was made, on the local limiter's clock.
        at: u64,
    },
}

/// Whether a rule's denials may be answered from the cache: enforce rules
/// whose units only time gives back (`count = "failures"` gives units back
/// after a success, so its denials are not certain).
fn cacheable(rule: &Rule) -> bool {
    rule.mode == Mode::Enforce && rule.count == Count::All
}

/// Decides `checks` (one per rule in `matched`) for a request whose
/// decision started at `started`; counts the outcome in `metrics`. The
/// checks stay the caller's (it needs them again afterwards): the limiter
/// gets the one copy it keeps.
pub(crate) async fn decide(
    limiter: &Limiter,
    metrics: &Metrics,
    matched: &[&Rule],
    checks: &[Check],
    started: Instant,
) -> Verdict {
    let eligible = |i: usize| cacheable(matched[i]);
    if let Some((rule, denial)) = limiter.remembered_denial(checks, eligible, started) {
        metrics.deny_cache_hit(&matched[rule].name);
        let counted = if denial.banned {
            Counted::Banned
        } else {
            Counted::Denied
        };
        metrics.decision(&matched[rule].name, counted);
        return Verdict::Cached {
            rule,
            banned: denial.banned,
            wait: denial.wait,
            quota: denial.quota,
        };
    }
    let result = limiter.decide(checks.to_vec()).await;
    match result {
        Ok(decision) => {
            // (A ban Redis answered is taught to the local fallback by the
            // limiter itself, for every caller.)
            limiter.remember_denials(checks, &decision, eligible, started);
            Verdict::Redis(decision)
        }
        Err(error) => fallback(limiter, metrics, matched, checks, error),
    }
}

/// Applies each rule's `on_redis_error`.
fn fallback(
    limiter: &Limiter,
    metrics: &Metrics,
    matched: &[&Rule],
    checks: &[Check],
    error: LimiterError,
) -> Verdict {
    let deny = matched
        .iter()
        .any(|r| r.mode == Mode::Enforce && r.on_redis_error == OnRedisError::Deny);
    if deny {
        for r in matched {
            metrics.decision(&r.name, Counted::ErrorDenied);
        }
        return Verdict::Unavailable(error);
    }
    let local: Vec<usize> = (0..matched.len())
        .filter(|&i| matched[i].on_redis_error == OnRedisError::Local)
        .collect();
    let checks: Vec<Check> = local
        .iter()
        .filter_map(|&i| checks.get(i).cloned())
        .collect();
    let (decision, at) = if checks.is_empty() {
        let allowed = Decision {
            outcomes: Vec::new(),
            allowed: true,
        };
        (allowed, 0)
    } else {
        limiter.local().decide_stamped(&checks)
    };
    for (i, r) in matched.iter().enumerate() {
        let counted = match local.iter().position(|&l| l == i) {
            Some(at) if decision.outcomes[at].allowed => Counted::LocalAllowed,
            Some(at) if decision.outcomes[at].banned => Counted::Banned,
            Some(_) => Counted::LocalDenied,
            None => Counted::ErrorAllowed,
        };
        metrics.decision(&r.name, counted);
    }
    Verdict::Fallback {
        error,
        local,
        checks,
        decision,
        at,
    }
}

/// Each rule's name and whether it was over, for the log.
pub(super) fn summary(rules: &[&Rule], outcomes: &[Outcome]) -> String {
    rules
        .iter()
        .zip(outcomes)
        .map(|(r, o)| format!("{}={}", r.name, if o.allowed { "ok" } else { "over" }))
        .collect::<Vec<_>>()
        .join(" ")
}
