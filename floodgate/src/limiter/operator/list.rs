//! What operators see without knowing an identity's key: every identity
//! with a ban or an override in force, found with `SCAN` over the operator
//! records (on a Cluster, on every master) and read with one `HMGET` each;
//! and the audit trail, a bounded list in Redis of operators' actions and
//! penalty bans. Nothing here runs on a decision's path: listings are
//! operators' commands, and the trail is written by whoever acts.

use std::borrow::Cow;
use std::sync::mpsc::{channel, Sender};
use std::time::{SystemTime, UNIX_EPOCH};

use redis::{ConnectionLike, Value};

use super::record_key;
use super::Limiter;
use crate::limiter::conn::Pool;
use crate::limiter::topology::{Link, RedisConn};
use crate::limiter::LimiterError;
use crate::rule::{rule_of_segment, rule_segment};

/// The newest entries the audit trail keeps.
pub(crate) const AUDIT_KEEP: usize = 10_000;

/// How long the audit trail lives after its newest entry (every key the
/// limiter writes has a TTL): a trail nobody adds to for this long goes.
const AUDIT_LASTS_MS: u64 = 400 * 24 * 3600 * 1000;

/// An identity with a ban or an override in force under one rule.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Listed {
    /// The rule's name.
    pub rule: String,
    /// The identity as its key holds it (`+15550109999|203.0.113.7`, or
    /// `~HASH` for a rule with `hash_key`).
    pub id: String,
    /// Its state key.
    pub key: String,
    /// Milliseconds left on its ban (0: not banned).
    pub banned_ms: u64,
    /// Who banned it, when it is banned: `"operator"` or `"penalty"`.
    pub ban_source: Option<String>,
    /// Its penalty level: how many penalty bans in a row it has had.
    pub level: u32,
    /// Its own limit, when one is in force.
    pub override_state: Option<ListedOverride>,
}

/// An override found by a listing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListedOverride {
    /// The limit (token bucket: burst).
    pub limit: u64,
    /// Its window in milliseconds; `None`: the rule's.
    pub window_ms: Option<u64>,
    /// Milliseconds until it ends; `None`: until cleared.
    pub expires_ms: Option<u64>,
}

/// One entry of the audit trail: who did what to which identity.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct AuditEntry {
    /// When, as RFC 3339 UTC (`2026-12-02T08:00:00Z`).
    pub at: String,
    /// `inspect` is not recorded; `reset`, `ban`, `unban`, `override`,
    /// `clear`, or `penalty` (a ban a rule's penalty gave).
    pub action: String,
    /// The rule's name.
    pub rule: String,
    /// The identity as its key holds it.
    pub id: String,
    /// The admin API client's address, `cli:` and the OS user, or
    /// `penalty`.
    pub by: String,
    /// What it did, in words (a ban's length, an override's numbers).
    pub detail: String,
}

impl AuditEntry {
    /// An entry made now.
    pub fn now(action: &str, rule: &str, id: &str, by: &str, detail: &str) -> AuditEntry {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        AuditEntry {
            at: rfc3339(secs),
            action: action.to_string(),
            rule: rule.to_string(),
            id: id.to_string(),
            by: by.to_string(),
            detail: detail.to_string(),
        }
    }

    /// Seconds since the epoch of [`AuditEntry::at`] (0 if unreadable).
    pub fn at_secs(&self) -> u64 {
        parse_rfc3339(&self.at).unwrap_or(0)
    }
}

/// The rule, kind and ID of a state key under `prefix`
/// (`PREFIX:RULE:KIND:ID`, the ID in braces on a Cluster; a rule name's
/// `:`, `{`, `}` and `%` stand escaped in RULE, and come back as they are).
#[doc(hidden)] // the floodgate binary's, not part of the API
pub fn split_state_key<'k>(prefix: &str, key: &'k str) -> Option<(Cow<'k, str>, &'k str, &'k str)> {
    let rest = key.strip_prefix(prefix)?.strip_prefix(':')?;
    let (rule, rest) = rest.split_once(':')?;
    let rule = rule_of_segment(rule);
    let (kind, id) = rest.split_once(':')?;
    let id = id
        .strip_prefix('{')
        .and_then(|i| i.strip_suffix('}'))
        .unwrap_or(id);
    Some((rule, kind, id))
}

