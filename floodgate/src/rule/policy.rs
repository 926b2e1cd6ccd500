//! The policies a rule names: its algorithm with its parameters, and its
//! penalty. The domain owns them; the limiter reads them (how each goes on
//! the wire is the limiter's: `limiter/algorithm.rs`).

use std::num::NonZeroU32;
use std::time::Duration;

use super::number;
use crate::units::{
    amount_of_time, written_duration, MAX_LARGE_LIMIT, MAX_LIMIT, MAX_RATE, MAX_WINDOW,
};

/// Why an algorithm's or a penalty's numbers cannot be used: the message a
/// configuration file's rule would get for them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidPolicy(String);

impl std::fmt::Display for InvalidPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidPolicy {}

impl InvalidPolicy {
    pub(crate) fn new(why: String) -> InvalidPolicy {
        InvalidPolicy(why)
    }
}

/// A rate-limiting algorithm with its parameters. Invalid ones cannot be
/// built: the constructors ([`Algorithm::sliding_window`],
/// [`Algorithm::token_bucket`], ...) check the numbers as a configuration
/// file's rule is checked; the variants are read by matching (with `..`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Algorithm {
    /// At most `limit` units in any interval of length `window`
    /// (a log of admission times per key).
    #[non_exhaustive]
    SlidingWindow {
        /// Units per window.
        limit: NonZeroU32,
        /// Window length (millisecond precision).
        window: Duration,
    },
    /// At most `limit` units in a window that opens at the first allowed
    /// request for the key.
    #[non_exhaustive]
    FixedWindow {
        /// Units per window.
        limit: NonZeroU32,
        /// Window length (millisecond precision).
        window: Duration,
    },
    /// A bucket of `burst` tokens refilled at `rate` per second.
    #[non_exhaustive]
    TokenBucket {
        /// Tokens added per second.
        rate: f64,
        /// Capacity; the bucket starts full.
        burst: NonZeroU32,
    },
    /// The generic cell rate algorithm: at most `limit` units at once,
    /// then one every `window / limit`; exact, one number per key (its
    /// theoretical arrival time).
    #[non_exhaustive]
    Gcra {
        /// Units at once (a fresh key, or one idle for `window`).
        limit: NonZeroU32,
        /// The time `limit` units take to come back (millisecond precision).
        window: Duration,
    },
    /// A sliding-window counter: the previous fixed window's count,
    /// weighted by the part of it still inside the sliding window, plus the
    /// current window's count, stays within `limit`. Approximate (up to
    /// twice `limit` in one sliding interval in adversarial timing, never
    /// more than `limit` in one fixed window), two counters per key.
    /// Windows are aligned to the epoch (Redis's clock).
    #[non_exhaustive]
    SlidingCounter {
        /// Units per window.
        limit: NonZeroU32,
        /// Window length (millisecond precision).
        window: Duration,
    },
}

/// The algorithms a rule names by `limit` and `window`: name, the word
/// in a name made for a [`Limit`](crate::Limit), largest limit, and the
/// constructor.
type Windowed = (
    &'static str,
    &'static str,
    u32,
    fn(NonZeroU32, Duration) -> Algorithm,
);

const WINDOWED: &[Windowed] = &[
    ("sliding_window", "sliding", MAX_LIMIT, |limit, window| {
        Algorithm::SlidingWindow { limit, window }
    }),
    ("fixed_window", "fixed", MAX_LIMIT, |limit, window| {
        Algorithm::FixedWindow { limit, window }
    }),
    ("gcra", "gcra", MAX_LARGE_LIMIT, |limit, window| {
        Algorithm::Gcra { limit, window }
    }),
    (
        "sliding_counter",
        "counter",
        MAX_LARGE_LIMIT,
        |limit, window| Algorithm::SlidingCounter { limit, window },
    ),
];

/// The name of the algorithm a rule gives by `rate` and `burst`.
pub(crate) const BUCKET: &str = "token_bucket";

