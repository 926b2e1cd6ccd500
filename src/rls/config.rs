//! `[rls]`: where the service listens, where its descriptor files are, and
//! what it does without Redis. The file's `[redis]`, `[limiter]`, `[admin]`
//! and `[defaults]` are read by the library as for the site (what `[rls]`
//! does not set of `algorithm`, `on_redis_error`, shadow mode and `headers`
//! comes from `[defaults]`, as a site's rules inherit it); `[server]` and
//! `[[rule]]` are refused (they would not apply).

use std::path::{Path, PathBuf};

use floodgate::config::AppConfig;
use floodgate::config::ConfigError;
use floodgate::rule::Algorithm;
use floodgate::rule::HeaderDialect;
use serde::Deserialize;

/// What a call gets when Redis cannot decide it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// gRPC `UNAVAILABLE` (the proxy's `failure_mode_deny` decides).
    Error,
    /// `OK`.
    Allow,
    /// `OVER_LIMIT`.
    Deny,
    /// Decided by this process alone, with the same limits.
    Local,
}

impl OnError {
    /// As written in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            OnError::Error => "error",
            OnError::Allow => "allow",
            OnError::Deny => "deny",
            OnError::Local => "local",
        }
    }
}

/// `[rls]`, checked.
#[derive(Debug, Clone)]
pub struct Settings {
    /// gRPC address, `host:port`.
    pub bind: String,
    /// `/healthz`, `/readyz`, `/metrics` and the admin API, `host:port`.
    pub http_bind: String,
    /// The descriptor file or folder.
    pub descriptors: PathBuf,
    /// The algorithm of a `rate_limit` that names none.
    pub algorithm: String,
    /// Without Redis.
    pub on_redis_error: OnError,
    /// Every answer OK.
    pub shadow: bool,
    /// Which RateLimit fields go in `response_headers_to_add`.
    pub headers: HeaderDialect,
}

/// `[rls]` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawRls {
    bind: Option<String>,
    http_bind: Option<String>,
    descriptors: Option<String>,
    algorithm: Option<String>,
    on_redis_error: Option<OnError>,
    shadow: Option<bool>,
    headers: Option<HeaderDialect>,
}

/// The service's part of the file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawApp {
    rls: RawRls,
    server: Option<toml::Value>,
    rule: Option<toml::Value>,
    /// `[defaults]` (checked by the library): what `[rls]` inherits where
    /// it says nothing, as the site's rules inherit it.
    defaults: Option<toml::Table>,
}

impl AppConfig for Settings {
    const SECTIONS: &'static [&'static str] = &["rls"];
    const SERVER_KEYS: &'static [&'static str] = &[];
    type Raw = RawApp;

    fn check(raw: RawApp, file: &str) -> Result<Settings, ConfigError> {
        let err = |place: &str, what: String| ConfigError {
            file: file.to_string(),
            place: place.to_string(),
            what,
        };
        if raw.server.is_some() {
            return Err(err(
                "[server]",
                "floodgate rls does not use [server]; its listeners are [rls] bind and http_bind"
                    .into(),
            ));
        }
        if raw.rule.is_some() {
            return Err(err(
                "[[rule]]",
                "floodgate rls does not use [[rule]]; its limits are in the descriptor files of [rls] descriptors".into(),
            ));
        }
        let r = raw.rls;
        // What `[defaults]` says, for what `[rls]` leaves unsaid: its
        // algorithm, on_redis_error, mode (shadow) and headers mean for
        // every limit what they mean for every rule of the site.
        let inherited = |key: &str| raw.defaults.as_ref().and_then(|d| d.get(key)).cloned();
        let algorithm_default = inherited("algorithm").and_then(|v| v.as_str().map(String::from));
        let on_error_default =
            inherited("on_redis_error").and_then(|v| v.try_into::<OnError>().ok());
        let shadow_default = inherited("mode").map(|v| v.as_str() == Some("shadow"));
        let headers_default = inherited("headers").and_then(|v| v.try_into::<HeaderDialect>().ok());
        let bind = check_bind(r.bind.as_deref().unwrap_or("127.0.0.1:8081"))
            .map_err(|w| err("[rls] bind", w))?;
        let http_bind = check_bind(r.http_bind.as_deref().unwrap_or("127.0.0.1:8082"))
            .map_err(|w| err("[rls] http_bind", w))?;
        let descriptors = r.descriptors.unwrap_or_else(|| "config/rls".into());
        if descriptors.is_empty() {
            return Err(err(
                "[rls] descriptors",
                "must name a file or folder".into(),
            ));
        }
        let algorithm = r
            .algorithm
            .or(algorithm_default)
            .unwrap_or_else(|| "sliding_window".into());
        if !Algorithm::NAMES.contains(&algorithm.as_str()) {
            return Err(err(
                "[rls] algorithm",
                format!(
                    "unknown algorithm {algorithm:?}, expected one of {}",
                    Algorithm::NAMES.join(", ")
                ),
            ));
        }
        Ok(Settings {
            bind,
            http_bind,
            descriptors: PathBuf::from(descriptors),
            algorithm,
            on_redis_error: r
                .on_redis_error
                .or(on_error_default)
                .unwrap_or(OnError::Error),
            shadow: r.shadow.or(shadow_default).unwrap_or(false),
            headers: r.headers.or(headers_default).unwrap_or(HeaderDialect::None),
        })
    }
}

/// `host:port` with a port; a host name or an IP address.
fn check_bind(text: &str) -> Result<String, String> {
    let ok = text
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
    if ok {
        Ok(text.to_string())
    } else {
        Err(format!(
            "{text:?} is not host:port (an IP address, [IPv6] or host name, then a port from 0 to 65535)"
        ))
    }
}

/// A checked `floodgate rls` configuration: the library's sections and `[rls]`.
#[derive(Debug, Clone)]
pub struct RlsConfig {
    /// `[redis]`, `[limiter]`, `[admin]`, `[defaults]`.
    pub filter: floodgate::config::Config,
    /// `[rls]`.
    pub rls: Settings,
}

impl RlsConfig {
    /// Reads and checks `path`, then applies `FLOODGATE_REDIS_URL`.
    pub fn load(path: &Path) -> Result<RlsConfig, ConfigError> {
        // Refused before the library reads `[server]` (which would name
        // its own keys, as if they applied here).
        if let Some(table) = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.parse::<toml::Table>().ok())
        {
            let raw = RawApp {
                server: table.get("server").cloned(),
                rule: table.get("rule").cloned(),
                ..RawApp::default()
            };
            Settings::check(raw, &path.display().to_string())?;
        }
        let (mut filter, rls) = floodgate::config::Config::load_file_with::<Settings>(path)?;
        filter.apply_env(|name| std::env::var(name).ok())?;
        Ok(RlsConfig { filter, rls })
    }
}

/// Whether the TOML file at `path` is a `floodgate rls` configuration (it
/// has an `[rls]` table); `false` when it cannot be read or parsed (the
/// site's reader then says why).
pub fn is_rls_file(path: &Path) -> bool {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| t.parse::<toml::Table>().ok())
        .is_some_and(|t| t.contains_key("rls"))
}