/// `text` with the glob characters of `SCAN MATCH` escaped.
fn glob_escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The keys matching `pattern` on one server, by `SCAN`.
fn scan_keys(
    mut call: impl FnMut(&redis::Cmd) -> redis::RedisResult<Value>,
    pattern: &str,
) -> redis::RedisResult<Vec<String>> {
    let mut keys = Vec::new();
    let mut cursor = "0".to_string();
    loop {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(&cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000);
        let (next, mut found): (String, Vec<String>) =
            redis::from_redis_value(call(&cmd)?).map_err(redis::RedisError::from)?;
        keys.append(&mut found);
        if next == "0" {
            return Ok(keys);
        }
        cursor = next;
    }
}

/// Every key matching `pattern`: on one server, or on every master of a
/// Cluster.
fn keys_matching(conn: &mut RedisConn, pattern: &str) -> redis::RedisResult<Vec<String>> {
    match conn {
        RedisConn(Link::Single(c)) => scan_keys(|cmd| cmd.query::<Value>(c), pattern),
        #[cfg(feature = "cluster")]
        RedisConn(Link::Cluster(c)) => {
            use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
            let slots = c.route_command(
                redis::cmd("CLUSTER").arg("SLOTS"),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
            )?;
            let mut masters: Vec<(String, u16)> = Vec::new();
            for (_, _, host, port) in
                crate::limiter::dispatch::cluster::slot::parse_slots(&slots).unwrap_or_default()
            {
                if !masters.contains(&(host.clone(), port)) {
                    masters.push((host, port));
                }
            }
            let mut keys = Vec::new();
            for (host, port) in masters {
                let node = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress { host, port });
                keys.append(&mut scan_keys(
                    |cmd| c.route_command(cmd, node.clone()),
                    pattern,
                )?);
            }
            keys.sort();
            keys.dedup();
            Ok(keys)
        }
    }
}

/// Redis's clock, in ms.
fn redis_now(conn: &mut impl ConnectionLike) -> redis::RedisResult<u64> {
    let (s, us): (u64, u64) = redis::cmd("TIME").query(conn)?;
    Ok(s * 1000 + us / 1000)
}

impl Limiter {
    /// Every identity under `prefix` with a ban or an override in force,
    /// rules in name order, then identities. Blocking: for operators'
    /// commands, or inside [`Limiter::with_redis`].
    pub fn listed_blocking(&self, prefix: &str) -> Result<Vec<Listed>, LimiterError> {
        let mut conn = self
            .pool()
            .get_timeout(self.timeout())
            .map_err(|e| LimiterError::Other(format!("redis pool: {e}")))?;
        let listed = list(&mut conn, prefix);
        conn.note(&listed);
        let mut listed = listed.map_err(LimiterError::from)?;
        listed.sort_by(|a, b| (&a.rule, &a.id).cmp(&(&b.rule, &b.id)));
        Ok(listed)
    }

    /// The state keys of the rule `rule` under `prefix` (on a Cluster, on
    /// every master), found with `SCAN`: those that hold counts, and those
    /// of identities with only an operator record (banned before any
    /// request). Blocking, as [`Limiter::listed_blocking`].
    #[doc(hidden)] // the floodgate binary's, not part of the API
    pub fn state_keys_blocking(
        &self,
        prefix: &str,
        rule: &str,
    ) -> Result<Vec<String>, LimiterError> {
        let mut conn = self
            .pool()
            .get_timeout(self.timeout())
            .map_err(|e| LimiterError::Other(format!("redis pool: {e}")))?;
        let pattern = format!(
            "{}:{}:*",
            glob_escaped(prefix),
            glob_escaped(&rule_segment(rule))
        );
        let keys = keys_matching(&mut conn, &pattern).and_then(|mut keys| {
            keys.extend(keys_matching(&mut conn, &format!("!{pattern}"))?);
            Ok(keys)
        });
        conn.note(&keys);
        let mut keys: Vec<String> = keys
            .map_err(LimiterError::from)?
            .into_iter()
            .map(|k| k.strip_prefix('!').map_or(k.clone(), str::to_string))
            .collect();
        keys.sort();
        keys.dedup();
        Ok(keys)
    }

