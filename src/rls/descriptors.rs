//! The descriptor files: envoyproxy/ratelimit's YAML format, read as that
//! service reads it, and checked as strictly. One file holds one domain; a
//! folder's `*.yaml` and `*.yml` files are read in name order. Every
//! refusal is a [`ConfigError`], `FILE: WHERE: WHAT`.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Duration;

use floodgate::config::duration_at_most;
use floodgate::config::ConfigError;
use floodgate::rule::{Algorithm, Penalty};
use serde::Deserialize;

use super::matcher::{Limit, Matcher, NodeKind, Pattern};
use super::proto::Unit;

/// A descriptor file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    domain: Option<String>,
    #[serde(default, deserialize_with = "null_as_empty")]
    descriptors: Vec<RawDescriptor>,
}

/// `descriptors: null` (or `descriptors:` with nothing after it) is no
/// descriptors, as envoyproxy/ratelimit reads it.
fn null_as_empty<'de, D>(d: D) -> Result<Vec<RawDescriptor>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    Ok(Option::<Vec<RawDescriptor>>::deserialize(d)?.unwrap_or_default())
}

/// A flag as envoyproxy/ratelimit's YAML reader (YAML 1.1) reads one:
/// `true` and `false`, and the words `yes`/`no`, `on`/`off` and `y`/`n`,
/// each in lower case, capitalized or in capitals; nothing written (`null`)
/// is false.
fn flag<'de, D>(d: D) -> Result<bool, D::Error>
where
    D: serde::Deserializer<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Flag {
        Bool(bool),
        Word(String),
    }
    let word = match Option::<Flag>::deserialize(d)? {
        None => return Ok(false),
        Some(Flag::Bool(b)) => return Ok(b),
        Some(Flag::Word(w)) => w,
    };
    match word.as_str() {
        "true" | "True" | "TRUE" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" | "y" | "Y" => {
            Ok(true)
        }
        "false" | "False" | "FALSE" | "no" | "No" | "NO" | "off" | "Off" | "OFF" | "n" | "N" => {
            Ok(false)
        }
        _ => Err(serde::de::Error::custom(format!(
            "expected true or false, got {word:?}"
        ))),
    }
}

/// One descriptor as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    key: Option<String>,
    value: Option<String>,
    rate_limit: Option<RawRateLimit>,
    #[serde(default, deserialize_with = "null_as_empty")]
    descriptors: Vec<RawDescriptor>,
    #[serde(default, deserialize_with = "flag")]
    shadow_mode: bool,
    #[serde(default, deserialize_with = "flag")]
    detailed_metric: bool,
    #[serde(default, deserialize_with = "flag")]
    value_to_metric: bool,
    #[serde(default, deserialize_with = "flag")]
    share_threshold: bool,
}

/// A `rate_limit` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimit {
    unit: Option<String>,
    requests_per_unit: Option<u32>,
    #[serde(default, deserialize_with = "flag")]
    unlimited: bool,
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<RawReplace>,
    algorithm: Option<String>,
    window: Option<String>,
    penalty: Option<RawPenalty>,
}

/// A `penalty` as written (floodgate's): `after` denials within `within`
/// ban the value for `ban`, doubling up to `max`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPenalty {
    after: u32,
    within: String,
    ban: String,
    max: String,
}

/// One `replaces` entry as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplace {
    name: Option<String>,
}

/// The length of each unit (a month is 30 days, a year 365).
pub fn unit_length(unit: Unit) -> Option<Duration> {
    let secs = match unit {
        Unit::Unknown => return None,
        Unit::Second => 1,
        Unit::Minute => 60,
        Unit::Hour => 3600,
        Unit::Day => 86_400,
        Unit::Week => 7 * 86_400,
        Unit::Month => 30 * 86_400,
        Unit::Year => 365 * 86_400,
    };
    Some(Duration::from_secs(secs))
}

/// The unit named `text` (any case).
fn parse_unit(text: &str) -> Option<Unit> {
    Some(match text.to_ascii_lowercase().as_str() {
        "second" => Unit::Second,
        "minute" => Unit::Minute,
        "hour" => Unit::Hour,
        "day" => Unit::Day,
        "week" => Unit::Week,
        "month" => Unit::Month,
        "year" => Unit::Year,
        _ => return None,
    })
}

