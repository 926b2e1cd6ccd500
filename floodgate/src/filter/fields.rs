//! The response fields that show clients the state of the rules that
//! matched, each rule in its own dialect (its `headers`).
//!
//! `ietf` rules are listed one item each in `RateLimit-Policy` and
//! `RateLimit`. The other dialects carry one rule each: the most
//! restrictive matching rule of that dialect (least remaining, then
//! soonest reset). `none` rules and shadow rules never show.
//!
//! Several dialects want the same field names (`ietf` and `draft-7` both
//! write `RateLimit` and `RateLimit-Policy`; `draft-6` writes
//! `RateLimit-Policy` too). One response never mixes two meanings in one
//! field: the dialects are served in the order `ietf`, `draft-7`,
//! `draft-6`, `x-ratelimit`, and a dialect that needs a field name already
//! in the response is left out of that response entirely (its other fields
//! too, so a client never reads half of one rule and half of another).
//! `x-ratelimit` shares no name with the others, so it always shows.
//!
//! Filters nest (limits wrapped on a resource inside the app's filter):
//! the inner one writes first, the outer one merges. `ietf` lists are
//! merged as text (ours first, then the inner's items); the one-rule
//! dialects are merged from what the inner filter noted ([`Noted`], which
//! each door carries from the inner filter to the outer one), so that the
//! pick is the most restrictive over both filters.
//!
//! A request with an `Origin` (a page's script, across origins) gets the
//! names of the rate-limit fields its response carries (and `Retry-After`
//! on a denial) in `Access-Control-Expose-Headers`, after the names the
//! application listed there itself: a browser lets the script read only
//! the fields named there.

use std::cell::RefCell;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::limiter::Outcome;
use crate::rule::{HeaderDialect, Mode, Rule};

thread_local! {
    /// The `ietf` lists (`RateLimit-Policy`, `RateLimit`) of the response
    /// being written, kept from one response to the next: each is copied
    /// into its field, so writing them allocates nothing more per response.
    static LISTS: RefCell<(String, String)> =
        const { RefCell::new((String::new(), String::new())) };
}

/// One rule's numbers, as a one-rule dialect shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pick {
    limit: u32,
    window: u64,
    remaining: u64,
    /// Seconds until the quota resets (denied: until the request fits).
    reset: u64,
}

impl Pick {
    /// The more restrictive of two: less remaining, then the sooner reset.
    fn tighter(self, other: Option<Pick>) -> Pick {
        match other {
            Some(o) if (o.remaining, o.reset) < (self.remaining, self.reset) => o,
            _ => self,
        }
    }
}

/// The one-rule dialects, in the order they get field names.
const SINGLE: [HeaderDialect; 3] = [
    HeaderDialect::Draft7,
    HeaderDialect::Draft6,
    HeaderDialect::XRateLimit,
];

/// The field names a one-rule dialect writes.
fn names(dialect: HeaderDialect) -> &'static [&'static str] {
    match dialect {
        HeaderDialect::Draft7 => &["ratelimit", "ratelimit-policy"],
        HeaderDialect::Draft6 => &[
            "ratelimit-limit",
            "ratelimit-remaining",
            "ratelimit-reset",
            "ratelimit-policy",
        ],
        HeaderDialect::XRateLimit => &[
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
        ],
        _ => &[],
    }
}

fn slot(dialect: HeaderDialect) -> Option<usize> {
    SINGLE.iter().position(|d| *d == dialect)
}

/// Whether `dialect` shows one rule (the most restrictive) rather than a
/// list of them.
pub(crate) fn is_one_rule(dialect: HeaderDialect) -> bool {
    slot(dialect).is_some()
}

