//! The limiter: algorithms, checks and the decisions Redis makes about them.
//!
//! A request that matches several rules becomes one [`Check`] per rule; the
//! checks of one request go to Redis together and are decided atomically
//! (all recorded, or none). [`Limiter::decide`] is the heart of it: it hands
//! the checks to the worker's lane or a dispatcher thread (see `lane.rs`
//! and `limiter/dispatch/`) and awaits the answer. [`Limiter::peek`]
//! answers the same questions without recording anything; the rest of the
//! surface is operators' actions and listings, give-backs, readiness and
//! the application's own Redis work ([`Limiter::with_redis`]).

#[macro_use]
pub(crate) mod algorithm;
mod breaker;
mod clock;
mod conn;
mod decide;
pub(crate) mod deny_cache;
pub(crate) mod dispatch;
mod error;
pub(crate) mod give_back;
mod join;
mod lane;
pub(crate) mod local;
pub(crate) mod operator;
mod peek;
pub(crate) mod program;
pub(crate) mod redis_config;
mod shared;

/// Dispatcher threads; two let one gather a batch while the other waits on Redis.
pub(crate) const DISPATCHERS: usize = 2;
pub(crate) mod tick;
pub(crate) mod topology;
pub(crate) mod wire;

use std::time::Duration;

use crate::rule::InvalidPolicy;

pub use self::decide::Limiter;
pub use self::error::LimiterError;
pub use self::operator::{
    split_state_key, Action, AuditEntry, Inspection, Listed, ListedOverride, OverrideState,
    TopEntry, TOP_SINCE_MOST,
};
pub use self::redis_config::without_password;
pub(crate) use self::redis_config::RedisConfig;
pub use self::topology::RedisConn;
pub(crate) use crate::rule::Algorithm;
pub(crate) use crate::rule::Penalty;

/// How the limiter behaves besides talking to Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimiterOptions {
    /// Remember denials in-process until their retry time, and answer a
    /// flood on a denied key without a Redis call.
    pub deny_cache: bool,
    /// After a call failed, how long no call is made (the error policy
    /// applies at once) before one call probes Redis again: at most 10
    /// minutes; 0, no breaker (every decision tries Redis).
    pub breaker: Duration,
    /// How decisions travel to Redis.
    pub dispatch: Dispatch,
}

impl Default for LimiterOptions {
    fn default() -> Self {
        LimiterOptions {
            deny_cache: true,
            breaker: Duration::from_secs(1),
            dispatch: Dispatch::default(),
        }
    }
}

/// How decisions travel to Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Dispatch {
    /// Two dispatcher threads with a connection each take queued jobs and
    /// send each batch as one script call; callers await a oneshot. No
    /// worker ever blocks on Redis, at the price of a thread hand-off (and
    /// its wake-ups) both ways for every request.
    Threads,
    /// Each worker thread (an actix worker, or a thread of a tokio
    /// runtime: axum, tonic, hyper) has a connection of its own: the
    /// requests that become ready in one scheduler tick queue on it, and
    /// one task sends them as one script call and reads the reply on the
    /// worker when Redis answers within a few milliseconds; a Redis that
    /// does not hands the call to the lane's helper thread. Off any async
    /// runtime, the dispatcher threads serve.
    #[default]
    Worker,
}

// (Here rather than in `rule`: the domain does not know the limiter.)
impl crate::rule::Rule {
    /// The check this rule makes of the identity whose Redis key is `key`
    /// (see [`Limiter::decide`](crate::limiter::Limiter::decide)): its
    /// algorithm, cost, mode and penalty.
    pub fn check(&self, key: impl Into<String>) -> Check {
        Check {
            key: key.into(),
            algorithm: self.algorithm,
            cost: self.cost,
            enforce: self.mode == crate::rule::Mode::Enforce,
            penalty: self.penalty,
        }
    }
}

/// One rule's question about one request: may `cost` units be taken from
/// `key`? Built by [`Check::new`] and its methods, which keep the cost
/// within the algorithm's quota (as a rule's).
#[derive(Debug, Clone, PartialEq)]
pub struct Check {
    /// The full Redis key, `PREFIX:RULE:KIND:ID`.
    pub(crate) key: String,
    /// The algorithm and its parameters.
    pub(crate) algorithm: Algorithm,
    /// Units the request takes.
    pub(crate) cost: u32,
    /// `false` for shadow rules: counted, but their denial does not deny.
    pub(crate) enforce: bool,
    /// Escalating bans: denials of this identity that ban it (see
    /// [`Penalty`]); `None`: none.
    pub(crate) penalty: Option<Penalty>,
}

impl Check {
    /// One unit from `key` (the full Redis key) under `algorithm`,
    /// enforced, with no penalty.
    pub fn new(key: impl Into<String>, algorithm: Algorithm) -> Check {
        Check {
            key: key.into(),
            algorithm,
            cost: 1,
            enforce: true,
            penalty: None,
        }
    }

    /// Takes `cost` units: from 1 to the algorithm's quota (its limit, or
    /// its burst), as a rule's `cost` (a larger one could never fit, and
    /// Redis refuses to decide it).
    pub fn with_cost(mut self, cost: u32) -> Result<Check, InvalidPolicy> {
        let quota = self.algorithm.quota();
        if !(1..=quota).contains(&cost) {
            return Err(InvalidPolicy::new(format!(
                "cost must be between 1 and {quota} (the {}), got {cost}",
                self.algorithm.quota_word()
            )));
        }
        self.cost = cost;
        Ok(self)
    }

