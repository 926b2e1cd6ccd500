//! The stages every door takes a request through: the rules that guard it
//! ([`guarding`]), the lookups of its key functions ([`lookups`]), each
//! rule's Redis key and check ([`checks`]), and after the decision
//! (`crate::gate`) the give-backs of `count = "failures"` ([`give_back`]).
//! Each door reads the body its keys need and writes the answer with its
//! own types (`actix/`, `tower.rs`).

use std::time::Instant;

use super::deny::{denying, noted, summary, DecidedBy, Denied, Input, Refused};
use super::head::Head;
use super::{json, usage, values, Filter, Usage, MAX_HEADER_BYTES};
use crate::gate::{self, Fallback, Named, Partial, Remembered, Verdict};
use crate::limiter::{Check, Decision, Outcome};
use crate::logging::{self, Escaped};
use crate::net::{self, HeaderLines};
use crate::rule::{self, Count, KeyKind, Mode, OnMissingKey, Rule};

impl Filter {
    /// [`Filter::key_for`], with the JSON body too, and what the rule's
    /// [`Key::lookup`](crate::Key::lookup) parts found (in their order).
    pub(crate) fn key_of<H: Head>(
        &self,
        rule: &Rule,
        req: &H,
        path: &str,
        body: &values::BodyRead<'_>,
        looked_up: &[Option<rule::Identity>],
    ) -> Result<values::Keyed, values::Unreadable> {
        let mut parts: Vec<(&'static str, String)> = Vec::with_capacity(rule.key.kinds().len());
        // Built once, and only for a key the application's functions read.
        let head = std::cell::OnceCell::new();
        let head = || head.get_or_init(|| req.request_head(self.client_of(req)));
        let mut lookups = looked_up.iter();
        let mut limit = None;
        let normalize = |v: Option<String>| v.and_then(|v| rule::normalize(&v, rule.normalize));
        for (at, kind) in rule.key.kinds().iter().enumerate() {
            let value = match kind {
                KeyKind::Ip => Some(net::ip_id(self.client_of(req))),
                KeyKind::Global => Some("all".to_string()),
                KeyKind::Path => Some(path.to_string()),
                KeyKind::Session => self.state.session.as_ref().and_then(|f| f(head())),
                KeyKind::Header(name) => normalize(values::header_value(req.headers(), name)?),
                KeyKind::Query(name) => {
                    normalize(values::urlencoded_value(req.query().as_bytes(), name)?)
                }
                KeyKind::Form(name) => match body.form {
                    Some(form) => normalize(values::urlencoded_value(form, name)?),
                    None => None,
                },
                KeyKind::Json(name) => match body.json {
                    Some(json) => normalize(json::json_value(json, name)?),
                    None => None,
                },
                KeyKind::Body(name) => match (body.form, body.json) {
                    (Some(form), _) => normalize(values::urlencoded_value(form, name)?),
                    (None, Some(json)) => normalize(json::json_value(json, name)?),
                    (None, None) => None,
                },
                KeyKind::Custom(f) if f.is_lookup() => match lookups.next() {
                    Some(Some(found)) => {
                        limit = found.limit().or(limit);
                        Some(f.prefixed(found.id()))
                    }
                    _ => None,
                },
                KeyKind::Custom(f) => f.key(head()),
            };
            match value.filter(|v| !v.is_empty()) {
                Some(v) => parts.push((kind.kind(), v)),
                None if rule.on_missing_key == OnMissingKey::Reject => {
                    return Err(values::Unreadable::Missing(at));
                }
                // Without a value of its own kind, a request is keyed by
                // its address alone (a part missing makes no combination),
                // with the rule's own quota.
                None => {
                    log::debug!(
                        "rule {}: no {kind} value, keyed by the client address",
                        rule.name
                    );
                    parts.clear();
                    parts.push(("ip", net::ip_id(self.client_of(req))));
                    limit = None;
                    break;
                }
            }
        }
        // One part (most rules) is used as it is; several are composed.
        let composed;
        let (kind, id) = match parts.as_slice() {
            [(kind, id)] => (*kind, id.as_str()),
            _ => {
                composed = rule::compose(&parts);
                (composed.0.as_str(), composed.1.as_str())
            }
        };
        Ok(values::Keyed {
            key: rule.state_key(
                self.state.limiter.hash_tags(),
                &self.state.key_prefix,
                kind,
                id,
            ),
            limit,
        })
    }
}

/// Stage 1: the rules that guard `req` (its method, and its decoded path or
/// the path the router routes, less the rules that skip or exempt it), and
/// its decoded path; `None` when no rule does, when the router routes it
/// under the unguarded prefix, or when it is a CORS preflight ([`is_preflight`]).
/// Refused: a header block over [`MAX_HEADER_BYTES`], a path that does not
/// decode. The path is copied only when a rule matched, so an unguarded
/// request allocates nothing here.
pub(super) fn guarding<'r, H: Head>(
    filter: &Filter,
    req: &H,
    rules: &'r [Rule],
) -> Result<Option<(Vec<&'r Rule>, String)>, Refused<'r>> {
    if req.header_bytes() > MAX_HEADER_BYTES {
        return Err(Refused::Input(Input::HeadersTooLarge));
    }
    let Ok(decoded) = percent_encoding::percent_decode_str(req.raw_path()).decode_utf8() else {
        return Err(Refused::Input(Input::BadPath));
    };
    // A CORS preflight asks whether the real request may be sent: no rule
    // counts or denies it (the browser could not read a denial anyway).
    if is_preflight(req) {
        return Ok(None);
    }
    let method = req.method();
    let routed = req.routed_path();
    // Exempt only what the router sends under the unguarded prefix.
    let unguarded = filter
        .state
        .unguarded
        .as_deref()
        .is_some_and(|p| is_under(routed, p));
    if unguarded {
        return Ok(None);
    }
    // A rule guards the decoded path (a client cannot step around it by
    // encoding a `/`), and the routed one (`/user/:id` guards
    // `/user/a%2Fb`, which the router sends to `/user/{id}`).
    let other = (routed != decoded).then_some(routed);
    // Built once, and only for a rule with a skip predicate or the bypass.
    let head = std::cell::OnceCell::new();
    let head = || head.get_or_init(|| req.request_head(filter.client_of(req)));
    let mut matched: Vec<&Rule> = rules
        .iter()
        .filter(|r| {
            (r.matches(method, &decoded) || other.is_some_and(|p| r.matches(method, p)))
                && (r.skip.is_none() || r.applies_to(head()))
        })
        .collect();
    // A rule's exempt clients are neither counted nor denied by it.
    if matched.iter().any(|r| !r.exempt.is_empty()) {
        let client = filter.client_of(req);
        matched.retain(|r| !r.exempts(client));
    }
    if matched.is_empty() {
        return Ok(None);
    }
    // The application's bypass: a request it names is neither counted nor
    // denied by any rule of this filter.
    if filter
        .state
        .bypass
        .as_ref()
        .is_some_and(|bypass| bypass(head()))
    {
        return Ok(None);
    }
    Ok(Some((matched, decoded.into_owned())))
}

/// Key functions that look the caller up, awaited in order: what each
/// matched rule's lookups found (nothing when no rule has one). Every door
/// calls it; the future holds no reference to the request.
pub(super) fn lookups<'r, H: Head>(
    filter: &Filter,
    req: &H,
    matched: &[&'r Rule],
) -> impl std::future::Future<Output = Vec<Vec<Option<rule::Identity>>>> + Send + 'r {
    let head = matched
        .iter()
        .any(|r| r.key.has_lookup())
        .then(|| req.request_head(filter.client_of(req)));
    // Copied only when a lookup will run (no allocation otherwise).
    let matched = if head.is_some() {
        matched.to_vec()
    } else {
        Vec::new()
    };
    async move {
        let mut looked_up = Vec::new();
        let Some(head) = head else {
            return looked_up;
        };
        for rule in matched {
            let mut found = Vec::new();
            for kind in rule.key.kinds() {
                if let KeyKind::Custom(f) = kind {
                    if let Some(lookup) = f.lookup(&head) {
                        found.push(lookup.await);
                    }
                }
            }
            looked_up.push(found);
        }
        looked_up
    }
}

