//! Deciding batches on a Redis Cluster.
//!
//! The filter puts the ID of every key in a hash tag
//! (`PREFIX:RULE:KIND:{ID}`), so the rules of one identity share a slot.
//! The dispatcher here splits each batch by slot, and sends every master
//! the groups of all the slots it serves as ONE call of the batch script,
//! in the cluster's copy flagged `allow-cross-slot-keys` (Redis 7): a
//! script's declared keys must still share a slot, so that call declares
//! none and passes its keys as arguments, slot by slot. Every master's call
//! is written before any reply is read: a batch costs one round trip and
//! one script call per master, however many identities it holds. One
//! identity's checks stay one job of one call, decided atomically.
//!
//! Before it writes anything, the per-master call touches a never-written
//! key of each of its slots: a slot served elsewhere, or being moved (a
//! resharding), makes it return at once having done nothing. Its groups
//! are then sent one by one (one call of the unflagged function per slot
//! group), as below, and the slot map is read again. Both functions are in
//! the one function library (`FCALL`, see `program.rs`); a cluster that
//! refuses functions gets the two scripts instead (`EVALSHA`).
//!
//! A request whose checks span several slots is decided per slot group.
//! It is allowed only if every group allows it; when one group denies (or
//! fails), the groups that admitted it give back what they took, with a
//! second small script. So nothing is ever admitted beyond what every
//! limit allows; between the decision and the give-back (one round trip)
//! the units are held, and a request racing for the last of them in that
//! moment may be denied.
//!
//! A call answered `MOVED`, `ASK`, `TRYAGAIN` or `CLUSTERDOWN` did not
//! run; its groups are sent (again) one by one through the crate's cluster
//! connection, which follows the redirection (`ASKING` for a slot being
//! imported); so is a group whose master is not in the slot map or could
//! not be reached before anything was written to it. A master that has not
//! got the library or the script (a new node, `FUNCTION FLUSH`, or for the
//! scripts a promoted node or the importing side of a slot being moved)
//! likewise ran nothing: the library and the scripts are loaded on every
//! master, once, and the groups are sent again. A group is sent again
//! only for the callers still waiting; a call that may have run (its reply
//! was lost, or its write failed part way) is never sent again: its
//! requests get their `on_redis_error` answer.
//!
//! Each master has a breaker of its own (see [`masters`]): after a
//! master failed, its groups get `on_redis_error` at once for the breaker's
//! period while the other masters' groups are sent as usual. A decision
//! that can no longer be handed over (its caller gave up while the replies
//! of a slower master were read) gives back what it took.

use std::collections::BTreeMap;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo, SingleNodeRoutingInfo,
};
use redis::{ConnectionLike as _, ErrorKind, RedisResult, ServerErrorKind, Value};

use self::give_back::{GiveBack, JobChecks, Taken};
use self::groups::{classify, group_by_slot, write_group, write_master_call, Group, Reply};
use self::masters::{Masters, Unwritten};
use self::slot::key_slot;
use super::{Job, Transport};
use crate::limiter::breaker::{Breaker, Gate};
use crate::limiter::conn::spoils;
use crate::limiter::program::{self, Missing, Program, Shipping};
use crate::limiter::shared::Shared;
use crate::limiter::topology::cluster_client;
use crate::limiter::wire;
use crate::limiter::{Check, Decision, LimiterError, Outcome, RedisConfig};

mod give_back;
mod groups;
pub(crate) mod health;
pub(crate) mod masters;
pub(crate) mod slot;

/// Gives back what the allowed groups of a denied request took.
const GIVE_BACK_SCRIPT: &str = crate::limiter::wire::CLUSTER_GIVE_BACK_SOURCE;

