//! The configuration file exactly as written: every key optional, unknown
//! keys refused by serde with their line and column.

use serde::Deserialize;

use crate::net::ProxyHeader;
use crate::rule::Algorithm;
use crate::rule::{Count, Deny, HeaderDialect, Mode, OnMissingKey, OnRedisError};

/// `algorithm` as written: one of [`Algorithm::NAMES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AlgorithmName(pub(crate) &'static str);

impl<'de> Deserialize<'de> for AlgorithmName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Algorithm::NAMES
            .iter()
            .find(|n| **n == text)
            .map(|n| AlgorithmName(n))
            .ok_or_else(|| serde::de::Error::unknown_variant(&text, Algorithm::NAMES))
    }
}

/// `normalize` as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum NormalizeName {
    /// `none`
    None,
    /// `digits`
    Digits,
    /// `lowercase`
    Lowercase,
    /// `e164`
    E164,
}

/// The library's sections of the file exactly as written; every key
/// optional. Keys the application reads (see [`AppConfig`](super::AppConfig))
/// are skipped; any other unknown key is refused at its line and column.
#[derive(Debug, Default)]
pub(crate) struct RawConfig {
    /// `[server]`: the filter's keys.
    pub(crate) server: RawServer,
    /// `[redis]`
    pub(crate) redis: RawRedis,
    /// `[limiter]`
    pub(crate) limiter: RawLimiter,
    /// `[defaults]`
    pub(crate) defaults: RawDefaults,
    /// `[[rule]]`
    pub(crate) rule: Vec<RawRule>,
    /// `[admin]`: the operators' HTTP API.
    pub(crate) admin: super::operator::RawAdmin,
}

/// The filter's keys of `[server]` as written.
#[derive(Debug, Default)]
pub(crate) struct RawServer {
    /// Proxies whose forwarding headers are believed.
    pub(crate) trusted_proxies: Vec<String>,
    /// `x-forwarded-for` | `forwarded`: the header those proxies write.
    pub(crate) proxy_header: Option<ProxyHeader>,
    /// Largest form body read, e.g. `"16KiB"`.
    pub(crate) max_form: Option<String>,
}

const SECTIONS: &[&str] = &["server", "redis", "limiter", "defaults", "rule", "admin"];
const SERVER_KEYS: &[&str] = &["trusted_proxies", "proxy_header", "max_form"];

/// Reads [`RawConfig`], skipping the application's keys: `sections` at the
/// top level, `server` inside `[server]`.
pub(crate) struct RawSeed {
    pub(crate) sections: &'static [&'static str],
    pub(crate) server: &'static [&'static str],
}

/// A key of one table: the library's (its index), or the application's.
enum Field {
    Ours(usize),
    Theirs,
}

/// Reads one key; a key neither side knows is refused here, while the
/// deserializer still knows the key's place in the file.
struct FieldSeed {
    ours: &'static [&'static str],
    theirs: &'static [&'static str],
}

impl<'de> serde::de::DeserializeSeed<'de> for FieldSeed {
    type Value = Field;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Field, D::Error> {
        d.deserialize_identifier(self)
    }
}

impl serde::de::Visitor<'_> for FieldSeed {
    type Value = Field;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a key")
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Field, E> {
        if let Some(i) = self.ours.iter().position(|k| *k == v) {
            return Ok(Field::Ours(i));
        }
        if self.theirs.contains(&v) {
            return Ok(Field::Theirs);
        }
        // serde's own wording, so both sides' keys read as one schema.
        let all: Vec<String> = self
            .ours
            .iter()
            .chain(self.theirs)
            .map(|k| format!("`{k}`"))
            .collect();
        let expected = match all.as_slice() {
            [] => "there are no fields".to_string(),
            [one] => format!("expected {one}"),
            [a, b] => format!("expected {a} or {b}"),
            _ => format!("expected one of {}", all.join(", ")),
        };
        Err(E::custom(format_args!("unknown field `{v}`, {expected}")))
    }
}

struct ServerSeed(&'static [&'static str]);

