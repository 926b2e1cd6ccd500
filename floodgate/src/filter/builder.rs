//! Building a [`Filter`] without the demo: from a TOML file or string, or
//! in code with a [`FilterBuilder`].

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::head::RequestHead;

use super::{Denial, Filter, FilterOptions, Limit, SetupError};

use crate::config::{Config, ConfigError};
use crate::limiter::{Limiter, LimiterOptions, RedisConfig};
use crate::metrics::Metrics;
use crate::net::{Cidr, ProxyHeader};
use crate::rule::Rule;
use crate::units::MAX_FORM;

/// The Redis settings of a file given to the builder (none: the defaults),
/// when code sets none: as for a file read whole
/// ([`Filter::from_toml_file`]), the environment's `FLOODGATE_REDIS_URL`
/// (`env_url`, when not empty) overrides the file's URL.
fn file_redis(
    file: Option<RedisConfig>,
    env_url: Option<String>,
    name: &str,
) -> Result<Option<RedisConfig>, ConfigError> {
    let Some(url) = env_url.filter(|v| !v.is_empty()) else {
        return Ok(file);
    };
    let mut redis = file.unwrap_or_else(default_redis);
    redis.url = crate::config::check_redis_url(&url).map_err(|what| ConfigError {
        file: name.to_string(),
        place: "FLOODGATE_REDIS_URL".into(),
        what,
    })?;
    Ok(Some(redis))
}

impl Filter {
    /// A filter with the rules and settings of a TOML file (the same file
    /// the `floodgate` command reads: `[redis]`, `[server] trusted_proxies`
    /// and `max_form`, `[defaults]`, `[[rule]]`). `FLOODGATE_REDIS_URL`
    /// overrides `[redis] url`.
    ///
    /// ```no_run
    /// let filter = floodgate_limiter::Filter::from_toml_file("floodgate.toml")?;
    /// # Ok::<(), floodgate_limiter::SetupError>(())
    /// ```
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<Filter, SetupError> {
        let config = Config::load(path.as_ref())?;
        Filter::from_config(&config)
    }

    /// As [`Filter::from_toml_file`], from text; `name` is the file name
    /// errors give.
    ///
    /// ```
    /// let err = floodgate_limiter::Filter::from_toml_str(
    ///     "[[rule]]\nname = \"x\"\npaths = [\"/x\"]\nlimit = 0\nwindow = \"1m\"\n",
    ///     "inline.toml",
    /// )
    /// .unwrap_err();
    /// assert_eq!(
    ///     err.to_string(),
    ///     "inline.toml: rule \"x\" (rule 1): limit must be between 1 and 100000, got 0"
    /// );
    /// ```
    pub fn from_toml_str(text: &str, name: &str) -> Result<Filter, SetupError> {
        let mut config = Config::parse(text, Path::new(name))?;
        config.apply_env(|n| std::env::var(n).ok())?;
        Filter::from_config(&config)
    }

    /// A filter for a checked [`Config`].
    pub fn from_config(config: &Config) -> Result<Filter, SetupError> {
        Filter::builder().config(config).build()
    }

    /// A builder, for a filter set up in code.
    ///
    /// ```no_run
    /// use floodgate_limiter::{Filter, Key, Limit};
    ///
    /// let filter = Filter::builder()
    ///     .redis_url("redis://127.0.0.1:6379/0")
    ///     .rule("/check", Limit::per_second(5).key(Key::ip()))
    ///     .build()?;
    /// # Ok::<(), floodgate_limiter::SetupError>(())
    /// ```
    pub fn builder() -> FilterBuilder {
        FilterBuilder::default()
    }
}

/// Builds a [`Filter`] in code. Every setting has the default the
/// configuration file has.
#[must_use]
#[derive(Default)]
pub struct FilterBuilder {
    redis: Option<RedisConfig>,
    redis_url: Option<String>,
    key_prefix: Option<String>,
    timeout: Option<Duration>,
    pool_size: Option<u32>,
    trusted_proxies: Vec<Cidr>,
    proxy_header: Option<ProxyHeader>,
    max_form: Option<usize>,
    json_content_type_required: Option<bool>,
    json_content_type: Option<Box<super::JsonContentType>>,
    rules: Vec<Rule>,
    limits: Vec<(String, Limit)>,
    toml: Option<Result<(String, String), ConfigError>>,
    limiter_set: bool,
    responder: Option<Box<super::DenialResponder>>,
    session: Option<Box<super::SessionLookup>>,
    denial_page: Option<Box<super::DenialPage>>,
    metrics: Option<Arc<Metrics>>,
    limiter_options: LimiterOptions,
    unguarded: Option<String>,
    bypass: Option<Box<super::Bypass>>,
}

