//! The masters of a Redis Cluster as one cluster dispatcher sees them: which
//! master serves each hash slot (read with `CLUSTER SLOTS`), and one plain
//! connection per master, so that a batch's slot groups reach each master
//! as one call: one round trip per master per batch, however many
//! identities the batch holds.
//!
//! The map is only a hint. A master that no longer serves a slot runs
//! nothing and answers `MOVED` or `ASK`; the dispatcher then sends that
//! group through the crate's cluster connection, which follows the
//! redirection, and the map is read again. A master that cannot be reached
//! gets nothing written; its groups go through the crate's connection too.
//!
//! Connections follow the rule of the single-server dispatcher: one idle
//! for a moment answers a `TIME` before anything is written on it (a
//! connection whose server went away while it sat idle fails only after the
//! next write, when nobody can tell whether that write ran), and one that
//! saw an I/O error is never used again.
//!
//! Each master has a breaker and an estimate of its clock of its own
//! ([`MasterHealth`], kept by address and shared by the dispatchers): a
//! master that stalls or dies holds back only the calls to its own slots,
//! and a master whose clock is off from the others' puts no wrong deadline
//! on the calls to the others. Each dispatcher also marks there when it
//! waits on a master's answer: a master another dispatcher has waited on
//! for over [`SUSPECT`] may be stalling before its breaker knows it, and a
//! batch then answers the jobs that do not need it first.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::cluster::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{ConnectionInfo, Value};

use super::health::{base_info, no_master, open_master, MasterHealth, SUSPECT};
use super::slot::{parse_slots, SLOTS};
use crate::limiter::conn::Conn;
use crate::limiter::shared::Shared;
use crate::limiter::RedisConfig;

/// How often, at most, the slot map is read again while it is known to be
/// out of date (a failover or a resharding in progress).
const REFRESH_EVERY: Duration = Duration::from_millis(100);

/// A slot whose master is not known.
const UNKNOWN: u16 = u16::MAX;

/// Where each slot's master is, and a connection to each master.
pub(crate) struct Masters {
    /// Per slot, the index of its master in `addrs`, or [`UNKNOWN`].
    slots: Vec<u16>,
    /// Host and port of each master in the map.
    addrs: Vec<(String, u16)>,
    /// This dispatcher's connection to each master, by index in `addrs`.
    conns: Vec<Option<Conn>>,
    /// Each master's breaker and clock, by index in `addrs`.
    health: Vec<Arc<MasterHealth>>,
    /// Where the healths are kept.
    shared: Arc<Shared>,
    /// User, password and database of the first seed; `None` when the seeds
    /// are not plain TCP, and then nothing is pipelined.
    base: Option<ConnectionInfo>,
    timeout: Duration,
    /// The map may be out of date (a redirection, or a master lost).
    stale: bool,
    /// When the map was last read.
    read_at: Option<Instant>,
    /// This dispatcher's number, for [`Waits`].
    me: usize,
}

/// Marks whether dispatcher `me` waits on master `i`'s answer now. A
/// function of the health list alone, so that it can be called while a
/// connection of the same `Masters` is borrowed.
fn mark_waiting(health: &[Arc<MasterHealth>], me: usize, i: usize, waiting: bool) {
    if let Some(h) = health.get(i) {
        h.waits.mark(me, waiting);
    }
}

/// Why a pipeline was not written.
pub(crate) enum Unwritten {
    /// Nothing reached the master (no connection, or the idle check failed
    /// on a closed one): the groups may be sent another way.
    NotSent(redis::RedisError),
    /// The master answers too slowly, or the write failed part way: the
    /// groups fail.
    Failed(redis::RedisError),
}

impl Masters {
    /// `me`: the dispatcher's number, from 0.
    pub(crate) fn new(config: &RedisConfig, shared: &Arc<Shared>, me: usize) -> Masters {
        Masters {
            slots: vec![UNKNOWN; usize::from(SLOTS)],
            addrs: Vec::new(),
            conns: Vec::new(),
            health: Vec::new(),
            shared: Arc::clone(shared),
            base: base_info(config),
            timeout: config.timeout,
            stale: true,
            read_at: None,
            me,
        }
    }

