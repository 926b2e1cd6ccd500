//! The configuration file: a typed TOML schema, its validation and the
//! environment override of the Redis URL.
//!
//! Reading happens in two steps. The raw schema mirrors the file exactly
//! (unknown keys are refused with their line and column); then every value
//! is checked and rules become [`Rule`]s that cannot be invalid. Every
//! failure is a [`ConfigError`] whose `Display` is the one line
//! `FILE: WHERE: WHAT`.
//!
//! # One file, two readers
//!
//! The library reads `[redis]`, `[limiter]`, `[defaults]`, `[[rule]]` and the
//! filter's keys of `[server]` (`trusted_proxies`, `proxy_header`,
//! `max_form`). An application that keeps its own settings in the same file
//! implements [`AppConfig`]: it names its sections and its `[server]` keys,
//! and [`Config::parse_with`] returns its checked settings beside the
//! library's. A key that neither side names is refused, with its place:
//!
//! ```
//! use std::path::Path;
//! use floodgate_limiter::config::{AppConfig, Config, ConfigError};
//!
//! #[derive(Default, serde::Deserialize)]
//! #[serde(default)]
//! struct RawApp {
//!     greeting: RawGreeting,
//! }
//!
//! #[derive(Default, serde::Deserialize)]
//! #[serde(default, deny_unknown_fields)]
//! struct RawGreeting {
//!     text: Option<String>,
//! }
//!
//! struct Greeting(String);
//!
//! impl AppConfig for Greeting {
//!     const SECTIONS: &'static [&'static str] = &["greeting"];
//!     const SERVER_KEYS: &'static [&'static str] = &[];
//!     type Raw = RawApp;
//!     fn check(raw: RawApp, _file: &str) -> Result<Self, ConfigError> {
//!         Ok(Greeting(raw.greeting.text.unwrap_or_else(|| "hi".into())))
//!     }
//! }
//!
//! let text = "[greeting]\ntext = \"hello\"\n[limiter]\nbreaker = \"2s\"\n";
//! let (config, greeting) = Config::parse_with::<Greeting>(text, Path::new("app.toml"))?;
//! assert_eq!(greeting.0, "hello");
//! assert_eq!(config.limiter.breaker, std::time::Duration::from_secs(2));
//!
//! let err = Config::parse_with::<Greeting>("[greting]\n", Path::new("app.toml")).err();
//! assert!(err.unwrap().to_string().starts_with("app.toml: line 1, column 2: unknown field"));
//! # Ok::<(), ConfigError>(())
//! ```

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod check;
mod operator;
mod raw;

pub(crate) use self::check::check_redis_url;
pub(crate) use self::check::rules_from_raw;
#[cfg(feature = "e164")]
use self::check::{check_defaults, Inherited};
use self::check::{check_topology, duration_setting};
pub use self::operator::{operator_duration, AdminConfig};
pub(crate) use self::raw::*;
pub use crate::limiter::redis_config::RedisConfig;
use crate::limiter::LimiterOptions;
use crate::net::{Cidr, ProxyHeader};
#[cfg(feature = "e164")]
use crate::rule::Region;
use crate::rule::Rule;
#[cfg(test)]
use crate::units::parse_duration;
pub(crate) use crate::units::parse_size;
pub use crate::units::{format_duration, human_duration};
pub use crate::units::{MAX_LARGE_LIMIT, MAX_LIMIT, MAX_RATE, MAX_WINDOW};

use crate::units::{MAX_BREAKER, MAX_REDIS_TIMEOUT};

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

/// The library's part of a checked, usable configuration. Made by
/// [`Config::load`] or [`Config::parse`] only (non-exhaustive: a field
/// a feature adds, such as `region`, changes no code outside the crate).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Config {
    /// The file it came from (for messages and reloads).
    pub path: PathBuf,
    /// The filter's keys of `[server]`.
    pub server: ServerConfig,
    /// `[redis]`
    pub redis: RedisConfig,
    /// `[limiter]` (its `dispatch` is not in the file: the default, or
    /// `FLOODGATE_DISPATCH` when the limiter starts).
    pub limiter: LimiterOptions,
    /// `[[rule]]`, with `[defaults]` applied.
    pub rules: Vec<Rule>,
    /// `[defaults] region`: the region of phone numbers written without
    /// `+`, for an application that reads numbers the way the `e164` rules
    /// do (see [`rule::e164`](crate::rule::e164)). (The `e164` feature.)
    #[cfg(feature = "e164")]
    pub region: Region,
    /// `[admin]`: the operators' HTTP API.
    pub admin: AdminConfig,
}

