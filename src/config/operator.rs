//! The operators' settings: `[admin]` (the HTTP API's token and the
//! addresses allowed to use it) and a rule's `penalty` (escalating bans).

use std::time::Duration;

use serde::Deserialize;

use super::units::{amount_of_time, invalid_duration, parse_duration_ms, DurationError};
use super::MAX_WINDOW;
use crate::limit::Penalty;
use crate::net::Cidr;

/// `[admin]` as written.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawAdmin {
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
pub struct RawPenalty {
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
        allow.push(Cidr::parse(a).ok_or_else(|| {
            (
                "[admin] allow",
                format!("{a:?} is not an IP address or CIDR"),
            )
        })?);
    }
    Ok(AdminConfig { token, allow })
}

/// A duration of a penalty: more than 0, at most 366 days, whole ms.
fn penalty_duration(what: &str, text: &str) -> Result<Duration, String> {
    let d = match parse_duration_ms(text) {
        Ok(ms) => Duration::from_millis(ms),
        Err(DurationError::TooLong) => Duration::MAX,
        Err(DurationError::Invalid) => {
            return Err(format!("penalty {what}: {}", invalid_duration(text)))
        }
    };
    if d.is_zero() {
        return Err(format!("penalty {what} must be greater than 0"));
    }
    if d > MAX_WINDOW {
        return Err(format!(
            "penalty {what} must be at most {}, got {text:?}",
            amount_of_time(MAX_WINDOW)
        ));
    }
    Ok(d)
}

/// Checks a rule's `penalty`.
pub(super) fn check_penalty(raw: &RawPenalty) -> Result<Penalty, String> {
    let after = u32::try_from(raw.after)
        .ok()
        .filter(|a| (1..=1_000_000).contains(a))
        .ok_or_else(|| {
            format!(
                "penalty after must be between 1 and 1000000, got {}",
                raw.after
            )
        })?;
    let within = penalty_duration("within", &raw.within)?;
    let ban = penalty_duration("ban", &raw.ban)?;
    let max = penalty_duration("max", &raw.max)?;
    if ban > max {
        return Err(format!(
            "penalty ban ({}) must be at most max ({})",
            raw.ban, raw.max
        ));
    }
    Ok(Penalty {
        after,
        within,
        ban,
        max,
    })
}

/// A duration an operator gives (`--for`, `--window`, `"for"`): more than
/// 0, at most 366 days, in whole milliseconds.
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
