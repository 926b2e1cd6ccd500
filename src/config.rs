//! The configuration file: a typed TOML schema, its validation and the
//! environment overrides.
//!
//! Reading happens in two steps. [`RawConfig`] mirrors the file exactly
//! (unknown keys are rejected by serde, with line and column); [`Config::from_raw`]
//! then checks every value and turns rules into [`Rule`]s that cannot be
//! invalid. Every failure is a [`ConfigError`] whose `Display` is the one line
//! `FILE: WHERE: WHAT` that the command line prints before exiting with status 2.

use std::fmt;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::filter::key::Region;
use crate::filter::route::PathPattern;
use crate::limit::Algorithm;

/// Largest `limit` a window rule may have.
pub const MAX_LIMIT: u32 = 100_000;

/// Most actix worker threads (`[server] workers`); actix-server refuses more.
pub const MAX_WORKERS: usize = 512;

/// Most connections in the pool (`[redis] pool_size`).
pub const MAX_POOL_SIZE: u32 = 1024;

/// Longest window, and longest time a token bucket may take to refill from empty.
pub const MAX_WINDOW: Duration = Duration::from_secs(366 * 86_400);

/// Longest `[redis] timeout`.
pub const MAX_REDIS_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest `[server] body_timeout`.
pub const MAX_BODY_TIMEOUT: Duration = Duration::from_secs(3600);

/// Longest `[limiter] breaker`.
pub const MAX_BREAKER: Duration = Duration::from_secs(600);

/// Largest token bucket `rate`, in tokens per second.
pub const MAX_RATE: f64 = 1_000_000.0;

/// Longest `error_page`.
pub const MAX_ERROR_PAGE: usize = 256;

/// Fewest connections the pool may have: one per dispatcher thread, which
/// holds its connection for good, and one for the site and `/readyz`.
pub fn min_pool_size() -> u32 {
    crate::limit::redis::DISPATCHERS as u32 + 1
}

/// A configuration that cannot be used, with where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file the error is in.
    pub file: String,
    /// Where in the file: `line 7, column 3`, `rule "sms" (rule 2)`, `[redis] timeout`…
    pub place: String,
    /// What is wrong, in one sentence.
    pub what: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.place.is_empty() {
            write!(f, "{}: {}", self.file, self.what)
        } else {
            write!(f, "{}: {}: {}", self.file, self.place, self.what)
        }
    }
}

impl std::error::Error for ConfigError {}

// ---------------------------------------------------------------------------
// The file as written
// ---------------------------------------------------------------------------

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
}

/// `[server]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawServer {
    /// Address to listen on.
    pub bind: Option<String>,
    /// Worker threads; 0 = one per core.
    pub workers: Option<usize>,
    /// Proxies whose forwarding headers are believed.
    pub trusted_proxies: Vec<String>,
    /// Largest form body read, e.g. `"16KiB"`.
    pub max_form: Option<String>,
    /// Key for cookies and CSRF.
    pub secret: Option<String>,
    /// How long a request body may take to arrive, e.g. `"10s"`.
    pub body_timeout: Option<String>,
}

/// `[redis]` as written.
#[derive(Debug, Default, Deserialize)]
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
    pub algorithm: Option<String>,
    /// `redirect` | `status`
    pub deny: Option<String>,
    /// Where `redirect` sends a denied request.
    pub error_page: Option<String>,
    /// `allow` | `deny`
    pub on_redis_error: Option<String>,
    /// `enforce` | `shadow`
    pub mode: Option<String>,
    /// Region of phone numbers written without `+` (`normalize = "e164"`).
    pub region: Option<String>,
    /// `all` | `failures`
    pub count: Option<String>,
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
    pub normalize: Option<String>,
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
    pub algorithm: Option<String>,
    /// Overrides `[defaults]` deny.
    pub deny: Option<String>,
    /// Overrides `[defaults]` error_page.
    pub error_page: Option<String>,
    /// Overrides `[defaults]` on_redis_error.
    pub on_redis_error: Option<String>,
    /// Overrides `[defaults]` mode.
    pub mode: Option<String>,
    /// Overrides `[defaults]` region.
    pub region: Option<String>,
    /// Overrides `[defaults]` count.
    pub count: Option<String>,
}

/// `[sms]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSms {
    /// `outbox` | `log`
    pub provider: Option<String>,
}

/// `[site]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSite {
    /// Site title shown in the header.
    pub title: Option<String>,
    /// Mark cookies `Secure` (serve over HTTPS).
    pub secure_cookies: Option<bool>,
}

// ---------------------------------------------------------------------------
// The checked configuration
// ---------------------------------------------------------------------------

/// A checked, usable configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it came from (for messages and SIGHUP reloads).
    pub path: PathBuf,
    /// `[server]`
    pub server: ServerConfig,
    /// `[redis]`
    pub redis: RedisConfig,
    /// `[limiter]`
    pub limiter: LimiterConfig,
    /// `[[rule]]`, with `[defaults]` applied.
    pub rules: Vec<Rule>,
    /// `[defaults] region`: how the site reads the phone numbers people
    /// type (with the same function as the `e164` rules).
    pub region: Region,
    /// `[sms]`
    pub sms: SmsConfig,
    /// `[site]`
    pub site: SiteConfig,
}

/// `[server]`, checked.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on, `host:port`.
    pub bind: String,
    /// Worker threads; 0 = one per core.
    pub workers: usize,
    /// Proxies whose forwarding headers are believed.
    pub trusted_proxies: Vec<Cidr>,
    /// Largest form body read, in bytes.
    pub max_form: usize,
    /// Key for cookies and CSRF (empty = random at each start).
    pub secret: String,
    /// A request body not fully received this long after its head gets
    /// `408` and the connection is closed.
    pub body_timeout: Duration,
}

