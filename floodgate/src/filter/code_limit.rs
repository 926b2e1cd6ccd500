//! Limits declared in code beside a handler ([`Limit`]), and the
//! middleware that applies them to a resource or scope ([`Filter::limit`]).

use std::time::Duration;

use crate::head::RequestHead;
use sha2::{Digest, Sha256};

use super::{Filter, SetupError};
use crate::rule::spec::{Amount, Defaults, RuleSpec, CODE_DENY};
use crate::rule::Algorithm;
use crate::rule::{
    Count, Deny, HeaderDialect, Key, KeyKind, Mode, Normalize, OnMissingKey, OnRedisError, Rule,
    Skip,
};
use crate::units::written_duration;

impl Filter {
    /// Middleware that applies `limit` to every request it wraps: `.wrap()`
    /// it on a `Resource` or a `Scope`. It shares this filter's Redis pool,
    /// dispatcher threads, responses and metrics; a request it denies takes
    /// nothing from the rules this filter applied around it (their units
    /// are given back).
    ///
    /// A limit's name is its state in Redis, so one name means one limit:
    /// a name already taken by one of this filter's rules, or by another
    /// limit (one with other settings, or made at another place in the
    /// code, such as the same `Limit` given to two resources) is refused.
    /// The same place in the code run again (an app factory builds the app
    /// once per worker) makes the same limit again, which is fine.
    ///
    /// # Panics
    ///
    /// When the limit cannot be used (a limit of 0, an error page that is
    /// not a plain path, a name already taken), with the reason; see
    /// [`Filter::try_limit`] for a `Result`.
    ///
    /// ```no_run
    /// use actix_web::{web, App, HttpResponse};
    /// use floodgate_limiter::{Filter, Key, Limit};
    ///
    /// # fn app(filter: Filter) {
    /// let app = App::new().service(
    ///     web::resource("/sms/send")
    ///         .wrap(filter.limit(Limit::per_minute(3).key(Key::form("phone"))))
    ///         .route(web::post().to(HttpResponse::Ok)),
    /// );
    /// # }
    /// ```
    #[track_caller]
    pub fn limit(&self, limit: Limit) -> Filter {
        self.limits([limit])
    }

    /// As [`Filter::limit`], with several limits decided together.
    ///
    /// # Panics
    ///
    /// As [`Filter::limit`].
    #[track_caller]
    pub fn limits(&self, limits: impl IntoIterator<Item = Limit>) -> Filter {
        match self.try_limits(limits) {
            Ok(filter) => filter,
            Err(e) => panic!("floodgate: {e}"),
        }
    }

    /// As [`Filter::limit`], with the refusal as an error instead of a panic.
    ///
    /// ```no_run
    /// # fn f(filter: floodgate_limiter::Filter) {
    /// let err = filter.try_limit(floodgate_limiter::Limit::per_minute(0)).unwrap_err();
    /// assert!(err.to_string().contains("limit must be between 1 and 100000, got 0"));
    /// # }
    /// ```
    #[track_caller]
    pub fn try_limit(&self, limit: Limit) -> Result<Filter, SetupError> {
        self.try_limits([limit])
    }

    /// As [`Filter::limits`], with the refusal as an error instead of a panic.
    #[track_caller]
    pub fn try_limits(
        &self,
        limits: impl IntoIterator<Item = Limit>,
    ) -> Result<Filter, SetupError> {
        let at = std::panic::Location::caller();
        let mut rules: Vec<Rule> = Vec::new();
        for limit in limits {
            let rule = limit.into_rule(None, &rules).map_err(SetupError::Limit)?;
            rules.push(rule);
        }
        self.claim_names(&rules, at).map_err(SetupError::Limit)?;
        Ok(self.with_rules(rules))
    }
}

/// A limit declared in code: how many units per window (or a token
/// bucket), counted by what key, and what a denied request gets.
/// Wrap it on a resource or scope with [`Filter::limit`], or give it paths
/// with [`FilterBuilder::rule`](super::FilterBuilder::rule).
///
/// Defaults: key by client address, sliding window, cost 1, `429` on
/// denial (JSON, or the HTML page for a client whose `Accept` names
/// `text/html`), Redis errors let requests through, enforced, every request
/// counted.
///
/// ```
/// use std::time::Duration;
/// use floodgate_limiter::{Key, Limit};
///
/// let sms = Limit::per_minute(3).key(Key::form("phone").and(Key::ip())).name("sms");
/// let api = Limit::token_bucket(10.0, 20).key(Key::header("x-api-key"));
/// let login = Limit::new(5, Duration::from_secs(900)).count_failures_only();
/// # let _ = (sms, api, login);
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Limit {
    algorithm: LimitAlgorithm,
    key: Key,
    name: Option<String>,
    cost: u32,
    deny: Deny,
    error_page: String,
    on_redis_error: OnRedisError,
    mode: Mode,
    count: Count,
    normalize: Normalize,
    description: Option<String>,
    methods: Vec<String>,
    on_missing_key: OnMissingKey,
    hash_key: bool,
    skip: Option<Skip>,
    headers: HeaderDialect,
    exempt: Vec<String>,
    penalty: Option<crate::rule::Penalty>,
}

