//! The rules: which requests a rule guards (methods and path patterns),
//! what it counts by (its key), how much, and what a denied request gets.
//! Configuration builds these; the filter applies them.

mod identity;
pub(crate) mod key;
#[cfg(feature = "e164")]
mod normalize;
mod options;
mod path;
pub(crate) mod policy;
pub(crate) mod spec;

pub(crate) use self::identity::identity_key;
pub use self::identity::{id_forms_of, IdForms};
pub use self::key::{compose, redis_key_for, stored_id, CustomKey, KeyKind};
pub(crate) use self::key::{hashed_id, rule_of_segment, rule_segment, Key};
#[cfg(feature = "e164")]
pub use self::normalize::{e164, Region};
pub use self::options::{Identity, LookupFn, LookupFuture, OnMissingKey, Skip};
pub use self::path::PathPattern;
pub use self::policy::{Algorithm, InvalidPolicy, Penalty};
use crate::net::Cidr;
use crate::units::human_duration;

/// How a value read from the request is normalized before it becomes a
/// key: the value of a `header`, `query`, `form`, `json` or `body` key kind
/// (a JSON number as its text). Addresses (`ip`, by their /64 for IPv6),
/// paths, accounts (`session`) and key functions' values are used as they
/// are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
// (Non-exhaustive: the `e164` feature adds a kind, and features add up.)
#[non_exhaustive]
pub enum Normalize {
    /// As sent (after percent-decoding).
    None,
    /// Only the ASCII digits are kept (phone numbers).
    Digits,
    /// Lower-cased and trimmed (e-mail addresses, user names).
    Lowercase,
    /// A phone number in E.164 (`+DIGITS`); numbers written without `+`
    /// are read with this region's prefixes. Not a possible number: none.
    /// (The `e164` feature.)
    #[cfg(feature = "e164")]
    E164(Region),
}

impl std::fmt::Display for Normalize {
    /// As the config file writes it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Normalize::None => "none",
            Normalize::Digits => "digits",
            Normalize::Lowercase => "lowercase",
            #[cfg(feature = "e164")]
            Normalize::E164(_) => "e164",
        })
    }
}

/// Applies a rule's `normalize` to a header, query, form, JSON or body value; `None`
/// when nothing is left (the request is then keyed by its address).
pub fn normalize(value: &str, how: Normalize) -> Option<String> {
    let v = match how {
        Normalize::None => value.to_string(),
        Normalize::Digits => value.chars().filter(char::is_ascii_digit).collect(),
        Normalize::Lowercase => value.trim().to_lowercase(),
        #[cfg(feature = "e164")]
        Normalize::E164(region) => return e164(value, region),
    };
    (!v.is_empty()).then_some(v)
}

/// Which requests a rule charges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Count {
    /// Every request it allows.
    All,
    /// Every request it allows is charged, and a request answered below 400
    /// gets its units back (failed sign-ins count, good ones do not).
    Failures,
}

/// What a denied request gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Deny {
    /// `303` to the error page (a client that asks for JSON and not for
    /// HTML gets the 429).
    Redirect,
    /// `429` with `Retry-After`: JSON, or the HTML page for a client whose
    /// `Accept` names `text/html`.
    Status,
}

/// What happens when Redis cannot answer in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum OnRedisError {
    /// Let the request through.
    Allow,
    /// Answer `503`.
    Deny,
    /// Enforce the rule in this process alone, in memory, until Redis
    /// answers again.
    Local,
}

/// Whether a rule may deny.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Mode {
    /// Denies over the limit.
    Enforce,
    /// Counts and reports, never denies.
    Shadow,
}

