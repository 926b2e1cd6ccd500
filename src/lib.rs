//! floodgate: a per-route, Redis-backed rate-limit filter for actix-web.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod config;
pub mod filter;
pub mod limit;
pub mod metrics;
pub mod net;
pub mod rule;
pub mod site;
pub mod startup;