#[derive(Debug, Clone, Copy)]
enum LimitAlgorithm {
    Window {
        limit: u32,
        window: Duration,
        /// The algorithm's name, one of [`Algorithm::NAMES`] given by limit
        /// and window (an unknown one is refused when the rule is built).
        name: &'static str,
    },
    Bucket {
        rate: f64,
        burst: u32,
    },
}

impl Limit {
    /// At most `limit` requests in any `window` (a sliding window).
    pub fn new(limit: u32, window: Duration) -> Limit {
        let d = Defaults::default();
        Limit {
            algorithm: LimitAlgorithm::Window {
                limit,
                window,
                name: Algorithm::NAMES[0],
            },
            key: d.key,
            name: None,
            cost: d.cost,
            deny: CODE_DENY,
            error_page: d.error_page,
            on_redis_error: d.on_redis_error,
            mode: d.mode,
            count: d.count,
            normalize: d.normalize,
            description: None,
            methods: Vec::new(),
            on_missing_key: d.on_missing_key,
            hash_key: d.hash_key,
            skip: None,
            headers: d.headers,
            exempt: d.exempt,
            penalty: None,
        }
    }

    /// At most `n` requests in any second.
    pub fn per_second(n: u32) -> Limit {
        Limit::new(n, Duration::from_secs(1))
    }

    /// At most `n` requests in any minute.
    pub fn per_minute(n: u32) -> Limit {
        Limit::new(n, Duration::from_secs(60))
    }

    /// At most `n` requests in any hour.
    pub fn per_hour(n: u32) -> Limit {
        Limit::new(n, Duration::from_secs(3600))
    }

    /// A bucket of `burst` tokens refilled at `rate` per second.
    pub fn token_bucket(rate: f64, burst: u32) -> Limit {
        Limit {
            algorithm: LimitAlgorithm::Bucket { rate, burst },
            ..Limit::per_second(1)
        }
    }

    /// Counts in fixed windows that open at the first request, instead of
    /// a sliding window (no effect on a token bucket).
    pub fn fixed_window(self) -> Limit {
        self.algorithm("fixed_window")
    }

    /// The algorithm, by its name in the config file, for the limit and
    /// window given (no effect on a token bucket): `"sliding_window"` (the
    /// default), `"fixed_window"`, `"gcra"`, `"sliding_counter"` (see
    /// [`Algorithm`]). A name no such algorithm has is refused when the
    /// limit is installed, as in a file.
    ///
    /// ```
    /// use std::time::Duration;
    /// use floodgate_limiter::Limit;
    ///
    /// let api = Limit::new(100, Duration::from_secs(60)).algorithm("fixed_window");
    /// # let _ = api;
    /// ```
    pub fn algorithm(mut self, name: &str) -> Limit {
        if let LimitAlgorithm::Window { name: n, .. } = &mut self.algorithm {
            *n = Algorithm::NAMES
                .iter()
                .find(|k| **k == name && Algorithm::max_limit(k).is_some())
                .copied()
                .unwrap_or("unknown");
        }
        self
    }

    /// A GCRA limit: at most `limit` at once, then one every
    /// `window / limit` (see [`Algorithm::Gcra`]).
    pub fn gcra(limit: u32, window: Duration) -> Limit {
        Limit::new(limit, window).algorithm("gcra")
    }

    /// A sliding-window counter: about `limit` per `window`, in constant
    /// memory (see [`Algorithm::SlidingCounter`]).
    pub fn sliding_counter(limit: u32, window: Duration) -> Limit {
        Limit::new(limit, window).algorithm("sliding_counter")
    }

    /// What the limit counts by (default [`Key::ip`]).
    pub fn key(mut self, key: Key) -> Limit {
        self.key = key;
        self
    }

    /// How header, query and form values are read before they key.
    pub fn normalize(mut self, normalize: Normalize) -> Limit {
        self.normalize = normalize;
        self
    }

    /// The rule's name in headers, metrics and Redis keys
    /// (`[A-Za-z0-9_-]{1,64}`); default: made from the key and the limit.
    pub fn name(mut self, name: &str) -> Limit {
        self.name = Some(name.to_string());
        self
    }

    /// Units one request takes (default 1).
    pub fn cost(mut self, cost: u32) -> Limit {
        self.cost = cost;
        self
    }

