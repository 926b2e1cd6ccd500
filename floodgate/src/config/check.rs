//! The checks that turn the file as written into rules and settings that
//! cannot be invalid; every refusal says what is wrong and the range allowed.

use std::num::NonZeroU32;
use std::time::Duration;

use super::raw::{AlgorithmName, NormalizeName, RawKey, RawPolicy, RawRule};
pub(super) use super::units::duration_setting;
use super::units::{amount_of_time, invalid_duration, number, parse_duration_ms, DurationError};
use super::{ConfigError, MAX_ERROR_PAGE, MAX_LIMIT, MAX_RATE, MAX_WINDOW};
use crate::limit::Algorithm;
use crate::net::Cidr;
#[cfg(feature = "e164")]
use crate::rule::Region;
use crate::rule::{
    Count, Deny, HeaderDialect, Key, KeyKind, Mode, Normalize, OnMissingKey, OnRedisError,
    PathPattern, Rule, Skip,
};

/// Why `normalize = "e164"` or a `region` is refused by a build without the
/// `e164` feature.
#[cfg(not(feature = "e164"))]
pub(crate) const NO_E164: &str =
    "this build of floodgate has no phone number support (feature \"e164\")";

/// Checks `[defaults]` and every `[[rule]]`; used at start and on SIGHUP.
pub(crate) fn rules_from_raw(
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
pub(super) struct Policy {
    pub(super) algorithm: AlgorithmName,
    pub(super) deny: Deny,
    error_page: String,
    on_redis_error: OnRedisError,
    mode: Mode,
    #[cfg(feature = "e164")]
    pub(super) region: Region,
    pub(super) count: Count,
    on_missing_key: OnMissingKey,
    headers: HeaderDialect,
    exempt: Vec<String>,
}

impl Policy {
    pub(super) fn builtin() -> Policy {
        Policy {
            algorithm: AlgorithmName::SlidingWindow,
            deny: Deny::Redirect,
            error_page: "/err".into(),
            on_redis_error: OnRedisError::Allow,
            mode: Mode::Enforce,
            #[cfg(feature = "e164")]
            region: Region::us(),
            count: Count::All,
            on_missing_key: OnMissingKey::Ip,
            headers: HeaderDialect::Ietf,
            exempt: Vec::new(),
        }
    }
}

/// Resolves a `[defaults]`-style table over `base`; errors name the key.
pub(super) fn check_policy(
    raw: &RawPolicy,
    base: &Policy,
) -> Result<Policy, (&'static str, String)> {
    let mut p = base.clone();
    p.algorithm = raw.algorithm.unwrap_or(p.algorithm);
    p.deny = raw.deny.unwrap_or(p.deny);
    if let Some(e) = &raw.error_page {
        check_error_page(e).map_err(|what| ("error_page", what))?;
        p.error_page = e.clone();
    }
    p.on_redis_error = raw.on_redis_error.unwrap_or(p.on_redis_error);
    p.mode = raw.mode.unwrap_or(p.mode);
    if let Some(r) = &raw.region {
        check_region(&mut p, r)?;
    }
    p.count = raw.count.unwrap_or(p.count);
    p.on_missing_key = raw.on_missing_key.unwrap_or(p.on_missing_key);
    p.headers = raw.headers.unwrap_or(p.headers);
    if let Some(list) = &raw.exempt {
        check_exempt(list).map_err(|what| ("exempt", what))?;
        p.exempt = list.clone();
    }
    Ok(p)
}

/// `region`: a two-letter region code with phone number data.
#[cfg(feature = "e164")]
fn check_region(p: &mut Policy, r: &str) -> Result<(), (&'static str, String)> {
    p.region = Region::parse(r).ok_or_else(|| {
        (
            "region",
            format!(
                "unknown region {r:?}, expected a two-letter region code such as \"US\" or \"GB\""
            ),
        )
    })?;
    Ok(())
}

/// `region` is for phone numbers, which this build cannot read.
#[cfg(not(feature = "e164"))]
fn check_region(_: &mut Policy, r: &str) -> Result<(), (&'static str, String)> {
    Err(("region", format!("region = {r:?}: {NO_E164}")))
}

/// `exempt`: addresses or networks of clients (`10.0.0.0/8`, `::1`).
fn check_exempt(list: &[String]) -> Result<Vec<Cidr>, String> {
    list.iter()
        .map(|text| Cidr::parse(text).map_err(|e| e.to_string()))
        .collect()
}

/// `error_page` is a plain absolute path on this site: it starts with one
/// `/`, has no query, fragment or percent-encoding, no empty, `.` or `..`
/// segment, and only the printable ASCII characters a path may hold as
/// they are (letters, digits and `-._~!$&'()*+,;=:@/`), at most
/// [`MAX_ERROR_PAGE`] bytes. So the `Location` header is always valid, and
/// what the browser asks for next is exactly the path the rules are
/// matched against.
pub(super) fn check_error_page(e: &str) -> Result<(), String> {
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
pub(super) fn check_path_chars(p: &str) -> Result<(), String> {
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

pub(super) fn valid_rule_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

const METHODS: &[&str] = &[
    "GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE",
];

/// A rule as its author gave it, in a file or in code, before any of its
/// values is checked: [`check_spec`] turns it into a [`Rule`] or says what
/// is wrong, with the same bounds and words wherever it came from.
#[derive(Debug, Clone)]
pub(crate) struct RuleSpec {
    /// The rule's name.
    pub name: String,
    /// Path patterns as written.
    pub paths: Vec<String>,
    /// Methods as written; empty = every method.
    pub methods: Vec<String>,
    /// What it counts by.
    pub key: Key,
    /// How values are read before they key.
    pub normalize: Normalize,
    /// The algorithm and its numbers, unchecked.
    pub amount: Amount,
    /// Units one request takes, unchecked.
    pub cost: i64,
    /// What a denied request gets.
    pub deny: Deny,
    /// Where `redirect` sends a denied request, unchecked.
    pub error_page: String,
    /// Redis error policy.
    pub on_redis_error: OnRedisError,
    /// Enforce or shadow.
    pub mode: Mode,
    /// Whether answers below 400 give their units back.
    pub count: Count,
    /// Which response fields show the rule.
    pub headers: HeaderDialect,
    /// Client addresses or networks the rule leaves alone, unchecked.
    pub exempt: Vec<String>,
    /// The limit in words; `None` or blank = generated.
    pub description: Option<String>,
    /// What a request without its key value gets.
    pub on_missing_key: OnMissingKey,
    /// Whether key values are hashed in Redis key names.
    pub hash_key: bool,
    /// A predicate that lets a request skip the rule.
    pub skip: Option<Skip>,
    /// Whether the paths are the requests the rule guards (a file's or a
    /// builder's rule), so that a redirect to a page they cover is a loop.
    /// A limit wrapped on a resource guards only what the resource serves,
    /// which is not known here.
    pub paths_are_known: bool,
    /// Escalating bans, checked.
    pub penalty: Option<crate::limit::Penalty>,
}

/// An algorithm's numbers as given.
#[derive(Debug, Clone)]
pub(crate) enum Amount {
    /// A sliding or fixed window.
    Window {
        /// Units per window.
        limit: i64,
        /// The window's length.
        window: Duration,
        /// The window as its author wrote it, for messages.
        written: String,
        /// Fixed (opens at the first request) rather than sliding.
        fixed: bool,
    },
    /// A token bucket.
    Bucket {
        /// Tokens per second.
        rate: f64,
        /// Capacity.
        burst: i64,
    },
}

/// `window`: more than 0, at most [`MAX_WINDOW`], in whole milliseconds
/// (what the Redis scripts count in). `written` is the value as given.
fn check_window(window: Duration, written: &str) -> Result<Duration, String> {
    if window.is_zero() {
        Err("window must be greater than 0".into())
    } else if window > MAX_WINDOW {
        Err(format!(
            "window must be at most {}, got {written:?}",
            amount_of_time(MAX_WINDOW)
        ))
    } else if !window.subsec_nanos().is_multiple_of(1_000_000) {
        Err(format!(
            "window must be a whole number of milliseconds (at least 1ms), got {written:?}"
        ))
    } else {
        Ok(window)
    }
}

/// A key: 1 to 4 kinds, none twice, each with a usable name.
fn check_key(key: &Key) -> Result<(), String> {
    let kinds = key.kinds();
    if kinds.is_empty() {
        return Err("key must name at least one kind".into());
    }
    if kinds.len() > 4 {
        return Err("key may combine at most 4 kinds".into());
    }
    for (i, kind) in kinds.iter().enumerate() {
        kind.check()?;
        let text = kind.to_string();
        if kinds[..i].iter().any(|k| k.to_string() == text) {
            return Err(format!("key lists {text:?} twice"));
        }
    }
    Ok(())
}

/// Checks every value of a rule, from a file or from code; `earlier` are
/// the rules already checked (names are unique).
pub(crate) fn check_spec(r: RuleSpec, earlier: &[Rule]) -> Result<Rule, String> {
    if !valid_rule_name(&r.name) {
        return Err(
            "name must be 1 to 64 characters from A-Z, a-z, 0-9, \"_\" and \"-\"".to_string(),
        );
    }
    if let Some(i) = earlier.iter().position(|e| e.name == r.name) {
        return Err(format!("duplicate rule name (also rule {})", i + 1));
    }
    check_error_page(&r.error_page)?;

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

    check_key(&r.key)?;
    let exempt = check_exempt(&r.exempt).map_err(|e| format!("exempt: {e}"))?;

    let algorithm = match r.amount {
        Amount::Bucket { rate, burst } => {
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
        Amount::Window {
            limit,
            window,
            written,
            fixed,
        } => {
            let limit = u32::try_from(limit)
                .ok()
                .filter(|l| *l <= MAX_LIMIT)
                .and_then(NonZeroU32::new)
                .ok_or_else(|| format!("limit must be between 1 and {MAX_LIMIT}, got {limit}"))?;
            let window = check_window(window, &written)?;
            if fixed {
                Algorithm::FixedWindow { limit, window }
            } else {
                Algorithm::SlidingWindow { limit, window }
            }
        }
    };

    // Units one request takes: 1 ..= the rule's limit or burst.
    let quota = algorithm.quota();
    let cost = u32::try_from(r.cost)
        .ok()
        .filter(|c| (1..=quota).contains(c))
        .ok_or_else(|| {
            let of = match algorithm {
                Algorithm::TokenBucket { .. } => "burst",
                _ => "limit",
            };
            format!(
                "cost must be between 1 and {quota} (the rule's {of}), got {}",
                r.cost
            )
        })?;

    if let Some(p) = &r.penalty {
        super::operator::check_penalty_values(p)?;
    }

    let description = match r.description {
        Some(d) if !d.trim().is_empty() => d.trim().to_string(),
        _ => crate::rule::describe(&algorithm, cost, &r.key),
    };

    let rule = Rule {
        description,
        name: r.name,
        path_text: r.paths,
        paths,
        methods,
        key: r.key,
        normalize: r.normalize,
        algorithm,
        cost,
        deny: r.deny,
        error_page: r.error_page,
        on_redis_error: r.on_redis_error,
        mode: r.mode,
        count: r.count,
        on_missing_key: r.on_missing_key,
        hash_key: r.hash_key,
        skip: r.skip,
        headers: r.headers,
        exempt,
        penalty: r.penalty,
    };
    // A browser sent to the error page would be sent there again, forever.
    if r.paths_are_known && rule.deny == Deny::Redirect && rule.matches("GET", &rule.error_page) {
        return Err(format!(
            "deny = \"redirect\" sends denied requests to error_page {:?}, which this rule's paths and methods cover too (a loop); leave the error page out of paths, set another error_page, or use deny = \"status\"",
            rule.error_page
        ));
    }
    Ok(rule)
}

/// A `[[rule]]` of the file: its shape (which keys go with which
/// algorithm) is checked here, its values by [`check_spec`].
pub(super) fn check_rule(r: RawRule, defaults: &Policy, earlier: &[Rule]) -> Result<Rule, String> {
    if !valid_rule_name(&r.name) {
        return Err(
            "name must be 1 to 64 characters from A-Z, a-z, 0-9, \"_\" and \"-\"".to_string(),
        );
    }
    if let Some(i) = earlier.iter().position(|e| e.name == r.name) {
        return Err(format!("duplicate rule name (also rule {})", i + 1));
    }
    let own = RawPolicy {
        algorithm: r.algorithm,
        deny: r.deny,
        error_page: r.error_page.clone(),
        on_redis_error: r.on_redis_error,
        mode: r.mode,
        region: r.region.clone(),
        count: r.count,
        on_missing_key: r.on_missing_key,
        headers: r.headers,
        // Checked with the rule's other values, where the message names it.
        exempt: None,
    };
    let policy = check_policy(&own, defaults).map_err(|(_, what)| what)?;

    // Paths and methods are checked before the key, as they are written.
    if r.paths.is_empty() {
        return Err("paths must name at least one path".into());
    }
    for p in &r.paths {
        check_path_chars(p)?;
        PathPattern::parse(p)?;
    }
    for m in &r.methods {
        if !METHODS.contains(&m.to_ascii_uppercase().as_str()) {
            return Err(format!("unknown method {m:?}"));
        }
    }

    let key = match &r.key {
        None => Key(vec![KeyKind::Ip]),
        Some(RawKey::One(text)) => Key(vec![KeyKind::parse(text)?]),
        Some(RawKey::Many(list)) => {
            let mut kinds: Vec<KeyKind> = Vec::with_capacity(list.len());
            for text in list {
                kinds.push(KeyKind::parse(text)?);
            }
            Key(kinds)
        }
    };
    let normalize = match r.normalize.unwrap_or(NormalizeName::None) {
        NormalizeName::None => Normalize::None,
        NormalizeName::Digits => Normalize::Digits,
        NormalizeName::Lowercase => Normalize::Lowercase,
        #[cfg(feature = "e164")]
        NormalizeName::E164 => Normalize::E164(policy.region),
        #[cfg(not(feature = "e164"))]
        NormalizeName::E164 => return Err(format!("normalize = \"e164\": {NO_E164}")),
    };

    let amount = match policy.algorithm {
        AlgorithmName::TokenBucket => {
            if r.limit.is_some() || r.window.is_some() {
                return Err(
                    "limit and window do not apply to token_bucket (use rate and burst)".into(),
                );
            }
            match (r.rate, r.burst) {
                (Some(rate), Some(burst)) => Amount::Bucket { rate, burst },
                (None, Some(_)) => return Err("token_bucket needs rate (tokens per second)".into()),
                (Some(_), None) => {
                    return Err("token_bucket needs burst (the bucket's capacity)".into())
                }
                (None, None) => return Err("token_bucket needs rate and burst".into()),
            }
        }
        window_algorithm => {
            let fixed = window_algorithm == AlgorithmName::FixedWindow;
            let window_kind = if fixed {
                "fixed_window"
            } else {
                "sliding_window"
            };
            if r.rate.is_some() || r.burst.is_some() {
                return Err(format!(
                    "rate and burst apply only to token_bucket, not {window_kind}"
                ));
            }
            let (limit, written) = match (r.limit, r.window) {
                (Some(limit), Some(window)) => (limit, window),
                (None, Some(_)) => return Err(format!("{window_kind} needs limit")),
                (Some(_), None) => return Err(format!("{window_kind} needs window")),
                (None, None) => return Err(format!("{window_kind} needs limit and window")),
            };
            let window = match parse_duration_ms(&written) {
                Ok(ms) => Duration::from_millis(ms),
                // More milliseconds than a u64 holds: over any bound.
                Err(DurationError::TooLong) => Duration::MAX,
                Err(DurationError::Invalid) => {
                    return Err(format!("window: {}", invalid_duration(&written)))
                }
            };
            Amount::Window {
                limit,
                window,
                written,
                fixed,
            }
        }
    };

    check_spec(
        RuleSpec {
            name: r.name,
            paths: r.paths,
            methods: r.methods,
            key,
            normalize,
            amount,
            cost: r.cost.unwrap_or(1),
            deny: policy.deny,
            error_page: policy.error_page,
            on_redis_error: policy.on_redis_error,
            mode: policy.mode,
            count: policy.count,
            headers: policy.headers,
            exempt: r.exempt.unwrap_or(policy.exempt),
            description: r.description,
            on_missing_key: policy.on_missing_key,
            hash_key: r.hash_key.unwrap_or(false),
            skip: None,
            paths_are_known: true,
            penalty: r
                .penalty
                .as_ref()
                .map(super::operator::check_penalty)
                .transpose()?,
        },
        earlier,
    )
}

/// Cluster and Sentinel settings: consistent with each other (a file that
/// names both, or Sentinels without the master's name, is refused rather
/// than half used). Errors name the key.
pub(super) fn check_topology(
    cluster: &[String],
    sentinel: &[String],
    master: &str,
) -> Result<(), (&'static str, String)> {
    if let Some((key, why)) = crate::limit::redis_config::missing_feature(cluster, sentinel) {
        return Err((key, why.into()));
    }
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

pub(super) fn check_redis_url(text: &str) -> Result<String, String> {
    redis::Client::open(text)
        .map(|_| text.to_string())
        .map_err(|e| format!("{text:?} is not a Redis URL ({e})"))
}
