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
//! `local.rs`). A subscriber that lost its connection forgets every
//! remembered denial and every ban it heard of when it is subscribed again,
//! since it may have missed messages.
//!
//! An operator's ban is counted in `floodgate_bans_total` once, by one of
//! the processes whose metrics are served: each claims it with one atomic
//! call on the ban's record ([`CLAIM_SOURCE`]), and only the claimer counts
//! it. The process that made the ban claims it as soon as it is made (the
//! admin API), the others when they hear of it; a command-line process,
//! whose metrics nobody reads, never claims.

use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::conn::Pool;
use super::decide::Shared;
use super::local::Bans;
use super::topology::{Master, RedisConn, Source};
use super::wire;
use super::{Check, Limiter, LimiterError, RedisConfig};
use crate::logging::Escaped;

/// The Lua of an operator's action: the shared helpers, the algorithm
/// files, then the action's driver.
pub const OPERATOR_SOURCE: &str = wire::OPERATOR_SOURCE;

fn script() -> &'static redis::Script {
    static SCRIPT: OnceLock<redis::Script> = OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(OPERATOR_SOURCE))
}

/// Claims the operator ban in force on a record (`KEYS[1]`) for one
/// process's count: 1 for the first claim of that ban (its end, in the
/// field `bc`), 0 for any later one, or when no operator ban is in force.
/// Writes nothing but that field of a record that exists (and keeps its
/// TTL).
pub const CLAIM_SOURCE: &str = r#"
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