/// `[redis]`, checked.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// Single-server URL.
    pub url: String,
    /// Cluster seed URLs (non-empty = cluster mode).
    pub cluster: Vec<String>,
    /// Sentinel URLs (non-empty = Sentinel mode, with `sentinel_master`).
    pub sentinel: Vec<String>,
    /// The master's name at the Sentinels (empty unless `sentinel` is set).
    pub sentinel_master: String,
    /// Pool size.
    pub pool_size: u32,
    /// Bound on connect, pool checkout and each command.
    pub timeout: Duration,
    /// First component of every key.
    pub key_prefix: String,
}

/// `[limiter]`, checked.
#[derive(Debug, Clone)]
pub struct LimiterConfig {
    /// A denied key is remembered in-process until its retry time, so a
    /// flood on a denied key costs no Redis call.
    pub deny_cache: bool,
    /// After Redis failed to answer in time, rules apply `on_redis_error`
    /// at once for this long; then one call probes Redis again.
    pub breaker: Duration,
}

/// `[sms]`, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmsProvider {
    /// Keep messages in Redis and show them at `/dev/outbox`.
    Outbox,
    /// Write messages to the log.
    Log,
}

/// `[sms]`, checked.
#[derive(Debug, Clone)]
pub struct SmsConfig {
    /// Where "sent" messages go.
    pub provider: SmsProvider,
}

/// `[site]`, checked.
#[derive(Debug, Clone)]
pub struct SiteConfig {
    /// Title in the page header.
    pub title: String,
    /// Whether cookies carry `Secure`.
    pub secure_cookies: bool,
}

/// What identifies the caller for a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyKind {
    /// The client address (behind trusted proxies).
    Ip,
    /// One key for the whole rule.
    Global,
    /// The request path.
    Path,
    /// The signed-in account, else the client address.
    Session,
    /// A request header's value.
    Header(String),
    /// A query-string parameter.
    Query(String),
    /// A field of an urlencoded form body.
    Form(String),
}

impl KeyKind {
    /// The KIND component of the Redis key.
    pub fn kind(&self) -> &'static str {
        match self {
            KeyKind::Ip => "ip",
            KeyKind::Global => "global",
            KeyKind::Path => "path",
            KeyKind::Session => "session",
            KeyKind::Header(_) => "header",
            KeyKind::Query(_) => "query",
            KeyKind::Form(_) => "form",
        }
    }
}

impl fmt::Display for KeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyKind::Header(n) => write!(f, "header:{n}"),
            KeyKind::Query(n) => write!(f, "query:{n}"),
            KeyKind::Form(n) => write!(f, "form:{n}"),
            other => f.write_str(other.kind()),
        }
    }
}

/// What a rule counts by: one kind, or several (one counter per
/// combination of their values, e.g. per phone number per address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key(pub Vec<KeyKind>);

impl Key {
    /// The kinds, in the order written (never empty).
    pub fn kinds(&self) -> &[KeyKind] {
        &self.0
    }

    /// Whether any part reads the form body.
    pub fn reads_form(&self) -> bool {
        self.0.iter().any(|k| matches!(k, KeyKind::Form(_)))
    }

    /// The only kind, when the key is not composite.
    pub fn single(&self) -> Option<&KeyKind> {
        match self.0.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.single() {
            Some(one) => write!(f, "{one}"),
            None => {
                let parts: Vec<String> = self
                    .0
                    .iter()
                    .map(|k| format!("{:?}", k.to_string()))
                    .collect();
                write!(f, "[{}]", parts.join(", "))
            }
        }
    }
}

/// How a header/query/form value is normalized before it becomes a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Normalize {
    /// As sent (after percent-decoding).
    None,
    /// Only the ASCII digits are kept (phone numbers).
    Digits,
    /// Lower-cased and trimmed (e-mail addresses, user names).
    Lowercase,
    /// A phone number in E.164 (`+DIGITS`); numbers written without `+`
    /// are read with this region's prefixes. Not a possible number: none.
    E164(Region),
}

/// Which requests a rule charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// Every request it allows.
    All,
    /// Every request it allows is charged, and a request answered below 400
    /// gets its units back (failed sign-ins count, good ones do not).
    Failures,
}

/// What a denied request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deny {
    /// `303` to the error page (JSON clients get a 429).
    Redirect,
    /// `429` with `Retry-After`.
    Status,
}

/// What happens when Redis cannot answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnRedisError {
    /// Let the request through.
    Allow,
    /// Answer `503`.
    Deny,
}

/// Whether a rule may deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Denies over the limit.
    Enforce,
    /// Counts and reports, never denies.
    Shadow,
}

/// One checked rule with `[defaults]` applied.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Unique name, `[A-Za-z0-9_-]{1,64}`.
    pub name: String,
    /// Path patterns as written (for display).
    pub path_text: Vec<String>,
    /// Compiled path patterns.
    pub paths: Vec<PathPattern>,
    /// Upper-case methods; empty = every method.
    pub methods: Vec<String>,
    /// What identifies the caller.
    pub key: Key,
    /// Normalization of header/query/form values.
    pub normalize: Normalize,
    /// The algorithm and its parameters.
    pub algorithm: Algorithm,
    /// Units one request takes.
    pub cost: u32,
    /// What a denied request gets.
    pub deny: Deny,
    /// Where `redirect` sends a denied request.
    pub error_page: String,
    /// Redis error policy.
    pub on_redis_error: OnRedisError,
    /// Enforce or shadow.
    pub mode: Mode,
    /// Whether answers below 400 give their units back.
    pub count: Count,
    /// The limit in human words.
    pub description: String,
}

impl Rule {
    /// Whether this rule guards `method` + (decoded) `path`.
    pub fn matches(&self, method: &str, path: &str) -> bool {
        (self.methods.is_empty() || self.methods.iter().any(|m| m == method))
            && self.paths.iter().any(|p| p.matches(path))
    }
}

/// An IP network: an address and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// Parses `10.0.0.1`, `10.0.0.0/8`, `::1` or `fd00::/8`.
    pub fn parse(text: &str) -> Option<Cidr> {
        let (addr, prefix) = match text.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (text, None),
        };
        let addr: IpAddr = addr.trim().parse().ok()?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => p.parse().ok()?,
            Some(_) => return None,
            None => max,
        };
        if prefix > max {
            return None;
        }
        Some(Cidr {
            addr: crate::filter::key::canonical_ip(addr),
            prefix,
        })
    }

    /// Whether `ip` is inside this network (IPv4-mapped IPv6 counts as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, crate::filter::key::canonical_ip(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