/// Which response fields announce a rule's state to clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[non_exhaustive]
pub enum HeaderDialect {
    /// `RateLimit-Policy` and `RateLimit` as lists, one item per rule.
    #[default]
    #[serde(rename = "ietf")]
    Ietf,
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset` (seconds)
    /// and `RateLimit-Policy: L;w=W`, for the most restrictive such rule.
    #[serde(rename = "draft-6")]
    Draft6,
    /// `RateLimit: limit=L, remaining=R, reset=T` and `RateLimit-Policy:
    /// L;w=W`, for the most restrictive such rule.
    #[serde(rename = "draft-7")]
    Draft7,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`
    /// (Unix seconds), for the most restrictive such rule.
    #[serde(rename = "x-ratelimit")]
    XRateLimit,
    /// No field: the rule's numbers stay hidden.
    #[serde(rename = "none")]
    None,
}

/// One checked rule with `[defaults]` applied. Only a file's `[[rule]]` or a
/// [`Limit`](crate::Limit) builds one, through the same checks; read it
/// through its methods.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Unique name, `[A-Za-z0-9_-]{1,64}`.
    pub(crate) name: String,
    /// Path patterns as written (for display).
    pub(crate) path_text: Vec<String>,
    /// Compiled path patterns.
    pub(crate) paths: Vec<PathPattern>,
    /// Upper-case methods; empty = every method.
    pub(crate) methods: Vec<String>,
    /// What identifies the caller.
    pub(crate) key: Key,
    /// Normalization of header/query/form values.
    pub(crate) normalize: Normalize,
    /// The algorithm and its parameters.
    pub(crate) algorithm: Algorithm,
    /// Units one request takes.
    pub(crate) cost: u32,
    /// What a denied request gets.
    pub(crate) deny: Deny,
    /// Where `redirect` sends a denied request.
    pub(crate) error_page: String,
    /// Redis error policy.
    pub(crate) on_redis_error: OnRedisError,
    /// Enforce or shadow.
    pub(crate) mode: Mode,
    /// Whether answers below 400 give their units back.
    pub(crate) count: Count,
    /// Which response fields show the rule.
    pub(crate) headers: HeaderDialect,
    /// Client addresses the rule neither counts nor denies.
    pub(crate) exempt: Vec<Cidr>,
    /// The limit in human words.
    pub(crate) description: String,
    /// What a request without its key value gets.
    pub(crate) on_missing_key: OnMissingKey,
    /// Whether key values appear in Redis key names only hashed.
    pub(crate) hash_key: bool,
    /// Requests this predicate holds for skip the rule (rules made in code).
    pub(crate) skip: Option<Skip>,
    /// Escalating bans (`None`: none).
    pub(crate) penalty: Option<Penalty>,
}

impl Rule {
    /// Unique name, `[A-Za-z0-9_-]{1,64}`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Path patterns as written (for display).
    pub fn path_text(&self) -> &[String] {
        &self.path_text
    }

    /// Compiled path patterns.
    pub fn paths(&self) -> &[PathPattern] {
        &self.paths
    }

    /// Upper-case methods; empty = every method.
    pub fn methods(&self) -> &[String] {
        &self.methods
    }

    /// What identifies the caller.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// Normalization of header/query/form values.
    pub fn normalize(&self) -> Normalize {
        self.normalize
    }

    /// The algorithm and its parameters.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Units one request takes.
    pub fn cost(&self) -> u32 {
        self.cost
    }

    /// What a denied request gets.
    pub fn deny(&self) -> Deny {
        self.deny
    }

    /// Where `redirect` sends a denied request.
    pub fn error_page(&self) -> &str {
        &self.error_page
    }

    /// Redis error policy.
    pub fn on_redis_error(&self) -> OnRedisError {
        self.on_redis_error
    }

    /// Enforce or shadow.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Whether answers below 400 give their units back.
    pub fn count(&self) -> Count {
        self.count
    }

    /// Which response fields show the rule.
    pub fn headers(&self) -> HeaderDialect {
        self.headers
    }

    /// Client addresses the rule neither counts nor denies.
    pub fn exempt(&self) -> &[Cidr] {
        &self.exempt
    }

    /// The limit in human words.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// What a request without its key value gets.
    pub fn on_missing_key(&self) -> OnMissingKey {
        self.on_missing_key
    }

    /// Whether key values appear in Redis key names only hashed.
    pub fn hash_key(&self) -> bool {
        self.hash_key
    }

    /// Escalating bans (`None`: none).
    pub fn penalty(&self) -> Option<Penalty> {
        self.penalty
    }

    /// Whether a predicate of the application's skips some requests (a
    /// [`Limit::skip_if`](crate::Limit::skip_if)).
    pub fn has_skip(&self) -> bool {
        self.skip.is_some()
    }

    /// Whether this rule guards `method` + (decoded) `path`. A rule that
    /// names `GET` guards `HEAD` too: axum, hyper and most routers run a
    /// GET handler for a HEAD request, so it would otherwise run unlimited.
    pub fn matches(&self, method: &str, path: &str) -> bool {
        let named = |m: &str| self.methods.iter().any(|n| n == m);
        (self.methods.is_empty() || named(method) || (method == "HEAD" && named("GET")))
            && self.paths.iter().any(|p| p.matches(path))
    }

    /// Whether the rule leaves requests from `client` alone (its `exempt`).
    pub fn exempts(&self, client: std::net::IpAddr) -> bool {
        self.exempt.iter().any(|c| c.contains(client))
    }

    /// Whether this rule applies to `req`, which [`Rule::matches`]: not
    /// when its skip predicate holds.
    pub fn applies_to(&self, req: &crate::head::RequestHead) -> bool {
        self.skip.as_ref().is_none_or(|s| !s.skips(req))
    }

    /// The Redis key of the identity whose key kind (composed, for several)
    /// is `kind` and whose value is `id`, under this rule: the one place
    /// where requests and operators alike name an identity's state, so that
    /// `hash_key` hashes the value for both and no secret reaches a key name.
    pub(crate) fn state_key(&self, hash_tags: bool, prefix: &str, kind: &str, id: &str) -> String {
        if self.hash_key {
            key::key_of_stored_id(hash_tags, prefix, &self.name, kind, &hashed_id(id))
        } else {
            redis_key_for(hash_tags, prefix, &self.name, kind, id)
        }
    }
}

/// A rule in human words: "at most 5 requests per 10 seconds for your address".
pub(crate) fn describe(algorithm: &Algorithm, cost: u32, key: &Key) -> String {
    let whose = key
        .kinds()
        .iter()
        .map(|k| match k {
            KeyKind::Ip => "from your address".to_string(),
            KeyKind::Session => "for your account".to_string(),
            KeyKind::Global => "for everyone together".to_string(),
            KeyKind::Path => "for this page".to_string(),
            KeyKind::Header(n)
            | KeyKind::Query(n)
            | KeyKind::Form(n)
            | KeyKind::Json(n)
            | KeyKind::Body(n) => format!("for each {n}"),
            KeyKind::Custom(c) => format!("for each {}", c.name()),
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
    algorithm.describe(per, human_duration, &whose)
}

/// A float for a message: plain when readable that way, else `1e-15`.
pub(crate) fn number(x: f64) -> String {
    if x == 0.0 || (1e-4..1e7).contains(&x.abs()) {
        format!("{x}")
    } else {
        format!("{x:e}")
    }
}

macro_rules! config_names {
    ($($ty:ident { $($variant:ident => $name:literal),+ $(,)? })+) => {$(
        impl $ty {
            /// The value as the configuration file writes it.
            pub fn as_str(&self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    )+};
}

config_names! {
    Count { All => "all", Failures => "failures" }
    Deny { Redirect => "redirect", Status => "status" }
    OnRedisError { Allow => "allow", Deny => "deny", Local => "local" }
    Mode { Enforce => "enforce", Shadow => "shadow" }
    HeaderDialect {
        Ietf => "ietf",
        Draft6 => "draft-6",
        Draft7 => "draft-7",
        XRateLimit => "x-ratelimit",
        None => "none",
    }
}
