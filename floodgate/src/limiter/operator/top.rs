//! The most denied identities per rule (`floodgate top`): each process
//! tallies its denials in memory (every enforce denial Redis answers, as
//! the dispatchers conclude it, whoever asked; and those the filter's
//! denial cache answers) and
//! a thread of its own writes the tally once a second, one script call per
//! rule, into sorted sets by the minute (`PREFIX:top:{RULE}:MINUTE`, the
//! identity's denials as its score) and one of the last denial's time
//! (`PREFIX:top:{RULE}:last`), all in the rule's hash slot. Memory is
//! bounded everywhere: the tally holds at most [`TALLY_MOST`] identities
//! between writes (more are dropped and counted in the log), a minute's set
//! keeps its [`MINUTE_MOST`] most denied, the last-time set the newest
//! [`LAST_MOST`], and every key expires after a day. A denial adds nothing
//! to its request's path but a lock and a map insert.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use super::{split_state_key, Limiter};
use crate::limiter::conn::Pool;
use crate::limiter::shared::{Counts, Tally, TALLY_MOST};
use crate::limiter::LimiterError;

/// Identities a rule's minute keeps (the most denied).
const MINUTE_MOST: usize = 1000;
/// Identities a rule's last-denial set keeps (the newest).
const LAST_MOST: usize = 10_000;
/// The longest `top` looks back.
#[doc(hidden)] // the floodgate binary's, not part of the API
pub const TOP_SINCE_MOST: Duration = Duration::from_secs(24 * 3600);
/// The most identities `top` answers.
pub(crate) const TOP_MOST: usize = 100;

/// What one write adds for one rule: `KEYS[1]` the minute's set,
/// `KEYS[2]` the last-denial set; `ARGV[1]` now in ms, then pairs of
/// identity and denials.
const WRITE: &str = r#"
local now = tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  redis.call('ZINCRBY', KEYS[1], ARGV[i + 1], ARGV[i])
  redis.call('ZADD', KEYS[2], now, ARGV[i])
end
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(MINUTE_MOST + 1))
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -(LAST_MOST + 1))
redis.call('PEXPIRE', KEYS[1], 90000000)
redis.call('PEXPIRE', KEYS[2], 90000000)
return 0
"#;

fn write_script() -> &'static redis::Script {
    static SCRIPT: OnceLock<redis::Script> = OnceLock::new();
    SCRIPT.get_or_init(|| {
        redis::Script::new(&format!(
            "local MINUTE_MOST = {MINUTE_MOST}\nlocal LAST_MOST = {LAST_MOST}\n{WRITE}"
        ))
    })
}

/// The keys of `rule`'s sets under `prefix`.
fn minute_key(prefix: &str, rule: &str, minute: u64) -> String {
    format!("{prefix}:top:{{{rule}}}:{minute}")
}

fn last_key(prefix: &str, rule: &str) -> String {
    format!("{prefix}:top:{{{rule}}}:last")
}

/// Starts the thread that writes `tally` once a second; it ends with the
/// tally's last owner.
pub(crate) fn start_writer(tally: &Arc<Tally>, pool: Pool, prefix: &str) {
    let tally: Weak<Tally> = Arc::downgrade(tally);
    let prefix = prefix.to_string();
    let started = std::thread::Builder::new()
        .name("floodgate-top".to_owned())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_secs(1));
            let Some(tally) = tally.upgrade() else {
                return;
            };
            let (counts, dropped) = tally.take();
            drop(tally);
            if dropped > 0 {
                log::info!(
                    "top: {dropped} denials not tallied (over {TALLY_MOST} identities in a second)"
                );
            }
            if !counts.is_empty() {
                if let Err(e) = write(&pool, &prefix, counts) {
                    log::warn!("top: the denials of the last second were not written: {e}");
                }
            }
        });
    if let Err(e) = started {
        log::warn!("cannot start the writer of denial counts ({e}); floodgate top shows nothing");
    }
}

fn write(pool: &Pool, prefix: &str, counts: Counts) -> Result<(), String> {
    let mut by_rule: HashMap<String, Vec<(String, u64)>> = HashMap::new();
    for (key, n) in counts {
        if let Some((rule, _, id)) = split_state_key(prefix, &key) {
            by_rule
                .entry(rule.to_string())
                .or_default()
                .push((id.to_string(), n));
        }
    }
    let mut conn = pool.get().map_err(|e| e.to_string())?;
    let time = redis::cmd("TIME");
    let (s, us): (u64, u64) = time.query(&mut *conn).map_err(|e| e.to_string())?;
    let now = s * 1000 + us / 1000;
    for (rule, ids) in by_rule {
        let mut call = write_script().prepare_invoke();
        call.key(minute_key(prefix, &rule, now / 60_000))
            .key(last_key(prefix, &rule))
            .arg(now);
        for (id, n) in ids {
            call.arg(id).arg(n);
        }
        let written: redis::RedisResult<i64> = call.invoke(&mut *conn);
        conn.note(&written);
        written.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// One identity `top` names.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TopEntry {
    /// The identity as its key holds it.
    pub id: String,
    /// Its denials in the period.
    pub denied: u64,
    /// Seconds since its last denial.
    pub last_s: u64,
}

impl Limiter {
    /// Counts a denial answered without Redis (from the denial cache) of
    /// the identity whose state key is `key`, for [`Limiter::top_blocking`]
    /// (written within about a second). Those Redis decides are counted as
    /// their decisions are concluded.
    pub(crate) fn tally_denial(&self, key: &str) {
        self.shared.top.add(key);
    }

    /// The identities denied most under `rule` in the last `since` (at
    /// most a day, to the minute), most first, at most 100, as all
    /// the processes sharing `prefix` wrote them. Blocking.
    pub fn top_blocking(
        &self,
        prefix: &str,
        rule: &str,
        since: Duration,
    ) -> Result<Vec<TopEntry>, LimiterError> {
        let since = since.min(TOP_SINCE_MOST);
        let mut conn = self
            .pool()
            .get_timeout(self.timeout())
            .map_err(|e| LimiterError::Other(format!("redis pool: {e}")))?;
        let read = (|| -> redis::RedisResult<Vec<TopEntry>> {
            let (s, us): (u64, u64) = redis::cmd("TIME").query(&mut *conn)?;
            let now = s * 1000 + us / 1000;
            let first = now.saturating_sub(since.as_millis() as u64) / 60_000;
            let mut pipe = redis::pipe();
            for minute in first..=now / 60_000 {
                pipe.cmd("ZRANGE")
                    .arg(minute_key(prefix, rule, minute))
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES");
            }
            let minutes: Vec<Vec<(String, f64)>> = pipe.query(&mut *conn)?;
            let mut denied: HashMap<String, u64> = HashMap::new();
            for (id, n) in minutes.into_iter().flatten() {
                *denied.entry(id).or_default() += n.max(0.0) as u64;
            }
            let mut most: Vec<(String, u64)> = denied.into_iter().collect();
            most.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            most.truncate(TOP_MOST);
            if most.is_empty() {
                return Ok(Vec::new());
            }
            let mut last = redis::cmd("ZMSCORE");
            last.arg(last_key(prefix, rule));
            for (id, _) in &most {
                last.arg(id);
            }
            let lasts: Vec<Option<f64>> = last.query(&mut *conn)?;
            Ok(most
                .into_iter()
                .zip(lasts)
                .map(|((id, denied), at)| TopEntry {
                    id,
                    denied,
                    last_s: at.map_or(0, |at| now.saturating_sub(at as u64) / 1000),
                })
                .collect())
        })();
        conn.note(&read);
        read.map_err(LimiterError::from)
    }
}
