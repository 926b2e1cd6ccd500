//! The demo site's configuration: the library's sections of the file
//! ([`floodgate::config::Config`]) and the site's own, read from the same file.
//!
//! The site reads `[server]` `bind`, `workers`, `secret` and
//! `body_timeout`, `[sms]` and `[site]` (see [`floodgate::config::AppConfig`]);
//! the library reads the rest, and refuses a key that neither reads.

use std::path::Path;
use std::time::Duration;

pub use floodgate::config::ConfigError;
use floodgate::config::{duration_at_most, AppConfig};
pub use floodgate::config::{format_duration, human_duration};
use serde::Deserialize;

/// The Redis a process uses, for its startup line, without passwords: the
/// URL, the Cluster's seeds, or the master the Sentinels name.
pub fn redis_target(redis: &floodgate::config::RedisConfig) -> String {
    let plain = |urls: &[String]| -> String {
        let urls: Vec<String> = urls
            .iter()
            .map(|u| floodgate::limiter::without_password(u))
            .collect();
        urls.join(",")
    };
    if !redis.cluster.is_empty() {
        format!("cluster {}", plain(&redis.cluster))
    } else if !redis.sentinel.is_empty() {
        format!(
            "master {:?} via sentinel {}",
            redis.sentinel_master,
            plain(&redis.sentinel)
        )
    } else {
        floodgate::limiter::without_password(&redis.url)
    }
}

/// The refusal of an address the file at `file` names under `place` that
/// cannot be listened on (taken, or not this machine's): the file cannot
/// be used as it is, as any unusable setting (exit 2).
pub fn cannot_listen(file: &Path, place: &str, addr: &str, e: &std::io::Error) -> ConfigError {
    ConfigError {
        file: file.display().to_string(),
        place: place.to_string(),
        what: format!("cannot listen on {addr}: {e}"),
    }
}

/// Most actix worker threads (`[server] workers`); actix-server refuses more.
pub const MAX_WORKERS: usize = 512;

/// Longest `[server] body_timeout`.
pub const MAX_BODY_TIMEOUT: Duration = Duration::from_secs(3600);

/// The file used when neither `--config` nor `$FLOODGATE_CONFIG` names one.
pub const DEFAULT_PATH: &str = "config/default.toml";

/// A checked, usable configuration: the filter's and the site's.
#[derive(Debug, Clone)]
pub struct Config {
    /// The library's sections: `[redis]`, `[limiter]`, `[defaults]`,
    /// `[[rule]]` and the filter's keys of `[server]`.
    pub filter: floodgate::config::Config,
    /// The site's keys of `[server]`.
    pub server: ServerConfig,
    /// `[sms]`
    pub sms: SmsConfig,
    /// `[site]`
    pub site: SiteConfig,
}

/// The site's keys of `[server]`, checked. `Debug` shows whether a secret
/// is set, never the secret.
#[derive(Clone)]
pub struct ServerConfig {
    /// Address to listen on, `host:port`.
    pub bind: String,
    /// Worker threads; 0 = one per core.
    pub workers: usize,
    /// Key for cookies and CSRF (empty = random at each start).
    pub secret: String,
    /// A request body not fully received this long after its head gets
    /// `408` and the connection is closed.
    pub body_timeout: Duration,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("bind", &self.bind)
            .field("workers", &self.workers)
            .field("secret", &if self.secret.is_empty() { "" } else { "***" })
            .field("body_timeout", &self.body_timeout)
            .finish()
    }
}

/// `[sms]`, checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
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
    /// Whether `/dev/outbox` answers every client; `false`: loopback
    /// clients only (the client address behind trusted proxies), others
    /// get 404. Whoever reads the outbox reads everyone's codes.
    pub public_outbox: bool,
}

/// The site's part of the file as written. Its top level and `[server]`
/// let the library's keys through (the library refuses unknown ones).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct RawSite {
    server: RawServer,
    sms: RawSms,
    site: RawSiteSection,
}