/// The filter's keys of `[server]`, checked.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Proxies whose forwarding header is believed.
    pub trusted_proxies: Vec<Cidr>,
    /// The forwarding header those proxies write; the other is ignored.
    pub proxy_header: ProxyHeader,
    /// Largest form body read, in bytes.
    pub max_form: usize,
}

/// An application's own settings in the library's file: the sections and
/// `[server]` keys it reads, and how it checks them. See the
/// [module documentation](self) for an example.
pub trait AppConfig: Sized {
    /// Top-level tables the application reads, such as `"site"`.
    const SECTIONS: &'static [&'static str];
    /// Keys of `[server]` the application reads, such as `"bind"`.
    const SERVER_KEYS: &'static [&'static str];
    /// The application's sections as written. It is read from the whole
    /// file, so it must not refuse unknown keys at the top level or in
    /// `[server]` (the library does that, knowing both sides' keys); its
    /// own sections may use `#[serde(deny_unknown_fields)]`.
    type Raw: serde::de::DeserializeOwned;
    /// Checks the raw settings of `file`.
    fn check(raw: Self::Raw, file: &str) -> Result<Self, ConfigError>;
}

/// No application settings: every key besides the library's is refused.
impl AppConfig for () {
    const SECTIONS: &'static [&'static str] = &[];
    const SERVER_KEYS: &'static [&'static str] = &[];
    type Raw = serde::de::IgnoredAny;
    fn check(_: serde::de::IgnoredAny, _: &str) -> Result<(), ConfigError> {
        Ok(())
    }
}

impl Config {
    /// Reads, parses and checks `path`, then applies `FLOODGATE_REDIS_URL`
    /// from the environment; every key besides the library's is refused.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_with::<()>(path).map(|(config, ())| config)
    }

    /// [`Config::load`] for a file that also holds the settings `A` reads.
    pub fn load_with<A: AppConfig>(path: &Path) -> Result<(Config, A), ConfigError> {
        let (mut config, app) = Config::load_file_with::<A>(path)?;
        config.apply_env(|name| std::env::var(name).ok())?;
        Ok((config, app))
    }

    /// Reads, parses and checks `path` without looking at the environment.
    pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
        Config::load_file_with::<()>(path).map(|(config, ())| config)
    }

    /// [`Config::load_file`] for a file that also holds the settings `A` reads.
    pub fn load_file_with<A: AppConfig>(path: &Path) -> Result<(Config, A), ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            file: file.clone(),
            place: String::new(),
            what: format!("cannot read the file: {}", io_words(&e)),
        })?;
        Config::parse_with::<A>(&text, path)
    }

    /// Parses and checks TOML text said to come from `path`; every key
    /// besides the library's is refused.
    pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
        Config::parse_with::<()>(text, path).map(|(config, ())| config)
    }

    /// Parses and checks TOML text said to come from `path`, with the
    /// application's settings `A` beside the library's. The library's keys
    /// are checked first, so a key unknown to both sides is refused before
    /// `A` is read.
    pub fn parse_with<A: AppConfig>(text: &str, path: &Path) -> Result<(Config, A), ConfigError> {
        use serde::de::DeserializeSeed;
        let file = path.display().to_string();
        let seed = RawSeed {
            sections: A::SECTIONS,
            server: A::SERVER_KEYS,
        };
        let raw = toml::Deserializer::parse(text)
            .and_then(|d| seed.deserialize(d))
            .map_err(|e| toml_error(&file, text, &e))?;
        let mut config = Config::from_raw(raw, &file)?;
        config.path = path.to_path_buf();
        let app_raw: A::Raw = toml::from_str(text).map_err(|e| toml_error(&file, text, &e))?;
        let app = A::check(app_raw, &file)?;
        Ok((config, app))
    }

    /// Applies the environment override `FLOODGATE_REDIS_URL`; `get` reads
    /// one variable.
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let file = self.path.display().to_string();
        if let Some(url) = get("FLOODGATE_REDIS_URL").filter(|v| !v.is_empty()) {
            self.redis.url = check_redis_url(&url).map_err(|what| ConfigError {
                file: file.clone(),
                place: "FLOODGATE_REDIS_URL".into(),
                what,
            })?;
        }
        if let Some(token) = get("FLOODGATE_ADMIN_TOKEN").filter(|v| !v.is_empty()) {
            self.admin.token = Some(operator::check_token(token).map_err(|what| ConfigError {
                file,
                place: "FLOODGATE_ADMIN_TOKEN".into(),
                what,
            })?);
        }
        Ok(())
    }

    /// Checks every value of a parsed file.
    pub(crate) fn from_raw(raw: RawConfig, file: &str) -> Result<Config, ConfigError> {
        let err = |place: &str, what: String| ConfigError {
            file: file.to_string(),
            place: place.to_string(),
            what,
        };

        let s = raw.server;
        let mut trusted_proxies = Vec::new();
        for p in &s.trusted_proxies {
            trusted_proxies
                .push(Cidr::parse(p).map_err(|e| err("[server] trusted_proxies", e.to_string()))?);
        }
        let max_form = parse_size(s.max_form.as_deref().unwrap_or("16KiB"))
            .map_err(|w| err("[server] max_form", w))?;
        let server = ServerConfig {
            trusted_proxies,
            proxy_header: s.proxy_header.unwrap_or_default(),
            max_form,
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
        let timeout = duration_setting(r.timeout.as_deref().unwrap_or("250ms"), MAX_REDIS_TIMEOUT)
            .map_err(|w| err("[redis] timeout", w.text()))?;
        let redis = RedisConfig {
            url,
            cluster,
            sentinel,
            sentinel_master,
            pool_size: r.pool_size.unwrap_or(16),
            timeout,
            key_prefix: r.key_prefix.unwrap_or_else(|| "floodgate".into()),
        };
        if let Some((place, what)) = redis.refused() {
            return Err(err(place, what));
        }

        let l = raw.limiter;
        let limiter = LimiterOptions {
            deny_cache: l.deny_cache.unwrap_or(true),
            breaker: duration_setting(l.breaker.as_deref().unwrap_or("1s"), MAX_BREAKER)
                .map_err(|w| err("[limiter] breaker", w.text()))?,
            ..LimiterOptions::default()
        };
        #[cfg(feature = "e164")]
        let region = check_defaults(&raw.defaults, &Inherited::builtin())
            .map(|p| p.region)
            .map_err(|(key, what)| err(&format!("[defaults] {key}"), what))?;
        let rules = rules_from_raw(&raw.defaults, raw.rule, file)?;

        let admin = operator::check_admin(raw.admin).map_err(|(place, what)| err(place, what))?;
        Ok(Config {
            admin,
            path: PathBuf::from(file),
            server,
            redis,
            limiter,
            rules,
            #[cfg(feature = "e164")]
            region,
        })
    }
}