// ---------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------

/// The file used when neither `--config` nor `$FLOODGATE_CONFIG` names one.
pub const DEFAULT_PATH: &str = "config/default.toml";

impl Config {
    /// Reads, parses and checks `path`, then applies `FLOODGATE_BIND` and
    /// `FLOODGATE_REDIS_URL` from the environment.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let mut config = Config::load_file(path)?;
        config.apply_env(|name| std::env::var(name).ok())?;
        Ok(config)
    }

    /// Reads, parses and checks `path` without looking at the environment.
    pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            place: String::new(),
            what: format!("cannot read the file: {}", io_words(&e)),
        })?;
        Config::parse(&text, path)
    }

    /// Parses and checks TOML text said to come from `path`.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        let file = path.display().to_string();
        let raw: RawConfig = toml::from_str(text).map_err(|e| toml_error(&file, text, &e))?;
        let mut config = Config::from_raw(raw, &file)?;
        config.path = path.to_path_buf();
        Ok(config)
    }

    /// Applies the environment overrides; `get` reads one variable.
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let file = self.path.display().to_string();
        if let Some(bind) = get("FLOODGATE_BIND").filter(|v| !v.is_empty()) {
            self.server.bind = check_bind(&bind).map_err(|what| ConfigError {
                file: file.clone(),
                place: "FLOODGATE_BIND".into(),
                what,
            })?;
        }
        if let Some(url) = get("FLOODGATE_REDIS_URL").filter(|v| !v.is_empty()) {
            self.redis.url = check_redis_url(&url).map_err(|what| ConfigError {
                file,
                place: "FLOODGATE_REDIS_URL".into(),
                what,
            })?;
        }
        Ok(())
    }

    /// Checks every value of a parsed file.
    pub fn from_raw(raw: RawConfig, file: &str) -> Result<Config, ConfigError> {
        let err = |place: &str, what: String| ConfigError {
            file: file.to_string(),
            place: place.to_string(),
            what,
        };

        let s = raw.server;
        let bind = check_bind(s.bind.as_deref().unwrap_or("127.0.0.1:8080"))
            .map_err(|w| err("[server] bind", w))?;
        let workers = s.workers.unwrap_or(0);
        if workers > MAX_WORKERS {
            return Err(err(
                "[server] workers",
                format!(
                    "must be between 0 and {MAX_WORKERS} (0 = one per CPU core), got {workers}"
                ),
            ));
        }
        let mut trusted_proxies = Vec::new();
        for p in &s.trusted_proxies {
            trusted_proxies.push(Cidr::parse(p).ok_or_else(|| {
                err(
                    "[server] trusted_proxies",
                    format!("{p:?} is not an IP address or CIDR"),
                )
            })?);
        }
        let max_form = parse_size(s.max_form.as_deref().unwrap_or("16KiB"))
            .map_err(|w| err("[server] max_form", w))?;
        let body_timeout =
            duration_setting(s.body_timeout.as_deref().unwrap_or("10s"), MAX_BODY_TIMEOUT)
                .map_err(|w| err("[server] body_timeout", w.text()))?;
        let server = ServerConfig {
            bind,
            workers,
            trusted_proxies,
            max_form,
            secret: s.secret.unwrap_or_default(),
            body_timeout,
        };

        let r = raw.redis;
        let url = check_redis_url(r.url.as_deref().unwrap_or("redis://127.0.0.1:6379/0"))
            .map_err(|w| err("[redis] url", w))?;
        let mut cluster = Vec::new();
        for u in &r.cluster {
            cluster.push(check_redis_url(u).map_err(|w| err("[redis] cluster", w))?);
        }
        let mut sentinel = Vec::new();
        for u in &r.sentinel {
            sentinel.push(check_redis_url(u).map_err(|w| err("[redis] sentinel", w))?);
        }
        let sentinel_master = r.sentinel_master.unwrap_or_default();
        check_topology(&cluster, &sentinel, &sentinel_master)
            .map_err(|(place, what)| err(place, what))?;
        let pool_size = r.pool_size.unwrap_or(16);
        let min_pool = min_pool_size();
        if !(min_pool..=MAX_POOL_SIZE).contains(&pool_size) {
            return Err(err(
                "[redis] pool_size",
                format!(
                    "must be between {min_pool} and {MAX_POOL_SIZE}, got {pool_size} (the limiter's \
                     {} dispatcher threads each hold a connection, and the site and /readyz \
                     need at least one more)",
                    crate::limit::redis::DISPATCHERS
                ),
            ));
        }
        let timeout = duration_setting(r.timeout.as_deref().unwrap_or("250ms"), MAX_REDIS_TIMEOUT)
            .map_err(|w| err("[redis] timeout", w.text()))?;
        let key_prefix = r.key_prefix.unwrap_or_else(|| "floodgate".into());
        if key_prefix.is_empty()
            || key_prefix.len() > 64
            || key_prefix
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(err(
                "[redis] key_prefix",
                format!(
                    "must be 1 to 64 bytes without spaces or control characters, got {key_prefix:?}"
                ),
            ));
        }
        let redis = RedisConfig {
            url,
            cluster,
            sentinel,
            sentinel_master,
            pool_size,
            timeout,
            key_prefix,
        };

        let l = raw.limiter;
        let limiter = LimiterConfig {
            deny_cache: l.deny_cache.unwrap_or(true),
            breaker: duration_setting(l.breaker.as_deref().unwrap_or("1s"), MAX_BREAKER)
                .map_err(|w| err("[limiter] breaker", w.text()))?,
        };
        let region = check_policy(&raw.defaults, &Policy::builtin())
            .map(|p| p.region)
            .map_err(|(key, what)| err(&format!("[defaults] {key}"), what))?;
        let rules = rules_from_raw(&raw.defaults, raw.rule, file)?;

        let sms = SmsConfig {
            provider: match raw.sms.provider.as_deref().unwrap_or("outbox") {
                "outbox" => SmsProvider::Outbox,
                "log" => SmsProvider::Log,
                other => {
                    return Err(err(
                        "[sms] provider",
                        format!("{other:?}: expected \"outbox\" or \"log\""),
                    ))
                }
            },
        };
        let site = SiteConfig {
            title: raw.site.title.unwrap_or_else(|| "floodgate".into()),
            secure_cookies: raw.site.secure_cookies.unwrap_or(false),
        };

        Ok(Config {
            path: PathBuf::from(file),
            server,
            redis,
            limiter,
            rules,
            region,
            sms,
            site,
        })
    }
}