impl FilterBuilder {
    /// Everything a checked configuration file sets: `[server]`
    /// `trusted_proxies`, `proxy_header` and `max_form`, `[redis]`,
    /// `[limiter]` and the rules (with `[defaults]` applied). What code sets
    /// besides (a denial page, a session lookup, metrics) still applies.
    pub fn config(mut self, config: &Config) -> Self {
        self.redis = Some(config.redis.clone());
        self.max_form = Some(config.server.max_form);
        self.limiter_options = LimiterOptions {
            deny_cache: config.limiter.deny_cache,
            breaker: config.limiter.breaker,
            ..LimiterOptions::default()
        };
        self.limiter_set = true;
        self.trusted_proxies
            .extend(config.server.trusted_proxies.iter().copied());
        self.proxy_header = Some(config.server.proxy_header);
        self.rules.extend(config.rules.iter().cloned());
        self
    }

    /// A path prefix that no rule guards and under which no request is
    /// counted (an operators' API, say): only what the router sends under
    /// it (`/admin/x`, not `/admin%2Fx`).
    pub fn unguarded(mut self, prefix: &str) -> Self {
        self.unguarded = Some(prefix.to_string());
        self
    }

    /// Requests for which `f` holds pass every rule of this filter, neither
    /// counted nor denied: a test suite's requests, a health checker. (One
    /// limit's own exception is [`Limit::skip_if`](crate::Limit::skip_if).)
    ///
    /// ```
    /// let filter = floodgate_limiter::Filter::builder()
    ///     .bypass(|req| req.header("x-load-test") == Some("k-7f3a"));
    /// # let _ = filter;
    /// ```
    pub fn bypass(mut self, f: impl Fn(&RequestHead) -> bool + Send + Sync + 'static) -> Self {
        self.bypass = Some(Box::new(f));
        self
    }

    /// Redis's URL (`redis://[:password@]host:port/db`); default
    /// `redis://127.0.0.1:6379/0`.
    pub fn redis_url(mut self, url: &str) -> Self {
        self.redis_url = Some(url.to_string());
        self
    }

    /// Every Redis setting at once (as `[redis]` in the file).
    pub fn redis(mut self, redis: RedisConfig) -> Self {
        self.redis = Some(redis);
        self
    }

    /// First component of every Redis key; default `floodgate`.
    pub fn key_prefix(mut self, prefix: &str) -> Self {
        self.key_prefix = Some(prefix.to_string());
        self
    }