#[derive(Default, Deserialize)]
#[serde(default)]
struct RawServer {
    bind: Option<String>,
    workers: Option<usize>,
    secret: Option<String>,
    body_timeout: Option<String>,
}

impl std::fmt::Debug for RawServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawServer")
            .field("bind", &self.bind)
            .field("workers", &self.workers)
            .field("secret", &self.secret.as_ref().map(|_| "***"))
            .field("body_timeout", &self.body_timeout)
            .finish()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawSms {
    provider: Option<SmsProvider>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawSiteSection {
    title: Option<String>,
    secure_cookies: Option<bool>,
    public_outbox: Option<bool>,
}

/// The site's settings, checked; [`Config`] puts them beside the library's.
#[derive(Debug, Clone)]
pub struct Site {
    server: ServerConfig,
    sms: SmsConfig,
    site: SiteConfig,
}

impl AppConfig for Site {
    const SECTIONS: &'static [&'static str] = &["sms", "site"];
    const SERVER_KEYS: &'static [&'static str] = &["bind", "workers", "secret", "body_timeout"];
    type Raw = RawSite;

    fn check(raw: RawSite, file: &str) -> Result<Site, ConfigError> {
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
        let body_timeout =
            duration_at_most(s.body_timeout.as_deref().unwrap_or("10s"), MAX_BODY_TIMEOUT)
                .map_err(|w| err("[server] body_timeout", w))?;
        Ok(Site {
            server: ServerConfig {
                bind,
                workers,
                secret: s.secret.unwrap_or_default(),
                body_timeout,
            },
            sms: SmsConfig {
                provider: raw.sms.provider.unwrap_or(SmsProvider::Outbox),
            },
            site: SiteConfig {
                title: raw.site.title.unwrap_or_else(|| "floodgate".into()),
                secure_cookies: raw.site.secure_cookies.unwrap_or(false),
                public_outbox: raw.site.public_outbox.unwrap_or(false),
            },
        })
    }
}

impl Config {
    fn join((filter, site): (floodgate::config::Config, Site)) -> Config {
        Config {
            filter,
            server: site.server,
            sms: site.sms,
            site: site.site,
        }
    }

    /// Reads, parses and checks `path`, then applies `FLOODGATE_BIND` and
    /// `FLOODGATE_REDIS_URL` from the environment.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let mut config = Config::load_file(path)?;
        config.apply_env(|name| std::env::var(name).ok())?;
        Ok(config)
    }

    /// Reads, parses and checks `path` without looking at the environment.
    pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
        floodgate::config::Config::load_file_with::<Site>(path).map(Config::join)
    }

    /// Parses and checks TOML text said to come from `path`.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        floodgate::config::Config::parse_with::<Site>(text, path).map(Config::join)
    }

    /// Applies the environment overrides `FLOODGATE_BIND` and
    /// `FLOODGATE_REDIS_URL`; `get` reads one variable.
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        if let Some(bind) = get("FLOODGATE_BIND").filter(|v| !v.is_empty()) {
            self.server.bind = check_bind(&bind).map_err(|what| ConfigError {
                file: self.filter.path.display().to_string(),
                place: "FLOODGATE_BIND".into(),
                what,
            })?;
        }
        self.filter.apply_env(get)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_hides_the_secret() {
        let config = Config::parse(
            "[server]\nsecret = \"hunter2-hunter2\"\n",
            Path::new("x.toml"),
        )
        .unwrap();
        let shown = format!("{config:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        let raw: RawSite = toml::from_str("[server]\nsecret = \"hunter2\"\n").unwrap();
        let shown = format!("{raw:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
    }

    #[test]
    fn body_timeout_defaults_to_ten_seconds() {
        let config = Config::parse("", Path::new("t.toml")).unwrap();
        assert_eq!(config.server.body_timeout, Duration::from_secs(10));
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
}
