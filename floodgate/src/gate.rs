//! A request's limits decided as the two doors decide them, for a front end
//! of your own (a gRPC service, a queue consumer): [`decide`].
//!
//! A denial the process remembers answers at once, without Redis; else
//! Redis decides every limit in one all-or-nothing call; else (Redis
//! failed, or the breaker is open) each limit's `on_redis_error` does:
//! `deny` refuses the request, `local` has this process enforce the limit
//! alone, `allow` lets it pass. A limit whose own state or parameters
//! Redis cannot use fails alone: when it lets requests pass, Redis decides
//! the others without it ([`Verdict::Partial`]). Every outcome is counted in [`Metrics`]
//! under its limit's name, as the filter counts its rules', and the time
//! the decision took goes into the latency histogram.
//!
//! ```no_run
//! use floodgate_limiter::gate::{self, Named, Verdict};
//! use floodgate_limiter::limiter::{Check, Limiter};
//! use floodgate_limiter::metrics::Metrics;
//! use floodgate_limiter::rule::{Algorithm, OnRedisError};
//! use std::time::Duration;
//!
//! # async fn run(limiter: &Limiter, metrics: &Metrics) -> Result<(), Box<dyn std::error::Error>> {
//! let per_user = Algorithm::sliding_window(100, Duration::from_secs(60))?;
//! let checks = [Check::new("jobs:user:42", per_user)];
//! let limits = [Named::new("jobs-per-user", OnRedisError::Local)];
//! match gate::decide(limiter, metrics, &limits, &checks).await {
//!     Verdict::Redis(d) if d.allowed => println!("run the job"),
//!     Verdict::Fallback(f) if f.decision.allowed => println!("run it (decided here)"),
//!     Verdict::Unavailable(e) => println!("try later: {e}"),
//!     _ => println!("over the limit"),
//! }
//! # Ok(()) }
//! ```

use std::time::{Duration, Instant};

use crate::limiter::{Check, Decision, Limiter, LimiterError, Quota};
use crate::metrics::{DecisionKind as Counted, Metrics};
use crate::rule::OnRedisError;

/// One limit of a request, as [`decide`] counts and falls back on it: the
/// name its outcomes are counted under, and what becomes of it when Redis
/// does not decide. Whether it enforces is its [`Check`]'s.
#[derive(Debug, Clone, Copy)]
pub struct Named<'a> {
    name: &'a str,
    on_redis_error: OnRedisError,
    /// Only time gives its units back, so a denial is certain until its
    /// wait is over (the denial cache may answer it).
    certain: bool,
}

impl<'a> Named<'a> {
    /// A limit counted as `name`, with `on_redis_error`.
    pub fn new(name: &'a str, on_redis_error: OnRedisError) -> Self {
        Named {
            name,
            on_redis_error,
            certain: true,
        }
    }

    /// Its units may come back before their time (as under `count =
    /// "failures"`), so its denials are never answered from the denial
    /// cache.
    pub fn gives_back(self) -> Self {
        Named {
            certain: false,
            ..self
        }
    }
}

/// How [`decide`] decided a request. Not `non_exhaustive`: a front end
/// matches every verdict, and a new one is a change it must make.
#[derive(Debug)]
pub enum Verdict {
    /// Redis decided (a denied request was charged nothing).
    Redis(Decision),
    /// Denied without a Redis call: the denial cache remembers a denial.
    Remembered(Remembered),
    /// Redis did not decide, and an enforcing limit says `deny`.
    Unavailable(LimiterError),
    /// Redis did not decide, and no enforcing limit says `deny`: the
    /// limits with `local` were decided by this process, the others let
    /// the request pass.
    Fallback(Fallback),
    /// Redis decided some of the limits; it could not decide the others
    /// (their state or parameters made its script fail), and those let the
    /// request pass: one limit cannot hurt another.
    Partial(Partial),
}

/// What [`decide`] did when some limits could not be decided.
#[derive(Debug)]
#[non_exhaustive]
pub struct Partial {
    /// The limits Redis decided (indexes into the limits given), in order.
    pub decided: Vec<usize>,
    /// Redis's decision on them: one outcome per entry of `decided`.
    pub decision: Decision,
    /// Why Redis could not decide the others ([`LimiterError::Check`]).
    pub error: LimiterError,
}