    /// Denied requests are sent (`303`) to `error_page` with the rule and
    /// retry time in the query, instead of getting a `429` (a client whose
    /// `Accept` names `application/json` and not `text/html` still gets the
    /// 429 JSON).
    pub fn redirect_to(mut self, error_page: &str) -> Limit {
        self.deny = Deny::Redirect;
        self.error_page = error_page.to_string();
        self
    }

    /// When Redis cannot answer in time, deny (`503`) instead of allowing.
    pub fn deny_when_redis_fails(mut self) -> Limit {
        self.on_redis_error = OnRedisError::Deny;
        self
    }

    /// What happens when Redis cannot answer in time (as a rule's
    /// `on_redis_error`): let the request through (the default), answer
    /// `503`, or enforce the limit in this process alone until Redis
    /// answers again ([`OnRedisError::Local`]).
    pub fn on_redis_error(mut self, policy: OnRedisError) -> Limit {
        self.on_redis_error = policy;
        self
    }

    /// Only requests with these methods count (as a rule's `methods`);
    /// default: every method.
    ///
    /// ```
    /// let login = floodgate_limiter::Limit::per_minute(5).methods(&["POST"]);
    /// # let _ = login;
    /// ```
    pub fn methods(mut self, methods: &[&str]) -> Limit {
        self.methods = methods.iter().map(|m| (*m).to_string()).collect();
        self
    }

    /// What a request without its key value gets (as a rule's
    /// `on_missing_key`): keyed by its address (the default), or refused
    /// with `400 {"error":"missing_key",...}` ([`OnMissingKey::Reject`]).
    pub fn on_missing_key(mut self, what: OnMissingKey) -> Limit {
        self.on_missing_key = what;
        self
    }

    /// Key values appear in Redis key names only as a hash (as a rule's
    /// `hash_key = true`): for values that are secrets, such as API keys.
    /// A hash of a value with few possibilities (a phone number) can be
    /// reversed by trying them all; this hides secrets, not small values.
    pub fn hash_key_values(mut self) -> Limit {
        self.hash_key = true;
        self
    }

    /// Requests for which `skip` returns `true` are neither counted nor
    /// denied by this limit (an internal caller, a health probe).
    ///
    /// ```
    /// let limit = floodgate_limiter::Limit::per_minute(10)
    ///     .skip_if(|req| req.headers().contains_key("x-internal-job"));
    /// # let _ = limit;
    /// ```
    pub fn skip_if(mut self, skip: impl Fn(&RequestHead) -> bool + Send + Sync + 'static) -> Limit {
        self.skip = Some(Skip::new("skip_if", skip));
        self
    }

    /// Count and report, never deny.
    pub fn shadow(mut self) -> Limit {
        self.mode = Mode::Shadow;
        self
    }

    /// Requests answered below 400 get their units back: only failures
    /// count (sign-in attempts, say).
    pub fn count_failures_only(mut self) -> Limit {
        self.count = Count::Failures;
        self
    }

    /// The limit in words, for error pages.
    pub fn description(mut self, text: &str) -> Limit {
        self.description = Some(text.to_string());
        self
    }

    /// Which response fields show the limit to clients (default
    /// [`HeaderDialect::Ietf`]; [`HeaderDialect::None`] keeps it hidden).
    pub fn headers(mut self, dialect: HeaderDialect) -> Limit {
        self.headers = dialect;
        self
    }

    /// Requests from this client address or network (`"10.0.0.0/8"`,
    /// `"::1"`; the client address behind trusted proxies) are neither
    /// counted nor denied by the limit. Call it once per network; a text
    /// that is not an address or CIDR makes the limit unusable.
    ///
    /// ```
    /// let limit = floodgate_limiter::Limit::per_minute(60).exempt("10.0.0.0/8").exempt("::1");
    /// # let _ = limit;
    /// ```
    pub fn exempt(mut self, network: &str) -> Limit {
        self.exempt.push(network.to_string());
        self
    }

    /// Escalating bans: `penalty.after` denials of one identity within
    /// `penalty.within` ban it under this limit (see
    /// [`Penalty`](crate::rule::Penalty)).
    ///
    /// ```
    /// use std::time::Duration;
    /// use floodgate_limiter::rule::Penalty;
    /// use floodgate_limiter::{Key, Limit};
    ///
    /// let secs = Duration::from_secs;
    /// let penalty = Penalty::new(3, secs(600), secs(300), secs(86_400))?;
    /// let guesses = Limit::per_minute(5).key(Key::form("phone")).penalty(penalty);
    /// # let _ = guesses;
    /// # Ok::<(), floodgate_limiter::rule::InvalidPolicy>(())
    /// ```
    pub fn penalty(mut self, penalty: crate::rule::Penalty) -> Limit {
        self.penalty = Some(penalty);
        self
    }

