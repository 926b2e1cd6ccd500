//! Checks of one call that name the same key, joined into one.
//!
//! Redis decides a call's checks each against the state before the call,
//! then records them all (or none): two checks on one key would each see
//! the units the other is about to take, and together could take more than
//! the limit holds. So a call's checks on one key become one check of
//! their summed cost before they leave, and its outcome is each one's.
//! Rules never share a key (the rule's name is in it), so a filter's
//! calls never need this; a caller of [`Limiter::decide`](super::Limiter::decide)
//! with checks of its own may.

use super::{Check, Decision, LimiterError, Outcome};

/// Which joined check answers each of the caller's (`None`: no key was
/// named twice, the checks went as the caller gave them).
pub(crate) struct Joined {
    of: Option<Vec<usize>>,
}

impl Joined {
    /// Joins `checks`: the checks to send, and how to answer the caller. Checks on one key must ask the same question of it
    /// (algorithm, mode, penalty), and their costs together must fit in
    /// its quota, as one check's cost must: otherwise Redis could not
    /// decide them, and the call is refused as such a check is
    /// ([`LimiterError::Check`]).
    pub(crate) fn new(checks: Vec<Check>) -> Result<(Vec<Check>, Joined), LimiterError> {
        let twice = (1..checks.len()).any(|i| checks[..i].iter().any(|c| c.key == checks[i].key));
        if !twice {
            return Ok((checks, Joined { of: None }));
        }
        let mut joined: Vec<Check> = Vec::with_capacity(checks.len());
        let mut of = Vec::with_capacity(checks.len());
        for c in checks {
            let Some(at) = joined.iter().position(|j| j.key == c.key) else {
                of.push(joined.len());
                joined.push(c);
                continue;
            };
            let j = &mut joined[at];
            if (j.algorithm, j.enforce, j.penalty) != (c.algorithm, c.enforce, c.penalty) {
                return Err(LimiterError::Check(format!(
                    "two checks of one call on {} ask different questions of it (algorithm, mode or penalty)",
                    c.key
                )));
            }
            let cost = j.cost.saturating_add(c.cost);
            let quota = j.algorithm.quota();
            if cost > quota {
                return Err(LimiterError::Check(format!(
                    "the checks of one call on {} take {cost} units together, more than its {} ({quota})",
                    c.key,
                    j.algorithm.quota_word()
                )));
            }
            j.cost = cost;
            of.push(at);
        }
        Ok((joined, Joined { of: Some(of) }))
    }

    /// The outcomes of the joined checks, one per check of the caller's.
    pub(crate) fn spread(&self, outcomes: Vec<Outcome>) -> Vec<Outcome> {
        match &self.of {
            None => outcomes,
            Some(of) => of
                .iter()
                .filter_map(|&k| outcomes.get(k).copied())
                .collect(),
        }
    }

    /// A decision of the joined checks, as one of the caller's.
    pub(crate) fn decision(&self, decision: Decision) -> Decision {
        Decision {
            allowed: decision.allowed,
            outcomes: self.spread(decision.outcomes),
        }
    }
}
