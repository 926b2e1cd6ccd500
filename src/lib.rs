//! floodgate: an actix-web site whose routes are guarded by a per-route
//! rate-limit filter that keeps its counts in Redis.
//!
//! - [`config`]: the TOML schema, validation, environment overrides
//! - [`filter`]: the actix-service middleware (rules, keys, denials)
//! - [`limit`]: algorithms and the Redis dispatcher (one Lua call per batch)
//! - [`site`]: the demo site and operational endpoints
//! - [`startup`]: `Application::build`, used by `main` and the tests
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod config;
pub mod filter;
pub mod limit;
pub mod metrics;
pub mod site;
pub mod startup;
