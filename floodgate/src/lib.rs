#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, unnameable_types)]
// What only `__private` reaches (feature `__internals`: the crate's own tests
// and the repository's tests and benchmarks) is unused without it.
#![cfg_attr(not(feature = "__internals"), allow(dead_code, unreachable_pub))]

mod head;
mod units;

pub mod config;
mod filter;
pub mod gate;
pub mod limiter;
pub mod logging;
pub mod metrics;
pub mod net;
pub mod rule;

/// The tower door: [`Filter`] is a `tower::Layer` (axum 0.8, tonic, hyper).
#[cfg(feature = "tower")]
pub mod tower {
    pub use crate::filter::tower::{Guarded, GuardedBody, GuardedRequestBody};
}

/// The actix-web door: [`Filter`] is a `Transform` (`App::wrap`).
#[cfg(feature = "actix")]
pub use crate::filter::{accepts, FilterService};
pub use crate::filter::{
    ban_action, operator_check, override_action, Denial, Filter, FilterBuilder, Limit,
    OperatorError, RuleState, SetupError, Unreadable, Usage,
};
pub use crate::head::RequestHead;
pub use crate::rule::key::{Key, KeyFn};
/// The `http` crate (version 1) whose types [`RequestHead`] and a
/// [denial responder](FilterBuilder::denial_responder)'s response are
/// written in.
pub use http;

/// Items the tests and the benchmarks reach (feature `__internals`); not
/// part of the API.
#[cfg(feature = "__internals")]
#[doc(hidden)]
pub mod __private {
    use crate::limiter::{Check, Decision, Limiter, LimiterError};

    pub use crate::limiter::deny_cache::{DenyCache, Remembered};

    /// Decides `checks` with this process's own counts (the local fallback).
    pub fn decide_here(limiter: &Limiter, checks: &[Check]) -> Result<Decision, LimiterError> {
        limiter.decide_here(checks)
    }
    pub use crate::limiter::dispatch::single::{decide_batch, decide_batch_with_deadlines};
    pub use crate::limiter::local::LocalLimiter;

    /// The limiter's denial cache (`None` when `deny_cache` is off).
    pub fn deny_cache(limiter: &crate::limiter::Limiter) -> Option<&DenyCache> {
        limiter.deny_cache()
    }

    /// The limiter's in-process fallback.
    pub fn local(limiter: &crate::limiter::Limiter) -> &LocalLimiter {
        limiter.local()
    }
    pub use crate::limiter::wire::SCRIPT_SOURCE;

    /// A check that `Check::with_cost` would refuse (a cost above the
    /// quota), for the tests of what Redis does with one.
    pub fn unchecked_check(
        key: &str,
        algorithm: crate::rule::Algorithm,
        cost: u32,
    ) -> crate::limiter::Check {
        let mut check = crate::limiter::Check::new(key, algorithm);
        check.cost = cost;
        check
    }

    /// The function library the dispatchers call (`FUNCTION LOAD` takes the
    /// first), and the name of its batch function (for `FCALL`).
    pub fn batch_function() -> (&'static str, &'static str) {
        let program = crate::limiter::program::Program::batch();
        (program.library(), program.function())
    }
}