/// The largest unit that divides `window` exactly, else `Unknown`.
pub fn unit_of(window: Duration) -> Unit {
    for unit in [
        Unit::Year,
        Unit::Month,
        Unit::Week,
        Unit::Day,
        Unit::Hour,
        Unit::Minute,
        Unit::Second,
    ] {
        if let Some(len) = unit_length(unit) {
            if window.as_millis() >= len.as_millis()
                && window.as_millis().is_multiple_of(len.as_millis())
            {
                return unit;
            }
        }
    }
    Unit::Unknown
}

/// The algorithm for `requests_per_unit` (at least 1) per `window`: the
/// one named, else `default`; when none is named and the limit is above
/// the default's largest (its burst, for the token bucket), the sliding
/// counter (which takes up to 10^9).
pub fn algorithm_for(
    named: Option<&str>,
    default: &str,
    requests: NonZeroU32,
    window: Duration,
) -> Result<Algorithm, String> {
    let name = named.unwrap_or(default);
    let bucket = name == "token_bucket";
    let largest = if bucket {
        Algorithm::max_limit("sliding_window")
    } else {
        Algorithm::max_limit(name)
    };
    let Some(max) = largest else {
        return Err(format!(
            "unknown algorithm {name:?}, expected one of {}",
            Algorithm::NAMES.join(", ")
        ));
    };
    if requests.get() > max {
        if named.is_some() {
            let what = if bucket { "burst" } else { "limit" };
            return Err(format!(
                "requests_per_unit {requests} is above {name}'s largest {what} {max} \
                 (gcra and sliding_counter take up to 1000000000)"
            ));
        }
        return Algorithm::windowed("sliding_counter", requests.get(), window)
            .map_err(|e| e.to_string());
    }
    if bucket {
        let rate = f64::from(requests.get()) / window.as_secs_f64();
        return Algorithm::token_bucket(rate, requests.get()).map_err(|e| e.to_string());
    }
    Algorithm::windowed(name, requests.get(), window).map_err(|e| e.to_string())
}

/// Reads the descriptor files at `path` (a file, or a folder of `*.yaml`
/// and `*.yml` files) and compiles them; `algorithm` is the one a
/// `rate_limit` without its own gets.
pub fn load(path: &Path, algorithm: &str) -> Result<Matcher, ConfigError> {
    let shown = path.display().to_string();
    let files = files_of(path).map_err(|what| ConfigError {
        file: shown.clone(),
        place: "[rls] descriptors".into(),
        what,
    })?;
    let mut matcher = Matcher::default();
    for file in files {
        let name = file.display().to_string();
        let text = std::fs::read_to_string(&file).map_err(|e| ConfigError {
            file: name.clone(),
            place: "[rls] descriptors".into(),
            what: format!("cannot be read: {e}"),
        })?;
        add_file(&mut matcher, &text, &name, algorithm)?;
    }
    Ok(matcher)
}

/// The files `path` names, in name order.
pub fn files_of(path: &Path) -> Result<Vec<PathBuf>, String> {
    Ok(listing(path)?.0)
}

/// What a user may have meant as descriptor files and floodgate does not
/// read (envoyproxy/ratelimit reads every file of its folder, sub-folders
/// too), and an empty set: one line each, for the log and `check-config`.
pub fn warnings(path: &Path, matcher: &Matcher) -> Vec<String> {
    let mut out: Vec<String> = listing(path)
        .map(|(_, skipped)| skipped)
        .unwrap_or_default()
        .into_iter()
        .map(|p| {
            format!(
                "{}: not read: the descriptor files are the *.yaml and *.yml files of the folder itself",
                p.display()
            )
        })
        .collect();
    for (path, name) in matcher.renamed() {
        out.push(format!(
            "descriptor {path:?}: its limit is named {name:?}: another limit has the name its path makes"
        ));
    }
    if matcher.domains().is_empty() {
        out.push(format!(
            "{}: no descriptor file: every call is answered OK without a limit",
            path.display()
        ));
    }
    out
}