/// A response's header fields, whatever the framework's header map: what
/// the fields are written into.
pub(crate) trait FieldMap {
    /// The field's value, when it is text.
    fn text(&self, name: &'static str) -> Option<&str>;
    /// Every line of the field that is text, joined as one list.
    fn joined(&self, name: &'static str) -> Option<String>;
    /// Whether the field is there.
    fn has(&self, name: &'static str) -> bool;
    /// Sets the field (a value that is no field value is left out).
    fn set(&mut self, name: &'static str, value: String);
    /// Removes the field.
    fn unset(&mut self, name: &'static str);
}

impl FieldMap for http::HeaderMap {
    fn text(&self, name: &'static str) -> Option<&str> {
        self.get(name).and_then(|v| v.to_str().ok())
    }
    fn joined(&self, name: &'static str) -> Option<String> {
        join(self.get_all(name).iter().filter_map(|v| v.to_str().ok()))
    }
    fn has(&self, name: &'static str) -> bool {
        self.contains_key(name)
    }
    fn set(&mut self, name: &'static str, value: String) {
        if let Ok(v) = http::HeaderValue::try_from(value) {
            self.insert(http::HeaderName::from_static(name), v);
        }
    }
    fn unset(&mut self, name: &'static str) {
        self.remove(name);
    }
}

/// The lines of a field as one list (`None` when there is none).
pub(super) fn join<'a>(lines: impl Iterator<Item = &'a str>) -> Option<String> {
    let mut joined: Option<String> = None;
    for line in lines {
        match &mut joined {
            Some(j) => {
                j.push_str(", ");
                j.push_str(line);
            }
            None => joined = Some(line.to_string()),
        }
    }
    joined
}

/// The field that names what a page's script may read of a response.
const EXPOSE: &str = "access-control-expose-headers";

/// The fields a script may be let read: every name a dialect writes, then
/// `Retry-After` (of a denial).
const EXPOSABLE: [&str; 9] = [
    "ratelimit-policy",
    "ratelimit",
    "ratelimit-limit",
    "ratelimit-remaining",
    "ratelimit-reset",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "retry-after",
];

/// What `Access-Control-Expose-Headers` holds for a request with an
/// `Origin`: the application's own list, and the names a filter added after
/// it. Noted for the filter around ([`Noted`]), so that it lists exactly
/// the fields the response carries once it merged its own.
#[derive(Debug, Clone, Default)]
pub(crate) struct Exposed {
    /// The application's own list, as it was before any filter added to it.
    app: Option<String>,
    /// The rate-limit fields a filter listed after it.
    listed: Vec<&'static str>,
}

impl Exposed {
    /// For a response whose `Access-Control-Expose-Headers`, if any, is the
    /// application's own.
    pub(crate) fn of(headers: &impl FieldMap) -> Exposed {
        Exposed {
            app: headers.joined(EXPOSE),
            listed: Vec::new(),
        }
    }
}

/// Names in `Access-Control-Expose-Headers` the rate-limit fields that
/// `headers` carry (`Retry-After` only on a denial: `denied`, or a filter
/// inside listed it), after the application's own names, none twice.
pub(crate) fn expose(headers: &mut impl FieldMap, exposed: &mut Exposed, denied: bool) {
    let carried: Vec<&'static str> = EXPOSABLE
        .iter()
        .copied()
        .filter(|name| {
            headers.has(name) && (*name != "retry-after" || denied || exposed.listed.contains(name))
        })
        .collect();
    if carried.is_empty() && exposed.listed.is_empty() {
        return;
    }
    let mut value = exposed.app.clone().unwrap_or_default();
    for name in &carried {
        let listed = value
            .split(',')
            .any(|item| item.trim().eq_ignore_ascii_case(name));
        if !listed {
            if !value.trim().is_empty() {
                value.push_str(", ");
            }
            value.push_str(name);
        }
    }
    exposed.listed = carried;
    if value.trim().is_empty() {
        headers.unset(EXPOSE);
    } else {
        headers.set(EXPOSE, value);
    }
}

/// What a filter showed in the one-rule dialects of a response, noted for
/// the filter around it ([`Noted`]). Only requests with a rule of such a
/// dialect carry one.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Shown {
    /// The pick of each dialect of [`SINGLE`], written or not.
    picks: [Option<Pick>; 3],
    /// Which of them are in the response (and so must go before a merge).
    written: [bool; 3],
}

/// What one filter notes for the filter around it (filters nest): what it
/// showed in the one-rule dialects, and what it listed for a page's script.
/// Each door carries it from the inner filter to the outer one: actix in
/// the request's extensions, tower in the response's.
#[derive(Debug, Clone, Default)]
pub(crate) struct Noted {
    shown: Option<Shown>,
    exposed: Option<Exposed>,
}

/// [`write`] for one of nested filters: after what the filter inside
/// `noted` (if any), and noting in turn what this one wrote (`None`:
/// nothing a filter around needs, the common case, so that a request
/// stores nothing). `origin`: the request came with an `Origin`.
pub(crate) fn write_noted(
    headers: &mut impl FieldMap,
    noted: Option<Noted>,
    origin: bool,
    (rules, outcomes): (&[&Rule], &[Outcome]),
    denied: bool,
) -> Option<Noted> {
    let Noted { shown, exposed } = noted.unwrap_or_default();
    let mut exposed = origin.then(|| exposed.unwrap_or_else(|| Exposed::of(headers)));
    let shown = write(headers, shown, rules, outcomes, denied, exposed.as_mut());
    (shown.is_some() || exposed.is_some()).then_some(Noted { shown, exposed })
}

/// A response no one could decide (503): `Retry-After` listed for a page's
/// script (when `origin`), after what a filter inside noted.
pub(crate) fn expose_unavailable(
    headers: &mut impl FieldMap,
    noted: Option<Noted>,
    origin: bool,
) -> Noted {
    let mut noted = noted.unwrap_or_default();
    if origin {
        let mut exposed = Exposed::of(headers);
        expose(headers, &mut exposed, true);
        noted.exposed = Some(exposed);
    }
    noted
}

/// Writes the fields of `rules` (with their `outcomes`, one each) into a
/// response's `headers`, after what an `inner` filter showed. `denied`: the
/// request took nothing from any of these rules (it was denied): in the
/// IETF lists a rule that denied shows 0 remaining, one that would have
/// admitted it what it holds now (its units still there); a one-rule
/// dialect's rule shows 0 remaining and a reset no sooner than the retry,
/// as a denial says. `exposed`: the request has an `Origin`, and the
/// fields the response then carries are named in
/// `Access-Control-Expose-Headers` ([`expose`]). Returns what a filter
/// around this one must know of the one-rule dialects shown, when any was.
pub(crate) fn write(
    headers: &mut impl FieldMap,
    inner: Option<Shown>,
    rules: &[&Rule],
    outcomes: &[Outcome],
    denied: bool,
    exposed: Option<&mut Exposed>,
) -> Option<Shown> {
    let shown = fields_of(headers, inner, rules, outcomes, denied);
    if let Some(exposed) = exposed {
        expose(headers, exposed, denied);
    }
    shown
}

/// [`write`] but for `Access-Control-Expose-Headers`.
fn fields_of(
    headers: &mut impl FieldMap,
    inner: Option<Shown>,
    rules: &[&Rule],
    outcomes: &[Outcome],
    denied: bool,
) -> Option<Shown> {
    use std::fmt::Write as _;
    // A denial's retry (the longest wait of the enforce rules that denied);
    // an allowed request has none to compute.
    let retry = if denied {
        rules
            .iter()
            .zip(outcomes)
            .filter(|(r, o)| r.mode == Mode::Enforce && !o.allowed)
            .map(|(_, o)| o.retry_after_secs())
            .max()
            .unwrap_or(0)
    } else {
        0
    };
    // An inner filter's one-rule fields are rewritten from its notes.
    let mut shown = Shown::default();
    if let Some(inner) = inner {
        for (i, dialect) in SINGLE.iter().enumerate() {
            if inner.written[i] {
                for name in names(*dialect) {
                    headers.unset(name);
                }
            }
        }
        shown.picks = inner.picks;
    }

    LISTS.with(|lists| {
        // Nothing below calls out, so the lists are never borrowed twice;
        // were they, fresh ones would do.
        let mut fresh = (String::new(), String::new());
        let mut kept = lists.try_borrow_mut();
        let (policy, state) = match kept.as_deref_mut() {
            Ok(kept) => kept,
            Err(_) => &mut fresh,
        };
        policy.clear();
        state.clear();
        for (r, o) in rules.iter().zip(outcomes) {
            if r.mode != Mode::Enforce || r.headers == HeaderDialect::None {
                continue;
            }
            let mut o = *o;
            if o.allowed && denied {
                o.uncharge(r.cost, &r.algorithm);
            }
            let quota = o.limit(&r.algorithm);
            let remaining = if o.allowed { o.remaining } else { 0 };
            if r.headers == HeaderDialect::Ietf {
                if !policy.is_empty() {
                    policy.push_str(", ");
                    state.push_str(", ");
                }
                // Writing to a String cannot fail.
                let _ = write!(
                    policy,
                    "\"{}\";q={};w={}",
                    r.name,
                    quota,
                    o.window_seconds(&r.algorithm)
                );
                let _ = write!(state, "\"{}\";r={};t={}", r.name, remaining, o.reset_secs());
            } else if let Some(i) = slot(r.headers) {
                let pick = Pick {
                    limit: quota,
                    window: o.window_seconds(&r.algorithm),
                    remaining,
                    reset: o.reset_secs(),
                };
                shown.picks[i] = Some(pick.tighter(shown.picks[i]));
            }
        }

        if !policy.is_empty() {
            // An inner filter (limits declared on a resource) may have
            // written its own rules already: ours go first, theirs follow.
            for (name, ours) in [("ratelimit-policy", &*policy), ("ratelimit", &*state)] {
                let value = match headers.text(name) {
                    Some(inner) => format!("{ours}, {inner}"),
                    None => ours.to_string(),
                };
                headers.set(name, value);
            }
        }
    });

    if shown.picks.iter().all(Option::is_none) {
        return None;
    }
    for (i, dialect) in SINGLE.iter().enumerate() {
        let Some(pick) = shown.picks[i] else {
            continue;
        };
        // A name already there belongs to a dialect served before this one.
        if names(*dialect).iter().any(|n| headers.has(n)) {
            continue;
        }
        // A denial says 0 remaining, whichever rule the dialect shows, and
        // a reset no sooner than the retry.
        let pick = if denied {
            Pick {
                remaining: 0,
                reset: pick.reset.max(retry),
                ..pick
            }
        } else {
            pick
        };
        for (name, value) in fields(*dialect, pick) {
            headers.set(name, value);
        }
        shown.written[i] = true;
    }
    Some(shown)
}

/// The fields of a one-rule dialect for `pick`.
fn fields(dialect: HeaderDialect, pick: Pick) -> Vec<(&'static str, String)> {
    let Pick {
        limit,
        window,
        remaining,
        reset,
    } = pick;
    match dialect {
        HeaderDialect::Draft7 => vec![
            (
                "ratelimit",
                format!("limit={limit}, remaining={remaining}, reset={reset}"),
            ),
            ("ratelimit-policy", format!("{limit};w={window}")),
        ],
        HeaderDialect::Draft6 => vec![
            ("ratelimit-limit", limit.to_string()),
            ("ratelimit-remaining", remaining.to_string()),
            ("ratelimit-reset", reset.to_string()),
            ("ratelimit-policy", format!("{limit};w={window}")),
        ],
        HeaderDialect::XRateLimit => {
            // A moment in Unix seconds, rounded up like the relative reset.
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis().div_ceil(1000) as u64);
            vec![
                ("x-ratelimit-limit", limit.to_string()),
                ("x-ratelimit-remaining", remaining.to_string()),
                ("x-ratelimit-reset", (now + reset).to_string()),
            ]
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;
    use std::cell::RefCell;
    use std::time::Duration;

    /// A request through nested filters, as a door carries it: whether it
    /// has an `Origin`, and what the last filter noted.
    #[derive(Default)]
    struct Req {
        origin: bool,
        noted: RefCell<Option<Noted>>,
    }

    /// One filter writing its fields, as both doors do.
    fn noted(req: &Req, h: &mut HeaderMap, rules: &[&Rule], outcomes: &[Outcome], denied: bool) {
        let earlier = req.noted.borrow_mut().take();
        let now = write_noted(h, earlier, req.origin, (rules, outcomes), denied);
        *req.noted.borrow_mut() = now;
    }

    fn rule(name: &str, headers: HeaderDialect, limit: u32) -> Rule {
        let toml = format!(
            "[[rule]]\nname = \"{name}\"\npaths = [\"/x\"]\nlimit = {limit}\nwindow = \"1m\"\nheaders = \"{headers}\"\n"
        );
        crate::config::Config::parse(&toml, std::path::Path::new("t.toml"))
            .unwrap()
            .rules
            .remove(0)
    }

    fn ok(remaining: u64, secs: u64) -> Outcome {
        Outcome {
            allowed: true,
            remaining,
            wait: Duration::from_secs(secs),
            banned: false,
            ban_started: false,
            quota: None,
        }
    }

    fn text(h: &HeaderMap, name: &str) -> Option<String> {
        h.get(name).map(|v| v.to_str().unwrap().to_string())
    }

    fn written(rules: &[&Rule], outcomes: &[Outcome]) -> HeaderMap {
        let req = Req::default();
        let mut h = HeaderMap::new();
        noted(&req, &mut h, rules, outcomes, false);
        h
    }

    #[test]
    fn each_one_rule_dialect_shows_its_tightest_rule() {
        let a = rule("a", HeaderDialect::Draft6, 10);
        let b = rule("b", HeaderDialect::Draft6, 5);
        let c = rule("c", HeaderDialect::Draft6, 5);
        let h = written(&[&a, &b, &c], &[ok(9, 60), ok(4, 60), ok(4, 30)]);
        assert_eq!(text(&h, "ratelimit-limit").as_deref(), Some("5"));
        assert_eq!(text(&h, "ratelimit-remaining").as_deref(), Some("4"));
        assert_eq!(text(&h, "ratelimit-reset").as_deref(), Some("30"));
        assert_eq!(text(&h, "ratelimit-policy").as_deref(), Some("5;w=60"));
        assert_eq!(text(&h, "ratelimit"), None);
    }

    #[test]
    fn ietf_keeps_its_names_and_draft_7_is_left_out() {
        let a = rule("a", HeaderDialect::Ietf, 10);
        let b = rule("b", HeaderDialect::Draft7, 5);
        let x = rule("x", HeaderDialect::XRateLimit, 5);
        let h = written(&[&a, &b, &x], &[ok(9, 60), ok(1, 60), ok(2, 60)]);
        assert_eq!(text(&h, "ratelimit").as_deref(), Some("\"a\";r=9;t=60"));
        assert_eq!(
            text(&h, "ratelimit-policy").as_deref(),
            Some("\"a\";q=10;w=60")
        );
        assert_eq!(text(&h, "x-ratelimit-remaining").as_deref(), Some("2"));
    }

    #[test]
    fn draft_7_comes_before_draft_6() {
        let six = rule("six", HeaderDialect::Draft6, 10);
        let seven = rule("seven", HeaderDialect::Draft7, 5);
        let h = written(&[&six, &seven], &[ok(1, 60), ok(3, 60)]);
        assert_eq!(
            text(&h, "ratelimit").as_deref(),
            Some("limit=5, remaining=3, reset=60")
        );
        assert_eq!(text(&h, "ratelimit-policy").as_deref(), Some("5;w=60"));
        assert_eq!(text(&h, "ratelimit-remaining"), None);
        assert_eq!(text(&h, "ratelimit-limit"), None);
    }

    #[test]
    fn hidden_and_shadow_rules_never_show() {
        let hidden = rule("hidden", HeaderDialect::None, 3);
        let mut shadow = rule("shadow", HeaderDialect::XRateLimit, 3);
        shadow.mode = Mode::Shadow;
        let h = written(&[&hidden, &shadow], &[ok(0, 60), ok(0, 60)]);
        assert!(h.is_empty(), "{h:?}");
    }

    #[test]
    fn an_outer_filter_merges_with_the_inner_ones_pick() {
        let req = Req::default();
        let mut h = HeaderMap::new();
        let inner = rule("inner", HeaderDialect::XRateLimit, 5);
        noted(&req, &mut h, &[&inner], &[ok(1, 60)], false);
        let outer = rule("outer", HeaderDialect::XRateLimit, 100);
        noted(&req, &mut h, &[&outer], &[ok(50, 60)], false);
        assert_eq!(text(&h, "x-ratelimit-limit").as_deref(), Some("5"));
        assert_eq!(text(&h, "x-ratelimit-remaining").as_deref(), Some("1"));
        // An outer ietf rule takes RateLimit from an inner draft-7 rule.
        let req = Req::default();
        let mut h = HeaderMap::new();
        let inner = rule("inner", HeaderDialect::Draft7, 5);
        noted(&req, &mut h, &[&inner], &[ok(1, 60)], false);
        let outer = rule("outer", HeaderDialect::Ietf, 100);
        noted(&req, &mut h, &[&outer], &[ok(50, 60)], false);
        assert_eq!(
            text(&h, "ratelimit").as_deref(),
            Some("\"outer\";r=50;t=60")
        );
    }

    #[test]
    fn a_denial_shows_zero_for_the_denier_and_untaken_units_for_the_rest() {
        let req = Req::default();
        let mut h = HeaderMap::new();
        let a = rule("a", HeaderDialect::Ietf, 10);
        let b = rule("b", HeaderDialect::Ietf, 3);
        let denied = Outcome {
            allowed: false,
            remaining: 2,
            wait: Duration::from_millis(1500),
            banned: false,
            ban_started: false,
            quota: None,
        };
        noted(&req, &mut h, &[&a, &b], &[ok(4, 60), denied], true);
        assert_eq!(
            text(&h, "ratelimit").as_deref(),
            Some("\"a\";r=5;t=60, \"b\";r=0;t=2")
        );
    }

    /// The names of `Access-Control-Expose-Headers`, in order.
    fn exposed(h: &HeaderMap) -> Vec<String> {
        text(h, EXPOSE)
            .map(|v| v.split(", ").map(str::to_string).collect())
            .unwrap_or_default()
    }

    fn from_origin() -> Req {
        Req {
            origin: true,
            ..Req::default()
        }
    }

    #[test]
    fn a_request_with_an_origin_is_let_read_the_fields_it_gets() {
        let a = rule("a", HeaderDialect::Ietf, 10);
        let x = rule("x", HeaderDialect::XRateLimit, 5);
        let h = written(&[&a, &x], &[ok(9, 60), ok(4, 60)]);
        assert_eq!(text(&h, EXPOSE), None, "no Origin, nothing exposed");
        let mut h = HeaderMap::new();
        noted(
            &from_origin(),
            &mut h,
            &[&a, &x],
            &[ok(9, 60), ok(4, 60)],
            false,
        );
        assert_eq!(
            exposed(&h),
            [
                "ratelimit-policy",
                "ratelimit",
                "x-ratelimit-limit",
                "x-ratelimit-remaining",
                "x-ratelimit-reset"
            ]
        );
        // Rules that never show leave the field out.
        let hidden = rule("hidden", HeaderDialect::None, 3);
        let mut h = HeaderMap::new();
        noted(&from_origin(), &mut h, &[&hidden], &[ok(2, 60)], false);
        assert!(h.is_empty(), "{h:?}");
    }

    #[test]
    fn the_applications_own_names_come_first_and_none_twice() {
        use http::header::{HeaderName, HeaderValue};
        let a = rule("a", HeaderDialect::Ietf, 10);
        let mut h = HeaderMap::new();
        h.append(
            HeaderName::from_static(EXPOSE),
            HeaderValue::from_static("X-Request-Id, RateLimit"),
        );
        h.append(
            HeaderName::from_static(EXPOSE),
            HeaderValue::from_static("Retry-After"),
        );
        // A denial: Retry-After is named too (once: the app named it).
        h.insert(
            HeaderName::from_static("retry-after"),
            HeaderValue::from_static("5"),
        );
        noted(&from_origin(), &mut h, &[&a], &[ok(9, 60)], true);
        assert_eq!(
            exposed(&h),
            [
                "X-Request-Id",
                "RateLimit",
                "Retry-After",
                "ratelimit-policy"
            ]
        );
        // An allowed response's own Retry-After is no rate-limit field.
        let mut h = HeaderMap::new();
        h.insert(
            HeaderName::from_static("retry-after"),
            HeaderValue::from_static("5"),
        );
        noted(&from_origin(), &mut h, &[&a], &[ok(9, 60)], false);
        assert_eq!(exposed(&h), ["ratelimit-policy", "ratelimit"]);
    }

    #[test]
    fn an_outer_filter_names_exactly_the_fields_left_after_its_merge() {
        use http::header::{HeaderName, HeaderValue};
        let req = from_origin();
        let mut h = HeaderMap::new();
        h.insert(
            HeaderName::from_static(EXPOSE),
            HeaderValue::from_static("x-app"),
        );
        h.insert(
            HeaderName::from_static("retry-after"),
            HeaderValue::from_static("5"),
        );
        // The inner filter denies under draft-6; the outer one's ietf rule
        // takes RateLimit-Policy, so draft-6 leaves the response.
        let inner = rule("inner", HeaderDialect::Draft6, 5);
        let denied = Outcome {
            allowed: false,
            ..ok(0, 5)
        };
        noted(&req, &mut h, &[&inner], &[denied], true);
        assert_eq!(
            exposed(&h),
            [
                "x-app",
                "ratelimit-policy",
                "ratelimit-limit",
                "ratelimit-remaining",
                "ratelimit-reset",
                "retry-after"
            ]
        );
        let outer = rule("outer", HeaderDialect::Ietf, 100);
        noted(&req, &mut h, &[&outer], &[ok(50, 60)], false);
        assert_eq!(text(&h, "ratelimit-limit"), None);
        assert_eq!(
            exposed(&h),
            ["x-app", "ratelimit-policy", "ratelimit", "retry-after"]
        );
    }
}
