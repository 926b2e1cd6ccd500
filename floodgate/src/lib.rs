//! floodgate: a per-route, Redis-backed rate-limit filter for actix-web.
//!
//! Counts live in Redis, so every server behind a load balancer shares them;
//! every rule that matches a request is decided in one atomic Lua call
//! (a denied request takes nothing from any rule). By default each actix
//! worker sends the decisions of one scheduler tick as one call and reads
//! the reply itself when it comes within a few milliseconds (a healthy
//! Redis answers in well under one); a Redis that stalls never holds the
//! worker longer: the call, reply still to come, goes to a helper thread
//! of that worker's, which waits out `[redis] timeout` and answers it,
//! while the worker serves its other requests. `Dispatch::Threads` hands
//! every decision to dispatcher threads instead, at the cost of a thread
//! hand-off per request.
//!
//! # Five minutes: a guarded route
//!
//! ```toml
//! # Cargo.toml
//! [dependencies]
//! floodgate = "0.1"
//! # until it is published, from a clone of this repository:
//! # floodgate = { path = "../floodgate/floodgate" }
//! ```
//!
//! With rules in TOML (the same file format the `floodgate` command reads):
//!
//! ```no_run
//! use actix_web::{web, App, HttpResponse, HttpServer};
//! use floodgate_limiter::Filter;
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
//! use floodgate_limiter::{Filter, Key, Limit, Usage};
//!
//! # fn build() -> Result<(), floodgate_limiter::SetupError> {
//! let filter = Filter::builder().redis_url("redis://127.0.0.1:6379/0").build()?;
//! let app = App::new().service(
//!     web::resource("/sms/send")
//!         .wrap(filter.limit(Limit::per_minute(3).key(Key::form("phone")).name("sms")))
//!         .route(web::post().to(|usage: Usage| async move {
//!             let left = usage.get("sms").map_or(0, |r| r.remaining);
//!             HttpResponse::Ok().body(format!("sent; {left} left this minute"))
//!         })),
//! );
//! # let _ = app; Ok(()) }
//! ```
//!
//! # What a guarded request gets
//!
//! Allowed responses carry `RateLimit-Policy` and `RateLimit` fields for
//! every enforce rule, or the fields of the rule's [`HeaderDialect`](rule::HeaderDialect)
//! (`draft-6`, `draft-7`, `x-ratelimit`, or none at all). A denial is a
//! `429` with `Retry-After` (JSON for a client that accepts only JSON), or,
//! for rules with `deny = "redirect"`, a `303` to the error page;
//! [`FilterBuilder::denial_responder`] replaces both; every denial carries
//! the same rate-limit fields. A rule's `exempt` client networks are
//! neither counted nor denied by it ([`Limit::exempt`] in code). When Redis cannot answer within the timeout, each rule's
//! `on_redis_error` applies: let the request through, or `503`.
//!
//! # Pieces
//!
//! - [`Filter`]: the middleware; `.wrap()` it on an `App`, a `Scope` or a
//!   `Resource`. Build it with [`Filter::from_toml_file`],
//!   [`Filter::from_toml_str`] or [`Filter::builder`].
//! - [`Limit`] and [`Key`]: limits in code; [`Filter::limit`] wraps one on a
//!   resource or scope, sharing the filter's Redis pool and threads.
//! - [`Usage`]: the extractor that shows a handler what was decided, and
//!   lets it [charge](Usage::charge) or [give back](Usage::give_back) units.
//! - [`KeyFn`], [`DenialResponder`], [`FilterBuilder::session_lookup`]: your
//!   own key function, denial response and account lookup.
//! - [`Limiter`]: the Redis side alone, for deciding [`Check`](limiter::Check)s directly, or
//!   [peeking](Limiter::peek) at what a decision would answer.
//!
//! The rest lives in modules named for what they hold: [`config`] (the
//! TOML file, and an application's own sections in it), [`filter`]
//! (options, denial pages, rule state), [`rule`] (rules, key kinds, phone
//! numbers), [`limiter`] (the Redis side: checks, decisions, errors),
//! [`net`] (client addresses), [`metrics`] and [`logging`].
//!
//! # Features
//!
//! All on by default; `default-features = false` gives the filter for a
//! single Redis server without phone-number parsing.
//!
//! - `e164`: `normalize = "e164"` and `rule::e164` (pulls in
//!   `phonenumber` and `regex`).
//! - `cluster`: `[redis] cluster`, a Redis Cluster.
//! - `sentinel`: `[redis] sentinel`, a master found through Redis Sentinel.
//!
//! Every build reads the same file format; a file (or a [`FilterBuilder`]
//! given a [`limiter::RedisConfig`]) that asks for what the build lacks is
//! refused with the key and the feature it needs: `config.toml: [redis]
//! cluster: this build of floodgate has no Redis Cluster support (feature
//! "cluster")`.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub, unnameable_types)]

pub mod config;
pub mod filter;
pub mod limiter;
pub mod logging;
pub mod metrics;
pub mod net;
pub mod rule;

/// The tower door: [`Filter`] is a `tower::Layer` (axum 0.8, tonic, hyper).
#[cfg(feature = "tower")]
pub mod tower {
    pub use crate::filter::tower::{Guarded, GuardedBody};
}

pub use crate::config::{Config, ConfigError};
pub use crate::filter::{
    Denial, DenialResponder, Filter, FilterBuilder, Limit, SessionLookup, SetupError, Usage,
};
pub use crate::limiter::Limiter;
pub use crate::rule::{Key, KeyFn};

/// Items the benchmarks and tests reach; not part of the supported API.
#[doc(hidden)]
pub mod __private {
    pub use crate::limiter::dispatch::single::{decide_batch, decide_batch_with_deadlines};
    pub use crate::limiter::local::LocalLimiter;
    pub use crate::limiter::wire::SCRIPT_SOURCE;
    pub use crate::rule::{redis_key, redis_key_for};

    /// The function library the dispatchers call (`FUNCTION LOAD` takes the
    /// first), and the name of its batch function (for `FCALL`).
    pub fn batch_function() -> (&'static str, &'static str) {
        let program = crate::limiter::program::Program::batch();
        (program.library(), program.function())
    }
}
