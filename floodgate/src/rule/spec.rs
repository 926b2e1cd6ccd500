//! The one validator of rules: a [`RuleSpec`] (a rule as its author gave
//! it, from a file's `[[rule]]` or a [`Limit`](crate::Limit) made in code)
//! becomes a checked [`Rule`], or a message that says what is wrong and the
//! range allowed; and the [`Defaults`] both start from.

use std::time::Duration;

use super::policy::Penalty;
use super::{
    Count, Deny, HeaderDialect, Key, KeyKind, Mode, Normalize, OnMissingKey, OnRedisError,
    PathPattern, Rule, Skip,
};
use crate::net::Cidr;

pub(crate) use crate::units::MAX_ERROR_PAGE;

/// What a rule has when its author sets nothing else: one set, for a
/// file's `[[rule]]` (under which `[defaults]` may set its own) and for a
/// [`Limit`](crate::Limit) made in code, which differs only in `deny`
/// ([`CODE_DENY`]).
#[derive(Debug, Clone)]
pub(crate) struct Defaults {
    /// By the client address.
    pub(crate) key: Key,
    /// Values as sent.
    pub(crate) normalize: Normalize,
    /// One unit a request.
    pub(crate) cost: u32,
    /// `303` to the error page.
    pub(crate) deny: Deny,
    /// `/err`.
    pub(crate) error_page: String,
    /// Let requests through.
    pub(crate) on_redis_error: OnRedisError,
    /// Enforced.
    pub(crate) mode: Mode,
    /// Every request counts.
    pub(crate) count: Count,
    /// Keyed by the client address.
    pub(crate) on_missing_key: OnMissingKey,
    /// `RateLimit-Policy` and `RateLimit`.
    pub(crate) headers: HeaderDialect,
    /// No client is exempt.
    pub(crate) exempt: Vec<String>,
    /// Key values in Redis key names as they are.
    pub(crate) hash_key: bool,
}

impl Default for Defaults {
    fn default() -> Defaults {
        Defaults {
            key: Key(vec![KeyKind::Ip]),
            normalize: Normalize::None,
            cost: 1,
            deny: Deny::Redirect,
            error_page: "/err".into(),
            on_redis_error: OnRedisError::Allow,
            mode: Mode::Enforce,
            count: Count::All,
            on_missing_key: OnMissingKey::Ip,
            headers: HeaderDialect::Ietf,
            exempt: Vec::new(),
            hash_key: false,
        }
    }
}

/// What a denied request gets from a [`Limit`](crate::Limit) made in code
/// that does not say: a `429` (JSON for clients that ask for it), since an
/// application using the library need not have an error page to send
/// browsers to. [`Limit::redirect_to`](crate::Limit::redirect_to) names one.
pub(crate) const CODE_DENY: Deny = Deny::Status;

/// A rule as its author gave it, in a file or in code, before any of its
/// values is checked: [`RuleSpec::check`] turns it into a [`Rule`] or says what
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
    pub penalty: Option<Penalty>,
}

/// An algorithm's numbers as given.
#[derive(Debug, Clone)]
pub(crate) enum Amount {
    /// An algorithm given by limit and window.
    Window {
        /// Units per window.
        limit: i64,
        /// The window's length.
        window: Duration,
        /// The window as its author wrote it, for messages.
        written: String,
        /// The algorithm's name (one [`Algorithm::windowed`] knows).
        name: &'static str,
    },
    /// A token bucket.
    Bucket {
        /// Tokens per second.
        rate: f64,
        /// Capacity.
        burst: i64,
    },
}

impl RuleSpec {
    /// The checked rule, or what is wrong with it; `earlier` are the rules
    /// already checked (names are unique). The one validator of rules: a
    /// file's `[[rule]]` and a [`Limit`](crate::Limit) made in code both end
    /// here, so they share every bound and every message.
    pub(crate) fn check(self, earlier: &[Rule]) -> Result<Rule, String> {
        check(self, earlier)
    }
}

