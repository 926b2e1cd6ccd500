//! Why the limiter could not decide. Being limited is not an error: it is a
//! [`Decision`](super::Decision) whose `allowed` is false.

use std::error::Error as StdError;
use std::fmt;

/// Why a decision could not be made; the filter then applies each rule's
/// `on_redis_error`. A Redis failure keeps the error redis-rs returned.
///
/// ```
/// use floodgate_limiter::limiter::LimiterError;
/// let e = LimiterError::Timeout;
/// assert!(e.is_timeout());
/// assert!(std::error::Error::source(&e).is_none());
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum LimiterError {
    /// Redis refused or failed a command, or could not be reached; the
    /// redis-rs error is the [`source`](StdError::source).
    Redis(redis::RedisError),
    /// Something else went wrong on the way to Redis: no pooled connection
    /// in time, an unexpected reply, a thread that could not start.
    Other(String),
    /// Redis answered, but could not decide this request: one of its rules
    /// has state or parameters the script cannot use. The other requests
    /// of the same batch were decided normally, so this says nothing about
    /// Redis's health.
    Check(String),
    /// No answer within `redis.timeout`.
    Timeout,
    /// Redis answered, but the job reached it after its deadline (its
    /// caller had given up, or a step of Redis's clock made it look so), so
    /// Redis decided nothing for it.
    Late,
    /// Redis failed to answer a moment ago: until the breaker period has
    /// passed, no call is made and the error policy applies at once.
    BreakerOpen,
    /// Too many requests are already waiting for Redis.
    Overloaded,
    /// The dispatcher threads are gone (the process is stopping).
    Stopped,
    /// The configuration asks for what this build of floodgate lacks (a
    /// Redis mode whose Cargo feature is off): the key, and which feature.
    Unsupported(String),
    /// An operator's action asks for what no operator's command accepts
    /// (a ban, an override's window or lifetime of 0 or longer than 366
    /// days, an override's limit of 0): why. Nothing was done.
    Invalid(String),
}

impl LimiterError {
    /// The redis-rs error kind, for a Redis failure.
    pub fn kind(&self) -> Option<redis::ErrorKind> {
        match self {
            LimiterError::Redis(e) => Some(e.kind()),
            _ => None,
        }
    }

    /// Whether Redis did not answer in time.
    pub fn is_timeout(&self) -> bool {
        match self {
            LimiterError::Redis(e) => e.is_timeout(),
            LimiterError::Timeout => true,
            _ => false,
        }
    }
}

impl fmt::Display for LimiterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimiterError::Redis(e) => write!(f, "redis: {e}"),
            LimiterError::Other(e) => write!(f, "redis: {e}"),
            LimiterError::Check(e) => write!(f, "undecidable check: {e}"),
            LimiterError::Timeout => f.write_str("redis did not answer in time"),
            LimiterError::Late => {
                f.write_str("the call reached redis after its deadline; nothing was decided")
            }
            LimiterError::BreakerOpen => f.write_str(
                "redis failed a moment ago; not asked again until the breaker period ends",
            ),
            LimiterError::Overloaded => f.write_str("too many decisions waiting for redis"),
            LimiterError::Stopped => f.write_str("the limiter is stopped"),
            LimiterError::Unsupported(e) | LimiterError::Invalid(e) => f.write_str(e),
        }
    }
}

impl StdError for LimiterError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            LimiterError::Redis(e) => Some(e),
            _ => None,
        }
    }
}

/// A Redis error as the limiter sees it: a timeout is [`LimiterError::Timeout`]
/// (Redis did not answer in time, whichever call it was); anything else
/// keeps the redis-rs error.
impl From<redis::RedisError> for LimiterError {
    fn from(e: redis::RedisError) -> LimiterError {
        if e.is_timeout() {
            LimiterError::Timeout
        } else {
            LimiterError::Redis(e)
        }
    }
}
