//! The configuration file exactly as written: every key optional, unknown
//! keys refused by serde with their line and column.

use serde::Deserialize;

use super::SmsProvider;
use crate::net::ProxyHeader;
use crate::rule::{Count, Deny, Mode, OnRedisError};

/// `algorithm` as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlgorithmName {
    /// `sliding_window`
    SlidingWindow,
    /// `fixed_window`
    FixedWindow,
    /// `token_bucket`
    TokenBucket,
}

/// `normalize` as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormalizeName {
    /// `none`
    None,
    /// `digits`
    Digits,
    /// `lowercase`
    Lowercase,
    /// `e164`
    E164,
}

/// The file exactly as written; every key optional, unknown keys rejected.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    /// `[server]`
    pub server: RawServer,
    /// `[redis]`
    pub redis: RawRedis,
    /// `[limiter]`
    pub limiter: RawLimiter,
    /// `[defaults]`
    pub defaults: RawPolicy,
    /// `[[rule]]`
    pub rule: Vec<RawRule>,
    /// `[sms]`: the demo site's SMS provider.
    pub sms: RawSms,
    /// `[site]`: the demo site's own settings.
    pub site: RawSite,
    /// `[admin]`: the operators' HTTP API.
    pub admin: super::operator::RawAdmin,
}

/// `[server]` as written. `Debug` hides the secret.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawServer {
    /// Address to listen on.
    pub bind: Option<String>,
    /// Worker threads; 0 = one per core.
    pub workers: Option<usize>,
    /// Proxies whose forwarding headers are believed.
    pub trusted_proxies: Vec<String>,
    /// `x-forwarded-for` | `forwarded`: the header those proxies write.
    pub proxy_header: Option<ProxyHeader>,
    /// Largest form body read, e.g. `"16KiB"`.
    pub max_form: Option<String>,
    /// Key for cookies and CSRF.
    pub secret: Option<String>,
    /// How long a request body may take to arrive, e.g. `"10s"`.
    pub body_timeout: Option<String>,
}

/// `[redis]` as written. `Debug` hides passwords in URLs.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRedis {
    /// `redis://host:port/db`
    pub url: Option<String>,
    /// Seed nodes of a Redis Cluster.
    pub cluster: Vec<String>,
    /// Sentinel servers that know the master.
    pub sentinel: Vec<String>,
    /// The name the Sentinels monitor the master under.
    pub sentinel_master: Option<String>,
    /// Connections in the r2d2 pool.
    pub pool_size: Option<u32>,
    /// Bound on connect, checkout and each command.
    pub timeout: Option<String>,
    /// First component of every key.
    pub key_prefix: Option<String>,
}

/// `[limiter]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLimiter {
    /// Remember denied keys in-process until their retry time.
    pub deny_cache: Option<bool>,
    /// How long rules apply `on_redis_error` at once after Redis failed.
    pub breaker: Option<String>,
}

/// The policy keys shared by `[defaults]` and `[[rule]]`.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawPolicy {
    /// `sliding_window` | `fixed_window` | `token_bucket`
    pub algorithm: Option<AlgorithmName>,
    /// `redirect` | `status`
    pub deny: Option<Deny>,
    /// Where `redirect` sends a denied request.
    pub error_page: Option<String>,
    /// `allow` | `deny` | `local`
    pub on_redis_error: Option<OnRedisError>,
    /// `enforce` | `shadow`
    pub mode: Option<Mode>,
    /// Region of phone numbers written without `+` (`normalize = "e164"`).
    pub region: Option<String>,
    /// `all` | `failures`
    pub count: Option<Count>,
}

/// A rule's `key` as written: one kind, or a list of kinds (one counter
/// per combination of their values).
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "a key kind such as \"ip\", or a list of kinds such as [\"form:phone\", \"ip\"]"
)]
pub enum RawKey {
    /// `key = "ip"`
    One(String),
    /// `key = ["form:phone", "ip"]`
    Many(Vec<String>),
}

/// One `[[rule]]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRule {
    /// Unique name.
    pub name: String,
    /// Path patterns.
    pub paths: Vec<String>,
    /// Methods; empty = all.
    #[serde(default)]
    pub methods: Vec<String>,
    /// Key kind, or a list of them.
    pub key: Option<RawKey>,
    /// `none` | `digits` | `lowercase` | `e164`
    pub normalize: Option<NormalizeName>,
    /// Requests per window.
    pub limit: Option<i64>,
    /// Window length.
    pub window: Option<String>,
    /// Token bucket refill, per second.
    pub rate: Option<f64>,
    /// Token bucket capacity.
    pub burst: Option<i64>,
    /// Units per request.
    pub cost: Option<i64>,
    /// The limit in human words, for the error page ("at most 3 codes per
    /// minute for this phone number"); generated when absent.
    pub description: Option<String>,
    /// Overrides `[defaults]` algorithm.
    pub algorithm: Option<AlgorithmName>,
    /// Overrides `[defaults]` deny.
    pub deny: Option<Deny>,
    /// Overrides `[defaults]` error_page.
    pub error_page: Option<String>,
    /// Overrides `[defaults]` on_redis_error.
    pub on_redis_error: Option<OnRedisError>,
    /// Overrides `[defaults]` mode.
    pub mode: Option<Mode>,
    /// Overrides `[defaults]` region.
    pub region: Option<String>,
    /// Overrides `[defaults]` count.
    pub count: Option<Count>,
    /// Escalating bans: `{ after, within, ban, max }`.
    pub penalty: Option<super::operator::RawPenalty>,
}

/// `[sms]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSms {
    /// `outbox` | `log`
    pub provider: Option<SmsProvider>,
}

/// `[site]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSite {
    /// Site title shown in the header.
    pub title: Option<String>,
    /// Mark cookies `Secure` (serve over HTTPS).
    pub secure_cookies: Option<bool>,
    /// Show `/dev/outbox` to every client, not only loopback ones.
    pub public_outbox: Option<bool>,
}

impl std::fmt::Debug for RawServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawServer")
            .field("bind", &self.bind)
            .field("workers", &self.workers)
            .field("trusted_proxies", &self.trusted_proxies)
            .field("proxy_header", &self.proxy_header)
            .field("max_form", &self.max_form)
            .field("secret", &self.secret.as_ref().map(|_| "***"))
            .field("body_timeout", &self.body_timeout)
            .finish()
    }
}

impl std::fmt::Debug for RawRedis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hide = |u: &String| crate::limit::without_password(u);
        f.debug_struct("RawRedis")
            .field("url", &self.url.as_ref().map(hide))
            .field(
                "cluster",
                &self.cluster.iter().map(hide).collect::<Vec<_>>(),
            )
            .field(
                "sentinel",
                &self.sentinel.iter().map(hide).collect::<Vec<_>>(),
            )
            .field("sentinel_master", &self.sentinel_master)
            .field("pool_size", &self.pool_size)
            .field("timeout", &self.timeout)
            .field("key_prefix", &self.key_prefix)
            .finish()
    }
}
