//! Operators' actions on one identity under one rule: look at what the
//! rule holds for it, forget it, ban it, end its ban, give it its own
//! limit. Each action is one atomic script call (`lua/operator.lua`) on the
//! identity's state key and its operator record, the hash beside it that
//! the decision script reads in the same call as the state (see
//! `lua/common.lua`): one `EXISTS` per call over every record it could
//! read, and an `HMGET` for a check whose record exists; never a round trip. On a Cluster the record shares the state key's
//! hash tag, so its slot.
//!
//! What the script cannot reach is each process's memory: after every
//! change the action publishes on the channel `PREFIX:operator`, and every
//! [`Limiter`] keeps one subscriber connection (a thread) that hears it.
//! Two messages go out per change: the state key alone (what the previous
//! version's listeners read: forget the key's remembered denial), then an
//! announcement, `!ban MS KEY` (banned for MS ms from now), `!unban KEY`,
//! `!reset KEY`, `!override KEY` or `!clear KEY`, from which a listener
//! also keeps the bans the local fallback enforces while Redis is away (see
//! `local/bans.rs`). A subscriber that lost its connection forgets every
//! remembered denial and every ban it heard of when it is subscribed again,
//! since it may have missed messages.
//!
//! An operator's ban is counted in `floodgate_bans_total` once, by one of
//! the processes whose metrics are served: each claims it with one atomic
//! call on the ban's record ([`CLAIM_SOURCE`]), and only the claimer counts
//! it. The process that made the ban claims it as soon as it is made (the
//! admin API), the others when they hear of it; a command-line process,
//! whose metrics nobody reads, never claims.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

mod list;
mod listener;
mod top;

pub(crate) use self::list::penalty_writer;
pub use self::list::{split_state_key, AuditEntry, Listed, ListedOverride};
use self::listener::announcement;
pub(in crate::limiter) use self::listener::listen;
pub(crate) use self::top::start_writer as start_top_writer;
pub use self::top::{TopEntry, TOP_SINCE_MOST};
use super::conn::Pool;
use super::local::Bans;
use super::topology::RedisConn;
use super::wire;
use super::{Check, Limiter, LimiterError};
use crate::logging::Escaped;
use crate::units::check_operator_length;

/// The Lua of an operator's action: the shared helpers, the algorithm
/// files, then the action's driver.
pub(crate) const OPERATOR_SOURCE: &str = wire::OPERATOR_SOURCE;

fn script() -> &'static redis::Script {
    static SCRIPT: OnceLock<redis::Script> = OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(OPERATOR_SOURCE))
}

/// Claims the operator ban in force on a record (`KEYS[1]`) for one
/// process's count: 1 for the first claim of that ban (its end, in the
/// field `bc`), 0 for any later one, or when no operator ban is in force.
/// Writes nothing but that field of a record that exists (and keeps its
/// TTL).
pub(crate) const CLAIM_SOURCE: &str = r#"
local ban = redis.call('HGET', KEYS[1], 'ban')
if not ban or redis.call('HGET', KEYS[1], 'by') ~= 'operator' then
  return 0
end
if redis.call('HGET', KEYS[1], 'bc') == ban then
  return 0
end
redis.call('HSET', KEYS[1], 'bc', ban)
return 1
"#;

fn claim_script() -> &'static redis::Script {
    static SCRIPT: OnceLock<redis::Script> = OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(CLAIM_SOURCE))
}

/// Claims the operator ban on the identity `key` (a state key under
/// `prefix`) for this process's count, and counts it in `bans` when the
/// claim is this process's.
fn claim(conn: &mut RedisConn, bans: &Bans, prefix: &str, key: &str) -> redis::RedisResult<()> {
    let claimed: i64 = claim_script().key(record_key(key)).invoke(conn)?;
    if claimed == 1 {
        // PREFIX:RULE:KIND:ID; rule names hold no ':'.
        let rule = key
            .strip_prefix(prefix)
            .and_then(|k| k.strip_prefix(':'))
            .and_then(|k| k.split(':').next());
        if let Some(rule) = rule {
            bans.count(rule);
        }
    }
    Ok(())
}