/// Checks `[defaults]` and every `[[rule]]`; used at start and on SIGHUP.
pub fn rules_from_raw(
    defaults: &RawPolicy,
    raw: Vec<RawRule>,
    file: &str,
) -> Result<Vec<Rule>, ConfigError> {
    let defaults =
        check_policy(defaults, &Policy::builtin()).map_err(|(key, what)| ConfigError {
            file: file.to_string(),
            place: format!("[defaults] {key}"),
            what,
        })?;
    let mut rules: Vec<Rule> = Vec::with_capacity(raw.len());
    for (i, r) in raw.into_iter().enumerate() {
        let place = format!("rule {:?} (rule {})", r.name, i + 1);
        let rule = check_rule(r, &defaults, &rules).map_err(|what| ConfigError {
            file: file.to_string(),
            place,
            what,
        })?;
        rules.push(rule);
    }
    Ok(rules)
}

/// The policy part of a rule, resolved.
#[derive(Debug, Clone)]
struct Policy {
    algorithm: String,
    deny: Deny,
    error_page: String,
    on_redis_error: OnRedisError,
    mode: Mode,
    region: Region,
    count: Count,
}

impl Policy {
    fn builtin() -> Policy {
        Policy {
            algorithm: "sliding_window".into(),
            deny: Deny::Redirect,
            error_page: "/err".into(),
            on_redis_error: OnRedisError::Allow,
            mode: Mode::Enforce,
            region: Region::us(),
            count: Count::All,
        }
    }
}

/// Resolves a `[defaults]`-style table over `base`; errors name the key.
fn check_policy(raw: &RawPolicy, base: &Policy) -> Result<Policy, (&'static str, String)> {
    let mut p = base.clone();
    if let Some(a) = &raw.algorithm {
        if !matches!(
            a.as_str(),
            "sliding_window" | "fixed_window" | "token_bucket"
        ) {
            return Err((
                "algorithm",
                format!(
                    "unknown algorithm {a:?}, expected \"sliding_window\", \"fixed_window\" or \"token_bucket\""
                ),
            ));
        }
        p.algorithm = a.clone();
    }
    if let Some(d) = &raw.deny {
        p.deny = match d.as_str() {
            "redirect" => Deny::Redirect,
            "status" => Deny::Status,
            _ => {
                return Err((
                    "deny",
                    format!("unknown deny {d:?}, expected \"redirect\" or \"status\""),
                ))
            }
        };
    }
    if let Some(e) = &raw.error_page {
        check_error_page(e).map_err(|what| ("error_page", what))?;
        p.error_page = e.clone();
    }
    if let Some(o) = &raw.on_redis_error {
        p.on_redis_error = match o.as_str() {
            "allow" => OnRedisError::Allow,
            "deny" => OnRedisError::Deny,
            _ => {
                return Err((
                    "on_redis_error",
                    format!("unknown on_redis_error {o:?}, expected \"allow\" or \"deny\""),
                ))
            }
        };
    }
    if let Some(m) = &raw.mode {
        p.mode = match m.as_str() {
            "enforce" => Mode::Enforce,
            "shadow" => Mode::Shadow,
            _ => {
                return Err((
                    "mode",
                    format!("unknown mode {m:?}, expected \"enforce\" or \"shadow\""),
                ))
            }
        };
    }
    if let Some(r) = &raw.region {
        p.region = Region::parse(r).ok_or_else(|| {
            (
                "region",
                format!("unknown region {r:?}, expected a two-letter region code such as \"US\" or \"GB\""),
            )
        })?;
    }
    if let Some(c) = &raw.count {
        p.count = match c.as_str() {
            "all" => Count::All,
            "failures" => Count::Failures,
            _ => {
                return Err((
                    "count",
                    format!("unknown count {c:?}, expected \"all\" or \"failures\""),
                ))
            }
        };
    }
    Ok(p)
}

/// `error_page` is a plain absolute path on this site: it starts with one
/// `/`, has no query, fragment or percent-encoding, no empty, `.` or `..`
/// segment, and only the printable ASCII characters a path may hold as
/// they are (letters, digits and `-._~!$&'()*+,;=:@/`), at most
/// [`MAX_ERROR_PAGE`] bytes. So the `Location` header is always valid, and
/// what the browser asks for next is exactly the path the rules are
/// matched against.
fn check_error_page(e: &str) -> Result<(), String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-._~!$&'()*+,;=:@/".contains(c);
    let problem = if !e.starts_with('/') {
        Some("must start with \"/\"")
    } else if e.starts_with("//") {
        Some("must not start with \"//\" (a browser reads that as another host)")
    } else if e.len() > MAX_ERROR_PAGE {
        Some("is longer than 256 bytes")
    } else if e.contains(['?', '#']) {
        Some("must not have a query or fragment (the rule and retry time are added as the query)")
    } else if e.contains('%') {
        Some("must not be percent-encoded")
    } else if !e.chars().all(allowed) {
        Some("may hold only letters, digits and -._~!$&'()*+,;=:@/ (no spaces, control or non-ASCII characters)")
    } else if e.contains("//") || e.split('/').any(|seg| seg == "." || seg == "..") {
        Some("must not have an empty, \".\" or \"..\" segment")
    } else {
        None
    };
    match problem {
        Some(why) => Err(format!(
            "error_page {e:?} {why}: it must be a plain absolute path on this site, like \"/err\""
        )),
        None => Ok(()),
    }
}

