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
//! A give-back does free units: every give-back (a handler's, a
//! `count = "failures"` success, an outer filter's withdrawal, the cluster
//! dispatcher's undoing of a partial admission) calls [`DenyCache::forget`]
//! on its keys once Redis has run it, so the next request on such a key is
//! decided by Redis again. A denial whose call was sent before a give-back
//! on its key and whose answer arrives after it is not remembered either:
//! each shard keeps, per group of keys, when one of them was last
//! forgotten, and a denial sent before that is dropped.
//!
//! Memory is bounded: a fixed number of shards, each holding at most
//! [`CAPACITY`] / shards keys; a full shard first drops its expired entries,
//! then, if that freed nothing, the eighth of its entries that free soonest.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Quota;

/// Most keys remembered at once (over all shards).
pub(crate) const CAPACITY: usize = 32_768;
const SHARDS: usize = 16;
/// Groups of keys per shard that each remember their last give-back.
const MARKS: usize = 64;
/// A full shard with nothing expired drops this share of its entries (the
/// ones that free soonest): 1/8.
const EVICT_SHARE: usize = 8;

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// The cost that was denied: any cost at least this is denied too.
    cost: u32,
    /// Until when the denial is certain.
    until: Instant,
    /// When the request surely fits again (for `Retry-After`).
    free_by: Instant,
    /// A ban, not a limit, denies (any cost).
    banned: bool,
    /// The identity's own quota (an override) the denial was decided under.
    quota: Option<Quota>,
}

/// A remembered denial, as [`DenyCache::denial`] answers it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Remembered {
    /// How long until the request surely fits again.
    pub wait: Duration,
    /// Whether a ban (rather than the limit) denies.
    pub banned: bool,
    /// The identity's own quota it was decided under (an operator's
    /// override), as [`Outcome::quota`](super::Outcome::quota).
    pub quota: Option<Quota>,
}

#[derive(Debug)]
struct Shard {
    entries: HashMap<String, Entry>,
    /// Per group of keys: µs after the cache's epoch when one of them was
    /// last forgotten (given back).
    forgotten: [u64; MARKS],
}

