//! The operators' settings: `[admin]` (the HTTP API's token and the
//! addresses allowed to use it) and a rule's `penalty` (escalating bans).

use std::time::Duration;

use serde::Deserialize;

use super::MAX_WINDOW;
use crate::net::Cidr;
use crate::rule::policy::{check_penalty_after, check_penalty_ban, check_penalty_duration};
use crate::rule::Penalty;
use crate::units::{amount_of_time, invalid_duration, parse_duration_ms, DurationError};

/// `[admin]` as written.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawAdmin {
    /// The bearer token; empty = no admin API.
    pub token: Option<String>,
    /// Client addresses that may use the admin API.
    pub allow: Option<Vec<String>>,
}

impl std::fmt::Debug for RawAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawAdmin")
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("allow", &self.allow)
            .finish()
    }
}

/// A rule's `penalty = { after, within, ban, max }` as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPenalty {
    /// Denials that ban.
    pub after: i64,
    /// How long denials are counted for.
    pub within: String,
    /// The first ban.
    pub ban: String,
    /// The longest ban (and how long a ban is remembered).
    pub max: String,
}

/// `[admin]`, checked. `Debug` shows whether a token is set, never the token.
#[derive(Clone, Default)]
pub struct AdminConfig {
    /// The bearer token; `None`: no admin API (every `/admin` path is 404).
    pub token: Option<String>,
    /// Client addresses (after trusted proxies) that may use it.
    pub allow: Vec<Cidr>,
}

impl std::fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminConfig")
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("allow", &self.allow)
            .finish()
    }
}

/// Shortest admin token accepted.
const MIN_TOKEN: usize = 16;

/// An admin token: long enough, and nothing a header cannot carry.
pub(super) fn check_token(token: String) -> Result<String, String> {
    if token.len() < MIN_TOKEN
        || token
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || !c.is_ascii())
    {
        return Err(format!(
            "must be at least {MIN_TOKEN} ASCII characters without spaces or control characters"
        ));
    }
    Ok(token)
}

/// Checks `[admin]` (`$FLOODGATE_ADMIN_TOKEN` is applied with the other
/// environment overrides). Errors: (place, what).
pub(super) fn check_admin(raw: RawAdmin) -> Result<AdminConfig, (&'static str, String)> {
    let token = match raw.token.filter(|t| !t.is_empty()) {
        Some(t) => Some(check_token(t).map_err(|w| ("[admin] token", w))?),
        None => None,
    };
    let written = raw
        .allow
        .unwrap_or_else(|| vec!["127.0.0.1/32".into(), "::1/128".into()]);
    let mut allow = Vec::with_capacity(written.len());
    for a in &written {
        allow.push(Cidr::parse(a).map_err(|e| ("[admin] allow", e.to_string()))?);
    }
    Ok(AdminConfig { token, allow })
}

/// A duration of a penalty as written: a duration, checked by the rules'
/// validator.
fn penalty_duration(what: &str, text: &str) -> Result<Duration, String> {
    let d = match parse_duration_ms(text) {
        Ok(ms) => Duration::from_millis(ms),
        Err(DurationError::TooLong) => Duration::MAX,
        Err(DurationError::Invalid) => {
            return Err(format!("penalty {what}: {}", invalid_duration(text)))
        }
    };
    check_penalty_duration(what, d, text)?;
    Ok(d)
}

/// Checks a rule's `penalty`, with the bounds and messages of a penalty
/// made in code.
pub(super) fn check_penalty(raw: &RawPenalty) -> Result<Penalty, String> {
    let penalty = Penalty {
        after: check_penalty_after(raw.after)?,
        within: penalty_duration("within", &raw.within)?,
        ban: penalty_duration("ban", &raw.ban)?,
        max: penalty_duration("max", &raw.max)?,
    };
    check_penalty_ban(&penalty, &raw.ban, &raw.max)?;
    Ok(penalty)
}