    /// Bound on connect, pool checkout and each decision; default 250 ms.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Connections in the pool (at least 3); default 16.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = Some(size);
        self
    }

    /// A proxy (address or network) whose forwarding header (see
    /// [`FilterBuilder::proxy_header`]) is believed.
    pub fn trusted_proxy(mut self, proxy: Cidr) -> Self {
        self.trusted_proxies.push(proxy);
        self
    }

    /// The forwarding header the trusted proxies write (default
    /// `X-Forwarded-For`); the other one is never read.
    pub fn proxy_header(mut self, header: ProxyHeader) -> Self {
        self.proxy_header = Some(header);
        self
    }

    /// Largest form body read for `form:` keys; default 16 KiB, at most 64
    /// MiB (`build` refuses 0 or more).
    pub fn max_form(mut self, bytes: usize) -> Self {
        self.max_form = Some(bytes);
        self
    }

    /// What the app's `web::JsonConfig::content_type_required` is, so that
    /// `json:` and `body:` keys read exactly the bodies its handlers'
    /// `web::Json` reads. Default `true`, as actix's: a body is read as
    /// JSON when its `Content-Type` is a JSON type (subtype `json`, as
    /// `application/json` and `text/json`, or suffix `+json`) or one
    /// [`FilterBuilder::json_content_type`] accepts. `false` (an app that
    /// set `content_type_required(false)`): every body is read as JSON,
    /// whatever its `Content-Type` or none (an urlencoded form still goes
    /// to `body:` keys as a form); an empty body then names no one, any
    /// other that is not JSON gets `400` as `web::Json` refuses it.
    ///
    /// ```no_run
    /// use actix_web::{web, App};
    /// let filter = floodgate_limiter::Filter::builder()
    ///     .json_content_type_required(false)
    ///     .build()?;
    /// let app = App::new()
    ///     .app_data(web::JsonConfig::default().content_type_required(false))
    ///     .wrap(filter);
    /// # Ok::<(), floodgate_limiter::SetupError>(())
    /// ```
    pub fn json_content_type_required(mut self, required: bool) -> Self {
        self.json_content_type_required = Some(required);
        self
    }

    /// The predicate the app gives `web::JsonConfig::content_type`: more
    /// media types whose bodies `json:` and `body:` keys read as JSON, as
    /// its handlers' `web::Json` reads them. Default: none (JSON types
    /// only, as actix's default).
    ///
    /// ```no_run
    /// use actix_web::{mime, web, App};
    /// let plain = |m: mime::Mime| m == mime::TEXT_PLAIN;
    /// let filter = floodgate_limiter::Filter::builder().json_content_type(plain).build()?;
    /// let app = App::new()
    ///     .app_data(web::JsonConfig::default().content_type(plain))
    ///     .wrap(filter);
    /// # Ok::<(), floodgate_limiter::SetupError>(())
    /// ```
    pub fn json_content_type(
        mut self,
        accepts: impl Fn(mime::Mime) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.json_content_type = Some(Box::new(accepts));
        self
    }

    /// Guards `path` (`/exact`, `/prefix/*`, `/user/:id`) with `limit`.
    pub fn rule(mut self, path: &str, limit: Limit) -> Self {
        self.limits.push((path.to_string(), limit));
        self
    }

    /// Adds the settings of TOML text in the configuration file's format;
    /// `name` is the file name errors give (`FILE: WHERE: WHAT`). Every
    /// table it holds is used: `[defaults]` and `[[rule]]` (after the
    /// builder's own rules), `[server] trusted_proxies` (with the builder's
    /// own), `proxy_header` and `max_form`, `[redis]` (including
    /// `key_prefix`) and `[limiter]`. The server's own settings (`[server]
    /// bind`, `workers`, `secret`, `body_timeout`, `[sms]`, `[site]`) are
    /// refused, and so is a setting made both here and in code
    /// ([`FilterBuilder::key_prefix`] and a `[redis]` table, say): nothing
    /// given is silently left out.
    ///
    /// ```
    /// let err = floodgate_limiter::Filter::builder()
    ///     .toml_rules("[server]\nbind = \"0.0.0.0:80\"\n", "rules.toml")
    ///     .build()
    ///     .unwrap_err();
    /// assert!(err.to_string().starts_with("rules.toml: [server] bind: is a setting of the floodgate server"));
    /// ```
    pub fn toml_rules(mut self, text: &str, name: &str) -> Self {
        self.toml = Some(Ok((text.to_string(), name.to_string())));
        self
    }

    /// [`FilterBuilder::toml_rules`] with the text of a file (named by its
    /// path in errors), so that a filter set up by a file still takes a
    /// [`FilterBuilder::denial_responder`], a session lookup or limits
    /// made in code.
    ///
    /// ```no_run
    /// use floodgate_limiter::http::{Response, StatusCode};
    /// let filter = floodgate_limiter::Filter::builder()
    ///     .toml_file("limits.toml")
    ///     .denial_responder(|denial, _req| {
    ///         let mut res = Response::new(format!("slow down ({} s)\n", denial.retry_after));
    ///         *res.status_mut() = StatusCode::TOO_MANY_REQUESTS;
    ///         res
    ///     })
    ///     .build()?;
    /// # Ok::<(), floodgate_limiter::SetupError>(())
    /// ```
    pub fn toml_file(mut self, path: impl AsRef<Path>) -> Self {
        let path = path.as_ref();
        let name = path.display().to_string();
        self.toml = Some(match std::fs::read_to_string(path) {
            Ok(text) => Ok((text, name)),
            Err(e) => Err(ConfigError {
                file: name,
                place: String::new(),
                what: format!("cannot read the file: {}", crate::config::io_words(&e)),
            }),
        });
        self
    }

    /// The whole response to a denied request, in place of the 303 to the
    /// error page or the 429, as the `http` crate writes one (re-exported as
    /// [`floodgate_limiter::http`](crate::http)): the actix-web filter and
    /// the tower layer both send it.
    ///
    /// ```no_run
    /// use floodgate_limiter::http::{header, Response, StatusCode};
    /// let builder = floodgate_limiter::Filter::builder().denial_responder(|denial, _req| {
    ///     Response::builder()
    ///         .status(StatusCode::TOO_MANY_REQUESTS)
    ///         .header(header::CONTENT_TYPE, "application/json")
    ///         .body(format!(r#"{{"limit":"{}","wait":{}}}"#, denial.rule.name(), denial.retry_after))
    ///         .unwrap_or_default()
    /// });
    /// ```
    pub fn denial_responder(
        mut self,
        f: impl Fn(&Denial, &RequestHead) -> http::Response<String> + Send + Sync + 'static,
    ) -> Self {
        self.responder = Some(Box::new(f));
        self
    }

    /// The HTML body of a 429 for a browser (the response stays the
    /// filter's own), given the denial (rule, seconds to wait, banned).
    pub fn denial_page(mut self, f: impl Fn(&Denial) -> String + Send + Sync + 'static) -> Self {
        self.denial_page = Some(Box::new(f));
        self
    }

    /// Who is signed in, for [`Key::session`](crate::Key::session) rules: the account ID, or
    /// `None` (the request is then keyed by its address).
    pub fn session_lookup(
        mut self,
        f: impl Fn(&RequestHead) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.session = Some(Box::new(f));
        self
    }

    /// The denial cache, the breaker and how decisions travel to Redis
    /// (default: [`LimiterOptions::default`]).
    pub fn limiter_options(mut self, options: LimiterOptions) -> Self {
        self.limiter_options = options;
        self.limiter_set = true;
        self
    }

    /// Counters to record decisions in (default: the filter's own).
    pub fn metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Checks the rules, starts the dispatcher threads and builds the
    /// filter. Redis need not be up: decisions apply each rule's
    /// `on_redis_error` until it is.
    pub fn build(mut self) -> Result<Filter, SetupError> {
        let mut rules = std::mem::take(&mut self.rules);
        if let Some(toml) = self.toml.take() {
            let (text, name) = toml?;
            let given = super::text::read(&text, &name)?;
            let both = |place: &str, code: &str| {
                Err(SetupError::Config(ConfigError {
                    file: name.clone(),
                    place: place.to_string(),
                    what: format!("is set here and in code ({code}); set it in one place"),
                }))
            };
            let in_code = self.redis.is_some()
                || self.redis_url.is_some()
                || self.key_prefix.is_some()
                || self.timeout.is_some()
                || self.pool_size.is_some();
            if given.redis.is_some() && in_code {
                return both("[redis]", "a FilterBuilder Redis setting");
            }
            if !in_code {
                let env_url = std::env::var("FLOODGATE_REDIS_URL").ok();
                self.redis = file_redis(given.redis, env_url, &name)?;
            }
            if let Some(header) = given.proxy_header {
                if self.proxy_header.is_some() {
                    return both("[server] proxy_header", "FilterBuilder::proxy_header");
                }
                self.proxy_header = Some(header);
            }
            if let Some(max) = given.max_form {
                if self.max_form.is_some() {
                    return both("[server] max_form", "FilterBuilder::max_form");
                }
                self.max_form = Some(max);
            }
            if given.deny_cache.is_some() || given.breaker.is_some() {
                if self.limiter_set {
                    return both("[limiter]", "FilterBuilder::limiter_options");
                }
                if let Some(d) = given.deny_cache {
                    self.limiter_options.deny_cache = d;
                }
                if let Some(b) = given.breaker {
                    self.limiter_options.breaker = b;
                }
            }
            self.trusted_proxies.extend(given.trusted_proxies);
            // (Names the file shares with the builder's rules are refused below.)
            rules.extend(given.rules);
        }
        let mut redis = self.redis.unwrap_or_else(default_redis);
        if let Some(url) = self.redis_url {
            redis.url = url;
        }
        if let Some(p) = self.key_prefix {
            redis.key_prefix = p;
        }
        if let Some(t) = self.timeout {
            redis.timeout = t;
        }
        if let Some(n) = self.pool_size {
            redis.pool_size = n;
        }
        for (i, r) in rules.iter().enumerate() {
            if rules[..i].iter().any(|e| e.name == r.name) {
                return Err(SetupError::Limit(format!(
                    "{:?}: two rules have this name; give each its own",
                    r.name
                )));
            }
        }
        for (path, limit) in self.limits {
            let rule = limit
                .into_rule(Some(&path), &rules)
                .map_err(SetupError::Limit)?;
            rules.push(rule);
        }
        let max_form = self.max_form.unwrap_or(16 * 1024);
        if max_form == 0 || max_form > MAX_FORM {
            return Err(SetupError::Setting(format!(
                "max_form: must be between 1 byte and 64MiB, got {max_form} bytes"
            )));
        }
        let limiter = Arc::new(Limiter::new(&redis, self.limiter_options)?);
        let metrics = self.metrics.unwrap_or_default();
        let denial_page = self.denial_page.unwrap_or_else(|| {
            Box::new(|denial: &Denial| {
                let what = if denial.banned {
                    "You are blocked".to_string()
                } else {
                    format!("Too many requests: {}", super::deny::Html(&denial.rule.description))
                };
                format!(
                    "<!doctype html>\n<html lang=\"en\">\n<head><meta charset=\"utf-8\"><title>Too many requests</title></head>\n<body><p>{what}. Try again in {} s.</p></body>\n</html>\n",
                    denial.retry_after
                )
            })
        });
        Ok(Filter::new(
            rules,
            limiter,
            metrics,
            FilterOptions {
                trusted_proxies: self.trusted_proxies,
                proxy_header: self.proxy_header.unwrap_or_default(),
                max_form,
                json_content_type_required: self.json_content_type_required.unwrap_or(true),
                json_content_type: self.json_content_type,
                key_prefix: redis.key_prefix,
                denial_page,
                session: self.session,
                responder: self.responder,
                unguarded: self.unguarded,
                bypass: self.bypass,
            },
        ))
    }
}