/// Denials remembered in-process, per Redis key.
#[derive(Debug)]
pub struct DenyCache {
    shards: Vec<Mutex<Shard>>,
    hasher: RandomState,
    per_shard: usize,
    epoch: Instant,
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
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard {
                        entries: HashMap::new(),
                        forgotten: [0; MARKS],
                    })
                })
                .collect(),
            hasher: RandomState::new(),
            per_shard: capacity.div_ceil(SHARDS).max(1),
            epoch: Instant::now(),
        }
    }

    /// The shard of `key`, locked, and the index of its group there.
    fn shard(&self, key: &str) -> (std::sync::MutexGuard<'_, Shard>, usize) {
        let hash = self.hasher.hash_one(key) as usize;
        let shard = match self.shards[hash % SHARDS].lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        (shard, (hash / SHARDS) % MARKS)
    }

    /// `at` in µs after the epoch, never 0 (0 means "never forgotten").
    fn micros(&self, at: Instant) -> u64 {
        (at.saturating_duration_since(self.epoch).as_micros() as u64).saturating_add(1)
    }

    /// If `cost` units on `key` are certainly denied at `now`: how long
    /// until they surely fit again.
    pub fn denied(&self, key: &str, cost: u32, now: Instant) -> Option<Duration> {
        self.denial(key, cost, now).map(|d| d.wait)
    }

    /// As [`DenyCache::denied`], with whether a ban (rather than the limit)
    /// denies and the quota it was decided under.
    pub fn denial(&self, key: &str, cost: u32, now: Instant) -> Option<Remembered> {
        let (mut shard, _) = self.shard(key);
        let entry = *shard.entries.get(key)?;
        if entry.until <= now {
            shard.entries.remove(key);
            return None;
        }
        (entry.cost <= cost).then(|| Remembered {
            wait: entry.free_by.saturating_duration_since(now),
            banned: entry.banned,
            quota: entry.quota,
        })
    }

    /// Remembers that Redis denied `key` because its identity is banned for
    /// `wait` (every cost is denied), as [`DenyCache::remember`] does.
    pub fn remember_ban(&self, key: &str, wait: Duration, sent: Instant, answered: Instant) {
        let denial = Remembered {
            wait,
            banned: true,
            quota: None,
        };
        self.insert(key, 1, denial, sent, answered);
    }

    /// Remembers that Redis denied `cost` units on `key` with `wait` (under
    /// the identity's own `quota`, if it has one), for a call sent at `sent`
    /// and answered at `answered`.
    pub fn remember(
        &self,
        key: &str,
        cost: u32,
        wait: Duration,
        quota: Option<Quota>,
        sent: Instant,
        answered: Instant,
    ) {
        let denial = Remembered {
            wait,
            banned: false,
            quota,
        };
        self.insert(key, cost, denial, sent, answered);
    }

    fn insert(&self, key: &str, cost: u32, denial: Remembered, sent: Instant, answered: Instant) {
        let entry = Entry {
            cost,
            until: sent + denial.wait,
            free_by: answered + denial.wait,
            banned: denial.banned,
            quota: denial.quota,
        };
        if entry.until <= Instant::now() {
            return;
        }
        let sent_us = self.micros(sent);
        let (mut shard, group) = self.shard(key);
        if shard.forgotten[group] >= sent_us {
            // Units of this key (or of one in its group) were given back
            // after the call was sent: the denial may no longer hold.
            return;
        }
        let shard = &mut *shard;
        let map = &mut shard.entries;
        if let Some(old) = map.get_mut(key) {
            // Keep the entry that covers more costs; for the same cost, the newer.
            if cost <= old.cost || old.until <= answered {
                *old = entry;
            }
            return;
        }
        if map.len() >= self.per_shard {
            let now = Instant::now();
            map.retain(|_, e| e.until > now);
            if map.len() >= self.per_shard {
                // The eighth that frees soonest goes, not one entry: under
                // a flood of new keys, one scan of the shard per eighth of
                // it inserted, not one per insert.
                let drop = (self.per_shard / EVICT_SHARE).max(1);
                let mut untils: Vec<Instant> = map.values().map(|e| e.until).collect();
                let (_, &mut cut, _) = untils.select_nth_unstable(drop - 1);
                map.retain(|_, e| e.until > cut);
            }
        }
        map.insert(key.to_string(), entry);
    }

    /// Forgets the denial of `key`: units were given back to it (call this
    /// once Redis has run the give-back, or may have). A denial of it whose
    /// call was sent before now is not remembered later either.
    pub fn forget(&self, key: &str) {
        let now = self.micros(Instant::now());
        let (mut shard, group) = self.shard(key);
        shard.entries.remove(key);
        let mark = &mut shard.forgotten[group];
        *mark = (*mark).max(now);
    }

    /// Forgets everything (the rules changed).
    pub fn clear(&self) {
        for shard in &self.shards {
            match shard.lock() {
                Ok(mut g) => g.entries.clear(),
                Err(p) => p.into_inner().entries.clear(),
            }
        }
    }

    /// Keys remembered now.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| match s.lock() {
                Ok(g) => g.entries.len(),
                Err(p) => p.into_inner().entries.len(),
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
        cache.remember("k", 2, Duration::from_secs(5), None, sent, answered);
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
    fn a_give_back_forgets_the_denial_and_one_answered_after_it() {
        let cache = DenyCache::default();
        let sent = Instant::now();
        cache.remember("k", 1, Duration::from_secs(60), None, sent, sent);
        assert!(cache.denied("k", 1, Instant::now()).is_some());
        cache.forget("k");
        assert_eq!(cache.denied("k", 1, Instant::now()), None);
        // A denial sent before the give-back, answered after it.
        cache.remember("k", 1, Duration::from_secs(60), None, sent, Instant::now());
        assert_eq!(cache.denied("k", 1, Instant::now()), None);
        // One sent after it is remembered again.
        let later = Instant::now() + Duration::from_millis(1);
        cache.remember("k", 1, Duration::from_secs(60), None, later, later);
        assert!(cache.denied("k", 1, Instant::now()).is_some());
        // Other keys keep theirs.
        cache.remember("other", 1, Duration::from_secs(60), None, later, later);
        cache.forget("k");
        assert!(cache.denied("other", 1, Instant::now()).is_some());
    }

    #[test]
    fn a_full_shard_drops_the_eighth_that_frees_soonest() {
        // One shard's worth (capacity 16 per shard), filled in one shard's
        // keys only: the 17th drops the 2 that free soonest.
        let cache = DenyCache::with_capacity(16 * SHARDS);
        let now = Instant::now();
        let mut keys = Vec::new();
        let mut i = 0u64;
        while keys.len() < 17 {
            let key = format!("k{i}");
            if (cache.hasher.hash_one(&key) as usize).is_multiple_of(SHARDS) {
                keys.push(key);
            }
            i += 1;
        }
        for (n, key) in keys.iter().enumerate() {
            let wait = Duration::from_secs(60 + n as u64);
            cache.remember(key, 1, wait, None, now, now);
        }
        assert_eq!(cache.len(), 15);
        assert!(cache.denied(&keys[0], 1, now).is_none());
        assert!(cache.denied(&keys[1], 1, now).is_none());
        for key in &keys[2..] {
            assert!(cache.denied(key, 1, now).is_some(), "{key}");
        }
    }

    #[test]
    fn the_cache_is_bounded_and_drops_what_frees_soonest() {
        let cache = DenyCache::with_capacity(SHARDS);
        let now = Instant::now();
        for i in 0..10_000u64 {
            let wait = Duration::from_secs(60 + i);
            cache.remember(&format!("k{i}"), 1, wait, None, now, now);
        }
        assert!(cache.len() <= SHARDS, "{}", cache.len());
        // The survivors are the ones that free last.
        assert!(cache.denied("k9999", 1, now).is_some());
        cache.clear();
        assert!(cache.is_empty());
    }
}