    /// Whether master `i` may be stalling: another dispatcher has waited on
    /// it for over [`SUSPECT`].
    pub(crate) fn suspect(&self, i: usize) -> bool {
        self.health
            .get(i)
            .is_some_and(|h| h.waits.others_over(self.me, SUSPECT))
    }

    /// Whether any master [`suspect`](Masters::suspect)s.
    pub(crate) fn any_suspect(&self) -> bool {
        (0..self.health.len()).any(|i| self.suspect(i))
    }

    /// The index of the master serving `slot`, as far as the map knows.
    pub(crate) fn of(&self, slot: u16) -> Option<usize> {
        match self.slots.get(usize::from(slot)) {
            Some(&i) if i != UNKNOWN && self.base.is_some() => Some(usize::from(i)),
            _ => None,
        }
    }

    /// Host and port of master `i`.
    pub(crate) fn addr(&self, i: usize) -> Option<&(String, u16)> {
        self.addrs.get(i)
    }

    /// Host and port of the master the map names for `slot`.
    pub(crate) fn addr_of_slot(&self, slot: u16) -> Option<(String, u16)> {
        self.of(slot).and_then(|m| self.addr(m)).cloned()
    }

    /// Whether the map names `addr` as the master of any slot.
    pub(crate) fn names(&self, addr: &(String, u16)) -> bool {
        self.addrs
            .iter()
            .position(|a| a == addr)
            .is_some_and(|i| self.slots.iter().any(|&s| usize::from(s) == i))
    }

    /// Master `i`'s breaker and clock.
    pub(crate) fn health(&self, i: usize) -> Option<&Arc<MasterHealth>> {
        self.health.get(i)
    }

    /// Whether any master's breaker would let the next call probe it.
    pub(crate) fn probe_due(&self) -> bool {
        self.health.iter().any(|h| h.breaker.probe_due())
    }

    /// Drops this dispatcher's connection to every master, and reads the
    /// map again before the next call.
    pub(crate) fn forget_conns(&mut self) {
        for conn in &mut self.conns {
            *conn = None;
        }
        self.stale = true;
    }

    /// Notes that the map may be out of date.
    pub(crate) fn stale(&mut self) {
        self.stale = true;
    }

    /// Notes a `MOVED`: `slot` is served by `host:port` from now on.
    pub(crate) fn moved(&mut self, slot: u16, addr: &str) {
        self.stale = true;
        let Some((host, port)) = addr
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
        else {
            return;
        };
        // An IPv6 address comes bracketed in a redirection, bare in the map.
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let i = self.index_of(host, port);
        if let Some(s) = self.slots.get_mut(usize::from(slot)) {
            *s = i;
        }
    }

    fn index_of(&mut self, host: &str, port: u16) -> u16 {
        if let Some(i) = self.addrs.iter().position(|(h, p)| h == host && *p == port) {
            return i as u16;
        }
        self.addrs.push((host.to_string(), port));
        self.conns.push(None);
        self.health.push(self.shared.masters.of(host, port));
        (self.addrs.len() - 1) as u16
    }

    /// Whether the map is out of date and due to be read again (at most
    /// every [`REFRESH_EVERY`]).
    pub(crate) fn wants_reading(&self) -> bool {
        self.base.is_some()
            && self.stale
            && self.read_at.is_none_or(|at| at.elapsed() >= REFRESH_EVERY)
    }

