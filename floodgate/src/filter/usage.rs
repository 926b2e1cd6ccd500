//! What the filter decided about a request, for its handler: the
//! [`Usage`] extractor, and charging or giving back units from a handler.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{lock, Filter};
use crate::limiter::give_back::Refund;
use crate::limiter::{Check, Decision, Limiter, LimiterError, Outcome};
use crate::rule::Algorithm;
use crate::rule::{Identity, Rule};

/// The rules that matched a request and what each said, as a handler sees
/// them (an extractor: add a `Usage` argument). Empty when no rule matched.
///
/// From a handler, [`Usage::charge`] takes more units from every matched
/// rule (all or nothing), and [`Usage::give_back`] returns what the request
/// took (a sign-in that succeeded, say).
///
/// ```no_run
/// use actix_web::{post, HttpResponse};
/// use floodgate_limiter::Usage;
///
/// #[post("/sms/send")]
/// async fn send(usage: Usage) -> HttpResponse {
///     for rule in usage.rules() {
///         println!("{}: {} left, resets in {:?}", rule.name, rule.remaining, rule.reset);
///     }
///     HttpResponse::Ok().finish()
/// }
/// ```
#[derive(Clone, Default)]
pub struct Usage {
    inner: Arc<Mutex<Vec<Entry>>>,
}

/// The rules' states, as [`Usage::rules`] gives them.
impl std::fmt::Debug for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.rules()).finish()
    }
}

#[derive(Clone)]
struct Entry {
    /// The rule's name, and its algorithm (what its quota is read from):
    /// all of the rule an entry needs, so a request does not copy the rule.
    name: String,
    algorithm: Algorithm,
    check: Check,
    outcome: Outcome,
    limiter: Arc<Limiter>,
    decided: Instant,
    given_back: bool,
    /// Who the rule's [`Key::lookup`](crate::Key::lookup) found.
    identity: Option<Identity>,
}

/// One matched rule's state after the decision.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RuleState {
    /// The rule's name.
    pub name: String,
    /// Whether this rule alone admitted the request (a shadow rule may not
    /// have, and the request still passed).
    pub allowed: bool,
    /// Units left after this request.
    pub remaining: u64,
    /// Time until the quota resets.
    pub reset: Duration,
    /// The rule's limit (or burst).
    pub quota: u32,
    /// Who the rule's [`Key::lookup`](crate::Key::lookup) found (the ID
    /// and the quota it chose), so that a handler need not look the
    /// caller up again; `None` without a lookup, or when it found no one.
    pub identity: Option<Identity>,
}

/// Marks a request that an inner filter denied: the outer filters give
/// back what they took, so a denied request takes nothing from any rule.
#[derive(Clone, Copy)]
pub(super) struct Withdrawn;

/// The units one filter took for a request: its entries in the request's
/// [`Usage`]. Every way units go back (an inner filter's denial, a success
/// under `count = "failures"`, the handler's [`Usage::give_back`]) takes
/// an entry's `given_back` first, so each charge is given back at most once.
pub(super) struct Taken {
    limits: Usage,
    from: usize,
    to: usize,
    decided: Instant,
}

impl Usage {
    /// Adds one filter's allowed decision to this `Usage`.
    pub(super) fn add(
        &self,
        limiter: &Arc<Limiter>,
        matched: &[&Rule],
        (checks, looked_up): (Vec<Check>, &[Vec<Option<Identity>>]),
        decision: &Decision,
        decided: Instant,
    ) -> Taken {
        let limits = self.clone();
        let mut entries = lock(&limits.inner);
        let from = entries.len();
        for (i, ((rule, check), outcome)) in matched
            .iter()
            .zip(checks)
            .zip(&decision.outcomes)
            .enumerate()
        {
            let identity = looked_up
                .get(i)
                .and_then(|found| found.iter().flatten().next().cloned());
            entries.push(Entry {
                name: rule.name.clone(),
                algorithm: rule.algorithm,
                check,
                outcome: *outcome,
                limiter: Arc::clone(limiter),
                decided,
                given_back: false,
                identity,
            });
        }
        let to = entries.len();
        drop(entries);
        Taken {
            limits,
            from,
            to,
            decided,
        }
    }

    /// Every matched rule, in the order the filters decided them.
    pub fn rules(&self) -> Vec<RuleState> {
        lock(&self.inner)
            .iter()
            .map(|e| RuleState {
                name: e.name.clone(),
                allowed: e.outcome.allowed,
                remaining: e.outcome.remaining,
                reset: e.outcome.wait,
                quota: e.outcome.limit(&e.algorithm),
                identity: e.identity.clone(),
            })
            .collect()
    }

