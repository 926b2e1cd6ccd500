//! The denial cache: a key that Redis denied stays denied, for the same or
//! a larger cost, until the wait Redis gave has run out, because nothing
//! but time frees units (no admission frees any, and a denial records
//! nothing). So the process remembers each denial and answers a flood on
//! a denied key without asking Redis again.
//!
//! Times are taken conservatively: the denial is certain from the moment
//! the call was SENT plus the wait (Redis decided no earlier than that), and
//! the `Retry-After` given from the cache counts from the moment the reply
//! ARRIVED plus the wait (Redis decided no later than that), so the retry
//! time it gives is never too early.
//!
//! Memory is bounded: a fixed number of shards, each holding at most
//! [`CAPACITY`] / shards keys; a full shard first drops its expired entries,
//! then the one that frees soonest.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Most keys remembered at once (over all shards).
pub const CAPACITY: usize = 32_768;
const SHARDS: usize = 16;

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// The cost that was denied: any cost at least this is denied too.
    cost: u32,
    /// Until when the denial is certain.
    until: Instant,
    /// When the request surely fits again (for `Retry-After`).
    free_by: Instant,
}

/// Denials remembered in-process, per Redis key.
#[derive(Debug)]
pub struct DenyCache {
    shards: Vec<Mutex<HashMap<String, Entry>>>,
    hasher: RandomState,
    per_shard: usize,
}

impl Default for DenyCache {
    fn default() -> Self {
        DenyCache::with_capacity(CAPACITY)
    }
}

impl DenyCache {
    /// A cache holding at most about `capacity` keys.
    pub fn with_capacity(capacity: usize) -> DenyCache {
        DenyCache {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
        }
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        let i = (self.hasher.hash_one(key) as usize) % self.shards.len();
        match self.shards[i].lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// If `cost` units on `key` are certainly denied at `now`: how long
    /// until they surely fit again.
    pub fn denied(&self, key: &str, cost: u32, now: Instant) -> Option<Duration> {
        let mut shard = self.shard(key);
        let entry = *shard.get(key)?;
        if entry.until <= now {
            shard.remove(key);
            return None;
        }
        (entry.cost <= cost).then(|| entry.free_by.saturating_duration_since(now))
    }

    /// Remembers that Redis denied `cost` units on `key` with `wait`, for a
    /// call sent at `sent` and answered at `answered`.
    pub fn remember(&self, key: &str, cost: u32, wait: Duration, sent: Instant, answered: Instant) {
        let entry = Entry {
            cost,
            until: sent + wait,
            free_by: answered + wait,
        };
        if entry.until <= Instant::now() {
            return;
        }
        let mut shard = self.shard(key);
        if let Some(old) = shard.get_mut(key) {
            // Keep the entry that covers more costs; for the same cost, the newer.
            if cost <= old.cost || old.until <= answered {
                *old = entry;
            }
            return;
        }
        if shard.len() >= self.per_shard {
            let now = Instant::now();
            shard.retain(|_, e| e.until > now);
            if shard.len() >= self.per_shard {
                let soonest = shard
                    .iter()
                    .min_by_key(|(_, e)| e.until)
                    .map(|(k, _)| k.clone());
                if let Some(k) = soonest {
                    shard.remove(&k);
                }
            }
        }
        shard.insert(key.to_string(), entry);
    }

    /// Forgets everything (the rules changed).
    pub fn clear(&self) {
        for shard in &self.shards {
            match shard.lock() {
                Ok(mut g) => g.clear(),
                Err(p) => p.into_inner().clear(),
            }
        }
    }

    /// Keys remembered now.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| match s.lock() {
                Ok(g) => g.len(),
                Err(p) => p.into_inner().len(),
            })
            .sum()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_denial_covers_its_cost_and_more_until_it_runs_out() {
        let cache = DenyCache::default();
        let sent = Instant::now();
        let answered = sent + Duration::from_millis(2);
        cache.remember("k", 2, Duration::from_secs(5), sent, answered);
        let now = sent + Duration::from_secs(1);
        assert_eq!(cache.denied("k", 1, now), None, "a smaller cost may fit");
        assert_eq!(
            cache.denied("k", 2, now),
            Some(Duration::from_millis(4002)),
            "the retry time counts from the answer"
        );
        assert!(cache.denied("k", 3, now).is_some());
        assert_eq!(cache.denied("other", 2, now), None);
        assert_eq!(cache.denied("k", 2, sent + Duration::from_secs(5)), None);
        assert!(cache.is_empty(), "an expired entry is dropped when met");
    }

    #[test]
    fn the_cache_is_bounded_and_drops_what_frees_soonest() {
        let cache = DenyCache::with_capacity(SHARDS);
        let now = Instant::now();
        for i in 0..10_000u64 {
            let wait = Duration::from_secs(60 + i);
            cache.remember(&format!("k{i}"), 1, wait, now, now);
        }
        assert!(cache.len() <= SHARDS, "{}", cache.len());
        // The survivors are the ones that free last.
        assert!(cache.denied("k9999", 1, now).is_some());
        cache.clear();
        assert!(cache.is_empty());
    }
}
