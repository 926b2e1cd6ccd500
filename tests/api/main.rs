//! floodgate's integration tests: one binary, one module per area. Every
//! test starts its own redis-server on a free port (redis-server must be
//! installed) and its own app, so tests run in parallel without sharing state.

// The library's own test helpers (floodgate/tests/common) name it by its
// package's crate name.
extern crate floodgate as floodgate_limiter;

mod algorithms;
mod changes;
mod cli;
mod cluster;
mod cluster_helpers;
mod config_errors;
mod faults;
mod fields;
mod filter;
mod helpers;
mod isolation;
mod keys;
mod limits;
mod monitoring;
mod operator;
mod peek;
mod resilience;
mod site;