    /// The checked rule: with `path`, a builder's rule guarding that
    /// pattern; without, a limit wrapped on a resource or scope (every
    /// request it sees). Checked by [`RuleSpec::check`], as a file's
    /// `[[rule]]` is: the same bounds and messages; an error names the limit.
    pub(super) fn into_rule(self, path: Option<&str>, earlier: &[Rule]) -> Result<Rule, String> {
        let name = match &self.name {
            Some(n) => n.clone(),
            None => self.default_name(),
        };
        let amount = match self.algorithm {
            LimitAlgorithm::Window {
                limit,
                window,
                name,
            } => Amount::Window {
                limit: i64::from(limit),
                window,
                written: written_duration(window),
                name,
            },
            LimitAlgorithm::Bucket { rate, burst } => Amount::Bucket {
                rate,
                burst: i64::from(burst),
            },
        };
        let spec = RuleSpec {
            name: name.clone(),
            paths: vec![path.unwrap_or("/*").to_string()],
            methods: self.methods,
            key: self.key,
            normalize: self.normalize,
            amount,
            cost: i64::from(self.cost),
            deny: self.deny,
            error_page: self.error_page,
            on_redis_error: self.on_redis_error,
            mode: self.mode,
            count: self.count,
            headers: self.headers,
            exempt: self.exempt,
            description: self.description,
            on_missing_key: self.on_missing_key,
            hash_key: self.hash_key,
            skip: self.skip,
            paths_are_known: path.is_some(),
            penalty: self.penalty,
        };
        spec.check(earlier)
            .map_err(|what| format!("{name:?}: {what}"))
    }

    /// A name made of everything that sets the limit's state apart: its
    /// key, algorithm and numbers, cost, normalization, counting and mode,
    /// e.g. `form-phone-ip-sliding-3-per-60000ms`. Two limits that differ
    /// in any of these get different names. When that cannot be said
    /// readably in 64 characters of `[A-Za-z0-9_-]` (a name with other
    /// characters, a long key), the readable part is cut and a hash of the
    /// whole description is appended, so that no two limits meet.
    fn default_name(&self) -> String {
        // Tokens joined by "-". Kinds and algorithms are fixed words and a
        // name token holds only [A-Za-z0-9_], so the name reads back one way.
        let mut exact = true;
        let word = |text: &str, exact: &mut bool| -> String {
            if text.is_empty() || !text.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                *exact = false;
            }
            text.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '_' {
                        c
                    } else {
                        '-'
                    }
                })
                .collect()
        };
        let mut parts: Vec<String> = Vec::new();
        for kind in self.key.kinds() {
            match kind {
                KeyKind::Header(n)
                | KeyKind::Query(n)
                | KeyKind::Form(n)
                | KeyKind::Json(n)
                | KeyKind::Body(n) => {
                    parts.push(format!("{}-{}", kind.kind(), word(n, &mut exact)));
                }
                KeyKind::Custom(c) => parts.push(format!("custom-{}", word(c.name(), &mut exact))),
                other => parts.push(other.kind().to_string()),
            }
        }
        match self.algorithm {
            LimitAlgorithm::Window {
                limit,
                window,
                name,
            } => {
                if !window.subsec_nanos().is_multiple_of(1_000_000) {
                    exact = false;
                }
                let algorithm = Algorithm::tag(name);
                parts.push(format!("{algorithm}-{limit}-per-{}ms", window.as_millis()));
            }
            LimitAlgorithm::Bucket { rate, burst } => {
                let rate = rate.to_string();
                if !rate.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
                    exact = false;
                }
                parts.push(format!(
                    "bucket-{burst}-at-{}ps",
                    word(&rate.replace('.', "p"), &mut exact)
                ));
            }
        }
        if self.cost != 1 {
            parts.push(format!("cost{}", self.cost));
        }
        match self.normalize {
            Normalize::None => {}
            Normalize::Digits => parts.push("digits".into()),
            Normalize::Lowercase => parts.push("lowercase".into()),
            #[cfg(feature = "e164")]
            Normalize::E164(region) => {
                parts.push(format!("e164{}", word(region.code(), &mut exact)))
            }
        }
        if self.count == Count::Failures {
            parts.push("failures".into());
        }
        if self.mode == Mode::Shadow {
            parts.push("shadow".into());
        }
        let name = parts.join("-");
        if exact && name.len() <= 64 {
            return name;
        }
        // Everything as given, unambiguously, for the hash.
        let whole = format!(
            "{}\n{:?}\n{}\n{:?}\n{}\n{}",
            self.key, self.algorithm, self.cost, self.normalize, self.count, self.mode
        );
        let digest = Sha256::digest(whole.as_bytes());
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        let mut readable: String = name.chars().take(64 - 1 - hex.len()).collect();
        while readable.ends_with('-') {
            readable.pop();
        }
        format!("{readable}-{hex}")
    }
}