/// Path patterns are matched against the percent-decoded path: a pattern
/// that holds a query, a fragment, percent-encoding, spaces or control
/// characters can never match what a client is guarded by.
fn check_path_chars(p: &str) -> Result<(), String> {
    let why = if p.contains('?') {
        "\"?\" (a query is not part of the path)"
    } else if p.contains('#') {
        "\"#\" (a fragment is never sent)"
    } else if p.contains('%') {
        "\"%\" (paths are matched percent-decoded: write \"/café\", not \"/caf%C3%A9\")"
    } else if p.chars().any(char::is_control) {
        "a control character"
    } else if p.chars().any(char::is_whitespace) {
        "a space"
    } else {
        return Ok(());
    };
    Err(format!("path {p:?} can never match: it contains {why}"))
}

fn valid_rule_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

const METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE",
];

fn check_rule(r: RawRule, defaults: &Policy, earlier: &[Rule]) -> Result<Rule, String> {
    if !valid_rule_name(&r.name) {
        return Err(
            "name must be 1 to 64 characters from A-Z, a-z, 0-9, \"_\" and \"-\"".to_string(),
        );
    }
    if let Some(i) = earlier.iter().position(|e| e.name == r.name) {
        return Err(format!("duplicate rule name (also rule {})", i + 1));
    }
    let own = RawPolicy {
        algorithm: r.algorithm.clone(),
        deny: r.deny.clone(),
        error_page: r.error_page.clone(),
        on_redis_error: r.on_redis_error.clone(),
        mode: r.mode.clone(),
        region: r.region.clone(),
        count: r.count.clone(),
    };
    let policy = check_policy(&own, defaults).map_err(|(_, what)| what)?;

    if r.paths.is_empty() {
        return Err("paths must name at least one path".into());
    }
    let mut paths = Vec::new();
    for p in &r.paths {
        check_path_chars(p)?;
        paths.push(PathPattern::parse(p)?);
    }

    let mut methods = Vec::new();
    for m in &r.methods {
        let up = m.to_ascii_uppercase();
        if !METHODS.contains(&up.as_str()) {
            return Err(format!("unknown method {m:?}"));
        }
        methods.push(up);
    }

    let key = match &r.key {
        None => Key(vec![KeyKind::Ip]),
        Some(RawKey::One(text)) => Key(vec![parse_key(text)?]),
        Some(RawKey::Many(list)) => {
            if list.is_empty() {
                return Err("key must name at least one kind".into());
            }
            if list.len() > 4 {
                return Err("key may combine at most 4 kinds".into());
            }
            let mut kinds: Vec<KeyKind> = Vec::with_capacity(list.len());
            for text in list {
                let kind = parse_key(text)?;
                if kinds.contains(&kind) {
                    return Err(format!("key lists {text:?} twice"));
                }
                kinds.push(kind);
            }
            Key(kinds)
        }
    };
    let normalize = match r.normalize.as_deref().unwrap_or("none") {
        "none" => Normalize::None,
        "digits" => Normalize::Digits,
        "lowercase" => Normalize::Lowercase,
        "e164" => Normalize::E164(policy.region),
        other => {
            return Err(format!(
            "unknown normalize {other:?}, expected \"none\", \"digits\", \"lowercase\" or \"e164\""
        ))
        }
    };

    let cost_wanted = r.cost.unwrap_or(1);

    let algorithm = match policy.algorithm.as_str() {
        "token_bucket" => {
            if r.limit.is_some() || r.window.is_some() {
                return Err(
                    "limit and window do not apply to token_bucket (use rate and burst)".into(),
                );
            }
            let (rate, burst) = match (r.rate, r.burst) {
                (Some(rate), Some(burst)) => (rate, burst),
                (None, Some(_)) => return Err("token_bucket needs rate (tokens per second)".into()),
                (Some(_), None) => {
                    return Err("token_bucket needs burst (the bucket's capacity)".into())
                }
                (None, None) => return Err("token_bucket needs rate and burst".into()),
            };
            if !(rate.is_finite() && rate > 0.0 && rate <= MAX_RATE) {
                return Err(format!(
                    "rate must be greater than 0 and at most {MAX_RATE} (tokens per second), got {}",
                    number(rate)
                ));
            }
            let burst = u32::try_from(burst)
                .ok()
                .filter(|b| *b <= MAX_LIMIT)
                .and_then(NonZeroU32::new)
                .ok_or_else(|| format!("burst must be between 1 and {MAX_LIMIT}, got {burst}"))?;
            // Every time the bucket's script derives (its TTL, a wait) is at
            // most burst / rate: bounding it keeps them whole milliseconds
            // that Redis takes as integers.
            let max_secs = MAX_WINDOW.as_secs_f64();
            // (A hair of slack, so the least rate the message names is accepted
            // when written back despite float rounding.)
            if f64::from(burst.get()) / rate > max_secs * (1.0 + 1e-9) {
                return Err(format!(
                    "a bucket of {burst} refilling at rate {} per second needs more than {} to refill from empty; rate must be at least {} (burst / {} seconds)",
                    number(rate),
                    amount_of_time(MAX_WINDOW),
                    number(f64::from(burst.get()) / max_secs),
                    MAX_WINDOW.as_secs()
                ));
            }
            Algorithm::TokenBucket { rate, burst }
        }
        window_kind => {
            if r.rate.is_some() || r.burst.is_some() {
                return Err(format!(
                    "rate and burst apply only to token_bucket, not {window_kind}"
                ));
            }
            let (limit, window) = match (r.limit, r.window.as_deref()) {
                (Some(limit), Some(window)) => (limit, window),
                (None, Some(_)) => return Err(format!("{window_kind} needs limit")),
                (Some(_), None) => return Err(format!("{window_kind} needs window")),
                (None, None) => return Err(format!("{window_kind} needs limit and window")),
            };
            let limit = u32::try_from(limit)
                .ok()
                .filter(|l| *l <= MAX_LIMIT)
                .and_then(NonZeroU32::new)
                .ok_or_else(|| format!("limit must be between 1 and {MAX_LIMIT}, got {limit}"))?;
            let window = duration_setting(window, MAX_WINDOW).map_err(|w| w.named("window"))?;
            if window_kind == "fixed_window" {
                Algorithm::FixedWindow { limit, window }
            } else {
                Algorithm::SlidingWindow { limit, window }
            }
        }
    };

    // Units one request takes: 1 ..= the rule's limit or burst.
    let quota = algorithm.quota();
    let cost = u32::try_from(cost_wanted)
        .ok()
        .filter(|c| (1..=quota).contains(c))
        .ok_or_else(|| {
            let of = match algorithm {
                Algorithm::TokenBucket { .. } => "burst",
                _ => "limit",
            };
            format!("cost must be between 1 and {quota} (the rule's {of}), got {cost_wanted}")
        })?;

    let description = match r.description {
        Some(d) if !d.trim().is_empty() => d.trim().to_string(),
        _ => describe(&algorithm, cost, &key),
    };

    let rule = Rule {
        description,
        name: r.name,
        path_text: r.paths,
        paths,
        methods,
        key,
        normalize,
        algorithm,
        cost,
        deny: policy.deny,
        error_page: policy.error_page,
        on_redis_error: policy.on_redis_error,
        mode: policy.mode,
        count: policy.count,
    };
    // A browser sent to the error page would be sent there again, forever.
    if rule.deny == Deny::Redirect && rule.matches("GET", &rule.error_page) {
        return Err(format!(
            "deny = \"redirect\" sends denied requests to error_page {:?}, which this rule's paths and methods cover too (a loop); leave the error page out of paths, set another error_page, or use deny = \"status\"",
            rule.error_page
        ));
    }
    Ok(rule)
}

