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

use crate::filter::route::PathPattern;
use crate::limit::Algorithm;

/// Largest `limit` a window rule may have.
pub const MAX_LIMIT: u32 = 100_000;

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
}

/// `[redis]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRedis {
    /// `redis://host:port/db`
    pub url: Option<String>,
    /// Seed nodes of a Redis Cluster.
    pub cluster: Vec<String>,
    /// Sentinel nodes that watch the master.
    pub sentinel: Vec<String>,
    /// The name the Sentinels know the master by.
    pub sentinel_master: Option<String>,
    /// Connections in the r2d2 pool.
    pub pool_size: Option<u32>,
    /// Bound on connect, checkout and each command.
    pub timeout: Option<String>,
    /// First component of every key.
    pub key_prefix: Option<String>,
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
    /// Key kind.
    pub key: Option<String>,
    /// `none` | `digits` | `lowercase`
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
    /// `[[rule]]`, with `[defaults]` applied.
    pub rules: Vec<Rule>,
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
}

/// `[redis]`, checked.
#[derive(Debug, Clone)]
pub struct RedisConfig {
    /// Single-server URL.
    pub url: String,
    /// Cluster seed URLs (non-empty = cluster mode).
    pub cluster: Vec<String>,
    /// Sentinel URLs (non-empty = Sentinel mode).
    pub sentinel: Vec<String>,
    /// The master's name at the Sentinels (set when `sentinel` is).
    pub sentinel_master: String,
    /// Pool size.
    pub pool_size: u32,
    /// Bound on connect, pool checkout and each command.
    pub timeout: Duration,
    /// First component of every key.
    pub key_prefix: String,
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
    /// The client address (CONTRACT 3.5).
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

/// How a header/query/form value is normalized before it becomes a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Normalize {
    /// As sent (after percent-decoding).
    None,
    /// Only the ASCII digits are kept (phone numbers).
    Digits,
    /// Lower-cased and trimmed (e-mail addresses, user names).
    Lowercase,
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
    pub key: KeyKind,
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
        let server = ServerConfig {
            bind,
            workers: s.workers.unwrap_or(0),
            trusted_proxies,
            max_form,
            secret: s.secret.unwrap_or_default(),
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
        if !sentinel.is_empty() && sentinel_master.is_empty() {
            return Err(err(
                "[redis] sentinel_master",
                "is required with sentinel: the name the Sentinels know the master by".into(),
            ));
        }
        if !sentinel.is_empty() && !cluster.is_empty() {
            return Err(err(
                "[redis] sentinel",
                "cannot be used together with cluster: list either cluster seeds or Sentinels"
                    .into(),
            ));
        }
        let pool_size = r.pool_size.unwrap_or(16);
        if !(1..=1024).contains(&pool_size) {
            return Err(err(
                "[redis] pool_size",
                format!("must be between 1 and 1024, got {pool_size}"),
            ));
        }
        let timeout = parse_duration(r.timeout.as_deref().unwrap_or("250ms"))
            .map_err(|w| err("[redis] timeout", w))?;
        if timeout.is_zero() {
            return Err(err("[redis] timeout", "must be greater than 0".into()));
        }
        let key_prefix = r.key_prefix.unwrap_or_else(|| "floodgate".into());
        if key_prefix.is_empty() || key_prefix.contains(char::is_whitespace) {
            return Err(err(
                "[redis] key_prefix",
                "must be non-empty and without spaces".into(),
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
            rules,
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
}

impl Policy {
    fn builtin() -> Policy {
        Policy {
            algorithm: "sliding_window".into(),
            deny: Deny::Redirect,
            error_page: "/err".into(),
            on_redis_error: OnRedisError::Allow,
            mode: Mode::Enforce,
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
        if !e.starts_with('/') || e.starts_with("//") || e.contains(['?', '#', ' ']) {
            return Err((
                "error_page",
                format!("{e:?} must be a local path starting with \"/\", without query"),
            ));
        }
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
    Ok(p)
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
    };
    let policy = check_policy(&own, defaults).map_err(|(_, what)| what)?;

    if r.paths.is_empty() {
        return Err("paths must name at least one path".into());
    }
    let mut paths = Vec::new();
    for p in &r.paths {
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

    let key = parse_key(r.key.as_deref().unwrap_or("ip"))?;
    let normalize = match r.normalize.as_deref().unwrap_or("none") {
        "none" => Normalize::None,
        "digits" => Normalize::Digits,
        "lowercase" => Normalize::Lowercase,
        other => {
            return Err(format!(
                "unknown normalize {other:?}, expected \"none\", \"digits\" or \"lowercase\""
            ))
        }
    };

    let cost = match r.cost {
        None => 1,
        Some(c) if c >= 1 && c <= i64::from(MAX_LIMIT) => c as u32,
        Some(c) => return Err(format!("cost must be at least 1, got {c}")),
    };

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
            if !(rate.is_finite() && rate > 0.0 && rate <= 1_000_000.0) {
                return Err(format!(
                    "rate must be greater than 0 (tokens per second), got {rate}"
                ));
            }
            let burst = u32::try_from(burst)
                .ok()
                .filter(|b| *b <= MAX_LIMIT)
                .and_then(NonZeroU32::new)
                .ok_or_else(|| format!("burst must be between 1 and {MAX_LIMIT}, got {burst}"))?;
            if cost > burst.get() {
                return Err(format!("cost {cost} is more than burst {burst}"));
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
            let window = parse_duration(window).map_err(|w| format!("window: {w}"))?;
            if window.is_zero() {
                return Err("window must be greater than 0".into());
            }
            if window > Duration::from_secs(366 * 86_400) {
                return Err("window must be at most 366 days".into());
            }
            if cost > limit.get() {
                return Err(format!("cost {cost} is more than limit {limit}"));
            }
            if window_kind == "fixed_window" {
                Algorithm::FixedWindow { limit, window }
            } else {
                Algorithm::SlidingWindow { limit, window }
            }
        }
    };

    let description = match r.description {
        Some(d) if !d.trim().is_empty() => d.trim().to_string(),
        _ => describe(&algorithm, cost, &key),
    };

    Ok(Rule {
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
    })
}

/// A rule in human words: "at most 5 requests per 10 seconds for your address".
fn describe(algorithm: &Algorithm, cost: u32, key: &KeyKind) -> String {
    let whose = match key {
        KeyKind::Ip => "from your address".to_string(),
        KeyKind::Session => "for your account".to_string(),
        KeyKind::Global => "for everyone together".to_string(),
        KeyKind::Path => "for this page".to_string(),
        KeyKind::Header(n) | KeyKind::Query(n) | KeyKind::Form(n) => format!("for each {n}"),
    };
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

/// Parses `"250ms"`, `"10s"`, `"1m"`, `"10m"`, `"1h"`, `"1d"`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || {
        format!(
            "invalid duration {text:?}: expected a whole number followed by ms, s, m, h or d, like \"250ms\" or \"10s\""
        )
    };
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (num, unit) = t.split_at(split);
    if num.is_empty() || num.len() > 12 {
        return Err(bad());
    }
    let n: u64 = num.parse().map_err(|_| bad())?;
    let ms = match unit {
        "ms" => n,
        "s" => n * 1000,
        "m" => n * 60_000,
        "h" => n * 3_600_000,
        "d" => n * 86_400_000,
        _ => return Err(bad()),
    };
    Ok(Duration::from_millis(ms))
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

/// Parses a size: `"16KiB"`, `"1MiB"`, `"4096"`, `"64KB"`.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let bad = || format!("invalid size {text:?}: expected a number with B, KiB, MiB, KB or MB");
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| bad())?;
    let mult = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1024,
        "MiB" => 1024 * 1024,
        "KB" | "kB" => 1000,
        "MB" => 1_000_000,
        _ => return Err(bad()),
    };
    let size = n.checked_mul(mult).ok_or_else(bad)?;
    if size == 0 || size > 64 * 1024 * 1024 {
        return Err(format!("{text:?}: must be between 1 byte and 64MiB"));
    }
    Ok(size)
}

fn check_bind(text: &str) -> Result<String, String> {
    match text.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
            Ok(text.to_string())
        }
        _ => Err(format!("{text:?} is not host:port")),
    }
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
}