/// The files `path` names, in name order, and the other entries of a
/// folder (sub-folders, files of other names; not those whose names start
/// with a dot, as editors' and tools' own files do).
fn listing(path: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>), String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot be read: {e}"))?;
    if !meta.is_dir() {
        return Ok((vec![path.to_path_buf()], Vec::new()));
    }
    let (mut files, mut skipped) = (Vec::new(), Vec::new());
    let entries = std::fs::read_dir(path).map_err(|e| format!("cannot be read: {e}"))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot be read: {e}"))?;
        let p = entry.path();
        let yaml = p
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e == "yaml" || e == "yml");
        if yaml && p.is_file() {
            files.push(p);
        } else if !entry.file_name().to_string_lossy().starts_with('.') {
            skipped.push(p);
        }
    }
    files.sort();
    skipped.sort();
    Ok((files, skipped))
}

/// Parses one file's text and adds its domain to `matcher`.
pub fn add_file(
    matcher: &mut Matcher,
    text: &str,
    file: &str,
    algorithm: &str,
) -> Result<(), ConfigError> {
    let err = |place: String, what: String| ConfigError {
        file: file.to_string(),
        place,
        what,
    };
    let raw: RawFile = serde_yaml_ng::from_str(text).map_err(|e| {
        let place = e
            .location()
            .map(|l| format!("line {}, column {}", l.line(), l.column()))
            // (An error of the whole text, such as a second document.)
            .unwrap_or_else(|| "the YAML".to_string());
        let mut what = e.to_string().replace('`', "\"");
        if let Some(at) = what.rfind(" at line ") {
            what.truncate(at);
        }
        // Not the name of a type of ours: what the file should hold there.
        for (raw, shown) in [
            (
                "struct RawFile",
                "a mapping with a domain and its descriptors",
            ),
            ("struct RawDescriptor", "a descriptor: a mapping with a key"),
            ("struct RawRateLimit", "a rate_limit mapping"),
            (
                "struct RawReplace",
                "a replaces entry: a mapping with a name",
            ),
        ] {
            what = what.replace(raw, shown);
        }
        err(place, what)
    })?;
    let domain = match raw.domain {
        Some(d) if !d.is_empty() => d,
        _ => {
            return Err(err(
                "domain".into(),
                "the domain must be given and not empty".into(),
            ))
        }
    };
    if let Some(other) = matcher.file_of_domain(&domain) {
        return Err(err(
            format!("domain {domain:?}"),
            format!("duplicate domain: the descriptor file {other} already has it"),
        ));
    }
    let root = matcher.add_domain(&domain, file);
    let ctx = Ctx {
        file,
        domain: &domain,
        algorithm,
    };
    add_level(matcher, &ctx, root, &domain, &raw.descriptors)?;
    // A name this file's limits share with an earlier one's (the files
    // before it were checked as they came).
    matcher
        .check_names()
        .map_err(|(place, what)| err(place, what))
}

/// What every descriptor of one file is read with.
struct Ctx<'a> {
    file: &'a str,
    domain: &'a str,
    algorithm: &'a str,
}

fn add_level(
    matcher: &mut Matcher,
    ctx: &Ctx<'_>,
    parent: usize,
    parent_path: &str,
    descriptors: &[RawDescriptor],
) -> Result<(), ConfigError> {
    for (i, d) in descriptors.iter().enumerate() {
        let err = |place: String, what: String| ConfigError {
            file: ctx.file.to_string(),
            place,
            what,
        };
        let key = match d.key.as_deref() {
            Some(k) if !k.is_empty() => k,
            _ => {
                return Err(err(
                    format!("descriptor {} under {parent_path:?}", i + 1),
                    "the descriptor has no key (or an empty one)".into(),
                ))
            }
        };
        let value = d.value.as_deref().filter(|v| !v.is_empty());
        let path = match value {
            Some(v) => format!("{parent_path}.{key}_{v}"),
            None => format!("{parent_path}.{key}"),
        };
        let place = format!("descriptor {path:?}");
        let kind = match value {
            None => NodeKind::KeyOnly,
            Some(v) if v.contains('*') => NodeKind::Wildcard {
                pattern: Pattern::new(v),
                shared: d.share_threshold,
            },
            Some(v) => NodeKind::Exact(v.to_string()),
        };
        if d.share_threshold && !matches!(kind, NodeKind::Wildcard { .. }) {
            return Err(err(
                place,
                "share_threshold needs a wildcard value (one with \"*\")".into(),
            ));
        }
        let limit = match &d.rate_limit {
            None => None,
            Some(rl) => {
                Some(check_rate_limit(ctx, rl, d, &path).map_err(|w| err(place.clone(), w))?)
            }
        };
        let node = matcher
            .add_node(parent, key, kind, limit, d.value_to_metric)
            .map_err(|w| err(place.clone(), w))?;
        add_level(matcher, ctx, node, &path, &d.descriptors)?;
    }
    Ok(())
}