/// Each matched rule's check, and the rules with an identity's own quota.
pub(super) struct Checked {
    pub(super) checks: Vec<Check>,
    /// A matched rule (by its index) with the quota its key chose.
    pub(super) own: Vec<(usize, Rule)>,
}

/// Stage 3: each matched rule's check (its Redis key, algorithm and cost),
/// and the rules whose key chose the identity's own quota, with that quota
/// (their index among `matched`). Refused: a key value that cannot be read
/// as the handler would, or that is missing for a rule that rejects those.
pub(super) fn checks<'r, H: Head>(
    filter: &Filter,
    req: &H,
    path: &str,
    bodies: &values::BodyRead<'_>,
    looked_up: &[Vec<Option<rule::Identity>>],
    matched: &[&'r Rule],
) -> Result<Checked, Refused<'r>> {
    let mut own: Vec<(usize, Rule)> = Vec::new();
    let mut checks: Vec<Check> = Vec::with_capacity(matched.len());
    for (i, rule) in matched.iter().enumerate() {
        let found = looked_up.get(i).map_or(&[][..], Vec::as_slice);
        let keyed = filter
            .key_of(rule, req, path, bodies, found)
            .map_err(|e| Refused::Unreadable(e, Some(rule)))?;
        let mut algorithm = rule.algorithm;
        if let Some(limit) = keyed.limit {
            match with_quota(rule, limit) {
                Some(a) => {
                    algorithm = a;
                    let mut r = (*rule).clone();
                    r.algorithm = a;
                    own.push((i, r));
                }
                None => crate::logging::repeated!(
                    &logging::BAD_QUOTA,
                    "rule {}: a key function chose the quota {limit}, which the rule cannot have (1 ..= {}, at least its cost {}); the rule's own applies",
                    rule.name,
                    rule.algorithm.max_quota(),
                    rule.cost
                ),
            }
        }
        checks.push(Check {
            key: keyed.key,
            algorithm,
            cost: rule.cost,
            enforce: rule.mode == Mode::Enforce,
            penalty: rule.penalty,
        });
    }
    Ok(Checked { checks, own })
}

