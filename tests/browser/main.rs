//! The browser tests: a headless Chromium (through chromedriver) signs in
//! and runs into the SMS limit. Their own target, behind the
//! `browser-tests` feature, so that `cargo test` needs only redis-server;
//! `scripts/test` runs them with `--features browser-tests`.

// The library's own test helpers (floodgate/tests/common, through the API
// tests' helpers) name it by its package's crate name.
extern crate floodgate as floodgate_limiter;

mod browser;
#[allow(dead_code)]
#[path = "../api/helpers.rs"]
mod helpers;
mod webdriver;