    /// The state of the rule named `name`, when it matched.
    pub fn get(&self, name: &str) -> Option<RuleState> {
        self.rules().into_iter().find(|r| r.name == name)
    }

    /// Whether no rule matched.
    pub fn is_empty(&self) -> bool {
        lock(&self.inner).is_empty()
    }

    /// Takes `units` more from every matched rule's key, all or nothing:
    /// `Ok(true)` when every enforce rule had room (and all were charged),
    /// `Ok(false)` when one had not (and none was). Useful when a handler
    /// learns the real cost of a request only once it has read it.
    pub async fn charge(&self, units: u32) -> Result<bool, LimiterError> {
        let entries = lock(&self.inner).clone();
        let Some(limiter) = entries.first().map(|e| Arc::clone(&e.limiter)) else {
            return Ok(true);
        };
        if units == 0 {
            return Ok(true);
        }
        if entries
            .iter()
            .any(|e| e.check.enforce && units > e.outcome.limit(&e.algorithm))
        {
            return Ok(false);
        }
        let checks = entries
            .iter()
            .map(|e| Check {
                cost: units.min(e.outcome.limit(&e.algorithm)),
                ..e.check.clone()
            })
            .collect();
        let decision = limiter.decide(checks).await?;
        if decision.allowed {
            let mut entries = lock(&self.inner);
            for (e, o) in entries.iter_mut().zip(&decision.outcomes) {
                e.outcome.remaining = o.remaining;
                e.outcome.wait = o.wait;
                // What the request took grows by what this charged: a
                // give-back returns it too.
                e.check.cost = e
                    .check
                    .cost
                    .saturating_add(units.min(e.outcome.limit(&e.algorithm)));
            }
        }
        Ok(decision.allowed)
    }

    /// Gives back the units this request took from every matched rule
    /// (what the filter took, and what [`Usage::charge`] added; once: later
    /// calls give nothing). Returns the units given back; a key whose
    /// give-back is no longer safe (its window has nearly passed) stays
    /// charged. Every rule's give-back is tried; the first error is
    /// returned after them all.
    pub async fn give_back(&self) -> Result<u64, LimiterError> {
        let pending: Vec<Entry> = {
            let mut entries = lock(&self.inner);
            let pending = entries
                .iter()
                .filter(|e| e.outcome.allowed && !e.given_back)
                .cloned()
                .collect();
            for e in entries.iter_mut() {
                e.given_back = true;
            }
            pending
        };
        let mut given = 0;
        let mut failed = None;
        for e in pending {
            let refund = refund(&e.check, &e.outcome);
            match e.limiter.give_back(vec![refund], e.decided).await {
                Ok(n) => given += n,
                Err(err) => {
                    failed.get_or_insert(err);
                    continue;
                }
            }
            if let Some(entry) = lock(&self.inner)
                .iter_mut()
                .find(|x| x.check.key == e.check.key)
            {
                entry.outcome.uncharge(e.check.cost, &e.algorithm);
            }
        }
        match failed {
            Some(err) => Err(err),
            None => Ok(given),
        }
    }
}

impl Taken {
    /// Takes the refund of this filter's entries that `want` picks (by
    /// their place among the filter's matched rules) and that nothing gave
    /// back yet: marks them given back and returns them with their places.
    fn take(&self, want: impl Fn(usize, &Entry) -> bool) -> (Vec<usize>, Vec<Refund>) {
        let mut entries = lock(&self.limits.inner);
        let mut places = Vec::new();
        let mut refunds = Vec::new();
        for (i, e) in entries[self.from..self.to].iter_mut().enumerate() {
            if e.outcome.allowed && !e.given_back && want(i, e) {
                e.given_back = true;
                places.push(i);
                refunds.push(refund(&e.check, &e.outcome));
            }
        }
        (places, refunds)
    }

    /// Gives these units back (an inner filter denied the request), those
    /// not given back already.
    pub(super) async fn withdraw(&self, filter: &Filter) -> Result<u64, LimiterError> {
        let (_, refunds) = self.take(|_, _| true);
        filter.limiter().give_back(refunds, self.decided).await
    }

    /// Gives back the units of the rules `refundable` picks (by place),
    /// those not given back already; returns the places given back and
    /// what Redis gave.
    pub(super) async fn give_back(
        &self,
        filter: &Filter,
        refundable: impl Fn(usize) -> bool,
    ) -> (Vec<usize>, Result<u64, LimiterError>) {
        let (places, refunds) = self.take(|i, _| refundable(i));
        let given = filter.limiter().give_back(refunds, self.decided).await;
        (places, given)
    }
}

fn refund(check: &Check, outcome: &Outcome) -> Refund {
    Refund {
        key: check.key.clone(),
        algorithm: check.algorithm,
        cost: check.cost,
        window_left: outcome.wait,
    }
}