/// A rule in human words: "at most 5 requests per 10 seconds for your address".
fn describe(algorithm: &Algorithm, cost: u32, key: &Key) -> String {
    let whose = key
        .kinds()
        .iter()
        .map(|k| match k {
            KeyKind::Ip => "from your address".to_string(),
            KeyKind::Session => "for your account".to_string(),
            KeyKind::Global => "for everyone together".to_string(),
            KeyKind::Path => "for this page".to_string(),
            KeyKind::Header(n) | KeyKind::Query(n) | KeyKind::Form(n) => format!("for each {n}"),
        })
        .collect::<Vec<_>>()
        .join(" ");
    let per = |n: u32| {
        if cost > 1 {
            format!("{n} units (this request takes {cost})")
        } else if n == 1 {
            "1 request".to_string()
        } else {
            format!("{n} requests")
        }
    };
    match algorithm {
        Algorithm::SlidingWindow { limit, window } | Algorithm::FixedWindow { limit, window } => {
            format!(
                "at most {} per {} {whose}",
                per(limit.get()),
                human_duration(*window)
            )
        }
        Algorithm::TokenBucket { rate, burst } => format!(
            "bursts of at most {}, then {rate} per second {whose}",
            per(burst.get())
        ),
    }
}

/// "10 seconds", "minute", "10 minutes", "hour", "1500 ms".
pub fn human_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (one, many, size) in [
        ("day", "days", 86_400_000),
        ("hour", "hours", 3_600_000),
        ("minute", "minutes", 60_000),
        ("second", "seconds", 1000),
    ] {
        if ms >= size && ms.is_multiple_of(size) {
            let n = ms / size;
            return if n == 1 {
                one.to_string()
            } else {
                format!("{n} {many}")
            };
        }
    }
    format!("{ms} ms")
}

fn parse_key(text: &str) -> Result<KeyKind, String> {
    let named = |n: &str, make: fn(String) -> KeyKind| -> Result<KeyKind, String> {
        if n.is_empty()
            || n.len() > 128
            || !n
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.[]".contains(&b))
        {
            Err(format!("key {text:?}: the name after the colon must be 1 to 128 characters from A-Z, a-z, 0-9, \"-\", \"_\", \".\", \"[\" and \"]\""))
        } else {
            Ok(make(n.to_string()))
        }
    };
    match text {
        "ip" => Ok(KeyKind::Ip),
        "global" => Ok(KeyKind::Global),
        "path" => Ok(KeyKind::Path),
        "session" => Ok(KeyKind::Session),
        _ => match text.split_once(':') {
            Some(("header", n)) => named(n, |n| KeyKind::Header(n.to_ascii_lowercase())),
            Some(("query", n)) => named(n, KeyKind::Query),
            Some(("form", n)) => named(n, KeyKind::Form),
            _ => Err(format!(
                "unknown key {text:?}, expected \"ip\", \"global\", \"path\", \"session\", \"header:NAME\", \"query:NAME\" or \"form:NAME\""
            )),
        },
    }
}

/// Parses `"250ms"`, `"10s"`, `"1m"`, `"10m"`, `"1h"`, `"1d"`. A number too
/// large to count in milliseconds is refused, never wrapped.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    match parse_duration_ms(text) {
        Ok(ms) => Ok(Duration::from_millis(ms)),
        Err(DurationError::Invalid) => Err(invalid_duration(text)),
        Err(DurationError::TooLong) => Err(format!("duration {text:?} is too long")),
    }
}

/// Why a duration did not parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DurationError {
    /// Not a whole number and a unit.
    Invalid,
    /// More milliseconds than a u64 holds.
    TooLong,
}

fn invalid_duration(text: &str) -> String {
    format!(
        "invalid duration {text:?}: expected a whole number followed by ms, s, m, h or d, like \"250ms\" or \"10s\""
    )
}

fn parse_duration_ms(text: &str) -> Result<u64, DurationError> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit())
        .ok_or(DurationError::Invalid)?;
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(DurationError::Invalid);
    }
    let size: u64 = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(DurationError::Invalid),
    };
    // Only digits are left, so a failed parse is an overflow.
    let n: u64 = num.parse().map_err(|_| DurationError::TooLong)?;
    n.checked_mul(size).ok_or(DurationError::TooLong)
}