    /// Reads the map again through `cluster`, from a master whose breaker
    /// is closed and that is not in `avoid` (one that stalls would hold the
    /// batch for the timeout, one that takes no connection gives no map;
    /// any node, when no such master is known). On failure the old map
    /// stays.
    pub(crate) fn read(&mut self, cluster: &mut ClusterConnection, avoid: &[(String, u16)]) {
        self.read_at = Some(Instant::now());
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let healthy = self
            .addrs
            .iter()
            .zip(&self.health)
            .find(|(a, h)| !h.breaker.is_open() && !avoid.contains(a));
        let node = match healthy {
            Some(((host, port), _)) => SingleNodeRoutingInfo::ByAddress {
                host: host.clone(),
                port: *port,
            },
            None => SingleNodeRoutingInfo::Random,
        };
        let reply = cluster.route_command(&cmd, RoutingInfo::SingleNode(node));
        match reply.map(|v| parse_slots(&v)) {
            Ok(Some(ranges)) => {
                let mut slots = vec![UNKNOWN; usize::from(SLOTS)];
                let mut addrs: Vec<(String, u16)> = Vec::new();
                for (start, end, host, port) in ranges {
                    let i = match addrs.iter().position(|(h, p)| *h == host && *p == port) {
                        Some(i) => i,
                        None => {
                            addrs.push((host, port));
                            addrs.len() - 1
                        }
                    };
                    for s in start..=end.min(SLOTS - 1) {
                        slots[usize::from(s)] = i as u16;
                    }
                }
                // Keep the connections to masters that are still masters.
                let mut old: HashMap<(String, u16), Conn> = self
                    .addrs
                    .drain(..)
                    .zip(self.conns.drain(..))
                    .filter_map(|(a, c)| Some((a, c?)))
                    .collect();
                self.conns = addrs.iter().map(|a| old.remove(a)).collect();
                self.health = addrs
                    .iter()
                    .map(|(h, p)| self.shared.masters.of(h, *p))
                    .collect();
                // A master that a whole map leaves out holds no slot (its
                // replica took over, or its slots moved): its health, a
                // breaker held open since it failed, says nothing of the
                // cluster any more, and readiness must not wait for it.
                if slots.iter().all(|&s| s != UNKNOWN) {
                    self.shared.masters.keep_only(&addrs);
                }
                self.addrs = addrs;
                self.slots = slots;
                self.stale = false;
            }
            Ok(None) => log::info!("CLUSTER SLOTS answered something unexpected"),
            Err(e) => log::info!("reading the cluster's slot map: {e}"),
        }
    }

    /// Writes `packed` (one or more commands) to master `i`, on a
    /// connection Redis answered on a moment ago or that answers a `TIME`
    /// now (which also tells that master's clock estimate its time).
    pub(crate) fn send(&mut self, i: usize, packed: &[u8]) -> Result<(), Unwritten> {
        mark_waiting(&self.health, self.me, i, true);
        let connected = self.connect(i).map(|_| ());
        mark_waiting(&self.health, self.me, i, false);
        connected?;
        let Some(conn) = self.conns.get_mut(i).and_then(Option::as_mut) else {
            return Err(Unwritten::NotSent(no_master()));
        };
        if let Err(e) = conn.send_packed_command(packed) {
            conn.spoil();
            self.drop_conn(i);
            return Err(Unwritten::Failed(e));
        }
        Ok(())
    }