impl Algorithm {
    /// Every name the config file accepts, the default first.
    pub const NAMES: &'static [&'static str] = &[
        "sliding_window",
        "fixed_window",
        "token_bucket",
        "gcra",
        "sliding_counter",
    ];

    /// The name used in the config file.
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::SlidingWindow { .. } => "sliding_window",
            Algorithm::FixedWindow { .. } => "fixed_window",
            Algorithm::TokenBucket { .. } => BUCKET,
            Algorithm::Gcra { .. } => "gcra",
            Algorithm::SlidingCounter { .. } => "sliding_counter",
        }
    }

    /// The limit and window of an algorithm given by them (every one but
    /// the token bucket).
    pub fn limit_window(&self) -> Option<(NonZeroU32, Duration)> {
        match *self {
            Algorithm::SlidingWindow { limit, window }
            | Algorithm::FixedWindow { limit, window }
            | Algorithm::Gcra { limit, window }
            | Algorithm::SlidingCounter { limit, window } => Some((limit, window)),
            Algorithm::TokenBucket { .. } => None,
        }
    }

    /// The quota `q` of the `RateLimit-Policy` field: limit, or burst.
    pub fn quota(&self) -> u32 {
        match self.limit_window() {
            Some((limit, _)) => limit.get(),
            None => match self {
                Algorithm::TokenBucket { burst, .. } => burst.get(),
                _ => 1,
            },
        }
    }

    /// What the quota is called in messages: "limit", or "burst".
    pub fn quota_word(&self) -> &'static str {
        match self {
            Algorithm::TokenBucket { .. } => "burst",
            _ => "limit",
        }
    }

    /// The largest quota this algorithm may have (a rule's limit or burst,
    /// an override's limit).
    pub fn max_quota(&self) -> u32 {
        Algorithm::max_limit(self.name()).unwrap_or(MAX_LIMIT)
    }

    /// The largest `limit` the algorithm named `name` takes (`None`: not
    /// one given by limit and window).
    pub fn max_limit(name: &str) -> Option<u32> {
        WINDOWED.iter().find(|w| w.0 == name).map(|w| w.2)
    }

    /// The window `w` of the `RateLimit-Policy` field, in whole seconds
    /// (token bucket: time to refill from empty), at least 1.
    pub fn window_seconds(&self) -> u64 {
        let ms = match (self, self.limit_window()) {
            (_, Some((_, window))) => window.as_millis() as f64,
            (Algorithm::TokenBucket { rate, burst }, None) => {
                f64::from(burst.get()) * 1000.0 / rate
            }
            _ => 1000.0,
        };
        ((ms / 1000.0).ceil() as u64).max(1)
    }

    /// At most `limit` units in any interval of length `window`.
    pub fn sliding_window(limit: u32, window: Duration) -> Result<Algorithm, InvalidPolicy> {
        Algorithm::windowed("sliding_window", limit, window)
    }

    /// At most `limit` units in a window opened by a key's first request.
    pub fn fixed_window(limit: u32, window: Duration) -> Result<Algorithm, InvalidPolicy> {
        Algorithm::windowed("fixed_window", limit, window)
    }

    /// At most `limit` units at once, then one every `window / limit`.
    pub fn gcra(limit: u32, window: Duration) -> Result<Algorithm, InvalidPolicy> {
        Algorithm::windowed("gcra", limit, window)
    }

    /// A sliding-window counter of `limit` units per `window`.
    pub fn sliding_counter(limit: u32, window: Duration) -> Result<Algorithm, InvalidPolicy> {
        Algorithm::windowed("sliding_counter", limit, window)
    }

    /// A bucket of `burst` tokens refilled at `rate` per second.
    pub fn token_bucket(rate: f64, burst: u32) -> Result<Algorithm, InvalidPolicy> {
        checked_bucket(rate, i64::from(burst)).map_err(InvalidPolicy)
    }

    /// The algorithm named `name` (one of [`Algorithm::NAMES`] but the
    /// token bucket) with `limit` units per `window`.
    pub fn windowed(name: &str, limit: u32, window: Duration) -> Result<Algorithm, InvalidPolicy> {
        checked_windowed(name, i64::from(limit), window, &written_duration(window))
            .map_err(InvalidPolicy)
    }

    /// The algorithm named `name` with `limit` and `window`, unchecked;
    /// `None` for a name that is not given by limit and window.
    pub(crate) fn with_window(
        name: &str,
        limit: NonZeroU32,
        window: Duration,
    ) -> Option<Algorithm> {
        WINDOWED
            .iter()
            .find(|w| w.0 == name)
            .map(|w| (w.3)(limit, window))
    }

    /// The word for it in a name made for a [`Limit`](crate::Limit).
    pub(crate) fn tag(name: &str) -> &'static str {
        WINDOWED
            .iter()
            .find(|w| w.0 == name)
            .map_or("bucket", |w| w.1)
    }

    /// The same algorithm with `quota` as its limit (a token bucket's rate
    /// scales with its burst), as an operator's override of that limit
    /// makes it; checked as its constructor checks it: `None` when that
    /// algorithm could not be built.
    ///
    /// ```
    /// # use std::{num::NonZeroU32, time::Duration};
    /// use floodgate_limiter::rule::Algorithm;
    /// let rule = Algorithm::sliding_window(5, Duration::from_secs(60))?;
    /// let raised = rule.with_quota(NonZeroU32::new(50).unwrap()).unwrap();
    /// assert_eq!(raised.limit_window(), Some((NonZeroU32::new(50).unwrap(), Duration::from_secs(60))));
    /// # Ok::<(), floodgate_limiter::rule::InvalidPolicy>(())
    /// ```
    pub fn with_quota(&self, quota: NonZeroU32) -> Option<Algorithm> {
        match (*self, self.limit_window()) {
            (Algorithm::TokenBucket { rate, burst }, _) => Algorithm::token_bucket(
                rate * f64::from(quota.get()) / f64::from(burst.get()),
                quota.get(),
            )
            .ok(),
            (a, Some((_, window))) => Algorithm::windowed(a.name(), quota.get(), window).ok(),
            (_, None) => None,
        }
    }

    /// Whether an operator's override of `limit`, over `window` when it
    /// sets one, makes sense for this algorithm.
    pub(crate) fn check_override(
        &self,
        limit: u32,
        window: Option<Duration>,
    ) -> Result<(), String> {
        if let (Some(w), Algorithm::TokenBucket { .. }) = (window, self) {
            // The refill rate it makes: at most what a rule may have.
            if f64::from(limit) / w.as_secs_f64() > MAX_RATE {
                return Err(format!(
                    "a bucket of {limit} refilled in {} refills faster than {} per second",
                    crate::units::human_duration(w),
                    MAX_RATE
                ));
            }
        }
        Ok(())
    }

    /// The limit in words, `per(n)` naming n units, `duration` a length
    /// of time, `whose` the identity: "at most 5 requests per 10 seconds
    /// from your address".
    pub(crate) fn describe(
        &self,
        per: impl Fn(u32) -> String,
        duration: impl Fn(Duration) -> String,
        whose: &str,
    ) -> String {
        match *self {
            Algorithm::TokenBucket { rate, burst } => format!(
                "bursts of at most {}, then {rate} per second {whose}",
                per(burst.get())
            ),
            Algorithm::Gcra { limit, window } => format!(
                "at most {} at once, then {} per {} {whose}",
                per(limit.get()),
                per(limit.get()),
                duration(window)
            ),
            Algorithm::SlidingWindow { limit, window }
            | Algorithm::FixedWindow { limit, window }
            | Algorithm::SlidingCounter { limit, window } => {
                format!(
                    "at most {} per {} {whose}",
                    per(limit.get()),
                    duration(window)
                )
            }
        }
    }

    /// Its numbers as the config file writes them, `duration` writing a
    /// length of time: "limit=5 window=10s", "rate=10/s burst=20".
    pub fn fields(&self, duration: impl Fn(Duration) -> String) -> String {
        match (self, self.limit_window()) {
            (Algorithm::TokenBucket { rate, burst }, _) => format!("rate={rate}/s burst={burst}"),
            (_, Some((limit, window))) => format!("limit={limit} window={}", duration(window)),
            _ => String::new(),
        }
    }

    /// Its numbers in words, `duration` writing a length of time:
    /// "5 per 10 seconds", "burst 20, 10 per second".
    pub fn parameters(&self, duration: impl Fn(Duration) -> String) -> String {
        match (self, self.limit_window()) {
            (Algorithm::TokenBucket { rate, burst }, _) => {
                format!("burst {burst}, {rate} per second")
            }
            (_, Some((limit, window))) => format!("{limit} per {}", duration(window)),
            _ => String::new(),
        }
    }
}

