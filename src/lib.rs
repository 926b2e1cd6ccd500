//! floodgate: a per-route, Redis-backed rate-limit filter for actix-web.
//!
//! Counts live in Redis, so every server behind a load balancer shares them;
//! every rule that matches a request is decided in one atomic Lua call
//! (a denied request takes nothing from any rule), and no worker thread ever
//! waits on Redis.
//!
//! # Five minutes: a guarded route
//!
//! ```toml
//! # Cargo.toml
//! [dependencies]
//! floodgate = { version = "0.1", default-features = false }   # the filter alone
//! ```
//!
//! With rules in TOML (the same file format the `floodgate` command reads):
//!
//! ```no_run
//! use actix_web::{web, App, HttpResponse, HttpServer};
//! use floodgate::Filter;
//!
//! #[actix_web::main]
//! async fn main() -> std::io::Result<()> {
//!     let filter = Filter::from_toml_str(
//!         r#"
//!         [redis]
//!         url = "redis://127.0.0.1:6379/0"
//!
//!         [[rule]]
//!         name = "hello"
//!         paths = ["/hello"]
//!         key = "ip"
//!         limit = 3
//!         window = "10s"
//!         deny = "status"   # 429 instead of a redirect to an error page
//!         "#,
//!         "rules.toml",
//!     )
//!     .map_err(std::io::Error::other)?;
//!     HttpServer::new(move || {
//!         App::new()
//!             .wrap(filter.clone())
//!             .route("/hello", web::get().to(|| async { HttpResponse::Ok().body("hi") }))
//!     })
//!     .bind("127.0.0.1:8080")?
//!     .run()
//!     .await
//! }
//! ```
//!
//! Or in code, beside the handler it guards:
//!
//! ```no_run
//! use actix_web::{web, App, HttpResponse};
//! use floodgate::{Filter, Key, Limit, Limits};
//!
//! # fn build() -> Result<(), floodgate::SetupError> {
//! let filter = Filter::builder().redis_url("redis://127.0.0.1:6379/0").build()?;
//! let app = App::new().service(
//!     web::resource("/sms/send")
//!         .wrap(filter.limit(Limit::per_minute(3).key(Key::form("phone")).name("sms")))
//!         .route(web::post().to(|limits: Limits| async move {
//!             let left = limits.get("sms").map_or(0, |r| r.remaining);
//!             HttpResponse::Ok().body(format!("sent; {left} left this minute"))
//!         })),
//! );
//! # let _ = app; Ok(()) }
//! ```
//!
//! # What a guarded request gets
//!
//! Allowed responses carry `RateLimit-Policy` and `RateLimit` fields for
//! every enforce rule. A denial is a `429` with `Retry-After` (JSON for a
//! client that accepts only JSON), or, for rules with `deny = "redirect"`,
//! a `303` to the error page; [`FilterBuilder::denial_responder`] replaces
//! both. When Redis cannot answer within the timeout, each rule's
//! `on_redis_error` applies: let the request through, or `503`.
//!
//! # Pieces
//!
//! - [`Filter`]: the middleware; `.wrap()` it on an `App`, a `Scope` or a
//!   `Resource`. Build it with [`Filter::from_toml_file`],
//!   [`Filter::from_toml_str`] or [`Filter::builder`].
//! - [`Limit`] and [`Key`]: limits in code; [`Filter::limit`] wraps one on a
//!   resource or scope, sharing the filter's Redis pool and threads.
//! - [`Limits`]: the extractor that shows a handler what was decided, and
//!   lets it [charge](Limits::charge) or [give back](Limits::give_back) units.
//! - [`KeyFn`], [`DenialResponder`], [`FilterBuilder::session_lookup`]: your
//!   own key function, denial response and account lookup.
//! - [`Limiter`]: the Redis side alone, for deciding [`Check`]s directly, or
//!   [peeking](Limiter::peek) at what a decision would answer.
//!
//! The default feature `site` also builds the demo site ([`site`]) and the
//! `floodgate` binary; `default-features = false` leaves them out.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod config;
mod filter;
mod limit;
pub mod logging;
mod metrics;
mod net;
mod rule;
#[cfg(feature = "site")]
pub mod site;

pub use crate::config::{
    format_duration, human_duration, operator_duration, AdminConfig, Config, ConfigError,
    LimiterConfig, ServerConfig, DEFAULT_PATH,
};
#[cfg(feature = "site")]
pub use crate::config::{SiteConfig, SmsConfig, SmsProvider};
pub use crate::filter::{
    accepts, ban_action, operator_check, override_action, Denial, DenialPage, DenialResponder,
    Filter, FilterBuilder, FilterOptions, Limit, Limits, OperatorError, RuleState, SessionLookup,
    SetupError,
};
pub use crate::limit::{
    without_password, Action, Algorithm, Check, Decision, Dispatch, Inspection, Limiter,
    LimiterError, LimiterOptions, Outcome, OverrideState, Penalty, RedisConfig,
};
pub use crate::metrics::Metrics;
pub use crate::net::{Cidr, ProxyHeader};
pub use crate::rule::{
    e164, identity_key, Count, CustomKey, Deny, Key, KeyFn, KeyKind, Mode, Normalize, OnRedisError,
    PathPattern, Region, Rule,
};

/// Items the benchmarks and tests reach; not part of the supported API.
#[doc(hidden)]
pub mod __private {
    pub use crate::limit::redis::{decide_batch, decide_batch_with_deadlines, SCRIPT_SOURCE};
    pub use crate::rule::{redis_key, redis_key_for};
}