/// Starts `count` cluster dispatchers on the limiter's queue.
pub(crate) fn start(
    config: &RedisConfig,
    rx: &Arc<Mutex<Receiver<Vec<Job>>>>,
    shared: &Arc<Shared>,
    margin: Duration,
    count: usize,
) -> Result<(), LimiterError> {
    let client = cluster_client(config).map_err(LimiterError::from)?;
    let give_back = Arc::new(redis::Script::new(GIVE_BACK_SCRIPT));
    for i in 0..count {
        let transport = Cluster {
            client: client.clone(),
            timeout: config.timeout,
            conn: None,
            program: Program::batch(),
            shipping: Shipping::Function,
            give_back: Arc::clone(&give_back),
            shared: Arc::clone(shared),
            margin,
            masters: Masters::new(config, shared, i),
            cmd: redis::Cmd::new(),
            packed: Vec::new(),
            give_backs: Vec::new(),
        };
        super::spawn(format!("floodgate-cluster-{i}"), rx, transport)?;
    }
    Ok(())
}

pub(crate) struct Cluster {
    client: ClusterClient,
    timeout: Duration,
    /// Its own cluster connection (one connection per master, opened on
    /// demand by the crate); dropped after an I/O error.
    conn: Option<ClusterConnection>,
    /// The batch function (one slot group) and its flagged twin (every
    /// group of one master), or their scripts.
    program: &'static Program,
    /// How they are called: the library's functions until Redis refuses them.
    shipping: Shipping,
    give_back: Arc<redis::Script>,
    /// The error and late counters, the denial cache, each master's
    /// breaker and clock.
    shared: Arc<Shared>,
    /// How long before its caller gives up a job must reach Redis.
    margin: Duration,
    /// The slot map and a connection per master, for the pipelines.
    masters: Masters,
    /// One group's call as it is written, reused.
    cmd: redis::Cmd,
    /// The pipeline as it goes on the wire, reused.
    packed: Vec<u8>,
    /// What the batch being decided gives back once its answers are out.
    give_backs: Vec<GiveBack>,
}

impl Transport for Cluster {
    fn shared(&self) -> &Shared {
        &self.shared
    }

    fn reset(&mut self) {
        self.conn = None;
        self.masters.forget_conns();
    }

    /// A job is held while the breaker of the master any of its keys is on
    /// holds: the master failed a moment ago.
    fn holds(&self, job: &Job) -> bool {
        job.checks
            .iter()
            .any(|c| self.holding(key_slot(c.key.as_bytes())))
    }

    fn probes(&self, job: &Job) -> bool {
        self.masters.probe_due() && Cluster::probes(self, job)
    }

    /// While another dispatcher waits on a master that may be stalling
    /// (see [`Masters::suspect`]), the jobs that need none such are decided
    /// and answered first: a master's stall holds only its own jobs, even
    /// before its breaker opens. (A master that stalls while this very
    /// batch waits on it still holds the batch's other jobs.)
    fn send(
        &mut self,
        batch: &mut Vec<Job>,
    ) -> Result<Vec<Result<Decision, LimiterError>>, LimiterError> {
        if batch.len() > 1 && self.masters.any_suspect() {
            let masters = &self.masters;
            let first: Vec<Job> = batch
                .extract_if(.., |job| !needs_suspect(masters, job))
                .collect();
            if batch.is_empty() {
                *batch = first;
            } else if !first.is_empty() {
                let results = self.decide(&first);
                super::conclude(self, first, Ok(results));
            }
        }
        Ok(self.decide(batch))
    }

    fn answered(&mut self, undelivered: Vec<(Vec<Check>, Option<u64>, Decision)>) {
        // The caller gave up before its answer came (the reply of another
        // master was slow, and this one was read after it): it was
        // answered without Redis's decision, so what this decision took
        // goes back.
        let mut give_backs = std::mem::take(&mut self.give_backs);
        for (checks, now_ms, decision) in &undelivered {
            give_back::recorded(checks, *now_ms, decision, &mut give_backs);
        }
        if !give_backs.is_empty() {
            self.give_back(give_backs);
        }
    }
}