/// A `rate_limit`, checked; `path` is the descriptor's path (its default name).
fn check_rate_limit(
    ctx: &Ctx<'_>,
    rl: &RawRateLimit,
    d: &RawDescriptor,
    path: &str,
) -> Result<Limit, String> {
    let name = match rl.name.as_deref() {
        Some("") => return Err("the rate_limit's name must not be empty".into()),
        Some(n) => n.to_string(),
        None => path.to_string(),
    };
    if name.len() > 512 || name.chars().any(char::is_control) {
        return Err(format!(
            "the rate_limit's name must be at most 512 bytes without control characters, got {name:?}"
        ));
    }
    let mut replaces = Vec::new();
    for r in &rl.replaces {
        match r.name.as_deref() {
            None | Some("") => return Err("a replaces entry has an empty name".into()),
            // Its own name, given or the default path name: a limit that
            // replaced itself would never apply.
            Some(n) if n == name => {
                return Err(format!("replaces names the limit's own name {n:?}"))
            }
            Some(n) => replaces.push(n.to_string()),
        }
    }
    let mut limit = Limit {
        name,
        named: rl.name.is_some(),
        domain: ctx.domain.to_string(),
        path: path.to_string(),
        requests_per_unit: 0,
        unit: Unit::Unknown,
        window: Duration::from_secs(1),
        algorithm: None,
        unlimited: rl.unlimited,
        shadow: d.shadow_mode,
        replaces,
        detailed_metric: d.detailed_metric,
        penalty: None,
    };
    if rl.penalty.is_some() && (rl.unlimited || rl.requests_per_unit == Some(0)) {
        return Err(
            "a penalty needs a limit that can admit a call (not unlimited, nor requests_per_unit: 0)"
                .into(),
        );
    }
    limit.penalty = rl.penalty.as_ref().map(penalty_of).transpose()?;
    if rl.unlimited {
        if rl.unit.is_some() || rl.window.is_some() {
            return Err("an unlimited rate_limit takes no unit or window".into());
        }
        if rl.algorithm.is_some() {
            return Err("an unlimited rate_limit takes no algorithm".into());
        }
        limit.requests_per_unit = rl.requests_per_unit.unwrap_or(0);
        return Ok(limit);
    }
    let (unit, window) = match (rl.unit.as_deref(), rl.window.as_deref()) {
        (Some(_), Some(_)) => return Err("give unit or window, not both".into()),
        (None, None) => {
            return Err(
                "the rate_limit needs a unit (second, minute, hour, day, week, month, year), \
                 or a window, or unlimited: true"
                    .into(),
            )
        }
        (Some(u), None) => {
            let unit = parse_unit(u).ok_or_else(|| {
                format!(
                    "invalid rate limit unit {u:?}, expected second, minute, hour, day, week, month or year"
                )
            })?;
            (unit, unit_length(unit).unwrap_or(Duration::from_secs(1)))
        }
        (None, Some(w)) => {
            let window = duration_at_most(w, floodgate::config::MAX_WINDOW)
                .map_err(|e| format!("window: {e}"))?;
            (unit_of(window), window)
        }
    };
    let Some(requests) = rl.requests_per_unit else {
        return Err("the rate_limit needs requests_per_unit (0: every request is over)".into());
    };
    limit.unit = unit;
    limit.window = window;
    limit.requests_per_unit = requests;
    limit.algorithm = match NonZeroU32::new(requests) {
        None => {
            if let Some(a) = rl.algorithm.as_deref() {
                // Still a name the file may use.
                algorithm_for(Some(a), ctx.algorithm, NonZeroU32::MIN, window)?;
            }
            None
        }
        Some(n) => Some(algorithm_for(
            rl.algorithm.as_deref(),
            ctx.algorithm,
            n,
            window,
        )?),
    };
    Ok(limit)
}

