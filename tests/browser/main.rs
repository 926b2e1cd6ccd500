//! The browser tests: a headless Chromium (through chromedriver) signs in
//! and runs into the SMS limit. Their own target, behind the
//! `browser-tests` feature, so that `cargo test` needs only redis-server;
//! `scripts/test` runs them with `--features browser-tests`.

mod browser;
#[allow(dead_code)]
#[path = "../api/helpers.rs"]
mod helpers;
mod webdriver;
