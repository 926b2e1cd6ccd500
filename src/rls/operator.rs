//! Operators' actions on the service's identities: a limit by its rule
//! name, and the values of the descriptor entries that count apart (keys
//! without a value, wildcards without `share_threshold`), in descriptor
//! order. They make the same Redis key as a call carrying those values, so
//! bans and overrides are honoured by the next call.

use floodgate::limiter::{Action, Check};

use super::matcher::{state_key, Matcher};

/// The check an operator's `action` on the identity `values` under the
/// limit named `rule` runs with; one sentence when it cannot be done.
/// `shadow`: `[rls] shadow`, under which no limit is enforced.
#[allow(clippy::too_many_arguments)]
pub fn check_for(
    matcher: &Matcher,
    prefix: &str,
    hash_tags: bool,
    shadow: bool,
    rule: &str,
    values: &[&str],
    action: &Action,
) -> Result<Check, String> {
    let Some((limit, slots)) = matcher.slots(rule) else {
        let names: Vec<&str> = matcher.limits().iter().map(|l| l.name.as_str()).collect();
        return Err(format!(
            "unknown rule {rule:?} (the rules are: {})",
            names.join(", ")
        ));
    };
    if values.len() != slots.len() {
        let wanted: Vec<&str> = slots.iter().map(|(k, _)| k.as_str()).collect();
        return Err(format!(
            "rule {rule:?} takes {} value{} ({}), got {}",
            slots.len(),
            if slots.len() == 1 { "" } else { "s" },
            if wanted.is_empty() {
                "its count is shared by every caller".to_string()
            } else {
                wanted.join(", ")
            },
            values.len()
        ));
    }
    for ((key, pattern), value) in slots.iter().zip(values) {
        if let Some(p) = pattern {
            if !p.matches(value) {
                return Err(format!(
                    "{value:?} does not match {key}'s pattern {:?}",
                    p.text()
                ));
            }
        }
    }
    let Some(algorithm) = limit.algorithm.filter(|_| !limit.unlimited) else {
        return Err(format!(
            "rule {rule:?} is {}: it keeps no count to act on",
            if limit.unlimited {
                "unlimited"
            } else {
                "always over (requests_per_unit 0)"
            }
        ));
    };
    if (limit.shadow || shadow) && matches!(action, Action::Ban(_) | Action::Override { .. }) {
        let why = if limit.shadow {
            format!("rule {rule:?} is in shadow mode")
        } else {
            "the service is in shadow mode ([rls] shadow = true)".to_string()
        };
        return Err(format!("{why}: a ban or override would never be enforced"));
    }
    if let Action::Override { limit: n, .. } = *action {
        let max = algorithm.max_quota();
        if n > max {
            return Err(format!("limit must be between 1 and {max}, got {n}"));
        }
    }
    Ok(
        Check::new(state_key(hash_tags, prefix, &limit.name, values), algorithm)
            .with_enforce(!(limit.shadow || shadow))
            .with_penalty(limit.penalty),
    )
}