    /// Adds `entry` to the audit trail under `prefix` (the newest
    /// 10 000 stay) and logs it. Blocking, as
    /// [`Limiter::listed_blocking`].
    #[doc(hidden)] // the floodgate binary's, not part of the API
    pub fn audit_blocking(&self, prefix: &str, entry: &AuditEntry) -> Result<(), LimiterError> {
        log::info!(
            "operator: {} under rule {} of {} by {}{}{}",
            entry.action,
            entry.rule,
            crate::logging::Escaped(&entry.id),
            crate::logging::Escaped(&entry.by),
            if entry.detail.is_empty() { "" } else { ": " },
            entry.detail
        );
        let mut conn = self
            .pool()
            .get_timeout(self.timeout())
            .map_err(|e| LimiterError::Other(format!("redis pool: {e}")))?;
        let line = serde_json::to_string(entry).map_err(|e| LimiterError::Other(e.to_string()))?;
        let mut pipe = redis::pipe();
        push_audit(&mut pipe, &audit_key(prefix), [line]);
        let written: redis::RedisResult<()> = pipe.query(&mut *conn);
        conn.note(&written);
        written.map_err(LimiterError::from)
    }

    /// The audit trail under `prefix`, newest first, entries made at or
    /// after `since` (seconds since the epoch), at most `most`.
    pub fn audit_trail_blocking(
        &self,
        prefix: &str,
        since: u64,
        most: usize,
    ) -> Result<Vec<AuditEntry>, LimiterError> {
        let mut conn = self
            .pool()
            .get_timeout(self.timeout())
            .map_err(|e| LimiterError::Other(format!("redis pool: {e}")))?;
        let lines: redis::RedisResult<Vec<String>> = redis::cmd("LRANGE")
            .arg(audit_key(prefix))
            .arg(0)
            .arg(AUDIT_KEEP - 1)
            .query(&mut *conn);
        conn.note(&lines);
        let entries = lines
            .map_err(LimiterError::from)?
            .iter()
            .filter_map(|l| serde_json::from_str::<AuditEntry>(l).ok())
            .take_while(|e| e.at_secs() >= since)
            .take(most)
            .collect();
        Ok(entries)
    }
}

/// Starts the thread that writes the penalty bans the dispatchers report
/// to the audit trail under `prefix`: what one wake-up finds goes in one
/// round trip, off every decision's path. A write that fails is logged and
/// dropped (the ban itself is in force). `None` if the thread cannot start.
pub(crate) fn penalty_writer(pool: Pool, prefix: &str) -> Option<Sender<(String, u64)>> {
    let (tx, rx) = channel::<(String, u64)>();
    let prefix = prefix.to_string();
    let started = std::thread::Builder::new()
        .name("floodgate-audit".to_owned())
        .spawn(move || {
            while let Ok(first) = rx.recv() {
                let mut bans = vec![first];
                bans.extend(rx.try_iter());
                write_penalties(&pool, &prefix, &bans);
            }
        });
    match started {
        Ok(_) => Some(tx),
        Err(e) => {
            log::warn!(
                "cannot start the audit trail's writer ({e}); penalty bans are not written to it"
            );
            None
        }
    }
}

/// Adds to `pipe` the writing of `lines` (oldest first) on the audit trail
/// at `key`, which then keeps its newest [`AUDIT_KEEP`] entries, for
/// [`AUDIT_LASTS_MS`] after the newest.
fn push_audit(pipe: &mut redis::Pipeline, key: &str, lines: impl IntoIterator<Item = String>) {
    for line in lines {
        pipe.cmd("LPUSH").arg(key).arg(line).ignore();
    }
    pipe.cmd("LTRIM")
        .arg(key)
        .arg(0)
        .arg(AUDIT_KEEP - 1)
        .ignore()
        .cmd("PEXPIRE")
        .arg(key)
        .arg(AUDIT_LASTS_MS)
        .ignore();
}

fn write_penalties(pool: &Pool, prefix: &str, bans: &[(String, u64)]) {
    let mut lines = Vec::with_capacity(bans.len());
    for (key, ms) in bans {
        let (rule, id) = split_state_key(prefix, key)
            .map_or((Cow::Borrowed(""), key.as_str()), |(r, _, i)| (r, i));
        let detail = format!(
            "for {}",
            crate::units::format_duration(std::time::Duration::from_millis(*ms))
        );
        let entry = AuditEntry::now("penalty", &rule, id, "penalty", &detail);
        log::info!(
            "penalty: ban under rule {rule} of {} {detail}",
            crate::logging::Escaped(id)
        );
        if let Ok(line) = serde_json::to_string(&entry) {
            lines.push(line);
        }
    }
    let mut pipe = redis::pipe();
    push_audit(&mut pipe, &audit_key(prefix), lines);
    let written = pool.get().map_err(|e| e.to_string()).and_then(|mut conn| {
        let written: redis::RedisResult<()> = pipe.query(&mut *conn);
        conn.note(&written);
        written.map_err(|e| e.to_string())
    });
    if let Err(e) = written {
        log::warn!(
            "{} penalty bans not written to the audit trail: {e}",
            bans.len()
        );
    }
}

