//! The TOML text a [`FilterBuilder`](super::FilterBuilder) is given: every
//! table and key in it is either used or refused, never ignored.

use std::path::Path;
use std::time::Duration;

use crate::config::{Config, ConfigError, RawConfig};
use crate::limit::RedisConfig;
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
    let config = Config::parse(text, Path::new(name))?;
    // The text parsed above, so this parses too.
    let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError {
        file: name.to_string(),
        place: String::new(),
        what: e.message().replace('`', "\""),
    })?;
    let refuse = |place: &str| {
        Err(ConfigError {
            file: name.to_string(),
            place: place.to_string(),
            what: "is a setting of the floodgate server, which a filter built in code does not use; leave it out (the application serves its own requests)".into(),
        })
    };
    let s = &raw.server;
    for (set, place) in [
        (s.bind.is_some(), "[server] bind"),
        (s.workers.is_some(), "[server] workers"),
        (s.secret.is_some(), "[server] secret"),
        (s.body_timeout.is_some(), "[server] body_timeout"),
    ] {
        if set {
            return refuse(place);
        }
    }
    let sms = &raw.sms;
    if sms.provider.is_some() {
        return refuse("[sms] provider");
    }
    let site = &raw.site;
    for (set, place) in [
        (site.title.is_some(), "[site] title"),
        (site.secure_cookies.is_some(), "[site] secure_cookies"),
        (site.public_outbox.is_some(), "[site] public_outbox"),
    ] {
        if set {
            return refuse(place);
        }
    }
    let r = &raw.redis;
    let redis_set = r.url.is_some()
        || !r.cluster.is_empty()
        || !r.sentinel.is_empty()
        || r.sentinel_master.is_some()
        || r.pool_size.is_some()
        || r.timeout.is_some()
        || r.key_prefix.is_some();
    Ok(TextSettings {
        rules: config.rules,
        trusted_proxies: config.server.trusted_proxies,
        proxy_header: s.proxy_header.map(|_| config.server.proxy_header),
        max_form: s.max_form.as_ref().map(|_| config.server.max_form),
        redis: redis_set.then_some(config.redis),
        deny_cache: raw.limiter.deny_cache.map(|_| config.limiter.deny_cache),
        breaker: raw.limiter.breaker.as_ref().map(|_| config.limiter.breaker),
    })
}
