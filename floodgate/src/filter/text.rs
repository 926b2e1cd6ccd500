//! The TOML text a [`FilterBuilder`](super::FilterBuilder) is given: every
//! table and key in it is either used or refused, never ignored.

use std::path::Path;
use std::time::Duration;

use crate::config::{Config, ConfigError};
use crate::limiter::RedisConfig;
use crate::net::{Cidr, ProxyHeader};
use crate::rule::Rule;

/// What the text sets: `None` where it says nothing (the builder's value,
/// or the default, applies).
pub(super) struct TextSettings {
    /// `[defaults]` and `[[rule]]`.
    pub rules: Vec<Rule>,
    /// `[server] trusted_proxies`.
    pub trusted_proxies: Vec<Cidr>,
    /// `[server] proxy_header`.
    pub proxy_header: Option<ProxyHeader>,
    /// `[server] max_form`.
    pub max_form: Option<usize>,
    /// `[redis]`, when the table sets anything.
    pub redis: Option<RedisConfig>,
    /// `[limiter] deny_cache`.
    pub deny_cache: Option<bool>,
    /// `[limiter] breaker`.
    pub breaker: Option<Duration>,
}

/// Checks `text` as the configuration file is checked (the same messages,
/// `FILE: WHERE: WHAT`), then refuses what a filter built in code cannot
/// use: the server's own settings (`[server] bind`, `workers`, `secret`,
/// `body_timeout`) and the demo site's tables (`[sms]`, `[site]`).
pub(super) fn read(text: &str, name: &str) -> Result<TextSettings, ConfigError> {
    // What the text names, read as plain TOML first: the server's own
    // settings get a message that says why, not only "unknown field".
    let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError {
        file: name.to_string(),
        place: String::new(),
        what: e.message().replace('`', "\""),
    })?;
    let has = |section: &str, key: &str| {
        table
            .get(section)
            .and_then(|v| v.as_table())
            .is_some_and(|t| t.contains_key(key))
    };
    let any = |section: &str| {
        table
            .get(section)
            .and_then(|v| v.as_table())
            .is_some_and(|t| !t.is_empty())
    };
    let refuse = |place: &str| {
        Err(ConfigError {
            file: name.to_string(),
            place: place.to_string(),
            what: "is a setting of the floodgate server, which a filter built in code does not use; leave it out (the application serves its own requests)".into(),
        })
    };
    for key in ["bind", "workers", "secret", "body_timeout"] {
        if has("server", key) {
            return refuse(&format!("[server] {key}"));
        }
    }
    for key in ["provider"] {
        if has("sms", key) {
            return refuse(&format!("[sms] {key}"));
        }
    }
    for key in ["title", "secure_cookies", "public_outbox"] {
        if has("site", key) {
            return refuse(&format!("[site] {key}"));
        }
    }
    let config = Config::parse(text, Path::new(name))?;
    Ok(TextSettings {
        rules: config.rules,
        trusted_proxies: config.server.trusted_proxies,
        proxy_header: has("server", "proxy_header").then_some(config.server.proxy_header),
        max_form: has("server", "max_form").then_some(config.server.max_form),
        redis: any("redis").then_some(config.redis),
        deny_cache: has("limiter", "deny_cache").then_some(config.limiter.deny_cache),
        breaker: has("limiter", "breaker").then_some(config.limiter.breaker),
    })
}