fn default_redis() -> RedisConfig {
    RedisConfig {
        url: "redis://127.0.0.1:6379/0".into(),
        cluster: Vec::new(),
        sentinel: Vec::new(),
        sentinel_master: String::new(),
        pool_size: 16,
        timeout: Duration::from_millis(250),
        key_prefix: "floodgate".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_environments_redis_url_overrides_a_files() {
        let file = RedisConfig {
            url: "redis://10.0.0.1:6379/0".into(),
            ..default_redis()
        };
        let env = Some("redis://127.0.0.1:7000/2".to_string());
        let got = file_redis(Some(file.clone()), env.clone(), "f.toml").unwrap();
        assert_eq!(
            got.map(|r| r.url).as_deref(),
            Some("redis://127.0.0.1:7000/2")
        );
        // No [redis] table: the defaults, with the environment's URL.
        let got = file_redis(None, env, "f.toml").unwrap();
        assert_eq!(
            got.map(|r| r.url).as_deref(),
            Some("redis://127.0.0.1:7000/2")
        );
        // Unset or empty: the file's settings as they are.
        let kept = file_redis(Some(file.clone()), None, "f.toml").unwrap();
        assert_eq!(
            kept.map(|r| r.url).as_deref(),
            Some("redis://10.0.0.1:6379/0")
        );
        assert!(file_redis(None, Some(String::new()), "f.toml")
            .unwrap()
            .is_none());
        let err = file_redis(Some(file), Some("http://x".into()), "f.toml").unwrap_err();
        assert_eq!(
            (err.file.as_str(), err.place.as_str()),
            ("f.toml", "FLOODGATE_REDIS_URL")
        );
    }
}