/// Escalating bans for a rule: `after` denials of one identity within
/// `within` ban it for `ban`; each further ban while the last one is
/// remembered (for `max` after it ends) lasts twice as long, up to `max`.
/// Counted and decided in the same call that denies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Penalty {
    /// Denials that ban (at least 1).
    pub after: u32,
    /// How long denials are counted for.
    pub within: Duration,
    /// The first ban's length.
    pub ban: Duration,
    /// The longest ban, and how long a ban is remembered after it ends.
    pub max: Duration,
}

impl Penalty {
    /// `after` denials within `within` ban for `ban`, doubling up to `max`;
    /// checked as a configuration file's `penalty` is.
    pub fn new(
        after: u32,
        within: Duration,
        ban: Duration,
        max: Duration,
    ) -> Result<Penalty, InvalidPolicy> {
        Penalty {
            after,
            within,
            ban,
            max,
        }
        .checked()
        .map_err(InvalidPolicy)
    }

    /// The penalty, or what is wrong with its numbers.
    pub(crate) fn checked(self) -> Result<Penalty, String> {
        check_penalty_after(i64::from(self.after))?;
        for (what, d) in [
            ("within", self.within),
            ("ban", self.ban),
            ("max", self.max),
        ] {
            check_penalty_duration(what, d, &written_duration(d))?;
        }
        check_penalty_ban(
            &self,
            &written_duration(self.ban),
            &written_duration(self.max),
        )?;
        Ok(self)
    }
}

