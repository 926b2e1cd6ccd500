//! floodgate: a per-route, Redis-backed rate-limit filter for actix-web.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod filter;
mod limit;
mod metrics;
mod net;
mod rule;
#[cfg(feature = "site")]
pub mod site;

pub use crate::config::{
    format_duration, human_duration, Config, ConfigError, LimiterConfig, ServerConfig, DEFAULT_PATH,
};
#[cfg(feature = "site")]
pub use crate::config::{SiteConfig, SmsConfig, SmsProvider};
pub use crate::filter::{
    accepts, Denial, DenialPage, DenialResponder, Filter, FilterBuilder, FilterOptions, Limit,
    Limits, RuleState, SessionLookup, SetupError,
};
pub use crate::limit::{
    without_password, Algorithm, Check, Decision, Limiter, LimiterError, Outcome, RedisConfig,
};
pub use crate::metrics::Metrics;
pub use crate::net::Cidr;
pub use crate::rule::{
    e164, Count, CustomKey, Deny, Key, KeyFn, KeyKind, Mode, Normalize, OnRedisError, PathPattern,
    Region, Rule,
};

/// Items the benchmarks and tests reach; not part of the supported API.
#[doc(hidden)]
pub mod __private {
    pub use crate::limit::redis::SCRIPT_SOURCE;
}