/// Why a duration setting was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
enum SettingError {
    /// Not a duration at all: the parse error.
    Invalid(String),
    /// A duration outside the setting's range: "must be ...".
    Range(String),
}

impl SettingError {
    /// The message after the setting's name: `window: invalid duration ...`
    /// or `window must be at most 366 days, got "400d"`.
    fn named(&self, name: &str) -> String {
        match self {
            SettingError::Invalid(w) => format!("{name}: {w}"),
            SettingError::Range(w) => format!("{name} {w}"),
        }
    }

    /// The message alone (the setting is named by the place).
    fn text(self) -> String {
        match self {
            SettingError::Invalid(w) | SettingError::Range(w) => w,
        }
    }
}

/// A duration setting: greater than 0 and at most `max`.
fn duration_setting(text: &str, max: Duration) -> Result<Duration, SettingError> {
    let too_long = || {
        SettingError::Range(format!(
            "must be at most {}, got {text:?}",
            amount_of_time(max)
        ))
    };
    match parse_duration_ms(text) {
        Err(DurationError::Invalid) => Err(SettingError::Invalid(invalid_duration(text))),
        Err(DurationError::TooLong) => Err(too_long()),
        Ok(0) => Err(SettingError::Range("must be greater than 0".into())),
        Ok(ms) if Duration::from_millis(ms) > max => Err(too_long()),
        Ok(ms) => Ok(Duration::from_millis(ms)),
    }
}

/// A float for a message: plain when readable that way, else `1e-15`.
fn number(x: f64) -> String {
    if x == 0.0 || (1e-4..1e7).contains(&x.abs()) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

/// "366 days", "1 minute", "10 minutes", "1500 ms".
fn amount_of_time(d: Duration) -> String {
    let words = human_duration(d);
    if words.starts_with(|c: char| c.is_ascii_digit()) {
        words
    } else {
        format!("1 {words}")
    }
}

/// Formats a duration the way the config writes it (`10s`, `1m`, `250ms`).
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1000),
    ] {
        if ms >= size && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}

/// Parses a size: `"16KiB"`, `"1MiB"`, `"4096"`, `"64KB"`; 1 byte to 64MiB.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let bad = || format!("invalid size {text:?}: expected a number with B, KiB, MiB, KB or MB");
    let range = || format!("must be between 1 byte and 64MiB, got {text:?}");
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(bad());
    }
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1024,
        "MiB" => 1024 * 1024,
        "KB" | "kB" => 1000,
        "MB" => 1_000_000,
        _ => return Err(bad()),
    };
    // Only digits are left, so a failed parse is an overflow.
    let n: u64 = num.parse().map_err(|_| range())?;
    let size = n.checked_mul(mult).ok_or_else(range)?;
    if size == 0 || size > 64 * 1024 * 1024 {
        return Err(range());
    }
    usize::try_from(size).map_err(|_| range())
}

/// Cluster and Sentinel settings: consistent with each other (a file that
/// names both, or Sentinels without the master's name, is refused rather
/// than half used). Errors name the key.
fn check_topology(
    cluster: &[String],
    sentinel: &[String],
    master: &str,
) -> Result<(), (&'static str, String)> {
    if !cluster.is_empty() && !sentinel.is_empty() {
        return Err((
            "[redis] cluster",
            "cluster and sentinel cannot both be set: Redis is either a Cluster or a master watched by Sentinels".into(),
        ));
    }
    if !sentinel.is_empty() && master.is_empty() {
        return Err((
            "[redis] sentinel",
            "sentinel needs sentinel_master, the name the Sentinels monitor the master under"
                .into(),
        ));
    }
    if !master.is_empty() && sentinel.is_empty() {
        return Err((
            "[redis] sentinel_master",
            "is set but sentinel lists no Sentinel servers".into(),
        ));
    }
    if master.len() > 256 || master.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err((
            "[redis] sentinel_master",
            format!("must be a name without spaces or control characters, got {master:?}"),
        ));
    }
    Ok(())
}

/// `host:port`: an IPv4 address, a bracketed IPv6 address or a host name,
/// then a port 0-65535 (0 picks a free one).
fn check_bind(text: &str) -> Result<String, String> {
    let bad = || {
        format!(
            "{text:?} is not host:port (an IP address, [IPv6] or host name, then a port from 0 to 65535)"
        )
    };
    let (host, port) = text.rsplit_once(':').ok_or_else(bad)?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) || port.parse::<u16>().is_err()
    {
        return Err(bad());
    }
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => host.parse::<std::net::Ipv4Addr>().is_ok() || is_host_name(host),
    };
    if host_ok {
        Ok(text.to_string())
    } else {
        Err(bad())
    }
}