/// A token bucket's `rate` and `burst`, or what is wrong with them.
pub(crate) fn checked_bucket(rate: f64, burst: i64) -> Result<Algorithm, String> {
    if !(rate.is_finite() && rate > 0.0 && rate <= MAX_RATE) {
        return Err(format!(
            "rate must be greater than 0 and at most {MAX_RATE} (tokens per second), got {}",
            number(rate)
        ));
    }
    let burst = u32::try_from(burst)
        .ok()
        .filter(|b| *b <= MAX_LIMIT)
        .and_then(NonZeroU32::new)
        .ok_or_else(|| format!("burst must be between 1 and {MAX_LIMIT}, got {burst}"))?;
    // Every time the bucket's script derives (its TTL, a wait) is at
    // most burst / rate: bounding it keeps them whole milliseconds
    // that Redis takes as integers.
    let max_secs = MAX_WINDOW.as_secs_f64();
    // (A hair of slack, so the least rate the message names is accepted
    // when written back despite float rounding.)
    if f64::from(burst.get()) / rate > max_secs * (1.0 + 1e-9) {
        return Err(format!(
            "a bucket of {burst} refilling at rate {} per second needs more than {} to refill from empty; rate must be at least {} (burst / {} seconds)",
            number(rate),
            amount_of_time(MAX_WINDOW),
            number(f64::from(burst.get()) / max_secs),
            MAX_WINDOW.as_secs()
        ));
    }
    Ok(Algorithm::TokenBucket { rate, burst })
}

/// The algorithm `name` with `limit` per `window` (`written`: the window as
/// its author wrote it), or what is wrong with them.
pub(crate) fn checked_windowed(
    name: &str,
    limit: i64,
    window: Duration,
    written: &str,
) -> Result<Algorithm, String> {
    let unknown = || format!("unknown algorithm {name:?}");
    let max = Algorithm::max_limit(name).ok_or_else(unknown)?;
    let limit = u32::try_from(limit)
        .ok()
        .filter(|l| *l <= max)
        .and_then(NonZeroU32::new)
        .ok_or_else(|| format!("limit must be between 1 and {max}, got {limit}"))?;
    let window = check_window(window, written)?;
    Algorithm::with_window(name, limit, window).ok_or_else(unknown)
}

/// `window`: more than 0, at most [`MAX_WINDOW`], in whole milliseconds
/// (what the Redis scripts count in). `written` is the value as given.
fn check_window(window: Duration, written: &str) -> Result<Duration, String> {
    if window.is_zero() {
        Err("window must be greater than 0".into())
    } else if window > MAX_WINDOW {
        Err(format!(
            "window must be at most {}, got {written:?}",
            amount_of_time(MAX_WINDOW)
        ))
    } else if !window.subsec_nanos().is_multiple_of(1_000_000) {
        Err(format!(
            "window must be a whole number of milliseconds (at least 1ms), got {written:?}"
        ))
    } else {
        Ok(window)
    }
}

/// A penalty's `after`: 1 to 1000000 denials.
pub(crate) fn check_penalty_after(after: i64) -> Result<u32, String> {
    u32::try_from(after)
        .ok()
        .filter(|a| (1..=1_000_000).contains(a))
        .ok_or_else(|| format!("penalty after must be between 1 and 1000000, got {after}"))
}

/// A penalty's `within`, `ban` or `max` (`what`): above 0, at most
/// [`MAX_WINDOW`], whole milliseconds; `written` is the value as given.
pub(crate) fn check_penalty_duration(what: &str, d: Duration, written: &str) -> Result<(), String> {
    if d.is_zero() {
        Err(format!("penalty {what} must be greater than 0"))
    } else if d > MAX_WINDOW {
        Err(format!(
            "penalty {what} must be at most {}, got {written:?}",
            amount_of_time(MAX_WINDOW)
        ))
    } else if !d.subsec_nanos().is_multiple_of(1_000_000) {
        Err(format!(
            "penalty {what} must be a whole number of milliseconds (at least 1ms), got {written:?}"
        ))
    } else {
        Ok(())
    }
}

/// A penalty's first ban is at most its longest (`ban` and `max` as given).
pub(crate) fn check_penalty_ban(p: &Penalty, ban: &str, max: &str) -> Result<(), String> {
    if p.ban > p.max {
        return Err(format!("penalty ban ({ban}) must be at most max ({max})"));
    }
    Ok(())
}
