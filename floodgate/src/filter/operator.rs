//! Operators' actions named as a person writes them: a rule by name and
//! the values of its key kinds, checked here (unknown rule, wrong number of
//! values, a bad value or limit), then run by the limiter (see
//! `limiter/operator.rs`). The `floodgate` command and the demo's admin API
//! are thin layers over [`operator_check`] and [`Filter::operate`].

use std::time::Duration;

use super::Filter;
use crate::limiter::{Action, Check, Inspection, LimiterError};
use crate::rule::{identity_key, Mode, Rule};

/// Why an operator's action was not done.
#[derive(Debug)]
pub enum OperatorError {
    /// The request itself is wrong (unknown rule, wrong number of values,
    /// a bad value, limit or duration): one sentence.
    Input(String),
    /// Redis did not do it.
    Redis(LimiterError),
}

impl std::fmt::Display for OperatorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OperatorError::Input(what) => f.write_str(what),
            OperatorError::Redis(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for OperatorError {}

/// The check an action on the identity `values` under the rule `rule` (of
/// `rules`) runs with, after checking that the action fits the rule (an
/// override's limit holds at least one request and is within the rule
/// algorithm's bounds).
#[doc(hidden)] // the floodgate binary's, not part of the API
pub fn operator_check(
    rules: &[Rule],
    key_prefix: &str,
    hash_tags: bool,
    rule: &str,
    values: &[&str],
    action: &Action,
) -> Result<Check, String> {
    let Some(r) = rules.iter().find(|r| r.name == rule) else {
        let names: Vec<&str> = rules.iter().map(|r| r.name.as_str()).collect();
        return Err(format!(
            "unknown rule {rule:?} (the rules are: {})",
            names.join(", ")
        ));
    };
    action.check()?;
    let key = identity_key(r, values, key_prefix, hash_tags)?;
    let check = Check {
        key,
        algorithm: r.algorithm,
        cost: r.cost,
        enforce: r.mode == Mode::Enforce,
        penalty: r.penalty,
    };
    action.fits(&check, Some(rule))?;
    Ok(check)
}

/// The override action for `limit` (as written), with an optional window
/// and lifetime (durations as written, like `"1m"`).
#[doc(hidden)] // the floodgate binary's, not part of the API
pub fn override_action(
    limit: i64,
    window: Option<&str>,
    lasts: Option<&str>,
) -> Result<Action, String> {
    let limit = match u32::try_from(limit) {
        Ok(l) if l >= 1 => l,
        _ if limit > 0 => {
            return Err(format!(
                "limit must be at most {} (and the rule's own bound), got {limit}",
                u32::MAX
            ))
        }
        _ => {
            return Err(format!(
                "limit must be a whole number of at least 1, got {limit}"
            ))
        }
    };
    let window = window
        .map(|w| crate::config::operator_duration("window", w))
        .transpose()?;
    let lasts = lasts
        .map(|d| crate::config::operator_duration("the override's length", d))
        .transpose()?;
    Ok(Action::Override {
        limit,
        window,
        lasts,
    })
}

/// The ban action for a length as written (at most 366 days).
#[doc(hidden)] // the floodgate binary's, not part of the API
pub fn ban_action(length: &str) -> Result<Action, String> {
    let d: Duration = crate::config::operator_duration("the ban's length", length)?;
    Ok(Action::Ban(d))
}

impl Filter {
    /// Runs an operator's `action` on the identity `values` under the
    /// filter's rule `rule`, and answers what the rule holds for it
    /// afterwards (see [`Limiter::operate`](crate::limiter::Limiter::operate)).
    pub async fn operate(
        &self,
        rule: &str,
        values: &[&str],
        action: Action,
    ) -> Result<Inspection, OperatorError> {
        let check = operator_check(
            &self.rules(),
            &self.state.key_prefix,
            self.state.limiter.hash_tags(),
            rule,
            values,
            &action,
        )
        .map_err(OperatorError::Input)?;
        // (A ban is counted by the process that claims it: see
        // `limiter/operator.rs`.)
        self.state
            .limiter
            .operate(check, action)
            .await
            .map_err(OperatorError::Redis)
    }
}