    /// Reads the next reply on master `i`'s connection. After an error the
    /// connection is dropped: the replies still due on it are lost, and
    /// the commands they answer may have run.
    pub(crate) fn recv(&mut self, i: usize) -> redis::RedisResult<Value> {
        let Some(conn) = self.conns.get_mut(i).and_then(Option::as_mut) else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Io,
                "no connection to the master",
            )));
        };
        mark_waiting(&self.health, self.me, i, true);
        let reply = loop {
            match conn.recv_response() {
                // Out-of-band RESP3 pushes are no reply.
                Ok(Value::Push { .. }) => continue,
                other => break other,
            }
        };
        mark_waiting(&self.health, self.me, i, false);
        conn.note(&reply);
        if reply.is_err() {
            self.drop_conn(i);
        }
        reply
    }

    fn drop_conn(&mut self, i: usize) {
        if let Some(c) = self.conns.get_mut(i) {
            *c = None;
        }
        self.stale = true;
    }

    fn connect(&mut self, i: usize) -> Result<&mut Conn, Unwritten> {
        let not_sent = |e| Unwritten::NotSent(e);
        let clock = &self
            .health
            .get(i)
            .ok_or_else(|| not_sent(no_master()))?
            .clock;
        let slot = self.conns.get_mut(i).ok_or_else(|| not_sent(no_master()))?;
        if let Some(conn) = slot.as_mut() {
            if !conn.recently_answered() {
                match conn.time(clock) {
                    Ok(()) => {}
                    Err(e) if e.is_timeout() => {
                        *slot = None;
                        return Err(Unwritten::Failed(e));
                    }
                    Err(e) => {
                        log::info!(
                            "cluster master connection found broken ({e}); opening a new one"
                        );
                        *slot = None;
                    }
                }
            }
        }
        if slot.is_none() {
            let (Some(base), Some((host, port))) = (&self.base, self.addrs.get(i)) else {
                return Err(not_sent(no_master()));
            };
            let opened = open_master(base, host, *port, self.timeout);
            let mut conn = match opened {
                Ok(c) => Conn::single(c),
                // A master that does not answer in time would hold the
                // crate's connection as long: its groups fail.
                Err(e) if e.is_timeout() => {
                    self.stale = true;
                    return Err(Unwritten::Failed(e));
                }
                Err(e) => {
                    self.stale = true;
                    return Err(not_sent(e));
                }
            };
            if let Err(e) = conn.time(clock) {
                self.stale = true;
                return Err(if e.is_timeout() {
                    Unwritten::Failed(e)
                } else {
                    not_sent(e)
                });
            }
            *slot = Some(conn);
        }
        slot.as_mut().ok_or_else(|| not_sent(no_master()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::health::{MasterHealths, Waits};
    use super::*;
    use crate::limiter::LimiterError;
    use crate::limiter::DISPATCHERS;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn each_master_has_a_breaker_and_a_clock_of_its_own() {
        let config = crate::config::Config::parse("", std::path::Path::new("t.toml")).unwrap();
        let healths = MasterHealths::new(&config.redis, Duration::from_secs(60));
        let a = healths.of("127.0.0.1", 7000);
        let b = healths.of("127.0.0.1", 7001);
        // Every dispatcher that looks a master up gets the same one.
        assert!(Arc::ptr_eq(&a, &healths.of("127.0.0.1", 7000)));
        a.breaker.trip(&LimiterError::Timeout);
        assert!(a.breaker.is_open() && !b.breaker.is_open());
        assert!(healths.any_open());
        a.clock.sample(1_700_000_000_000_000, Instant::now());
        assert!(a.clock.redis_ms(Instant::now()).is_some());
        assert_eq!(b.clock.redis_ms(Instant::now()), None);
    }

    #[test]
    fn a_master_is_suspect_to_the_others_while_one_dispatcher_waits_on_it() {
        let waits = Waits::new();
        assert!(!waits.others_over(0, Duration::ZERO) && !waits.others_over(1, Duration::ZERO));
        waits.mark(0, true);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !waits.others_over(1, Duration::ZERO) {
            assert!(Instant::now() < deadline, "a wait that began is never seen");
            std::thread::yield_now();
        }
        // Its own wait is no news to the dispatcher, and a wait shorter
        // than asked does not count.
        assert!(!waits.others_over(0, Duration::ZERO));
        assert!(!waits.others_over(1, Duration::from_secs(3600)));
        waits.mark(0, false);
        assert!(!waits.others_over(1, Duration::ZERO));
        // A dispatcher number past the array is ignored, not a panic.
        waits.mark(DISPATCHERS, true);
        assert!(!waits.others_over(0, Duration::ZERO));
    }

    #[test]
    fn cluster_slots_replies_become_ranges_and_unknown_hosts_are_left_out() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(7000), bulk("id0")]),
                Value::Array(vec![bulk("127.0.0.1"), Value::Int(7003), bulk("id3")]),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(10922),
                Value::Array(vec![bulk(""), Value::Int(7001), bulk("id1")]),
            ]),
        ]);
        assert_eq!(
            parse_slots(&reply),
            Some(vec![(0, 5460, "127.0.0.1".to_string(), 7000)])
        );
        assert_eq!(parse_slots(&Value::Int(1)), None);
    }
}