/// A decided request, as every door answers it.
pub(super) enum Settled<'r> {
    /// The door writes the denial (see [`Denied::answer`]).
    Denied(Denied<'r>),
    /// The inner service answers, with the rules' fields.
    Admitted(Admitted<'r>),
}

/// An admitted request: the rules whose fields its answer carries, and
/// what each said.
pub(super) struct Admitted<'r> {
    pub(super) rules: Vec<&'r Rule>,
    pub(super) decision: Decision,
    /// The rules' checks, until [`Admitted::record`] hands them to `Usage`.
    checks: Vec<Check>,
    /// Decided in this process (Redis did not answer), at this time on the
    /// local limiter's clock: units go back here, and `Usage` has none.
    here: Option<u64>,
}

/// Stage 4: the decision on `matched` (with their `checks`; a rule of
/// `own` decides, and shows, the quota its key chose for the identity),
/// timed, and what it comes to ([`settle`]).
pub(super) async fn decided<'r>(
    filter: &Filter,
    matched: Vec<&'r Rule>,
    Checked { checks, own }: &'r mut Checked,
    (method, path): (&str, &str),
) -> (Settled<'r>, Instant) {
    let mut matched = matched;
    for (i, r) in own.iter() {
        matched[*i] = r;
    }
    let checks = std::mem::take(checks);
    let started = Instant::now();
    let limits = |i: usize| {
        let r: &Rule = matched[i];
        let named = Named::new(&r.name, r.on_redis_error);
        // (`count = "failures"` gives units back: its denials are not certain.)
        if r.count == Count::All {
            named
        } else {
            named.gives_back()
        }
    };
    let state = &filter.state;
    let verdict = gate::decide_each(&state.limiter, &state.metrics, &checks, limits).await;
    // A denial of several rules: what the others hold is remembered for
    // the denials answered from memory after it, and recalled for them.
    let recalled = match &verdict {
        Verdict::Redis(decision) if !decision.allowed => {
            state.recalled.remember(&checks, &decision.outcomes);
            None
        }
        Verdict::Remembered(_) => state.recalled.recall(&checks),
        _ => None,
    };
    let settled = settle(matched, checks, verdict, (method, path), recalled);
    (settled, started)
}