    /// The same question about another key.
    pub fn with_key(mut self, key: impl Into<String>) -> Check {
        self.key = key.into();
        self
    }

    /// `false`: counted, but a denial does not deny (a shadow rule's check).
    pub fn with_enforce(mut self, enforce: bool) -> Check {
        self.enforce = enforce;
        self
    }

    /// Denials of this identity that ban it (`None`: none).
    pub fn with_penalty(mut self, penalty: Option<Penalty>) -> Check {
        self.penalty = penalty;
        self
    }

    /// The full Redis key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The algorithm and its parameters.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Units the request takes.
    pub fn cost(&self) -> u32 {
        self.cost
    }

    /// `false` for a shadow check: counted, but its denial does not deny.
    pub fn enforce(&self) -> bool {
        self.enforce
    }

    /// Escalating bans (`None`: none).
    pub fn penalty(&self) -> Option<Penalty> {
        self.penalty
    }

    /// The `flags` argument of the check, as `lua/batch.lua` reads it:
    /// enforce (1) or shadow (0), and the penalty's numbers in ms.
    pub(crate) fn flags(&self) -> std::borrow::Cow<'static, str> {
        let enforce = if self.enforce { "1" } else { "0" };
        match &self.penalty {
            None => enforce.into(),
            Some(p) => format!(
                "{enforce}:{}:{}:{}:{}",
                p.after,
                p.within.as_millis(),
                p.ban.as_millis(),
                p.max.as_millis()
            )
            .into(),
        }
    }
}

/// Redis's answer to one [`Check`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// Whether this check alone would admit the request.
    pub allowed: bool,
    /// Units left after this request (allowed) or now (denied).
    pub remaining: u64,
    /// Allowed: time until the quota resets (the oldest unit leaves, the
    /// window closes, the bucket is full). Denied: time until the same
    /// request would be allowed.
    pub wait: Duration,
    /// Denied because the identity is banned under the rule (by an
    /// operator, or a penalty): `wait` is the time left on the ban.
    pub banned: bool,
    /// This very denial started the ban (the rule's penalty).
    pub ban_started: bool,
    /// The numbers it was decided under when they are not the rule's: the
    /// identity's override (set by an operator). `None`: the rule's own.
    pub quota: Option<Quota>,
}

/// A limit and window a check was decided under instead of its rule's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// Units per window (token bucket: burst).
    pub limit: u32,
    /// The window (token bucket: time to refill from empty).
    pub window: Duration,
}

impl Outcome {
    /// The quota `q` it was decided under: the override's limit (token
    /// bucket: burst) when there is one, else `algorithm`'s (the rule's).
    pub fn limit(&self, algorithm: &Algorithm) -> u32 {
        self.quota.map_or_else(|| algorithm.quota(), |q| q.limit)
    }

    /// The window `w` it was decided under, in whole seconds, at least 1:
    /// the override's when there is one, else `algorithm`'s.
    pub fn window_seconds(&self, algorithm: &Algorithm) -> u64 {
        match self.quota {
            Some(q) => (q.window.as_millis().div_ceil(1000) as u64).max(1),
            None => algorithm.window_seconds(),
        }
    }

    /// Makes an allowed outcome say what its rule holds now for a request
    /// that was not charged after all (another rule denied it, or its units
    /// were given back): `cost` more units remaining (at most the quota),
    /// and, where units come back one by one (token bucket, GCRA), a reset
    /// sooner by the time `cost` units take to come back.
    pub fn uncharge(&mut self, cost: u32, algorithm: &Algorithm) {
        let limit = self.limit(algorithm);
        self.remaining = (self.remaining + u64::from(cost)).min(u64::from(limit));
        let window = match (self.quota, algorithm) {
            (Some(q), Algorithm::TokenBucket { .. } | Algorithm::Gcra { .. }) => q.window,
            (None, Algorithm::TokenBucket { rate, burst, .. }) => {
                Duration::try_from_secs_f64(f64::from(burst.get()) / rate).unwrap_or(Duration::MAX)
            }
            (None, Algorithm::Gcra { window, .. }) => *window,
            (_, Algorithm::SlidingWindow { .. })
            | (_, Algorithm::FixedWindow { .. })
            | (_, Algorithm::SlidingCounter { .. }) => return,
        };
        let share = f64::from(cost) / f64::from(limit.max(1));
        // (No panic whatever the numbers: a duration past range gives back
        // the whole wait.)
        let back =
            Duration::try_from_secs_f64(window.as_secs_f64() * share).unwrap_or(Duration::MAX);
        self.wait = self.wait.saturating_sub(back);
    }

    /// `wait` in whole seconds, rounded up, at least 1 (for `Retry-After`).
    pub fn retry_after_secs(&self) -> u64 {
        (self.wait.as_millis().div_ceil(1000) as u64).max(1)
    }

    /// `wait` in whole seconds, rounded up (the `t` of the `RateLimit` field).
    pub fn reset_secs(&self) -> u64 {
        self.wait.as_millis().div_ceil(1000) as u64
    }
}

/// The decision for a whole request: every check's outcome, and whether the
/// request is allowed (every enforce check allowed). Being limited is a
/// value, not an error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// One per check, in the order given.
    pub outcomes: Vec<Outcome>,
    /// Whether every enforce check allowed (and so everything was recorded).
    pub allowed: bool,
}
