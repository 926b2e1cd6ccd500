//! The bans this process knows of, for the local fallback.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::limiter::deny_cache::DenyCache;

/// What this process knows of bans, for the local fallback: those Redis
/// answered (a decision denied as banned) and those announced on the
/// operator channel, each until the ban's end (bounded as the denial
/// cache is: 32768 keys, the ones that end soonest dropped first). And the
/// operator bans this process claimed to count in its metrics.
#[derive(Debug, Default)]
pub(crate) struct Bans {
    known: DenyCache,
    /// Whether metrics are served from this process (a filter watches the
    /// limiter): only then does it claim operator bans to count them.
    counting: AtomicBool,
    /// Operator bans claimed here, per rule.
    counted: Mutex<BTreeMap<String, u64>>,
}

impl Bans {
    /// Remembers that `key` is banned for `wait`, as Redis answered a call
    /// sent at `sent` and answered at `answered` (or as a message heard at
    /// `answered` said: then both are that moment). Not remembered when
    /// the key's ban was ended (or reset) after `sent`.
    pub(crate) fn learn(&self, key: &str, wait: Duration, sent: Instant, answered: Instant) {
        self.known.remember_ban(key, wait, sent, answered);
    }

    /// The ban of `key` ended, or may have: forget it (and a ban Redis
    /// answered for a call sent before now).
    pub(crate) fn forget(&self, key: &str) {
        self.known.forget(key);
    }

    /// Forgets every ban (the operator channel may have missed an unban).
    pub(crate) fn clear(&self) {
        self.known.clear();
    }

    /// How long `key` stays banned, if it is at `now`.
    pub(crate) fn banned(&self, key: &str, now: Instant) -> Option<Duration> {
        self.known.denial(key, 1, now).map(|d| d.wait)
    }

    /// From now on this process counts the operator bans it claims.
    pub(crate) fn count_here(&self) {
        self.counting.store(true, Ordering::Relaxed);
    }

    /// Whether this process counts the operator bans it claims.
    pub(crate) fn counting(&self) -> bool {
        self.counting.load(Ordering::Relaxed)
    }

    /// Counts one operator ban under `rule`, claimed by this process.
    pub(crate) fn count(&self, rule: &str) {
        let mut counted = match self.counted.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        *counted.entry(rule.to_string()).or_default() += 1;
    }

    /// The operator bans counted here, per rule.
    pub(crate) fn counted(&self) -> BTreeMap<String, u64> {
        match self.counted.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }
}