/// What the verdict on `matched` (with their `checks`) comes to
/// for the request `method` `path` (decoded), logged (the gate counted it).
/// `recalled`: for a denial answered from memory, what every rule held as
/// far as the last denial by Redis tells (see `recalled.rs`).
pub(super) fn settle<'r>(
    matched: Vec<&'r Rule>,
    checks: Vec<Check>,
    verdict: Verdict,
    (method, path): (&str, &str),
    recalled: Option<Vec<Outcome>>,
) -> Settled<'r> {
    let denied = match verdict {
        Verdict::Redis(decision) if decision.allowed => {
            log::debug!(
                "{method} {}: allowed ({})",
                Escaped(path),
                summary(&matched, &decision.outcomes)
            );
            return Settled::Admitted(Admitted {
                rules: matched,
                decision,
                checks,
                here: None,
            });
        }
        Verdict::Redis(decision) => match limited(matched, decision, DecidedBy::Redis) {
            Some(denied) => denied,
            None => return Settled::Admitted(Admitted::untouched()),
        },
        Verdict::Remembered(Remembered {
            index: rule,
            wait,
            quota,
            banned,
        }) => {
            let remembered = Outcome {
                allowed: false,
                remaining: 0,
                wait,
                banned,
                ban_started: false,
                quota,
            };
            let retry = remembered.retry_after_secs();
            match recalled.filter(|r| r.len() == matched.len()) {
                // The others as the last denial by Redis left them.
                Some(mut outcomes) => {
                    outcomes[rule] = remembered;
                    Denied::Limited {
                        rule: matched[rule],
                        retry,
                        rules: matched,
                        outcomes,
                        by: DecidedBy::Remembered,
                    }
                }
                // Otherwise only the denying rule's state is known; a rule
                // shown in a one-rule dialect says what a denial says of
                // the request's quota (0 left until the retry) whatever it
                // holds, so those rules show too.
                None => {
                    let mut rules = vec![matched[rule]];
                    let mut outcomes = vec![remembered];
                    for (i, r) in matched.iter().enumerate() {
                        let one_rule = super::fields::is_one_rule(r.headers);
                        if i != rule && one_rule && r.mode == Mode::Enforce {
                            rules.push(r);
                            outcomes.push(Outcome {
                                banned: false,
                                quota: None,
                                ..remembered
                            });
                        }
                    }
                    Denied::Limited {
                        rule: matched[rule],
                        retry,
                        rules,
                        outcomes,
                        by: DecidedBy::Remembered,
                    }
                }
            }
        }
        Verdict::Unavailable(e) => Denied::Unavailable(e),
        Verdict::Partial(Partial {
            decided,
            decision,
            error,
        }) => {
            // The rules Redis could not decide let the request pass: only
            // the others have outcomes.
            let rules: Vec<&Rule> = decided.iter().map(|&i| matched[i]).collect();
            let checks: Vec<Check> = decided.iter().map(|&i| checks[i].clone()).collect();
            crate::logging::repeated!(
                &logging::NO_DECISION,
                "{method} {}: no decision for {} of its rules ({}); the others decided",
                Escaped(path),
                matched.len() - rules.len(),
                Escaped(&error.to_string())
            );
            if decision.allowed {
                return Settled::Admitted(Admitted {
                    rules,
                    decision,
                    checks,
                    here: None,
                });
            }
            match limited(rules, decision, DecidedBy::Redis) {
                Some(denied) => denied,
                None => return Settled::Admitted(Admitted::untouched()),
            }
        }
        Verdict::Fallback(Fallback {
            error,
            local,
            checks,
            decision,
            at,
        }) => {
            // Only the rules this process decided have outcomes.
            let rules: Vec<&Rule> = local.iter().map(|&i| matched[i]).collect();
            if decision.allowed {
                crate::logging::repeated!(
                    &logging::NO_DECISION,
                    "{method} {}: no decision ({}), allowed{}",
                    Escaped(path),
                    Escaped(&error.to_string()),
                    if rules.is_empty() { "" } else { " here" }
                );
                return Settled::Admitted(Admitted {
                    rules,
                    decision,
                    checks,
                    here: Some(at),
                });
            }
            match limited(rules, decision, DecidedBy::Here(error)) {
                Some(denied) => denied,
                None => return Settled::Admitted(Admitted::untouched()),
            }
        }
    };
    noted(method, path, &denied);
    Settled::Denied(denied)
}

/// The denial of `rules`, whose `decision` (by Redis, or here) denied the
/// request: named by the denying rule that frees last, so that
/// Retry-After holds for every rule. `None` when no enforce rule denied
/// (not reachable: only an enforce rule denies a request).
fn limited<'r>(rules: Vec<&'r Rule>, decision: Decision, by: DecidedBy) -> Option<Denied<'r>> {
    let (rule, outcome) = denying(&rules, &decision)?;
    Some(Denied::Limited {
        rule,
        retry: outcome.retry_after_secs(),
        rules,
        outcomes: decision.outcomes,
        by,
    })
}