impl<'de> serde::de::DeserializeSeed<'de> for ServerSeed {
    type Value = RawServer;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<RawServer, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for ServerSeed {
    type Value = RawServer;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a table")
    }
    fn visit_map<M: serde::de::MapAccess<'de>>(self, mut map: M) -> Result<RawServer, M::Error> {
        let mut server = RawServer::default();
        let seed = || FieldSeed {
            ours: SERVER_KEYS,
            theirs: self.0,
        };
        while let Some(field) = map.next_key_seed(seed())? {
            match field {
                Field::Ours(0) => server.trusted_proxies = map.next_value()?,
                Field::Ours(1) => server.proxy_header = map.next_value()?,
                Field::Ours(_) => server.max_form = map.next_value()?,
                Field::Theirs => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(server)
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for RawSeed {
    type Value = RawConfig;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<RawConfig, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for RawSeed {
    type Value = RawConfig;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a table")
    }
    fn visit_map<M: serde::de::MapAccess<'de>>(self, mut map: M) -> Result<RawConfig, M::Error> {
        let mut raw = RawConfig::default();
        let seed = || FieldSeed {
            ours: SECTIONS,
            theirs: self.sections,
        };
        while let Some(field) = map.next_key_seed(seed())? {
            match field {
                Field::Ours(0) => raw.server = map.next_value_seed(ServerSeed(self.server))?,
                Field::Ours(1) => raw.redis = map.next_value()?,
                Field::Ours(2) => raw.limiter = map.next_value()?,
                Field::Ours(3) => raw.defaults = map.next_value()?,
                Field::Ours(4) => raw.rule = map.next_value()?,
                Field::Ours(_) => raw.admin = map.next_value()?,
                Field::Theirs => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(raw)
    }
}

/// `[redis]` as written. `Debug` hides passwords in URLs.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawRedis {
    /// `redis://host:port/db`
    pub(crate) url: Option<String>,
    /// Seed nodes of a Redis Cluster.
    pub(crate) cluster: Vec<String>,
    /// Sentinel servers that know the master.
    pub(crate) sentinel: Vec<String>,
    /// The name the Sentinels monitor the master under.
    pub(crate) sentinel_master: Option<String>,
    /// Connections in the r2d2 pool.
    pub(crate) pool_size: Option<u32>,
    /// Bound on connect, checkout and each command.
    pub(crate) timeout: Option<String>,
    /// First component of every key.
    pub(crate) key_prefix: Option<String>,
}

/// `[limiter]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawLimiter {
    /// Remember denied keys in-process until their retry time.
    pub(crate) deny_cache: Option<bool>,
    /// How long rules apply `on_redis_error` at once after Redis failed.
    pub(crate) breaker: Option<String>,
}

/// `[defaults]` as written: the keys a `[[rule]]` may also set for itself.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawDefaults {
    /// One of [`Algorithm::NAMES`].
    pub(crate) algorithm: Option<AlgorithmName>,
    /// `redirect` | `status`
    pub(crate) deny: Option<Deny>,
    /// Where `redirect` sends a denied request.
    pub(crate) error_page: Option<String>,
    /// `allow` | `deny` | `local`
    pub(crate) on_redis_error: Option<OnRedisError>,
    /// `enforce` | `shadow`
    pub(crate) mode: Option<Mode>,
    /// Region of phone numbers written without `+` (`normalize = "e164"`).
    pub(crate) region: Option<String>,
    /// `all` | `failures`
    pub(crate) count: Option<Count>,
    /// `ip` | `reject`: what a request without its key value gets.
    pub(crate) on_missing_key: Option<OnMissingKey>,
    /// `ietf` | `draft-6` | `draft-7` | `x-ratelimit` | `none`
    pub(crate) headers: Option<HeaderDialect>,
    /// Client addresses or networks never counted nor denied.
    pub(crate) exempt: Option<Vec<String>>,
}

/// A rule's `key` as written: one kind, or a list of kinds (one counter
/// per combination of their values).
#[derive(Debug, Clone, Deserialize)]
#[serde(
    untagged,
    expecting = "a key kind such as \"ip\", or a list of kinds such as [\"form:phone\", \"ip\"]"
)]
pub(crate) enum RawKey {
    /// `key = "ip"`
    One(String),
    /// `key = ["form:phone", "ip"]`
    Many(Vec<String>),
}

/// One `[[rule]]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRule {
    /// Unique name.
    pub(crate) name: String,
    /// Path patterns.
    pub(crate) paths: Vec<String>,
    /// Methods; empty = all.
    #[serde(default)]
    pub(crate) methods: Vec<String>,
    /// Key kind, or a list of them.
    pub(crate) key: Option<RawKey>,
    /// `none` | `digits` | `lowercase` | `e164`
    pub(crate) normalize: Option<NormalizeName>,
    /// Requests per window.
    pub(crate) limit: Option<i64>,
    /// Window length.
    pub(crate) window: Option<String>,
    /// Token bucket refill, per second.
    pub(crate) rate: Option<f64>,
    /// Token bucket capacity.
    pub(crate) burst: Option<i64>,
    /// Units per request.
    pub(crate) cost: Option<i64>,
    /// The limit in human words, for the error page ("at most 3 codes per
    /// minute for this phone number"); generated when absent.
    pub(crate) description: Option<String>,
    /// Overrides `[defaults]` algorithm.
    pub(crate) algorithm: Option<AlgorithmName>,
    /// Overrides `[defaults]` deny.
    pub(crate) deny: Option<Deny>,
    /// Overrides `[defaults]` error_page.
    pub(crate) error_page: Option<String>,
    /// Overrides `[defaults]` on_redis_error.
    pub(crate) on_redis_error: Option<OnRedisError>,
    /// Overrides `[defaults]` mode.
    pub(crate) mode: Option<Mode>,
    /// Overrides `[defaults]` region.
    pub(crate) region: Option<String>,
    /// Overrides `[defaults]` count.
    pub(crate) count: Option<Count>,
    /// Overrides `[defaults]` on_missing_key.
    pub(crate) on_missing_key: Option<OnMissingKey>,
    /// Key values appear in Redis key names only hashed (API keys).
    pub(crate) hash_key: Option<bool>,
    /// Overrides `[defaults]` headers.
    pub(crate) headers: Option<HeaderDialect>,
    /// Overrides `[defaults]` exempt.
    pub(crate) exempt: Option<Vec<String>>,
    /// Escalating bans: `{ after, within, ban, max }`.
    pub(crate) penalty: Option<super::operator::RawPenalty>,
}

impl std::fmt::Debug for RawRedis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hide = |u: &String| crate::limiter::without_password(u);
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