/// A duration an operator gives (`--for`, `--window`, `"for"`): more than
/// 0, at most 366 days, in whole milliseconds.
#[doc(hidden)] // the floodgate binary's, not part of the API
pub fn operator_duration(what: &str, text: &str) -> Result<Duration, String> {
    let d = match parse_duration_ms(text) {
        Ok(ms) => Duration::from_millis(ms),
        Err(DurationError::TooLong) => Duration::MAX,
        Err(DurationError::Invalid) => return Err(format!("{what}: {}", invalid_duration(text))),
    };
    if d.is_zero() {
        return Err(format!("{what} must be greater than 0"));
    }
    if d > MAX_WINDOW {
        return Err(format!(
            "{what} must be at most {}, got {text:?}",
            amount_of_time(MAX_WINDOW)
        ));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::Config;

    fn refusal(toml: &str) -> String {
        Config::parse(toml, Path::new("x.toml"))
            .unwrap_err()
            .to_string()
    }

    const RULE: &str = "[[rule]]\nname = \"r\"\npaths = [\"/r\"]\nlimit = 1\nwindow = \"1m\"\n";

    #[test]
    fn a_penalty_is_read_and_its_bounds_are_refused_in_words() {
        let ok = Config::parse(
            &format!(
                "{RULE}penalty = {{ after = 3, within = \"10m\", ban = \"5m\", max = \"1d\" }}\n"
            ),
            Path::new("x.toml"),
        )
        .unwrap();
        let p = ok.rules[0].penalty.unwrap();
        assert_eq!(
            (p.after, p.ban.as_secs(), p.max.as_secs()),
            (3, 300, 86_400)
        );
        for (penalty, says) in [
            (
                "after = 0, within = \"1m\", ban = \"1m\", max = \"1h\"",
                "penalty after must be between 1 and 1000000, got 0",
            ),
            (
                "after = 1, within = \"1m\", ban = \"2h\", max = \"1h\"",
                "penalty ban (2h) must be at most max (1h)",
            ),
            (
                "after = 1, within = \"0s\", ban = \"1m\", max = \"1h\"",
                "penalty within must be greater than 0",
            ),
            (
                "after = 1, within = \"1m\", ban = \"1m\", max = \"400d\"",
                "penalty max must be at most 366 days, got \"400d\"",
            ),
            (
                "after = 1, within = \"soon\", ban = \"1m\", max = \"1h\"",
                "penalty within: invalid duration",
            ),
        ] {
            let e = refusal(&format!("{RULE}penalty = {{ {penalty} }}\n"));
            assert!(e.starts_with("x.toml: rule \"r\" (rule 1): "), "{e}");
            assert!(e.contains(says), "{e}");
        }
        assert!(refusal(&format!("{RULE}penalty = {{ after = 1 }}\n")).contains("missing field"));
    }

    #[test]
    fn admin_needs_a_long_token_and_addresses() {
        let none = Config::parse("", Path::new("x.toml")).unwrap();
        assert!(none.admin.token.is_none());
        assert_eq!(none.admin.allow.len(), 2);
        assert!(
            refusal("[admin]\ntoken = \"short\"\n").contains("[admin] token: must be at least 16")
        );
        assert!(refusal("[admin]\nallow = [\"nowhere\"]\n")
            .contains("[admin] allow: \"nowhere\" is not"));
        let mut c = Config::parse(
            "[admin]\ntoken = \"a-token-of-16-chars\"\n",
            Path::new("x.toml"),
        )
        .unwrap();
        c.apply_env(|n| (n == "FLOODGATE_ADMIN_TOKEN").then(|| "from-the-environment".to_string()))
            .unwrap();
        assert_eq!(c.admin.token.as_deref(), Some("from-the-environment"));
        let debug = format!("{c:?}");
        assert!(!debug.contains("from-the-environment"), "{debug}");
    }
}
