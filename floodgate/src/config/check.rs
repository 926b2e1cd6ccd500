//! The checks that turn the file as written into rules and settings that
//! cannot be invalid; every refusal says what is wrong and the range allowed.
//! A rule's values are checked by the rules' own validator
//! ([`RuleSpec::check`]), which rules made in code go through too; here
//! are the file's part: `[defaults]`, and the shape of a `[[rule]]`.

use std::time::Duration;

use super::raw::{AlgorithmName, NormalizeName, RawDefaults, RawKey, RawRule};
use super::ConfigError;
use crate::rule::policy::BUCKET;
use crate::rule::spec::{
    check_error_page, check_exempt, check_methods, check_name, check_paths, Amount, Defaults,
    RuleSpec,
};
use crate::rule::Algorithm;
#[cfg(feature = "e164")]
use crate::rule::Region;
use crate::rule::{Key, KeyKind, Normalize, Rule};
pub(super) use crate::units::duration_setting;
use crate::units::{invalid_duration, parse_duration_ms, DurationError};

/// Why `normalize = "e164"` or a `region` is refused by a build without the
/// `e164` feature.
#[cfg(not(feature = "e164"))]
pub(crate) const NO_E164: &str =
    "this build of floodgate has no phone number support (feature \"e164\")";

/// Checks `[defaults]` and every `[[rule]]`; used at start and on SIGHUP.
pub(crate) fn rules_from_raw(
    defaults: &RawDefaults,
    raw: Vec<RawRule>,
    file: &str,
) -> Result<Vec<Rule>, ConfigError> {
    let defaults =
        check_defaults(defaults, &Inherited::builtin()).map_err(|(key, what)| ConfigError {
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

/// What a `[[rule]]` inherits unless it sets its own: the rules' built-in
/// [`Defaults`] with `[defaults]` over them, and the file's own two.
#[derive(Debug, Clone)]
pub(super) struct Inherited {
    /// The algorithm a rule without `algorithm` has.
    pub(super) algorithm: AlgorithmName,
    /// The region of phone numbers written without `+`.
    #[cfg(feature = "e164")]
    pub(super) region: Region,
    /// The rest, as a rule made in code has them too.
    pub(super) rule: Defaults,
}

impl Inherited {
    pub(super) fn builtin() -> Inherited {
        Inherited {
            algorithm: AlgorithmName(Algorithm::NAMES[0]),
            #[cfg(feature = "e164")]
            region: Region::us(),
            rule: Defaults::default(),
        }
    }
}

/// Resolves a `[defaults]`-style table over `base`; errors name the key.
pub(super) fn check_defaults(
    raw: &RawDefaults,
    base: &Inherited,
) -> Result<Inherited, (&'static str, String)> {
    let mut p = base.clone();
    p.algorithm = raw.algorithm.unwrap_or(p.algorithm);
    let d = &mut p.rule;
    d.deny = raw.deny.unwrap_or(d.deny);
    if let Some(e) = &raw.error_page {
        check_error_page(e).map_err(|what| ("error_page", what))?;
        d.error_page = e.clone();
    }
    d.on_redis_error = raw.on_redis_error.unwrap_or(d.on_redis_error);
    d.mode = raw.mode.unwrap_or(d.mode);
    if let Some(r) = &raw.region {
        check_region(&mut p, r)?;
    }
    let d = &mut p.rule;
    d.count = raw.count.unwrap_or(d.count);
    d.on_missing_key = raw.on_missing_key.unwrap_or(d.on_missing_key);
    d.headers = raw.headers.unwrap_or(d.headers);
    if let Some(list) = &raw.exempt {
        check_exempt(list).map_err(|what| ("exempt", what))?;
        d.exempt = list.clone();
    }
    Ok(p)
}

/// `region`: a two-letter region code with phone number data.
#[cfg(feature = "e164")]
fn check_region(p: &mut Inherited, r: &str) -> Result<(), (&'static str, String)> {
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
fn check_region(_: &mut Inherited, r: &str) -> Result<(), (&'static str, String)> {
    Err(("region", format!("region = {r:?}: {NO_E164}")))
}

/// A `[[rule]]` of the file: its shape (which keys go with which
/// algorithm) is checked here, its values by [`RuleSpec::check`].
pub(super) fn check_rule(
    r: RawRule,
    defaults: &Inherited,
    earlier: &[Rule],
) -> Result<Rule, String> {
    check_name(&r.name, earlier)?;
    let own = RawDefaults {
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
    let inherited = check_defaults(&own, defaults).map_err(|(_, what)| what)?;
    let d = inherited.rule;

    // Paths and methods are refused before the key, in the order they are
    // written (the validator checks them again, with the rest).
    check_paths(&r.paths)?;
    check_methods(&r.methods)?;

    let key = match &r.key {
        None => d.key,
        Some(RawKey::One(text)) => Key(vec![KeyKind::parse(text)?]),
        Some(RawKey::Many(list)) => {
            let mut kinds: Vec<KeyKind> = Vec::with_capacity(list.len());
            for text in list {
                kinds.push(KeyKind::parse(text)?);
            }
            Key(kinds)
        }
    };
    let normalize = match r.normalize {
        None => d.normalize,
        Some(NormalizeName::None) => Normalize::None,
        Some(NormalizeName::Digits) => Normalize::Digits,
        Some(NormalizeName::Lowercase) => Normalize::Lowercase,
        #[cfg(feature = "e164")]
        Some(NormalizeName::E164) => Normalize::E164(inherited.region),
        #[cfg(not(feature = "e164"))]
        Some(NormalizeName::E164) => return Err(format!("normalize = \"e164\": {NO_E164}")),
    };

    let amount = match inherited.algorithm.0 {
        BUCKET => {
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
        window_kind => {
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
                name: window_kind,
            }
        }
    };

    RuleSpec {
        name: r.name,
        paths: r.paths,
        methods: r.methods,
        key,
        normalize,
        amount,
        cost: r.cost.unwrap_or(i64::from(d.cost)),
        deny: d.deny,
        error_page: d.error_page,
        on_redis_error: d.on_redis_error,
        mode: d.mode,
        count: d.count,
        headers: d.headers,
        exempt: r.exempt.unwrap_or(d.exempt),
        description: r.description,
        on_missing_key: d.on_missing_key,
        hash_key: r.hash_key.unwrap_or(d.hash_key),
        skip: None,
        paths_are_known: true,
        penalty: r
            .penalty
            .as_ref()
            .map(super::operator::check_penalty)
            .transpose()?,
    }
    .check(earlier)
}

/// Cluster and Sentinel settings: consistent with each other (see
/// `topology_refused`). Errors name the key.
pub(super) fn check_topology(
    cluster: &[String],
    sentinel: &[String],
    master: &str,
) -> Result<(), (&'static str, String)> {
    use crate::limiter::redis_config::{missing_feature, topology_refused};
    if let Some((key, why)) = missing_feature(cluster, sentinel) {
        return Err((key, why.into()));
    }
    match topology_refused(cluster, sentinel, master) {
        Some(refused) => Err(refused),
        None => Ok(()),
    }
}

pub(crate) fn check_redis_url(text: &str) -> Result<String, String> {
    redis::Client::open(text)
        .map(|_| text.to_string())
        .map_err(|e| {
            // (Its password stays out of the message, which may be logged.)
            let shown = crate::limiter::without_password(text);
            format!("{shown:?} is not a Redis URL ({e})")
        })
}