/// A checked `penalty`, in the words a configuration file's gets.
fn penalty_of(raw: &RawPenalty) -> Result<Penalty, String> {
    let duration = |what: &str, text: &str| {
        duration_at_most(text, floodgate::config::MAX_WINDOW)
            .map_err(|e| format!("penalty {what}: {e}"))
    };
    Penalty::new(
        raw.after,
        duration("within", &raw.within)?,
        duration("ban", &raw.ban)?,
        duration("max", &raw.max)?,
    )
    .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rls::proto::Entry;

    fn load_one(text: &str) -> Result<Matcher, String> {
        let mut m = Matcher::default();
        add_file(&mut m, text, "t.yaml", "sliding_window").map_err(|e| e.to_string())?;
        m.check_names()
            .map_err(|(p, w)| format!("t.yaml: {p}: {w}"))?;
        Ok(m)
    }

    fn entries(pairs: &[(&str, &str)]) -> Vec<Entry> {
        pairs
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect()
    }

    /// The rule name and identity values `pairs` reach in domain `d`.
    fn hit(m: &Matcher, d: &str, pairs: &[(&str, &str)]) -> Option<(String, Vec<String>)> {
        let e = entries(pairs);
        m.find(d, &e).map(|x| {
            (
                x.limit.name.clone(),
                x.values.iter().map(|v| v.to_string()).collect(),
            )
        })
    }

    const TREE: &str = r#"
domain: d
descriptors:
  - key: k
    value: v
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: k
    value: "v*"
    rate_limit: {name: prefix, unit: minute, requests_per_unit: 2}
  - key: k
    value: "*x"
    rate_limit: {name: suffix, unit: minute, requests_per_unit: 3}
  - key: k
    rate_limit: {unit: hour, requests_per_unit: 4}
  - key: files
    value: "a/*"
    share_threshold: true
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: outer
    value: o
    descriptors:
      - key: inner
        rate_limit: {unit: day, requests_per_unit: 6}
  - key: free
    rate_limit: {unlimited: true}
  - key: never
    rate_limit: {unit: second, requests_per_unit: 0}
"#;

    #[test]
    fn exact_then_first_wildcard_then_key_only() {
        let m = load_one(TREE).unwrap();
        assert_eq!(hit(&m, "d", &[("k", "v")]).unwrap().0, "d.k_v");
        // Both wildcards match "vx": the first in file order wins.
        assert_eq!(
            hit(&m, "d", &[("k", "vx")]).unwrap(),
            ("prefix".into(), vec!["vx".into()])
        );
        assert_eq!(hit(&m, "d", &[("k", "ax")]).unwrap().0, "suffix");
        assert_eq!(
            hit(&m, "d", &[("k", "zz")]).unwrap(),
            ("d.k".into(), vec!["zz".into()])
        );
        // share_threshold: every value shares one count.
        assert_eq!(
            hit(&m, "d", &[("files", "a/1")]).unwrap(),
            ("d.files_a/*".into(), vec![])
        );
        assert!(hit(&m, "d", &[("files", "b/1")]).is_none());
    }

    /// `descriptors: null`, at the top and inside a descriptor, is none.
    #[test]
    fn null_descriptors_are_none() {
        let m = load_one("domain: n\ndescriptors: null\n").unwrap();
        assert!(hit(&m, "n", &[("k", "v")]).is_none());
        let m = load_one(
            "domain: n\ndescriptors:\n  - key: k\n    descriptors: null\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        )
        .unwrap();
        assert_eq!(hit(&m, "n", &[("k", "v")]).unwrap().0, "n.k");
    }

    #[test]
    fn nested_unknown_and_leaving_the_tree() {
        let m = load_one(TREE).unwrap();
        assert_eq!(
            hit(&m, "d", &[("outer", "o"), ("inner", "i1")]).unwrap(),
            ("d.outer_o.inner".into(), vec!["i1".into()])
        );
        // Ends on a node without rate_limit.
        assert!(hit(&m, "d", &[("outer", "o")]).is_none());
        // Goes deeper than the tree.
        assert!(hit(&m, "d", &[("k", "v"), ("more", "x")]).is_none());
        assert!(hit(&m, "d", &[("nope", "x")]).is_none());
        assert!(hit(&m, "other", &[("k", "v")]).is_none());
        assert!(hit(&m, "d", &[]).is_none());
    }

    #[test]
    fn units_windows_algorithms_and_special_limits() {
        let m = load_one(
            r#"
domain: u
descriptors:
  - key: a
    rate_limit: {unit: week, requests_per_unit: 7}
  - key: b
    rate_limit: {window: 90s, requests_per_unit: 7, algorithm: token_bucket}
  - key: c
    rate_limit: {window: 2h, requests_per_unit: 7, algorithm: gcra}
  - key: d
    rate_limit: {unit: MONTH, requests_per_unit: 500000}
  - key: f
    rate_limit: {window: 1500ms, requests_per_unit: 7}
  - key: e
    shadow_mode: true
    rate_limit: {unit: year, requests_per_unit: 0}
"#,
        )
        .unwrap();
        let l = m.limits();
        assert_eq!(l[0].unit, Unit::Week);
        assert_eq!(l[0].window, Duration::from_secs(7 * 86_400));
        // The largest unit that divides the window.
        assert_eq!(l[1].unit, Unit::Second);
        assert_eq!(l[1].algorithm.unwrap().name(), "token_bucket");
        assert_eq!(l[2].unit, Unit::Hour);
        assert_eq!(l[2].algorithm.unwrap().name(), "gcra");
        // Above the sliding window's largest limit: the sliding counter.
        assert_eq!(l[3].algorithm.unwrap().name(), "sliding_counter");
        assert_eq!(l[3].window, Duration::from_secs(30 * 86_400));
        assert_eq!(l[4].unit, Unit::Unknown);
        assert!(l[5].algorithm.is_none() && l[5].shadow && !l[5].unlimited);
    }

    #[test]
    fn refusals_say_where_and_what() {
        let cases: &[(&str, &str)] = &[
            ("domain: d\ndescriptors:\n  - key: a\n    valu: x\n", "t.yaml: line 4, column 5: descriptors[0]: unknown field \"valu\", expected one of \"key\""),
            ("descriptors: []\n", "t.yaml: domain: the domain must be given"),
            ("domain: d\ndescriptors:\n  - value: x\n", "t.yaml: descriptor 1 under \"d\": the descriptor has no key"),
            ("domain: d\ndescriptors:\n  - {key: a, value: x}\n  - {key: a, value: x}\n", "descriptor \"d.a_x\": duplicate descriptor"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {requests_per_unit: 1}\n", "needs a unit"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second}\n", "needs requests_per_unit"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, unit: second}\n", "unlimited rate_limit takes no unit"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {name: n, unit: second, requests_per_unit: 1, replaces: [{name: n}]}\n", "replaces names the limit's own name"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: ''}]}\n", "empty name"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, replaces: [{name: d.a}]}\n", "replaces names the limit's own name \"d.a\""),
            ("domain: d\ndescriptors:\n  - key: a\n    value: b\n    share_threshold: true\n", "share_threshold needs a wildcard"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, algorithm: leaky}\n", "unknown algorithm \"leaky\""),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, window: 1m, requests_per_unit: 1}\n", "unit or window, not both"),
            ("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {name: same, unit: second, requests_per_unit: 1}\n  - key: b\n    rate_limit: {name: same, unit: second, requests_per_unit: 1}\n", "also the name of"),
            ("domain: [unclosed\n", "t.yaml: line"),
        ];
        for (text, wanted) in cases {
            let got = load_one(text).err().unwrap_or_default();
            assert!(got.contains(wanted), "{text:?}: {got:?} lacks {wanted:?}");
        }
    }

    #[test]
    fn a_limit_above_the_default_algorithms_largest_gets_the_sliding_counter() {
        let n = NonZeroU32::new(500_000).unwrap();
        for default in ["token_bucket", "sliding_window", "fixed_window"] {
            let a = algorithm_for(None, default, n, Duration::from_secs(1)).unwrap();
            assert_eq!(a.name(), "sliding_counter", "{default}");
        }
        let named = algorithm_for(Some("token_bucket"), "gcra", n, Duration::from_secs(1));
        assert!(named
            .unwrap_err()
            .contains("token_bucket's largest burst 100000"));
        let small = algorithm_for(
            None,
            "token_bucket",
            NonZeroU32::MIN,
            Duration::from_secs(1),
        );
        assert_eq!(small.unwrap().name(), "token_bucket");
    }

    /// Flags read as envoyproxy/ratelimit's YAML 1.1 reader reads them.
    #[test]
    fn flags_read_as_yaml_one_one_reads_them() {
        for (word, on) in [
            ("true", true),
            ("yes", true),
            ("On", true),
            ("Y", true),
            ("false", false),
            ("NO", false),
            ("off", false),
            ("", false),
        ] {
            // (A limit that is not unlimited needs its numbers.)
            let numbers = if on {
                ""
            } else {
                ", unit: second, requests_per_unit: 1"
            };
            let text = format!(
                "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: {word}\n    rate_limit: {{unlimited: {word}{numbers}}}\n"
            );
            let m = load_one(&text).unwrap_or_else(|e| panic!("{word:?}: {e}"));
            let l = &m.limits()[0];
            assert_eq!((l.shadow, l.unlimited), (on, on), "{word:?}");
        }
        let e =
            load_one("domain: d\ndescriptors:\n  - key: a\n    shadow_mode: maybe\n").unwrap_err();
        assert!(e.contains("expected true or false, got \"maybe\""), "{e}");
    }

    /// Paths can make one name (`a_b` = `c` and `a` = `b_c`; `a.b` and `a`
    /// then `b`), or a given name: the file is read as envoyproxy/ratelimit
    /// reads it, and the later unnamed limits get `#2`, `#3`, with a warning.
    #[test]
    fn unnamed_limits_whose_paths_meet_are_numbered() {
        let rl = "rate_limit: {unit: minute, requests_per_unit: 3}";
        let text = format!(
            "domain: x\ndescriptors:\n  - key: a_b\n    value: c\n    {rl}\n  - key: a\n    value: b_c\n    {rl}\n  - key: q\n    rate_limit: {{name: x.a_b_c#3, unit: minute, requests_per_unit: 3}}\n  - key: r\n    rate_limit: {{name: x.a, unit: minute, requests_per_unit: 3}}\n  - key: a\n    {rl}\n"
        );
        let m = load_one(&text).unwrap();
        let names: Vec<&str> = m.limits().iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["x.a_b_c", "x.a_b_c#2", "x.a_b_c#3", "x.a", "x.a#2"]);
        let dir = std::env::temp_dir().join(format!("fg-rls-names-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("x.yaml"), &text).unwrap();
        let w = warnings(&dir, &load(&dir, "sliding_window").unwrap());
        assert_eq!(
            w,
            [
                "descriptor \"x.a_b_c\": its limit is named \"x.a_b_c#2\": another limit has the name its path makes",
                "descriptor \"x.a\": its limit is named \"x.a#2\": another limit has the name its path makes",
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// What a folder holds besides its descriptor files is named, as is an
    /// empty set: envoyproxy/ratelimit would have read those files.
    #[test]
    fn files_not_read_and_an_empty_set_are_warned_of() {
        let dir = std::env::temp_dir().join(format!("fg-rls-warn-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        for f in ["a.yaml", "b.conf", ".a.yaml.swp"] {
            std::fs::write(dir.join(f), "domain: a\n").unwrap();
        }
        let m = load(&dir, "sliding_window").unwrap();
        let w = warnings(&dir, &m);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].ends_with("b.conf: not read: the descriptor files are the *.yaml and *.yml files of the folder itself"), "{w:?}");
        assert!(w[1].contains("sub: not read"), "{w:?}");
        std::fs::remove_file(dir.join("a.yaml")).unwrap();
        let m = load(&dir, "sliding_window").unwrap();
        let w = warnings(&dir, &m);
        assert!(
            w[2].ends_with("no descriptor file: every call is answered OK without a limit"),
            "{w:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_domain_twice_is_refused() {
        let mut m = Matcher::default();
        add_file(&mut m, "domain: d\n", "a.yaml", "sliding_window").unwrap();
        let e = add_file(&mut m, "domain: d\n", "b.yaml", "sliding_window").unwrap_err();
        assert_eq!(
            e.to_string(),
            "b.yaml: domain \"d\": duplicate domain: the descriptor file a.yaml already has it"
        );
    }
}