impl Admitted<'_> {
    /// Passed on with no fields and nothing taken.
    fn untouched() -> Self {
        Admitted {
            rules: Vec::new(),
            decision: Decision {
                allowed: true,
                outcomes: Vec::new(),
            },
            checks: Vec::new(),
            here: None,
        }
    }

    /// Notes what Redis took for the request in its `usage` (which the
    /// handler reads, and charges or gives back through): the units taken,
    /// which go back at most once. Nothing when decided here.
    pub(super) fn record(
        &mut self,
        filter: &Filter,
        usage: &Usage,
        looked_up: &[Vec<Option<rule::Identity>>],
        started: Instant,
    ) -> Option<usage::Taken> {
        if self.here.is_some() || self.rules.is_empty() {
            return None;
        }
        let checks = std::mem::take(&mut self.checks);
        Some(usage.add(
            filter.limiter(),
            &self.rules,
            (checks, looked_up),
            &self.decision,
            started,
        ))
    }

    /// An inner filter denied the request: the units taken go back, and the
    /// request takes nothing from these rules. Whether they went back.
    pub(super) async fn withdraw(filter: &Filter, taken: Option<&usage::Taken>) -> bool {
        let Some(taken) = taken else {
            return false;
        };
        match taken.withdraw(filter).await {
            Ok(_) => true,
            Err(e) => {
                crate::logging::repeated!(
                    &logging::GIVE_BACK_FAILED,
                    "could not give units back ({}); the request stays charged",
                    Escaped(&e.to_string())
                );
                false
            }
        }
    }

    /// The inner service answered with `status`: under `count =
    /// "failures"`, an answer below 400 gives back what the request took
    /// (here, or in Redis: `taken`), and the outcomes show it.
    pub(super) async fn answered(
        &mut self,
        filter: &Filter,
        status: u16,
        taken: Option<&usage::Taken>,
    ) {
        if status >= 400 || !self.rules.iter().any(|r| r.count == Count::Failures) {
            return;
        }
        match (self.here, taken) {
            (Some(at), _) => {
                // Units taken here go back here; Redis took none.
                let local = filter.state.limiter.local();
                for ((r, c), o) in self
                    .rules
                    .iter()
                    .zip(&self.checks)
                    .zip(&mut self.decision.outcomes)
                {
                    if r.count == Count::Failures && o.allowed {
                        local.give_back(c, at);
                        o.uncharge(c.cost, &r.algorithm);
                    }
                }
            }
            (None, Some(taken)) => give_back(filter, &self.rules, taken, &mut self.decision).await,
            (None, None) => {}
        }
    }
}

/// `count = "failures"`: a request answered below 400 gets back the units
/// its failures-only rules took (those that admitted it, and that nothing
/// gave back already: the handler, or an inner filter's denial), and the
/// `RateLimit` fields then show them as remaining again.
pub(super) async fn give_back(
    filter: &Filter,
    matched: &[&Rule],
    taken: &usage::Taken,
    decision: &mut Decision,
) {
    let (places, given) = taken
        .give_back(filter, |i| {
            matched.get(i).is_some_and(|r| r.count == Count::Failures)
        })
        .await;
    match given {
        Ok(0) => {}
        Ok(_) => {
            for i in places {
                if let (Some(o), Some(r)) = (decision.outcomes.get_mut(i), matched.get(i)) {
                    o.uncharge(r.cost, &r.algorithm);
                }
            }
        }
        Err(e) => crate::logging::repeated!(
            &logging::GIVE_BACK_FAILED,
            "could not give units back ({}); the request stays charged",
            Escaped(&e.to_string())
        ),
    }
}

/// The rule's algorithm with `limit` as its quota (a token bucket's rate
/// scales with its burst), when the rule can have that quota.
fn with_quota(rule: &Rule, limit: u32) -> Option<crate::rule::Algorithm> {
    let quota = std::num::NonZeroU32::new(limit)
        .filter(|q| q.get() <= rule.algorithm.max_quota() && q.get() >= rule.cost)?;
    rule.algorithm.with_quota(quota)
}

/// Whether `req` is a CORS preflight: `OPTIONS` with
/// `Access-Control-Request-Method`.
pub(super) fn is_preflight<H: Head>(req: &H) -> bool {
    req.method() == "OPTIONS"
        && req
            .headers()
            .lines("access-control-request-method")
            .next()
            .is_some()
}

/// Whether `path` is `prefix` or below it.
fn is_under(path: &str, prefix: &str) -> bool {
    path.strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}