/// A denial answered from the denial cache.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Remembered {
    /// The denying limit (an index into the limits and checks given).
    pub index: usize,
    /// When the request surely fits again (or the ban is over).
    pub wait: Duration,
    /// The identity's own quota (an operator's override) it was denied
    /// under, if any.
    pub quota: Option<Quota>,
    /// The identity is banned, not only over the limit.
    pub banned: bool,
}

/// What [`decide`] did without Redis.
#[derive(Debug)]
pub struct Fallback {
    /// Why Redis did not decide.
    pub error: LimiterError,
    /// The limits decided here (indexes into the limits given), in order.
    pub local: Vec<usize>,
    /// Their checks, in the same order.
    pub checks: Vec<Check>,
    /// This process's decision on them: one outcome per entry of `local`
    /// (none, and allowed, when no limit says `local`).
    pub decision: Decision,
    /// When it was decided, on the local limiter's clock (its give-backs).
    pub(crate) at: u64,
}

/// Decides `checks`, one per entry of `limits`, for one request; counts the
/// outcomes in `metrics` (see the module's documentation).
///
/// Redis's denials are counted for the enforcing limits that denied
/// (`denied` or `banned`), and `shadow_denied` for each limit that does not
/// enforce and was over, whether the request was allowed or not; an allowed
/// request counts its other limits `allowed`. A check without its `Named`
/// (a `limits` shorter than `checks`) is counted under an empty name and
/// decided with `allow`.
pub async fn decide(
    limiter: &Limiter,
    metrics: &Metrics,
    limits: &[Named<'_>],
    checks: &[Check],
) -> Verdict {
    let allow = Named::new("", OnRedisError::Allow);
    decide_each(limiter, metrics, checks, |i| {
        limits.get(i).copied().unwrap_or(allow)
    })
    .await
}

/// As [`decide`], with each check's limit from `limit` (the filter's rules,
/// without a list of them per request).
pub(crate) async fn decide_each<'a>(
    limiter: &Limiter,
    metrics: &Metrics,
    checks: &[Check],
    limit: impl Fn(usize) -> Named<'a>,
) -> Verdict {
    let started = Instant::now();
    let verdict = decide_at(limiter, metrics, checks, &limit, started).await;
    metrics.observe(started.elapsed());
    verdict
}

async fn decide_at<'a>(
    limiter: &Limiter,
    metrics: &Metrics,
    checks: &[Check],
    limit: &impl Fn(usize) -> Named<'a>,
    started: Instant,
) -> Verdict {
    let eligible = |i: usize| checks[i].enforce() && limit(i).certain;
    if let Some((index, denial)) = limiter.remembered_denial(checks, eligible, started) {
        let name = limit(index).name;
        metrics.deny_cache_hit(name);
        let counted = if denial.banned {
            Counted::Banned
        } else {
            Counted::Denied
        };
        metrics.decision(name, counted);
        return Verdict::Remembered(Remembered {
            index,
            wait: denial.wait,
            quota: denial.quota,
            banned: denial.banned,
        });
    }
    match limiter.decide(checks.to_vec()).await {
        Ok(decision) => {
            // (A ban Redis answered is taught to the local fallback by the
            // limiter itself, for every caller.)
            limiter.remember_denials(checks, &decision, eligible, started);
            count_redis(metrics, limit, checks, &decision);
            Verdict::Redis(decision)
        }
        Err(error @ LimiterError::Check(_)) if checks.len() > 1 => {
            without_undecidable(limiter, metrics, checks, limit, started, error).await
        }
        Err(error) => fallback(limiter, metrics, checks, limit, error),
    }
}

