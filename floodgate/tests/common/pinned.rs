//! Pinned-clock plumbing: a limiter whose clock a test pins with
//! `decide_at`, and checks of each algorithm.

use std::num::NonZeroU32;
use std::path::Path;
use std::time::Duration;

use floodgate_limiter::config::Config;
use floodgate_limiter::limiter::Limiter;
use floodgate_limiter::limiter::{Check, LimiterOptions};
use floodgate_limiter::rule::Algorithm;

use super::RedisServer;

/// A realistic pinned epoch (ms).
pub const T0: u64 = 1_700_000_000_000;

pub fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// A limiter on `redis` whose clock the test pins with `decide_at`.
pub fn pinned_limiter(redis: &RedisServer) -> Limiter {
    let mut config = Config::parse("", Path::new("test.toml")).unwrap();
    config.redis.url = redis.url();
    config.redis.timeout = Duration::from_secs(5);
    Limiter::new(&config.redis, LimiterOptions::default()).unwrap()
}

pub fn sliding(limit: u32, window_ms: u64) -> Algorithm {
    Algorithm::sliding_window(limit, Duration::from_millis(window_ms)).unwrap()
}

pub fn fixed(limit: u32, window_ms: u64) -> Algorithm {
    Algorithm::fixed_window(limit, Duration::from_millis(window_ms)).unwrap()
}

pub fn bucket(rate: f64, burst: u32) -> Algorithm {
    Algorithm::token_bucket(rate, burst).unwrap()
}

pub fn check(key: &str, algorithm: Algorithm, cost: u32) -> Check {
    Check::new(key.to_string(), algorithm)
        .with_cost(cost)
        .unwrap()
}