/// What an operator does to an identity under a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing: only look.
    Inspect,
    /// Forget its counts, its ban and its penalty history (not its override).
    Reset,
    /// Deny it for this long (at most 366 days).
    Ban(Duration),
    /// End its ban (counts stay).
    Unban,
    /// Give it its own limit (token bucket: burst, the rate scaling with
    /// it) and, optionally, window, for a while or until cleared.
    Override {
        /// Limit (token bucket: burst).
        limit: u32,
        /// Window (token bucket: time to refill from empty); `None`: the rule's.
        window: Option<Duration>,
        /// How long it lasts; `None`: until cleared.
        lasts: Option<Duration>,
    },
    /// Back to the rule's limit.
    Clear,
}

impl Action {
    /// Refuses the numbers no operator's command accepts: a ban, an
    /// override's window or lifetime of 0 or longer than 366 days, an
    /// override's limit of 0. ([`Limiter::operate`] and
    /// `Filter::operate` ask it before they act.)
    pub(crate) fn check(&self) -> Result<(), String> {
        match *self {
            Action::Ban(d) => check_operator_length("the ban's length", d),
            Action::Override {
                limit,
                window,
                lasts,
            } => {
                if limit == 0 {
                    return Err("limit must be a whole number of at least 1, got 0".into());
                }
                if let Some(w) = window {
                    check_operator_length("window", w)?;
                }
                lasts.map_or(Ok(()), |l| {
                    check_operator_length("the override's length", l)
                })
            }
            Action::Inspect | Action::Reset | Action::Unban | Action::Clear => Ok(()),
        }
    }

    /// Refuses what cannot apply under the rule `check` was made from: a
    /// ban or an override under a rule that never denies (shadow: it would
    /// never be enforced), an override's limit outside the rule's cost and
    /// its algorithm's largest, or a window the algorithm does not take.
    /// `rule` names the rule in the messages (`None`: "the rule").
    pub(crate) fn fits(&self, check: &Check, rule: Option<&str>) -> Result<(), String> {
        let enforced = matches!(self, Action::Ban(_) | Action::Override { .. });
        if enforced && !check.enforce {
            let rule = rule.map_or_else(|| "the rule".to_string(), |r| format!("rule {r:?}"));
            return Err(format!(
                "{rule} is a shadow rule: it counts and reports but never denies, so {} under it would never be enforced",
                if matches!(self, Action::Ban(_)) { "a ban" } else { "an override" }
            ));
        }
        if let Action::Override { limit, window, .. } = *self {
            let max = check.algorithm.max_quota();
            if limit < check.cost || limit > max {
                return Err(format!(
                    "limit must be between {} (the rule's cost) and {max}, got {limit}",
                    check.cost
                ));
            }
            check.algorithm.check_override(limit, window)?;
        }
        Ok(())
    }

    /// The action's name, for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Action::Inspect => "inspect",
            Action::Reset => "reset",
            Action::Ban(_) => "ban",
            Action::Unban => "unban",
            Action::Override { .. } => "override",
            Action::Clear => "override --clear",
        }
    }
}

/// An identity's own limit, as in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverrideState {
    /// Its limit (token bucket: burst).
    pub limit: u64,
    /// Its window in whole seconds, rounded up (token bucket: time to refill).
    pub window_s: u64,
    /// Seconds until it ends, rounded up; `None`: until cleared.
    pub expires_s: Option<u64>,
}

/// What a rule holds for one identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inspection {
    /// The identity's Redis key.
    pub key: String,
    /// The rule's algorithm name.
    pub algorithm: &'static str,
    /// The limit in force for it (its override's, else the rule's).
    pub limit: u64,
    /// The window in force, in whole seconds (token bucket: to refill from empty).
    pub window_s: u64,
    /// Units used.
    pub used: u64,
    /// Units left.
    pub remaining: u64,
    /// Seconds until the quota resets (or, when a request would be denied,
    /// until it would be allowed), rounded up.
    pub reset_s: u64,
    /// Seconds left on its ban, rounded up; 0 = none.
    pub banned_s: u64,
    /// Its own limit, if any.
    pub override_state: Option<OverrideState>,
}

