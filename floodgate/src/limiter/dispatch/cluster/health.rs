//! What the cluster dispatchers share about each master (one per master
//! for the whole process): its breaker, the estimate of its clock, and who
//! waits on it now; and how to reach a master by address for a readiness
//! PING. A leaf: the limiter's shared state holds it, the dispatchers read
//! it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};

use super::slot::{parse_slots, SLOTS};
use crate::limiter::breaker::Breaker;
use crate::limiter::clock::RedisClock;
use crate::limiter::DISPATCHERS;
use crate::limiter::{LimiterError, RedisConfig};

/// How long another dispatcher may have waited on a master's answer before
/// the master counts as suspect (see [`Waits`]). A healthy master answers
/// the largest batch in a few ms.
pub(crate) const SUSPECT: Duration = Duration::from_millis(10);

/// What the dispatchers know of one master: its breaker, the estimate of
/// its clock taken from its own replies, and who waits on it now.
#[derive(Debug)]
pub(crate) struct MasterHealth {
    pub(crate) breaker: Arc<Breaker>,
    pub(crate) clock: RedisClock,
    pub(crate) waits: Waits,
}

/// When each cluster dispatcher began to wait on the master's answer, if it
/// waits now. A master that stalls holds the first dispatcher that asks it
/// for the whole timeout before its breaker opens; meanwhile another
/// dispatcher, seeing that wait, answers the jobs of its batch that do not
/// need that master before it asks the master in turn (`Cluster::send`).
#[derive(Debug)]
pub(crate) struct Waits {
    pub(super) epoch: Instant,
    /// Per dispatcher: µs after `epoch`, plus one, when its wait began; 0:
    /// it does not wait.
    pub(super) since: [AtomicU64; DISPATCHERS],
}