impl Cluster {
    /// Whether one of `job`'s keys is on a master whose breaker would let
    /// the next call probe it.
    fn probes(&self, job: &Job) -> bool {
        job.checks.iter().any(|c| {
            self.masters
                .of(key_slot(c.key.as_bytes()))
                .and_then(|m| self.masters.health(m))
                .is_some_and(|h| h.breaker.probe_due())
        })
    }

    /// Whether the breaker of the master the map names for `slot` holds
    /// calls back now.
    fn holding(&self, slot: u16) -> bool {
        self.masters
            .of(slot)
            .and_then(|m| self.masters.health(m))
            .is_some_and(|h| h.breaker.holding())
    }

    fn connect(&mut self) -> Result<&mut ClusterConnection, LimiterError> {
        if self.conn.is_none() {
            let conn = self.client.get_connection().map_err(LimiterError::from)?;
            conn.set_write_timeout(Some(self.timeout))
                .map_err(LimiterError::from)?;
            self.conn = Some(conn);
            if let Err(e) = self.load_scripts() {
                log::info!("loading the scripts on the cluster's masters: {e}");
            }
        }
        self.conn.as_mut().ok_or(LimiterError::Stopped)
    }

    /// Loads the batch library (or, once the cluster has refused it, the
    /// batch scripts) and the give-back script on every master (a master
    /// that already has them keeps them).
    fn load_scripts(&mut self) -> RedisResult<()> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        let all = RoutingInfo::MultiNode((
            MultipleNodeRoutingInfo::AllMasters,
            Some(ResponsePolicy::AllSucceeded),
        ));
        if self.shipping == Shipping::Function {
            match conn.route_command(
                &program::load_library_cmd(self.program.library()),
                all.clone(),
            ) {
                Ok(_) => {}
                Err(e) if program::refuses_functions(&e) => {
                    log::warn!("the cluster refused floodgate's function library ({e}); deciding with EVALSHA instead");
                    self.shipping = Shipping::Script;
                }
                Err(e) => return Err(e),
            }
        }
        let batch = self.program.script_sources();
        let scripts = match self.shipping {
            Shipping::Function => &[][..],
            Shipping::Script => &batch[..],
        };
        for source in scripts.iter().copied().chain([GIVE_BACK_SCRIPT]) {
            let mut load = redis::cmd("SCRIPT");
            load.arg("LOAD").arg(source);
            conn.route_command(&load, all.clone())?;
        }
        Ok(())
    }

    /// Loads the give-back script on the master this dispatcher's map names
    /// for `slot`.
    fn load_give_back_on(&mut self, slot: u16) -> RedisResult<()> {
        let named = self.masters.addr_of_slot(slot);
        let (Some((host, port)), Some(conn)) = (named, self.conn.as_mut()) else {
            return Ok(());
        };
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(GIVE_BACK_SCRIPT);
        let to = SingleNodeRoutingInfo::ByAddress { host, port };
        conn.route_command(&load, RoutingInfo::SingleNode(to))
            .map(drop)
    }

    /// Notes an error on the connection: one that may have left it out of
    /// step is dropped.
    fn note(&mut self, e: &redis::RedisError) {
        if spoils(e) && !e.is_cluster_error() {
            self.conn = None;
        }
    }

    /// Decides every job of `batch`: each slot group is one call, and a
    /// request allowed by some groups but not all gives back what those
    /// took (once the answers are out, see [`Transport::answered`]).
    fn decide(&mut self, batch: &[Job]) -> Vec<Result<Decision, LimiterError>> {
        let mut groups = group_by_slot(batch);
        let calls = self.call_groups(batch, &mut groups);

        // Per job and check: what each group decided.
        let mut taken: Vec<Vec<Option<Taken>>> =
            batch.iter().map(|j| vec![None; j.checks.len()]).collect();
        // A job is failed unless every one of its checks gets decided.
        let mut failed: Vec<Option<LimiterError>> = vec![None; batch.len()];
        for (members, reply) in calls {
            let members = members.iter().map(|&g| &groups[g]);
            match reply {
                Ok(reply) => {
                    // One reply for the call's groups, one after another.
                    let mut at = 0;
                    for (group, part) in members.flat_map(|g| g.parts.iter().map(move |p| (g, p))) {
                        let job = &batch[part.job];
                        let checks = part.checks.iter().map(|&c| &job.checks[c]);
                        let decision = match wire::job(checks, &reply, &mut at) {
                            Ok(decision) => decision,
                            // Skipped as late, or undecidable: the script
                            // recorded nothing for this part.
                            Err(e) => {
                                failed[part.job].get_or_insert(e);
                                continue;
                            }
                        };
                        let part_allowed = decision.allowed;
                        for (&c, outcome) in part.checks.iter().zip(decision.outcomes) {
                            taken[part.job][c] = Some(Taken {
                                outcome,
                                committed: part_allowed && outcome.allowed,
                                slot: group.slot,
                            });
                        }
                    }
                }
                Err(e) => {
                    for part in members.flat_map(|g| g.parts.iter()) {
                        failed[part.job].get_or_insert(e.clone());
                    }
                }
            }
        }

        for (j, taken) in taken.iter().enumerate() {
            if taken.iter().any(Option::is_none) {
                failed[j].get_or_insert(LimiterError::Timeout);
            }
        }
        let mut give_backs = std::mem::take(&mut self.give_backs);
        let results = batch
            .iter()
            .zip(taken)
            .zip(failed)
            .map(|((job, mut taken), failed)| {
                let job = JobChecks {
                    checks: &job.checks,
                    now_ms: job.now_ms,
                };
                let allowed = failed.is_none()
                    && job
                        .checks
                        .iter()
                        .zip(&taken)
                        .all(|(c, t)| !c.enforce || t.is_some_and(|t| t.outcome.allowed));
                if !allowed {
                    // Nothing stays recorded for a request that is not allowed.
                    job.give_back(&mut taken, &mut give_backs);
                }
                match failed {
                    Some(e) => Err(e),
                    None => Ok(Decision {
                        outcomes: taken
                            .iter()
                            .map(|t| t.map(|t| t.outcome).unwrap_or_else(denied_outcome))
                            .collect(),
                        allowed,
                    }),
                }
            })
            .collect();
        self.give_backs = give_backs;
        results
    }

    /// One script call per master: every group of a master the slot map
    /// knows goes to it in one call, every master's call written before any
    /// reply is read (one round trip for the batch). Returns each call's
    /// groups (indices into `groups`) and its reply.
    ///
    /// A per-master call that did not run (one of its slots served
    /// elsewhere or being moved, `NOSCRIPT`, a redirection, its master
    /// unreachable) is split: each of its groups is sent alone through the
    /// crate's cluster connection, which follows `MOVED` and `ASK`
    /// (`ASKING`, then the call); so is a group of no known master. A call
    /// that may have run is never sent again.
    fn call_groups(
        &mut self,
        batch: &[Job],
        groups: &mut [Group],
    ) -> Vec<(Vec<usize>, Result<wire::Replied, LimiterError>)> {
        let calls = self.pipeline(batch, groups);
        let mut out = Vec::with_capacity(calls.len());
        let mut loaded = false;
        for (members, reply) in calls {
            let reply = match reply {
                Reply::Done(_) | Reply::Failed(_) | Reply::Abandoned => reply,
                Reply::Elsewhere | Reply::Redirected(_) | Reply::Unloaded(_) | Reply::Unsent
                    if members.len() > 1 =>
                {
                    if let Reply::Unloaded(e) = &reply {
                        if !loaded {
                            if let Err(e) = self.forget_and_load(&e.clone()) {
                                for g in members {
                                    out.push((vec![g], Err(e.clone())));
                                }
                                continue;
                            }
                            loaded = true;
                        }
                    } else {
                        log::debug!("a master's call goes slot by slot");
                    }
                    for g in members {
                        let reply = self.resend(batch, &mut groups[g], Reply::Unsent);
                        out.push((vec![g], finish(reply)));
                    }
                    continue;
                }
                Reply::Unloaded(_) if loaded => Reply::Unsent,
                Reply::Elsewhere => Reply::Unsent,
                not_run => match members.first() {
                    Some(&g) => self.resend(batch, &mut groups[g], not_run),
                    None => not_run,
                },
            };
            let reply = match (reply, members.first()) {
                (Reply::Unsent, Some(&g)) => self.resend(batch, &mut groups[g], Reply::Unsent),
                (reply, _) => reply,
            };
            out.push((members, finish(reply)));
        }
        out
    }

    /// After `e`, an answer that the library or a script is missing: a
    /// master without them may be a new or restarted one that lost every
    /// key, so the denials remembered from before are forgotten; then they
    /// are loaded on every master. After an answer that `FCALL` is refused,
    /// the scripts are loaded and used from then on.
    fn forget_and_load(&mut self, e: &redis::RedisError) -> Result<(), LimiterError> {
        if program::missing(e) == Some(Missing::Functions) {
            log::warn!("the cluster refuses FCALL ({e}); deciding with EVALSHA instead");
            self.shipping = Shipping::Script;
        } else if let Some(cache) = &self.shared.deny_cache {
            cache.clear();
        }
        self.load_scripts().map_err(|e| {
            self.note(&e);
            LimiterError::from(e.clone())
        })
    }

    /// Writes every master the slot map knows its groups as one call, then
    /// reads the replies. Groups of no known master, or whose master could
    /// not be written to without risk, come back alone as
    /// [`Reply::Unsent`].
    ///
    /// Each master's breaker is asked first: the groups of a master held as
    /// failed get [`LimiterError::BreakerOpen`] at once, unless this batch
    /// is that master's probe. What the master's pipeline comes to moves
    /// its breaker: an answer closes it, a timeout or a lost connection
    /// opens it. Each master's call carries deadlines on that master's own
    /// clock, and its reply tells that clock alone.
    fn pipeline(&mut self, batch: &[Job], groups: &mut [Group]) -> Vec<(Vec<usize>, Reply)> {
        let mut replies: Vec<Reply> = groups.iter().map(|_| Reply::Unsent).collect();
        let mut calls = Vec::new();
        if self.masters.wants_reading() && self.connect().is_ok() {
            if let Some(conn) = self.conn.as_mut() {
                self.masters.read(conn, &[]);
            }
        }
        let now = Instant::now();
        let mut by_master: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (g, group) in groups.iter_mut().enumerate() {
            // A caller that gave up must not have quota taken for it.
            group.parts.retain(|p| batch[p.job].waiting(now));
            if group.parts.is_empty() {
                replies[g] = Reply::Abandoned;
            } else if let Some(m) = self.masters.of(group.slot) {
                by_master.entry(m).or_default().push(g);
            }
        }

        // Write every master's pipeline first, then read: the masters work
        // on their shares at the same time.
        let margin = self.margin;
        let mut sent = Vec::with_capacity(by_master.len());
        // The probes of this batch: given back when this returns, however
        // it returns.
        let mut probing = Vec::new();
        // Masters that did not take a connection (refused, reset): held as
        // failed below, unless the map no longer names them.
        let mut unreachable = Vec::new();
        for (m, gs) in by_master {
            let Some(health) = self.masters.health(m).map(Arc::clone) else {
                continue;
            };
            match Breaker::gate(Arc::clone(&health.breaker)) {
                Gate::Closed => {}
                Gate::Probe(probe) => probing.push(probe),
                // (A dispatcher thread does not wait for another's probe.)
                Gate::Open | Gate::Probing => {
                    for &g in &gs {
                        replies[g] = Reply::Failed(LimiterError::BreakerOpen);
                    }
                    continue;
                }
            }
            self.packed.clear();
            let members: Vec<&Group> = gs.iter().map(|&g| &groups[g]).collect();
            let target = self.program.cluster_target(self.shipping);
            let expected = write_master_call(&mut self.cmd, target, batch, &members, |job| {
                job.redis_deadline(&health.clock, margin)
            });
            self.cmd.write_packed_command(&mut self.packed);
            match self.masters.send(m, &self.packed) {
                Ok(()) => sent.push((m, health, gs, expected)),
                // Nothing was written: the crate's connection may try (the
                // slot may have moved), but this master is held as failed.
                Err(Unwritten::NotSent(e)) => {
                    log::debug!("cluster master unreachable, its groups go another way: {e}");
                    if let Some(addr) = self.masters.addr(m) {
                        unreachable.push((addr.clone(), health, e));
                    }
                }
                // A write that timed out may yet be read whole: the
                // call is not sent again.
                Err(Unwritten::Failed(e)) if e.is_timeout() => {
                    health.breaker.trip(&LimiterError::from(e.clone()));
                    for &g in &gs {
                        replies[g] = Reply::Failed(LimiterError::from(e.clone()));
                    }
                }
                // One call that was not written whole did not run.
                Err(Unwritten::Failed(e)) => health.breaker.trip(&LimiterError::from(e.clone())),
            }
        }
        for (m, health, gs, expected) in sent {
            let value = match self.masters.recv(m) {
                Ok(value) => value,
                Err(e) => {
                    // The call may have run.
                    health.breaker.trip(&LimiterError::from(e.clone()));
                    calls.push((gs, Reply::Failed(LimiterError::from(e.clone()))));
                    continue;
                }
            };
            let reply = match classify(Ok(value), expected, Some(&health.clock)) {
                Reply::Redirected(e) => {
                    match e.redirect_node() {
                        Some((addr, slot))
                            if e.kind() == ErrorKind::Server(ServerErrorKind::Moved) =>
                        {
                            self.masters.moved(slot, addr)
                        }
                        _ => self.masters.stale(),
                    }
                    Reply::Redirected(e)
                }
                // A slot of the call has moved (or is moving): the map is
                // read again.
                Reply::Elsewhere => {
                    self.masters.stale();
                    Reply::Elsewhere
                }
                other => other,
            };
            health.breaker.close();
            calls.push((gs, reply));
        }
        if !unreachable.is_empty() {
            // An address that takes no connection may be a master a
            // failover replaced while this process was idle: the map is
            // read again at once, and a master it no longer names holds
            // no slot, so no breaker opens for it (its groups, which go
            // alone below, reach the master the map names now). One the
            // map still names is held as failed.
            let avoid: Vec<(String, u16)> = unreachable.iter().map(|(a, _, _)| a.clone()).collect();
            if self.connect().is_ok() {
                if let Some(conn) = self.conn.as_mut() {
                    self.masters.read(conn, &avoid);
                }
            }
            for (addr, health, e) in unreachable {
                if self.masters.names(&addr) {
                    health.breaker.trip(&LimiterError::from(e));
                }
            }
        }
        drop(probing);
        // Every group not in a master's call goes alone, as it stands.
        let mut in_call = vec![false; groups.len()];
        for (gs, _) in &calls {
            for &g in gs {
                in_call[g] = true;
            }
        }
        for (g, reply) in replies.into_iter().enumerate() {
            if !in_call[g] {
                calls.push((vec![g], reply));
            }
        }
        calls
    }

    /// Sends a group that did not run through the crate's cluster
    /// connection, again (at most twice more) while it still does not run:
    /// after a redirection, and after loading the scripts where it landed.
    fn resend(&mut self, batch: &[Job], group: &mut Group, first: Reply) -> Reply {
        let mut reply = first;
        for _ in 0..3 {
            match &reply {
                Reply::Unsent => {}
                Reply::Redirected(e) => log::debug!("slot {} sent again: {e}", group.slot),
                Reply::Unloaded(e) => {
                    if let Err(e) = self.forget_and_load(&e.clone()) {
                        return Reply::Failed(e);
                    }
                }
                Reply::Done(_) | Reply::Failed(_) | Reply::Abandoned | Reply::Elsewhere => break,
            }
            reply = self.call_group(batch, group);
        }
        reply
    }

    /// `reply`, the crate's answer to `cmd` on `slot`; or, when the crate
    /// could not place it (its own map may still name a master that a
    /// failover replaced: no connection is taken there, so nothing ran),
    /// the answer of the master this dispatcher's map names for the slot,
    /// read again first (from another master than the one it named).
    fn placed(
        &mut self,
        slot: u16,
        cmd: &redis::Cmd,
        reply: RedisResult<Value>,
    ) -> RedisResult<Value> {
        if !matches!(&reply, Err(e) if e.is_connection_refusal()) {
            return reply;
        }
        let Some(conn) = self.conn.as_mut() else {
            return reply;
        };
        let avoid: Vec<(String, u16)> = self.masters.addr_of_slot(slot).into_iter().collect();
        self.masters.read(conn, &avoid);
        match self.masters.addr_of_slot(slot) {
            Some((host, port)) => {
                let to = SingleNodeRoutingInfo::ByAddress { host, port };
                conn.route_command(cmd, RoutingInfo::SingleNode(to))
            }
            None => reply,
        }
    }

    /// Sends one group, through the cluster connection (which follows
    /// MOVED and ASK), for the callers still waiting: the parts of callers
    /// that gave up are dropped from the group first (they would take
    /// quota for a request answered without it).
    fn call_group(&mut self, batch: &[Job], group: &mut Group) -> Reply {
        let now = Instant::now();
        group.parts.retain(|p| batch[p.job].waiting(now));
        if group.parts.is_empty() {
            return Reply::Abandoned;
        }
        if self.holding(group.slot) {
            // Its master failed a moment ago (maybe in this very batch):
            // no call until the breaker's period is over, whichever way.
            return Reply::Failed(LimiterError::BreakerOpen);
        }
        let mut cmd = redis::Cmd::new();
        // The deadline on the clock of the master the map names for the
        // slot (after a MOVED, the new one); none when no master is known.
        let health = self
            .masters
            .of(group.slot)
            .and_then(|m| self.masters.health(m))
            .map(Arc::clone);
        let margin = self.margin;
        let target = self.program.target(self.shipping);
        let expected = write_group(&mut cmd, target, batch, &group.parts, |job| {
            health
                .as_ref()
                .and_then(|h| job.redis_deadline(&h.clock, margin))
        });
        let reply = match self.connect() {
            Ok(conn) => conn.req_command(&cmd),
            Err(e) => return Reply::Failed(e),
        };
        let reply = self.placed(group.slot, &cmd, reply);
        if let Err(e) = &reply {
            self.note(e);
        }
        // The crate may have followed a redirection to another node than
        // the map names: its clock is not told.
        classify(reply, expected, None)
    }
}

/// Whether one of `job`'s keys is on a master that may be stalling.
fn needs_suspect(masters: &Masters, job: &Job) -> bool {
    job.checks.iter().any(|c| {
        masters
            .of(key_slot(c.key.as_bytes()))
            .is_some_and(|m| masters.suspect(m))
    })
}

/// What a call's last reply comes to for its groups.
fn finish(reply: Reply) -> Result<wire::Replied, LimiterError> {
    match reply {
        Reply::Done(values) => Ok(values),
        Reply::Failed(e) => Err(e),
        Reply::Redirected(e) | Reply::Unloaded(e) => Err(LimiterError::from(e.clone())),
        Reply::Unsent | Reply::Abandoned | Reply::Elsewhere => Err(LimiterError::Timeout),
    }
}

/// Never used for a decided check; a placeholder that denies.
fn denied_outcome() -> Outcome {
    Outcome {
        allowed: false,
        remaining: 0,
        wait: Duration::from_secs(1),
        banned: false,
        ban_started: false,
        quota: None,
    }
}
