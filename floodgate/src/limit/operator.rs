//! Operators' actions on one identity under one rule: look at what the
//! rule holds for it, forget it, ban it, end its ban, give it its own
//! limit. Each action is one atomic script call (`lua/operator.lua`) on the
//! identity's state key and its operator record, the hash beside it that
//! the decision script reads in the same call as the state (see
//! `lua/common.lua`): one `EXISTS` per call over every record it could
//! read, and an `HMGET` for a check whose record exists; never a round trip. On a Cluster the record shares the state key's
//! hash tag, so its slot.
//!
//! What the script cannot reach is each process's denial cache: after
//! every change the action publishes the state key on the channel
//! `PREFIX:operator`, and every [`Limiter`] with a denial cache keeps one
//! subscriber connection (a thread) that forgets the key's remembered
//! denial. A subscriber that lost its connection forgets every remembered
//! denial when it is subscribed again, since it may have missed messages.

use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use super::conn::Pool;
use super::limiter::Shared;
use super::topology::{Master, RedisConn, Source};
use super::wire;
use super::{Check, Limiter, LimiterError, RedisConfig};

/// The Lua of an operator's action: the shared helpers, the algorithm
/// files, then the action's driver.
pub const OPERATOR_SOURCE: &str = wire::OPERATOR_SOURCE;

fn script() -> &'static redis::Script {
    static SCRIPT: OnceLock<redis::Script> = OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(OPERATOR_SOURCE))
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
/// publishes the change on `channel`, and answers what the rule holds for
/// the identity afterwards. Blocking; bounded by the connection's timeouts.
pub(crate) fn operate_blocking(
    pool: &Pool,
    timeout: Duration,
    channel: &str,
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
    if action != Action::Inspect {
        // Every process forgets its remembered denial of the key.
        let published: redis::RedisResult<i64> = redis::cmd("PUBLISH")
            .arg(channel)
            .arg(&check.key)
            .query(&mut **conn);
        conn.note(&published);
        published.map_err(LimiterError::from)?;
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
        let work = actix_rt::task::spawn_blocking(move || {
            operate_blocking(&pool, timeout, &channel, &check, action)
        });
        match tokio::time::timeout(timeout * 3, work).await {
            Ok(Ok(result)) => result,
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
        operate_blocking(self.pool(), self.timeout(), self.channel(), check, action)
    }
}

/// Starts the thread that listens for operator changes and forgets the
/// changed keys' remembered denials in `shared`'s cache. It ends once the
/// limiter is dropped.
pub(super) fn listen(config: &RedisConfig, source: Source, shared: &Arc<Shared>) {
    let listener = Listener {
        seeds: config.cluster.clone(),
        source,
        channel: channel(&config.key_prefix),
        timeout: config.timeout,
        shared: Arc::downgrade(shared),
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
    timeout: Duration,
    shared: Weak<Shared>,
}

/// How long the listener waits for a message before it checks that the
/// limiter still exists and its server is still the one to listen to.
const LISTEN_TICK: Duration = Duration::from_millis(500);

impl Listener {
    fn run(self) {
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

    /// Listens until the connection fails (false) or the limiter is gone (true).
    fn listen(&self, mut conn: redis::Connection, master: Option<&Master>) -> bool {
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
                    if let (Some(cache), Ok(key)) = (
                        &shared.deny_cache,
                        std::str::from_utf8(msg.get_payload_bytes()),
                    ) {
                        cache.forget(key);
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