impl Waits {
    pub(super) fn new() -> Waits {
        Waits {
            epoch: Instant::now(),
            since: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    pub(super) fn mark(&self, who: usize, waiting: bool) {
        if let Some(since) = self.since.get(who) {
            let at = if waiting {
                self.epoch.elapsed().as_micros() as u64 + 1
            } else {
                0
            };
            since.store(at, Ordering::Relaxed);
        }
    }

    /// Whether a dispatcher other than `me` has waited on the master for
    /// over `longer`.
    pub(crate) fn others_over(&self, me: usize, longer: Duration) -> bool {
        let now = self.epoch.elapsed().as_micros() as u64 + 1;
        let longer = longer.as_micros() as u64;
        self.since.iter().enumerate().any(|(who, since)| {
            let since = since.load(Ordering::Relaxed);
            who != me && since != 0 && now.saturating_sub(since) > longer
        })
    }
}

/// Every master's [`MasterHealth`], by address: one per master for the
/// whole process (the dispatchers share them), made when a master is first
/// seen in the slot map or a redirection.
#[derive(Debug)]
pub(crate) struct MasterHealths {
    pub(super) period: Duration,
    /// How to reach a master by address (user, password, database of the
    /// first seed), for the readiness PING of a master held as failed.
    pub(super) base: Option<ConnectionInfo>,
    pub(super) by_addr: Mutex<HashMap<(String, u16), Arc<MasterHealth>>>,
}

impl MasterHealths {
    /// `period`: the breaker's (`[limiter] breaker`).
    pub(crate) fn new(config: &RedisConfig, period: Duration) -> MasterHealths {
        MasterHealths {
            period,
            base: base_info(config),
            by_addr: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn map(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<(String, u16), Arc<MasterHealth>>> {
        match self.by_addr.lock() {
            Ok(m) => m,
            Err(p) => p.into_inner(),
        }
    }

    /// The health of the master at `host:port` (made on first use).
    pub(super) fn of(&self, host: &str, port: u16) -> Arc<MasterHealth> {
        let mut map = self.map();
        let made = map.entry((host.to_string(), port)).or_insert_with(|| {
            Arc::new(MasterHealth {
                breaker: Arc::new(Breaker::new(self.period)),
                clock: RedisClock::new(),
                waits: Waits::new(),
            })
        });
        Arc::clone(made)
    }

    /// Forgets the masters not in `addrs` (a whole slot map's).
    pub(super) fn keep_only(&self, addrs: &[(String, u16)]) {
        self.map().retain(|a, _| addrs.contains(a));
    }

    /// Whether any master's breaker is open.
    pub(crate) fn any_open(&self) -> bool {
        self.map().values().any(|h| h.breaker.is_open())
    }

    /// Sends a PING to every master whose breaker is open, each bounded by
    /// `timeout`; a master that answers has its breaker closed (the next
    /// call to it is made). An error while any breaker stays open.
    /// Blocking.
    pub(crate) fn ping_open(&self, timeout: Duration) -> Result<(), LimiterError> {
        let open: Vec<((String, u16), Arc<MasterHealth>)> = self
            .map()
            .iter()
            .filter(|(_, h)| h.breaker.is_open())
            .map(|(a, h)| (a.clone(), Arc::clone(h)))
            .collect();
        let mut failed = None;
        for ((host, port), health) in open {
            let answered = match &self.base {
                Some(base) => open_master(base, &host, port, timeout)
                    .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c).map(|_| ())),
                None => Err(no_master()),
            };
            match answered {
                Ok(()) => health.breaker.close(),
                // Its replica took over (or its slots moved): it is no
                // master of this cluster any more, and readiness does not
                // wait for it, with or without traffic to read the new map.
                Err(_) if self.left_the_map(&host, port, timeout) => {
                    self.map().remove(&(host, port));
                }
                Err(e) => failed = Some(format!("cluster master {host}:{port}: {e}")),
            }
        }
        match failed {
            Some(why) => Err(LimiterError::Other(why)),
            None => Ok(()),
        }
    }
}

impl MasterHealths {
    /// Whether a whole slot map, as another known master answers it, no
    /// longer names `host:port` as a master. False when none answers or its
    /// map leaves a slot without a master (a failover under way).
    fn left_the_map(&self, host: &str, port: u16, timeout: Duration) -> bool {
        let Some(base) = &self.base else {
            return false;
        };
        let others: Vec<(String, u16)> = self
            .map()
            .keys()
            .filter(|(h, p)| !(h == host && *p == port))
            .cloned()
            .collect();
        for (h, p) in others {
            let reply = open_master(base, &h, p, timeout).and_then(|mut c| {
                redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query::<redis::Value>(&mut c)
            });
            let Some(ranges) = reply.ok().as_ref().and_then(parse_slots) else {
                continue;
            };
            let covered: u32 = ranges
                .iter()
                .map(|(start, end, _, _)| u32::from(end.saturating_sub(*start)) + 1)
                .sum();
            return covered == u32::from(SLOTS)
                && !ranges.iter().any(|(_, _, h, p)| h == host && *p == port);
        }
        false
    }
}

/// User, password and database of the first seed, when the seeds are plain
/// TCP.
pub(super) fn base_info(config: &RedisConfig) -> Option<ConnectionInfo> {
    config
        .cluster
        .first()
        .and_then(|seed| seed.as_str().into_connection_info().ok())
        .filter(|info| matches!(info.addr(), ConnectionAddr::Tcp(..)))
}

/// A plain connection to the master at `host:port`, opened and bounded by
/// `timeout`.
pub(super) fn open_master(
    base: &ConnectionInfo,
    host: &str,
    port: u16,
    timeout: Duration,
) -> redis::RedisResult<redis::Connection> {
    let info = base
        .clone()
        .set_addr(ConnectionAddr::Tcp(host.to_string(), port));
    redis::Client::open(info)
        .and_then(|c| c.get_connection_with_timeout(timeout))
        .and_then(|c| {
            c.set_read_timeout(Some(timeout))?;
            c.set_write_timeout(Some(timeout))?;
            Ok(c)
        })
}

/// The error of a slot whose master is not known.
pub(crate) fn no_master() -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Io, "no known master for the slot"))
}