/// Checks a duration setting such as `"10s"`: greater than 0 and at most
/// `max`, with the library's messages ("must be at most 1 hour, got ...").
/// For an [`AppConfig`]'s own duration settings, as the axum example's.
pub fn duration_at_most(text: &str, max: Duration) -> Result<Duration, String> {
    duration_setting(text, max).map_err(|e| e.text())
}

/// An I/O error in words, without the "(os error N)" suffix.
pub(crate) fn io_words(e: &std::io::Error) -> String {
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
    use super::check::duration_setting;
    use super::*;
    use crate::rule::spec::check_error_page;
    use crate::units::SettingError;
    use std::time::Duration;

    #[test]
    fn debug_output_hides_redis_passwords() {
        let config = Config::parse(
            "[redis]\nurl = \"redis://me:pa55word@localhost:6379/0\"\n",
            Path::new("x.toml"),
        )
        .unwrap();
        let shown = format!("{config:?}");
        assert!(!shown.contains("pa55word"), "{shown}");
        assert!(shown.contains("redis://me:***@localhost:6379/0"), "{shown}");
        let raw: RawRedis = toml::from_str("url = \"redis://:pa55word@h/0\"\n").unwrap();
        let shown = format!("{raw:?}");
        assert!(!shown.contains("pa55word"), "{shown}");
        // Nor does the message that refuses a URL.
        let refused = Config::parse(
            "[redis]\nurl = \"redis://me:pa55word@localhost:port/0\"\n",
            Path::new("x.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(refused.contains("is not a Redis URL"), "{refused}");
        assert!(!refused.contains("pa55word"), "{refused}");
    }

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
        assert!(
            check_error_page(&format!("/{}", "a".repeat(crate::units::MAX_ERROR_PAGE))).is_err()
        );
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
        assert!(config.limiter.deny_cache);
        assert_eq!(config.limiter.breaker, Duration::from_secs(1));
        assert!(config.redis.sentinel.is_empty());
        assert_eq!(config.redis.sentinel_master, "");
        assert_eq!(config.redis.pool_size, 16);
        assert!(config.redis.pool_size >= crate::units::min_pool_size());
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
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("10.0.0/8").is_err());
        assert!(Cidr::parse("::/129")
            .unwrap_err()
            .to_string()
            .contains("at most 128"));
        assert!(Cidr::parse("10.0.0.0/x")
            .unwrap_err()
            .to_string()
            .contains("a number"));
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
    #[cfg(feature = "e164")]
    fn keys_regions_and_counts() {
        use crate::rule::{Count, Key, KeyKind, Normalize};
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
            ("count = \"some\"\n", "line 6, column 9: unknown variant \"some\", expected \"all\" or \"failures\""),
            ("key = []\n", "key must name at least one kind"),
            ("key = [\"ip\", \"ip\"]\n", "key lists \"ip\" twice"),
            ("key = [\"ip\", \"nope\"]\n", "unknown key \"nope\""),
            ("normalize = \"phone\"\n", "unknown variant \"phone\", expected one of \"none\", \"digits\", \"lowercase\", \"e164\""),
        ] {
            let err = rules(&format!("{base}{extra}")).unwrap_err();
            assert!(err.contains(says), "{extra}: {err}");
        }
        let err = rules(&format!("[defaults]\nregion = \"Mars\"\n{base}")).unwrap_err();
        assert!(err.contains("[defaults] region"), "{err}");
    }

    /// A build without the `e164` feature reads the same keys, and refuses
    /// the ones that ask for phone numbers, naming the feature.
    #[test]
    #[cfg(not(feature = "e164"))]
    fn phone_numbers_need_the_e164_feature() {
        let base = "[[rule]]\nname = \"a\"\npaths = [\"/a\"]\nkey = \"header:x-id\"\nlimit = 1\nwindow = \"1m\"\n";
        assert_eq!(
            rules(&format!("{base}normalize = \"e164\"\n")).unwrap_err(),
            "t.toml: rule \"a\" (rule 1): normalize = \"e164\": this build of floodgate has \
             no phone number support (feature \"e164\")"
        );
        assert_eq!(
            rules(&format!("[defaults]\nregion = \"GB\"\n{base}")).unwrap_err(),
            "t.toml: [defaults] region: region = \"GB\": this build of floodgate has no phone \
             number support (feature \"e164\")"
        );
        assert_eq!(
            rules(&format!("{base}region = \"GB\"\n")).unwrap_err(),
            "t.toml: rule \"a\" (rule 1): region = \"GB\": this build of floodgate has no \
             phone number support (feature \"e164\")"
        );
        // The other normalizations need nothing optional.
        assert!(rules(&format!("{base}normalize = \"digits\"\n")).is_ok());
    }

    /// What an operator types names the key a request carrying it is
    /// counted under: a path percent-encoded as it is sent, and, for
    /// `find`, an address under a rule whose other kinds fall back to it.
    #[test]
    fn operators_values_name_what_requests_are_keyed_by() {
        let config = Config::parse(
            "[[rule]]\nname = \"p\"\npaths = [\"/p/*\"]\nkey = \"path\"\nlimit = 1\nwindow = \"1m\"\n\
             [[rule]]\nname = \"h\"\npaths = [\"/h\"]\nkey = \"header:x-id\"\nlimit = 1\nwindow = \"1m\"\n",
            Path::new("x.toml"),
        )
        .unwrap();
        let (p, h) = (&config.rules[0], &config.rules[1]);
        let key = crate::rule::identity_key(p, &["/p/%61%20b"], "fg", false).unwrap();
        assert_eq!(key, "fg:p:path:/p/a b");
        assert!(crate::rule::identity_key(p, &["/p/%ff"], "fg", false).is_err());
        let wholes = |rule, value| crate::rule::id_forms_of(rule, value).wholes;
        assert_eq!(wholes(h, "203.0.113.7"), ["203.0.113.7"]);
        let v6 = wholes(h, "2001:db8::1");
        assert_eq!(
            v6.len(),
            2,
            "the header's text and the address's /64: {v6:?}"
        );
        assert_eq!(wholes(p, "/p/x"), ["/p/x"]);
        // One kind's ID is the value as it is (hashed when long); only a
        // composite ID's parts are escaped.
        assert_eq!(wholes(h, "a|b%c"), ["a|b%c"]);
        let long = "k".repeat(65);
        assert_eq!(wholes(h, &long), [crate::rule::stored_id(&long)]);
        assert!(crate::rule::id_forms_of(h, "a").parts.is_empty());
    }
}