/// A DNS host name: dot-separated labels of letters, digits and inner
/// hyphens, the last one not all digits (that would be a bad IPv4 address).
fn is_host_name(host: &str) -> bool {
    let labels: Vec<&str> = host.strip_suffix('.').unwrap_or(host).split('.').collect();
    (1..=253).contains(&host.len())
        && labels.iter().all(|l| {
            (1..=63).contains(&l.len())
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
        && labels
            .last()
            .is_some_and(|l| !l.bytes().all(|b| b.is_ascii_digit()))
}

fn check_redis_url(text: &str) -> Result<String, String> {
    redis::Client::open(text)
        .map(|_| text.to_string())
        .map_err(|e| format!("{text:?} is not a Redis URL ({e})"))
}

/// An I/O error in words, without the "(os error N)" suffix.
pub fn io_words(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error") {
        Some(at) => text[..at].to_string(),
        None => text,
    }
}

/// Turns a TOML or schema error into `FILE: line L, column C: WHAT`.
fn toml_error(file: &str, text: &str, e: &toml::de::Error) -> ConfigError {
    let place = match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!("line {line}, column {column}")
        }
        None => String::new(),
    };
    let what = e
        .message()
        .trim()
        .replace('`', "\"")
        .lines()
        .collect::<Vec<_>>()
        .join("; ");
    ConfigError {
        file: file.to_string(),
        place,
        what,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse_duration("1d").unwrap(), Duration::from_secs(86400));
        for bad in ["", "10", "s", "1.5s", "-1s", "10x", "10 s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(format_duration(Duration::from_secs(600)), "10m");
        assert_eq!(format_duration(Duration::from_millis(1500)), "1500ms");
    }

    #[test]
    fn durations_that_overflow_are_refused_not_wrapped() {
        assert!(parse_duration("213503982335d").is_err());
        assert!(parse_duration("99999999999999999999999ms").is_err());
        assert_eq!(
            parse_duration("18446744073709551615ms").unwrap(),
            Duration::from_millis(u64::MAX)
        );
        assert_eq!(
            duration_setting("213503982335d", MAX_WINDOW),
            Err(SettingError::Range(
                "must be at most 366 days, got \"213503982335d\"".into()
            ))
        );
        assert_eq!(duration_setting("366d", MAX_WINDOW).unwrap(), MAX_WINDOW);
        assert_eq!(
            duration_setting("0s", MAX_WINDOW),
            Err(SettingError::Range("must be greater than 0".into()))
        );
    }

    #[test]
    fn error_pages() {
        for good in ["/err", "/errors/rate-limited", "/a:b@c/~x_y.z", "/err/"] {
            assert_eq!(check_error_page(good), Ok(()), "{good}");
        }
        for bad in [
            "", "err", "//x", "/a//b", "/a/./b", "/a/..", "/err?x", "/err#x", "/e%72r", "/e r",
            "/e\tr", "/\u{e9}", "/\"x\"", "/<x>",
        ] {
            assert!(check_error_page(bad).is_err(), "{bad:?}");
        }
        assert!(check_error_page(&format!("/{}", "a".repeat(MAX_ERROR_PAGE))).is_err());
    }

    #[test]
    fn binds() {
        for good in [
            "127.0.0.1:8080",
            "0.0.0.0:0",
            "[::1]:80",
            "localhost:8080",
            "web-1.example.:443",
        ] {
            assert!(check_bind(good).is_ok(), "{good}");
        }
        for bad in [
            "127.0.0.1",
            ":80",
            "999.1.1.1:80",
            "::1:80",
            "[::1]",
            "host:+80",
            "host:65536",
            "a b:80",
            "-x:80",
        ] {
            assert!(check_bind(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn redirect_rule_may_cover_its_error_page_only_for_other_methods() {
        let toml = |methods: &str, deny: &str| {
            format!(
                "[[rule]]\nname = \"r\"\npaths = [\"/*\"]\nmethods = {methods}\nlimit = 1\nwindow = \"1s\"\ndeny = \"{deny}\"\n"
            )
        };
        let parse = |t: String| Config::parse(&t, Path::new("t.toml"));
        assert!(parse(toml("[]", "redirect")).is_err());
        assert!(parse(toml("[\"GET\"]", "redirect")).is_err());
        assert!(parse(toml("[\"POST\"]", "redirect")).is_ok());
        assert!(parse(toml("[]", "status")).is_ok());
    }

    #[test]
    fn new_keys_have_their_defaults() {
        let config = Config::parse("", Path::new("t.toml")).unwrap();
        assert_eq!(config.server.body_timeout, Duration::from_secs(10));
        assert!(config.limiter.deny_cache);
        assert_eq!(config.limiter.breaker, Duration::from_secs(1));
        assert!(config.redis.sentinel.is_empty());
        assert_eq!(config.redis.sentinel_master, "");
        assert_eq!(config.redis.pool_size, 16);
        assert!(config.redis.pool_size >= min_pool_size());
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("16KiB").unwrap(), 16384);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert!(parse_size("16XB").is_err());
        assert!(parse_size("0").is_err());
    }

    #[test]
    fn cidrs() {
        let net = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(net.contains("10.1.2.3".parse().unwrap()));
        assert!(net.contains("::ffff:10.1.2.3".parse().unwrap()));
        assert!(!net.contains("11.0.0.1".parse().unwrap()));
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("1.2.3.4".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.0/33").is_none());
        assert!(Cidr::parse("10.0.0/8").is_none());
        assert!(Cidr::parse("fd00::/8")
            .unwrap()
            .contains("fd12::1".parse().unwrap()));
    }

    fn rules(toml: &str) -> Result<Vec<Rule>, String> {
        Config::parse(toml, Path::new("t.toml"))
            .map(|c| c.rules)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn keys_regions_and_counts() {
        let r = rules(
            "[defaults]\nregion = \"gb\"\ncount = \"failures\"\n[[rule]]\nname = \"a\"\npaths = [\"/a\"]\nkey = [\"form:phone\", \"ip\"]\nnormalize = \"e164\"\nlimit = 1\nwindow = \"1m\"\n",
        )
        .unwrap();
        assert_eq!(
            r[0].key,
            Key(vec![KeyKind::Form("phone".into()), KeyKind::Ip])
        );
        assert_eq!(r[0].key.to_string(), "[\"form:phone\", \"ip\"]");
        assert_eq!(
            r[0].normalize,
            Normalize::E164(Region::parse("GB").unwrap())
        );
        assert_eq!(r[0].count, Count::Failures);
        let base = "[[rule]]\nname = \"a\"\npaths = [\"/a\"]\nlimit = 1\nwindow = \"1m\"\n";
        for (extra, says) in [
            ("region = \"XX\"\n", "unknown region \"XX\""),
            ("count = \"some\"\n", "unknown count \"some\""),
            ("key = []\n", "key must name at least one kind"),
            ("key = [\"ip\", \"ip\"]\n", "key lists \"ip\" twice"),
            ("key = [\"ip\", \"nope\"]\n", "unknown key \"nope\""),
            ("normalize = \"phone\"\n", "unknown normalize \"phone\""),
        ] {
            let err = rules(&format!("{base}{extra}")).unwrap_err();
            assert!(err.contains(says), "{extra}: {err}");
        }
        let err = rules(&format!("[defaults]\nregion = \"Mars\"\n{base}")).unwrap_err();
        assert!(err.contains("[defaults] region"), "{err}");
    }
}