impl Inspection {
    /// The inspection as one JSON object, with `rule` first.
    pub fn to_json(&self, rule: &str) -> String {
        let over = match &self.override_state {
            None => "null".to_string(),
            Some(o) => format!(
                "{{\"limit\":{},\"window_s\":{},\"expires_s\":{}}}",
                o.limit,
                o.window_s,
                o.expires_s.map_or("null".to_string(), |s| s.to_string())
            ),
        };
        format!(
            "{{\"rule\":{},\"key\":{},\"algorithm\":\"{}\",\"limit\":{},\"window_s\":{},\"used\":{},\"remaining\":{},\"reset_s\":{},\"banned_s\":{},\"override\":{over}}}",
            json_string(rule),
            json_string(&self.key),
            self.algorithm,
            self.limit,
            self.window_s,
            self.used,
            self.remaining,
            self.reset_s,
            self.banned_s,
        )
    }
}

/// `text` as a JSON string.
pub(crate) fn json_string(text: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The operator record beside a state key (the decision script derives
/// the same name).
pub(crate) fn record_key(state_key: &str) -> String {
    format!("!{state_key}")
}

/// The channel operator changes are published on.
pub(crate) fn channel(key_prefix: &str) -> String {
    format!("{key_prefix}:operator")
}

fn secs(ms: i64) -> u64 {
    (ms.max(0) as u64).div_ceil(1000)
}

/// Runs `action` on the identity `check.key` (under the rule whose
/// algorithm and cost `check` carries) on a connection from `pool`,
/// publishes the change on `channel`, claims a ban for `bans`'s count
/// (when this process counts), and answers what the rule holds for the
/// identity afterwards. Blocking; bounded by the connection's timeouts.
pub(crate) fn operate_blocking(
    pool: &Pool,
    timeout: Duration,
    channel: &str,
    bans: &Bans,
    check: &Check,
    action: Action,
) -> Result<Inspection, LimiterError> {
    let mut conn = pool
        .get_timeout(timeout)
        .map_err(|e| LimiterError::Other(format!("redis pool: {e}")))?;
    let mut call = script().prepare_invoke();
    call.key(&check.key).key(record_key(&check.key));
    call.arg(match action {
        Action::Clear => "clear",
        other => other.name(),
    });
    wire::algorithm(&mut call, &check.algorithm);
    call.arg(check.cost);
    let ms = |d: Option<Duration>| d.map_or(String::new(), |d| d.as_millis().to_string());
    match action {
        Action::Ban(d) => call.arg(d.as_millis() as u64).arg("").arg(""),
        Action::Override {
            limit,
            window,
            lasts,
        } => call.arg(limit).arg(ms(window)).arg(ms(lasts)),
        Action::Inspect | Action::Reset | Action::Unban | Action::Clear => {
            call.arg("").arg("").arg("")
        }
    };
    let result: redis::RedisResult<Vec<i64>> = call.invoke(&mut **conn);
    conn.note(&result);
    let v = result.map_err(LimiterError::from)?;
    if let (Action::Ban(_), true) = (action, bans.counting()) {
        // Claimed before it is published: a process that counts is the one
        // that counts its own ban.
        let prefix = channel.strip_suffix(":operator").unwrap_or(channel);
        let claimed = claim(&mut conn, bans, prefix, &check.key);
        conn.note(&claimed);
        if let Err(e) = claimed {
            // A listener (this process's too) claims it then.
            log::debug!(
                "could not claim the ban of {} to count it: {e}",
                Escaped(&check.key)
            );
        }
    }
    if action != Action::Inspect {
        // Every process forgets its remembered denial of the key (the key
        // alone, for the previous version's listeners), and hears what
        // changed.
        for message in [check.key.clone(), announcement(action, &check.key)] {
            let published: redis::RedisResult<i64> = redis::cmd("PUBLISH")
                .arg(channel)
                .arg(message)
                .query(&mut **conn);
            conn.note(&published);
            published.map_err(LimiterError::from)?;
        }
    }
    inspection(check, &v)
}

/// Reads the operator script's answer (see `lua/operator.lua`).
fn inspection(check: &Check, v: &[i64]) -> Result<Inspection, LimiterError> {
    if let [-1, code, ..] = *v {
        return Err(wire::undecidable(code, &check.key));
    }
    let [limit, window_ms, used, reset_ms, banned_ms, ol, ow, oe] = *v else {
        return Err(wire::reply_length(v.len(), 8));
    };
    let limit = limit.max(0) as u64;
    let used = used.max(0) as u64;
    let override_state = (ol >= 0).then(|| OverrideState {
        limit: ol as u64,
        window_s: if ow >= 0 { secs(ow) } else { secs(window_ms) },
        expires_s: (oe >= 0).then(|| secs(oe)),
    });
    Ok(Inspection {
        key: check.key.clone(),
        algorithm: check.algorithm.name(),
        limit,
        window_s: secs(window_ms).max(1),
        used,
        remaining: limit.saturating_sub(used),
        reset_s: secs(reset_ms),
        banned_s: secs(banned_ms),
        override_state,
    })
}

impl Limiter {
    /// Runs an operator's `action` on the identity `check.key` under the
    /// rule `check` was made from, and answers what the rule holds for it
    /// afterwards. The change is seen by the next decision on the key in
    /// every process sharing this Redis (decisions read it in their own
    /// call), and every process's remembered denial of the key is
    /// forgotten within moments. Uses a pooled connection, within
    /// `redis.timeout`.
    pub async fn operate(&self, check: Check, action: Action) -> Result<Inspection, LimiterError> {
        action.check().map_err(LimiterError::Invalid)?;
        action.fits(&check, None).map_err(LimiterError::Invalid)?;
        let pool = self.pool().clone();
        let timeout = self.timeout();
        let channel = self.channel().to_string();
        let bans = Arc::clone(self.local().bans());
        let key = check.key.clone();
        let work = tokio::task::spawn_blocking(move || {
            operate_blocking(&pool, timeout, &channel, &bans, &check, action)
        });
        match tokio::time::timeout(timeout * 3, work).await {
            Ok(Ok(result)) => {
                if result.is_ok() {
                    self.changed_here(&key, action);
                }
                result
            }
            Ok(Err(e)) => Err(LimiterError::Other(format!(
                "the action did not finish: {e}"
            ))),
            Err(_) => Err(LimiterError::Timeout),
        }
    }

    /// As [`Limiter::operate`], blocking the calling thread (a command line
    /// tool has no runtime to spare).
    pub fn operate_blocking(
        &self,
        check: &Check,
        action: Action,
    ) -> Result<Inspection, LimiterError> {
        action.check().map_err(LimiterError::Invalid)?;
        action.fits(check, None).map_err(LimiterError::Invalid)?;
        let result = operate_blocking(
            self.pool(),
            self.timeout(),
            self.channel(),
            self.local().bans(),
            check,
            action,
        );
        if result.is_ok() {
            self.changed_here(&check.key, action);
        }
        result
    }

    /// What this process knows of `key` after `action` succeeded, at once:
    /// the listener hears the same a moment later, but the next request
    /// (often the operator's own check) may come before it.
    fn changed_here(&self, key: &str, action: Action) {
        if action == Action::Inspect {
            return;
        }
        if let Some(cache) = self.deny_cache() {
            cache.forget(key);
        }
        let bans = self.local().bans();
        match action {
            Action::Ban(d) => {
                let now = Instant::now();
                bans.learn(key, d, now, now);
            }
            Action::Unban | Action::Reset => bans.forget(key),
            _ => {}
        }
    }
}