/// A request of several limits that Redis could not decide because of
/// some of them (their state or parameters make the script fail): those,
/// found by peeking each limit alone, fail alone. When their
/// `on_redis_error` lets the request pass (`allow`, or a limit that does
/// not enforce), Redis decides the others, all or nothing among
/// themselves; a failing limit that says `deny` or `local` makes it
/// the whole request's failure, as when Redis is away.
async fn without_undecidable<'a>(
    limiter: &Limiter,
    metrics: &Metrics,
    checks: &[Check],
    limit: &impl Fn(usize) -> Named<'a>,
    started: Instant,
    mut error: LimiterError,
) -> Verdict {
    let passes = |i: usize| !checks[i].enforce() || limit(i).on_redis_error == OnRedisError::Allow;
    let mut left: Vec<usize> = (0..checks.len()).collect();
    let mut failed: Vec<usize> = Vec::new();
    loop {
        let mut failing = Vec::new();
        for &i in &left {
            if let Err(LimiterError::Check(_)) = limiter.peek(vec![checks[i].clone()]).await {
                failing.push(i);
            }
        }
        if failing.is_empty() || !failing.iter().all(|&i| passes(i)) {
            return fallback(limiter, metrics, checks, limit, error);
        }
        left.retain(|i| !failing.contains(i));
        failed.extend(failing);
        let sub: Vec<Check> = left.iter().map(|&i| checks[i].clone()).collect();
        // (No checks left: the limiter allows at once, asking nothing.)
        match limiter.decide(sub.clone()).await {
            Ok(decision) => {
                let of = |j: usize| limit(left[j]);
                let eligible = |j: usize| sub[j].enforce() && of(j).certain;
                limiter.remember_denials(&sub, &decision, eligible, started);
                count_redis(metrics, &of, &sub, &decision);
                for &i in &failed {
                    metrics.decision(limit(i).name, Counted::ErrorAllowed);
                }
                return Verdict::Partial(Partial {
                    decided: left,
                    decision,
                    error,
                });
            }
            Err(e @ LimiterError::Check(_)) if left.len() > 1 => error = e,
            Err(e) => return fallback(limiter, metrics, checks, limit, e),
        }
    }
}

/// Counts what Redis decided (see [`decide`]).
fn count_redis<'a>(
    metrics: &Metrics,
    limit: &impl Fn(usize) -> Named<'a>,
    checks: &[Check],
    d: &Decision,
) {
    for (i, (c, o)) in checks.iter().zip(&d.outcomes).enumerate() {
        let counted = match (d.allowed, o.allowed, c.enforce()) {
            (true, true, _) => Some(Counted::Allowed),
            // A watching limit over its count would have refused the
            // request, whether or not another limit did.
            (_, false, false) => Some(Counted::ShadowDenied),
            (_, false, true) if o.banned => Some(Counted::Banned),
            (_, false, true) => Some(Counted::Denied),
            // A denied request's other limits took nothing.
            (false, true, _) => None,
        };
        if let Some(counted) = counted {
            metrics.decision(limit(i).name, counted);
        }
        if o.ban_started {
            metrics.ban(limit(i).name, "penalty");
        }
    }
}

/// Applies each limit's `on_redis_error`.
fn fallback<'a>(
    limiter: &Limiter,
    metrics: &Metrics,
    checks: &[Check],
    limit: &impl Fn(usize) -> Named<'a>,
    error: LimiterError,
) -> Verdict {
    let policy = |i: usize| limit(i).on_redis_error;
    let deny = (0..checks.len()).any(|i| checks[i].enforce() && policy(i) == OnRedisError::Deny);
    if deny {
        for i in 0..checks.len() {
            metrics.decision(limit(i).name, Counted::ErrorDenied);
        }
        return Verdict::Unavailable(error);
    }
    let local: Vec<usize> = (0..checks.len())
        .filter(|&i| policy(i) == OnRedisError::Local)
        .collect();
    let here: Vec<Check> = local.iter().map(|&i| checks[i].clone()).collect();
    let (decision, at) = if here.is_empty() {
        let allowed = Decision {
            outcomes: Vec::new(),
            allowed: true,
        };
        (allowed, 0)
    } else {
        limiter.local().decide_stamped(&here)
    };
    for (i, check) in checks.iter().enumerate() {
        let counted = match local.iter().position(|&l| l == i) {
            Some(at) => {
                let o = &decision.outcomes[at];
                match (o.allowed, o.banned, check.enforce()) {
                    (true, _, _) => Counted::LocalAllowed,
                    (false, true, _) => Counted::Banned,
                    (false, false, true) => Counted::LocalDenied,
                    (false, false, false) => Counted::ShadowDenied,
                }
            }
            None => Counted::ErrorAllowed,
        };
        metrics.decision(limit(i).name, counted);
    }
    Verdict::Fallback(Fallback {
        error,
        local,
        checks: here,
        decision,
        at,
    })
}

/// Counts a denial the caller decided without a check (a limit of no
/// requests at all): `denied`, or `shadow_denied` for a limit that does
/// not `enforce`.
#[doc(hidden)] // the floodgate binary's, not part of the API
pub fn count_refused(metrics: &Metrics, name: &str, enforce: bool) {
    let counted = if enforce {
        Counted::Denied
    } else {
        Counted::ShadowDenied
    };
    metrics.decision(name, counted);
}