fn check(r: RuleSpec, earlier: &[Rule]) -> Result<Rule, String> {
    check_name(&r.name, earlier)?;
    check_error_page(&r.error_page)?;
    let paths = check_paths(&r.paths)?;
    let methods = check_methods(&r.methods)?;
    check_key(&r.key)?;
    if !matches!(r.normalize, Normalize::None) && !r.key.normalizes() {
        return Err(format!(
            "normalize applies to header, query, form, json and body keys; key = {} reads none",
            r.key
        ));
    }
    let exempt = check_exempt(&r.exempt).map_err(|e| format!("exempt: {e}"))?;

    let algorithm = match r.amount {
        Amount::Bucket { rate, burst } => super::policy::checked_bucket(rate, burst)?,
        Amount::Window {
            limit,
            window,
            written,
            name,
        } => super::policy::checked_windowed(name, limit, window, &written)?,
    };

    // Units one request takes: 1 ..= the rule's limit or burst.
    let quota = algorithm.quota();
    let cost = u32::try_from(r.cost)
        .ok()
        .filter(|c| (1..=quota).contains(c))
        .ok_or_else(|| {
            let of = algorithm.quota_word();
            format!(
                "cost must be between 1 and {quota} (the rule's {of}), got {}",
                r.cost
            )
        })?;

    if let Some(p) = &r.penalty {
        check_penalty(p)?;
    }

    let description = match r.description {
        Some(d) if !d.trim().is_empty() => d.trim().to_string(),
        _ => super::describe(&algorithm, cost, &r.key),
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

/// `name`: `[A-Za-z0-9_-]{1,64}`, and not the name of an `earlier` rule.
pub(crate) fn check_name(name: &str, earlier: &[Rule]) -> Result<(), String> {
    if !valid_rule_name(name) {
        return Err(
            "name must be 1 to 64 characters from A-Z, a-z, 0-9, \"_\" and \"-\"".to_string(),
        );
    }
    if let Some(i) = earlier.iter().position(|e| e.name == name) {
        return Err(format!("duplicate rule name (also rule {})", i + 1));
    }
    Ok(())
}

/// `paths`: at least one, each a pattern that can match a decoded path.
pub(crate) fn check_paths(texts: &[String]) -> Result<Vec<PathPattern>, String> {
    if texts.is_empty() {
        return Err("paths must name at least one path".into());
    }
    let mut paths = Vec::with_capacity(texts.len());
    for p in texts {
        check_path_chars(p)?;
        paths.push(PathPattern::parse(p)?);
    }
    Ok(paths)
}

/// `methods`: HTTP methods in any case, upper-cased; empty = every method.
pub(crate) fn check_methods(texts: &[String]) -> Result<Vec<String>, String> {
    let mut methods = Vec::with_capacity(texts.len());
    for m in texts {
        let up = m.to_ascii_uppercase();
        if !METHODS.contains(&up.as_str()) {
            return Err(format!("unknown method {m:?}"));
        }
        methods.push(up);
    }
    Ok(methods)
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

/// `error_page` is a plain absolute path on this site: it starts with one
/// `/`, has no query, fragment or percent-encoding, no empty, `.` or `..`
/// segment, and only the printable ASCII characters a path may hold as
/// they are (letters, digits and `-._~!$&'()*+,;=:@/`), at most
/// [`MAX_ERROR_PAGE`] bytes. So the `Location` header is always valid, and
/// what the browser asks for next is exactly the path the rules are
/// matched against.
pub(crate) fn check_error_page(e: &str) -> Result<(), String> {
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

/// `exempt`: addresses or networks of clients (`10.0.0.0/8`, `::1`).
pub(crate) fn check_exempt(list: &[String]) -> Result<Vec<Cidr>, String> {
    list.iter()
        .map(|text| Cidr::parse(text).map_err(|e| e.to_string()))
        .collect()
}

/// The bounds of a penalty however it was given (a file's, or one made in
/// code): `after` 1 to 1000000, durations above 0 and at most 366 days in
/// whole milliseconds, the first ban at most `max`.
fn check_penalty(p: &Penalty) -> Result<(), String> {
    p.checked().map(|_| ())
}