/// The audit trail's key. On a Cluster it is one key, on one master.
fn audit_key(prefix: &str) -> String {
    format!("{prefix}:audit")
}

fn list(conn: &mut RedisConn, prefix: &str) -> redis::RedisResult<Vec<Listed>> {
    let pattern = format!("!{}:*", glob_escaped(prefix));
    let records = keys_matching(conn, &pattern)?;
    let now = redis_now(conn)?;
    let mut listed = Vec::new();
    for record in records {
        let Some(state_key) = record.strip_prefix('!') else {
            continue;
        };
        let Some((rule, _, id)) = split_state_key(prefix, state_key) else {
            continue;
        };
        debug_assert_eq!(record_key(state_key), record);
        let fields: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&record)
            .arg(&["ban", "lv", "ol", "ow", "oe", "by"])
            .query(conn)?;
        // (Lua writes whole numbers; read as numbers whatever their form.)
        let field = |i: usize| {
            fields
                .get(i)
                .and_then(|f| f.as_deref()?.parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(|v| v.ceil() as u64)
        };
        let by = fields.get(5).cloned().flatten();
        let banned_ms = field(0).map_or(0, |end| end.saturating_sub(now));
        let override_state = field(2)
            .filter(|_| field(4).is_none_or(|end| end > now))
            .map(|limit| ListedOverride {
                limit,
                window_ms: field(3),
                expires_ms: field(4).map(|end| end - now),
            });
        if banned_ms == 0 && override_state.is_none() {
            continue;
        }
        listed.push(Listed {
            rule: rule.to_string(),
            id: id.to_string(),
            key: state_key.to_string(),
            banned_ms,
            ban_source: by.filter(|_| banned_ms > 0),
            level: field(1).map_or(0, |l| u32::try_from(l).unwrap_or(u32::MAX)),
            override_state,
        });
    }
    Ok(listed)
}

/// Seconds since the epoch as RFC 3339 UTC.
fn rfc3339(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// What [`rfc3339`] wrote, back to seconds since the epoch.
fn parse_rfc3339(text: &str) -> Option<u64> {
    let b = text.as_bytes();
    if b.len() != 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[19] != b'Z' {
        return None;
    }
    let n = |r: std::ops::Range<usize>| text.get(r)?.parse::<u64>().ok();
    let days = days_from_civil(n(0..4)? as i64, n(5..7)?, n(8..10)?);
    let secs =
        u64::try_from(days).ok()? * 86_400 + n(11..13)? * 3600 + n(14..16)? * 60 + n(17..19)?;
    Some(secs)
}

/// The civil date of a day count from 1970-01-01 (Howard Hinnant's
/// algorithm).
fn civil_from_days(z: i64) -> (i64, u64, u64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097) as u64;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe as i64 + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// The day count from 1970-01-01 of a civil date.
fn days_from_civil(y: i64, m: u64, d: u64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400) as u64;
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe as i64 - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_written_and_read_as_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_198_400), "2026-12-02T08:00:00Z");
        for secs in [0, 951_782_400, 1_796_198_400, 4_102_444_799] {
            assert_eq!(parse_rfc3339(&rfc3339(secs)), Some(secs));
        }
        assert_eq!(parse_rfc3339("yesterday"), None);
    }

    #[test]
    fn state_keys_split_into_rule_kind_and_id() {
        assert_eq!(
            split_state_key("floodgate", "floodgate:sms:form+ip:+1555|203.0.113.7"),
            Some(("sms".into(), "form+ip", "+1555|203.0.113.7"))
        );
        assert_eq!(
            split_state_key("fg", "fg:check:ip:{127.0.0.1}"),
            Some(("check".into(), "ip", "127.0.0.1"))
        );
        assert_eq!(split_state_key("fg", "other:check:ip:1"), None);
        // A name's `:`, braces and `%` stand escaped, and come back whole.
        let key = crate::rule::redis_key_for(true, "fg", "a:b{c}%3A", "rls", "x:y");
        assert_eq!(key, "fg:a%3Ab%7Bc%7D%253A:rls:{x:y}");
        assert_eq!(
            split_state_key("fg", &key),
            Some(("a:b{c}%3A".into(), "rls", "x:y"))
        );
        assert_eq!(
            split_state_key("fg", "fg:50%:rls:1"),
            Some(("50%".into(), "rls", "1"))
        );
        assert_eq!(glob_escaped("a*b[c]"), "a\\*b\\[c\\]");
    }
}