/// What a listener hears of one change (see the module's docs).
#[derive(Debug, PartialEq, Eq)]
enum Heard<'m> {
    /// A key alone: forget its remembered denial.
    Key(&'m str),
    /// Banned for this long from when it is heard.
    Ban(Duration, &'m str),
    /// Its ban ended (an unban, a reset).
    Unbanned(&'m str),
    /// Its override changed: forget its remembered denial.
    Changed(&'m str),
    /// An announcement of a later version: nothing this one understands.
    Unknown,
}

/// The announcement of `action` on `key`, as [`heard`] reads it.
fn announcement(action: Action, key: &str) -> String {
    match action {
        Action::Ban(d) => format!("!ban {} {key}", d.as_millis()),
        Action::Clear => format!("!clear {key}"),
        other => format!("!{} {key}", other.name()),
    }
}

/// Reads one message on the operator channel.
fn heard(message: &str) -> Heard<'_> {
    let Some(news) = message.strip_prefix('!') else {
        return Heard::Key(message);
    };
    let Some((what, rest)) = news.split_once(' ') else {
        return Heard::Unknown;
    };
    match what {
        "ban" => match rest.split_once(' ') {
            Some((ms, key)) => match ms.parse::<u64>() {
                Ok(ms) => Heard::Ban(Duration::from_millis(ms), key),
                Err(_) => Heard::Unknown,
            },
            None => Heard::Unknown,
        },
        "unban" | "reset" => Heard::Unbanned(rest),
        "override" | "clear" => Heard::Changed(rest),
        _ => Heard::Unknown,
    }
}

/// Escalating bans for a rule: `after` denials of one identity within
/// `within` ban it for `ban`; each further ban while the last one is
/// remembered (for `max` after it ends) lasts twice as long, up to `max`.
/// Counted and decided in the same call that denies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Penalty {
    /// Denials that ban (at least 1).
    pub after: u32,
    /// How long denials are counted for.
    pub within: Duration,
    /// The first ban's length.
    pub ban: Duration,
    /// The longest ban, and how long a ban is remembered after it ends.
    pub max: Duration,
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
pub fn json_string(text: &str) -> String {
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
pub fn record_key(state_key: &str) -> String {
    format!("!{state_key}")
}

/// The channel operator changes are published on.
pub fn channel(key_prefix: &str) -> String {
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
        let pool = self.pool().clone();
        let timeout = self.timeout();
        let channel = self.channel().to_string();
        let bans = Arc::clone(self.local().bans());
        let key = check.key.clone();
        let work = actix_rt::task::spawn_blocking(move || {
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

/// Starts the thread that listens for operator changes: it forgets the
/// changed keys' remembered denials in `shared`'s cache, keeps the bans it
/// hears of in `bans`, and claims operator bans to count them. It ends
/// once the limiter is dropped.
pub(super) fn listen(config: &RedisConfig, source: Source, shared: &Arc<Shared>, bans: &Arc<Bans>) {
    let listener = Listener {
        seeds: config.cluster.clone(),
        source,
        channel: channel(&config.key_prefix),
        prefix: config.key_prefix.clone(),
        timeout: config.timeout,
        shared: Arc::downgrade(shared),
        bans: Arc::clone(bans),
        commands: None,
    };
    let started = std::thread::Builder::new()
        .name("floodgate-operator".into())
        .spawn(move || listener.run());
    if let Err(e) = started {
        log::warn!("cannot start the operator listener ({e}); operator changes reach this process's denial cache only when the denials expire");
    }
}

struct Listener {
    #[cfg_attr(not(feature = "cluster"), allow(dead_code))]
    seeds: Vec<String>,
    source: Source,
    channel: String,
    /// `[redis] key_prefix`: state keys are PREFIX:RULE:KIND:ID.
    prefix: String,
    timeout: Duration,
    shared: Weak<Shared>,
    bans: Arc<Bans>,
    /// A connection for claims (a subscribed one sends no commands),
    /// opened when first needed.
    commands: Option<RedisConn>,
}

/// How long the listener waits for a message before it checks that the
/// limiter still exists and its server is still the one to listen to.
const LISTEN_TICK: Duration = Duration::from_millis(500);

impl Listener {
    fn run(mut self) {
        let mut seed = 0;
        let mut failing_since: Option<Instant> = None;
        loop {
            if self.shared.strong_count() == 0 {
                return;
            }
            match self.connect(&mut seed) {
                Ok((conn, master)) => {
                    failing_since = None;
                    if self.listen(conn, master.as_ref()) {
                        return;
                    }
                }
                Err(e) => {
                    if failing_since.is_none() {
                        log::debug!("operator listener: cannot connect ({e}); retrying");
                        failing_since = Some(Instant::now());
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    }

    /// A connection to listen on: the server (or the master the Sentinels
    /// name); on a Cluster, a seed node (a Cluster delivers every message
    /// to every node).
    #[cfg_attr(not(feature = "cluster"), allow(unused_variables))]
    fn connect(&self, seed: &mut usize) -> redis::RedisResult<(redis::Connection, Option<Master>)> {
        #[cfg(feature = "cluster")]
        if let Source::Cluster(_) = self.source {
            let url = &self.seeds[*seed % self.seeds.len().max(1)];
            *seed += 1;
            let conn =
                redis::Client::open(url.as_str())?.get_connection_with_timeout(self.timeout)?;
            return Ok((conn, None));
        }
        match self.source.open(self.timeout, self.timeout)? {
            (RedisConn::Single(conn), master) => Ok((conn, master)),
            #[cfg(feature = "cluster")]
            (RedisConn::Cluster(_), _) => Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "a cluster connection cannot subscribe",
            ))),
        }
    }

    /// Claims the operator ban on `key` for this process's count, on the
    /// listener's own command connection (opened again after an error).
    fn claim(&mut self, key: &str) {
        if self.commands.is_none() {
            match self.source.open(self.timeout, self.timeout) {
                Ok((conn, _)) => self.commands = Some(conn),
                Err(e) => {
                    log::debug!("operator listener: cannot connect to claim a ban ({e})");
                    return;
                }
            }
        }
        let Some(conn) = self.commands.as_mut() else {
            return;
        };
        if let Err(e) = claim(conn, &self.bans, &self.prefix, key) {
            log::debug!(
                "operator listener: could not claim the ban of {} ({e})",
                Escaped(key)
            );
            self.commands = None;
        }
    }

    /// Acts on one message: the denial cache forgets, the bans learn or
    /// forget, a ban is claimed.
    fn hear(&mut self, shared: &Shared, message: &str) {
        let forget = |key: &str| {
            if let Some(cache) = &shared.deny_cache {
                cache.forget(key);
            }
        };
        match heard(message) {
            Heard::Key(key) | Heard::Changed(key) => forget(key),
            Heard::Ban(wait, key) => {
                forget(key);
                let now = Instant::now();
                self.bans.learn(key, wait, now, now);
                if self.bans.counting() {
                    self.claim(key);
                }
            }
            Heard::Unbanned(key) => {
                forget(key);
                self.bans.forget(key);
            }
            Heard::Unknown => {}
        }
    }

    /// Listens until the connection fails (false) or the limiter is gone (true).
    fn listen(&mut self, mut conn: redis::Connection, master: Option<&Master>) -> bool {
        let mut pubsub = conn.as_pubsub();
        if pubsub.subscribe(&self.channel).is_err()
            || pubsub.set_read_timeout(Some(LISTEN_TICK)).is_err()
        {
            return false;
        }
        // Messages may have been missed while no connection listened.
        match self.shared.upgrade() {
            Some(shared) => {
                if let Some(cache) = &shared.deny_cache {
                    cache.clear();
                }
                self.bans.clear();
            }
            None => return true,
        }
        loop {
            let message = pubsub.get_message();
            let Some(shared) = self.shared.upgrade() else {
                return true;
            };
            match message {
                Ok(msg) => {
                    if let Ok(text) = std::str::from_utf8(msg.get_payload_bytes()) {
                        self.hear(&shared, text);
                    }
                }
                Err(e) if e.is_timeout() => {
                    if !self.source.still_named(master) {
                        // A failover: listen to the new master.
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_read_back_as_they_were_written() {
        let key = "fg:check:ip:203.0.113.7";
        let ban = Action::Ban(Duration::from_secs(90));
        assert_eq!(
            heard(&announcement(ban, key)),
            Heard::Ban(Duration::from_secs(90), key)
        );
        for action in [Action::Unban, Action::Reset] {
            assert_eq!(heard(&announcement(action, key)), Heard::Unbanned(key));
        }
        let over = Action::Override {
            limit: 5,
            window: None,
            lasts: None,
        };
        for action in [over, Action::Clear] {
            assert_eq!(heard(&announcement(action, key)), Heard::Changed(key));
        }
        // What the previous version publishes: the key alone.
        assert_eq!(heard(key), Heard::Key(key));
        // A later version's news, or a garbled ban: nothing.
        assert_eq!(heard("!pause 10 k"), Heard::Unknown);
        assert_eq!(heard("!ban soon k"), Heard::Unknown);
        assert_eq!(heard("!ban"), Heard::Unknown);
        // A key with spaces (a header value) stays whole.
        assert_eq!(
            heard("!ban 5 fg:h:header:a b"),
            Heard::Ban(Duration::from_millis(5), "fg:h:header:a b")
        );
    }
}
