//! Deciding batches on a Redis Cluster.
//!
//! A script may only touch keys of one hash slot. The filter puts the ID of
//! every key in a hash tag (`PREFIX:RULE:KIND:{ID}`), so the rules of one
//! identity share a slot and a request keyed by one identity is still
//! decided by one atomic call. The dispatcher here splits each batch by
//! slot: every slot group is one `EVALSHA` of the same batch script, so a
//! hot identity's requests still share one call. The groups go to their
//! masters as one pipeline per master, every pipeline written before any
//! reply is read (see [`masters`]): a batch costs one round trip,
//! not one per identity. A pipeline's replies are read one by one, so one
//! group's error never costs another group its answer.
//!
//! A request whose checks span several slots is decided per slot group.
//! It is allowed only if every group allows it; when one group denies (or
//! fails), the groups that admitted it give back what they took, with a
//! second small script. So nothing is ever admitted beyond what every
//! limit allows; between the decision and the give-back (one round trip)
//! the units are held, and a request racing for the last of them in that
//! moment may be denied.
//!
//! A slot group answered `MOVED`, `ASK`, `TRYAGAIN` or `CLUSTERDOWN` did
//! not run, and is sent again through the crate's cluster connection,
//! which follows the redirection; so is a group whose master is not in the
//! slot map or could not be reached before anything was written to it.
//! `NOSCRIPT` (a master that never saw the script: a new or promoted node,
//! or the importing side of a slot being moved) likewise ran nothing: the
//! scripts are loaded on every master and the group is sent again. A group
//! is sent again only for the callers still waiting; a group that may have
//! run (its reply was lost, or its pipeline failed part way) is never sent
//! again: its requests get their `on_redis_error` answer.
//!
//! Each master has a breaker of its own (see [`masters`]): after a
//! master failed, its groups get `on_redis_error` at once for the breaker's
//! period while the other masters' groups are sent as usual. A decision
//! that can no longer be handed over (its caller gave up while the replies
//! of a slower master were read) gives back what it took.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::{ConnectionLike as _, ErrorKind, RedisResult, ServerErrorKind, Value};

use self::masters::{Masters, Unwritten};
use self::slot::key_slot;
use super::{next_batch, retain_waiting, Job};
use crate::limit::breaker::{Breaker, Gate};
use crate::limit::clock::RedisClock;
use crate::limit::conn::spoils;
use crate::limit::limiter::Shared;
use crate::limit::topology::cluster_client;
use crate::limit::wire::{self, Args as _};
use crate::limit::{Algorithm, Check, Decision, LimiterError, Outcome, RedisConfig};

pub(crate) mod masters;
mod slot;

/// The batch script, the same as on one server: one call per slot group.
const BATCH_SCRIPT: &str = crate::limit::wire::SCRIPT_SOURCE;

/// Gives back what the allowed groups of a denied request took.
const GIVE_BACK_SCRIPT: &str = crate::limit::wire::CLUSTER_GIVE_BACK_SOURCE;

/// Starts `count` cluster dispatchers on the limiter's queue.
pub(crate) fn start(
    config: &RedisConfig,
    rx: &Arc<Mutex<Receiver<Job>>>,
    shared: &Arc<Shared>,
    margin: Duration,
    count: usize,
) -> Result<(), LimiterError> {
    let client = cluster_client(config).map_err(LimiterError::from)?;
    let batch = Arc::new(redis::Script::new(BATCH_SCRIPT));
    let give_back = Arc::new(redis::Script::new(GIVE_BACK_SCRIPT));
    for i in 0..count {
        let dispatcher = ClusterDispatcher {
            rx: Arc::clone(rx),
            client: client.clone(),
            timeout: config.timeout,
            conn: None,
            batch: Arc::clone(&batch),
            give_back: Arc::clone(&give_back),
            shared: Arc::clone(shared),
            margin,
            masters: Masters::new(config, shared),
            cmd: redis::Cmd::new(),
            packed: Vec::new(),
        };
        std::thread::Builder::new()
            .name(format!("floodgate-cluster-{i}"))
            .spawn(move || dispatcher.run())
            .map_err(|e| LimiterError::Other(format!("cannot start a dispatcher: {e}")))?;
    }
    Ok(())
}

struct ClusterDispatcher {
    rx: Arc<Mutex<Receiver<Job>>>,
    client: ClusterClient,
    timeout: Duration,
    /// Its own cluster connection (one connection per master, opened on
    /// demand by the crate); dropped after an I/O error.
    conn: Option<ClusterConnection>,
    batch: Arc<redis::Script>,
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
}

/// The checks of one job that fall in one slot.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Part {
    job: usize,
    checks: Vec<usize>,
}

/// One slot's share of a batch: one script call.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Group {
    slot: u16,
    parts: Vec<Part>,
}

/// Splits a batch by slot, keeping the order of jobs and checks.
fn group_by_slot(batch: &[Job]) -> Vec<Group> {
    let mut groups: BTreeMap<u16, Vec<Part>> = BTreeMap::new();
    for (j, job) in batch.iter().enumerate() {
        let mut mine: BTreeMap<u16, Vec<usize>> = BTreeMap::new();
        for (c, check) in job.checks.iter().enumerate() {
            mine.entry(key_slot(check.key.as_bytes()))
                .or_default()
                .push(c);
        }
        for (slot, checks) in mine {
            groups
                .entry(slot)
                .or_default()
                .push(Part { job: j, checks });
        }
    }
    groups
        .into_iter()
        .map(|(slot, parts)| Group { slot, parts })
        .collect()
}

/// How one slot group's call came back.
enum Reply {
    /// Three values per check.
    Done(Vec<i64>),
    /// Did not run; send it again where the cluster says.
    Redirected(redis::RedisError),
    /// Did not run; load the scripts and send it again.
    NoScript(redis::RedisError),
    /// Failed; it may or may not have run.
    Failed(LimiterError),
    /// Not sent: every caller in it had given up.
    Abandoned,
    /// Not sent yet.
    Unsent,
}

/// Sorts one group's reply. A reply that decided gives `clock` (the
/// estimate of the clock of the master that answered, when it is known for
/// sure) its last value, Redis's clock in microseconds, and keeps the three
/// per check.
fn classify(reply: RedisResult<Value>, expected: usize, clock: Option<&RedisClock>) -> Reply {
    match reply.and_then(|v| v.extract_error()) {
        Ok(value) => match redis::from_redis_value::<Vec<i64>>(value) {
            Ok(mut values) => match wire::take_clock(&mut values, expected) {
                Ok(redis_us) => {
                    if let Some(clock) = clock {
                        clock.sample(redis_us, Instant::now());
                    }
                    Reply::Done(values)
                }
                Err(e) => Reply::Failed(e),
            },
            Err(e) => Reply::Failed(LimiterError::Other(format!("unexpected reply: {e}"))),
        },
        Err(e) => match e.kind() {
            ErrorKind::Server(ServerErrorKind::NoScript) => Reply::NoScript(e),
            ErrorKind::Server(
                ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly,
            ) => Reply::Redirected(e),
            _ => Reply::Failed(LimiterError::from(e.clone())),
        },
    }
}

/// What one check of a job came to across the groups.
#[derive(Clone, Copy)]
struct Taken {
    outcome: Outcome,
    /// The script recorded it (its part was allowed).
    committed: bool,
    slot: u16,
}

/// A job's checks, once its reply has been taken apart from it.
struct JobChecks<'a> {
    checks: &'a [Check],
    now_ms: Option<u64>,
}

impl JobChecks<'_> {
    /// Adds to `give_backs` what the job's groups recorded, and notes
    /// it given back.
    fn give_back(&self, taken: &mut [Option<Taken>], give_backs: &mut Vec<GiveBack>) {
        for (check, t) in self.checks.iter().zip(taken.iter_mut()) {
            if let Some(t) = t.as_mut().filter(|t| t.committed) {
                give_backs.push(GiveBack {
                    slot: t.slot,
                    key: check.key.clone(),
                    algorithm: check.algorithm,
                    cost: check.cost,
                    now_ms: self.now_ms,
                });
                t.committed = false;
                t.outcome.remaining += u64::from(check.cost);
            }
        }
    }
}

/// Units to give back on one key.
struct GiveBack {
    slot: u16,
    key: String,
    algorithm: Algorithm,
    cost: u32,
    now_ms: Option<u64>,
}

impl ClusterDispatcher {
    fn run(mut self) {
        loop {
            let Some(mut batch) = next_batch(&self.rx) else {
                return;
            };
            // A caller that gave up must not have quota taken for it.
            retain_waiting(&mut batch);
            if batch.is_empty() {
                continue;
            }
            // The jobs that would probe a master held as failed go last,
            // in a batch of their own: if that master still stalls, the
            // others are not held behind its timeout.
            let (mut probing, batch): (Vec<Job>, Vec<Job>) = if self.masters.probe_due() {
                batch.into_iter().partition(|j| self.probes(j))
            } else {
                (Vec::new(), batch)
            };
            if !batch.is_empty() {
                self.decide(batch);
            }
            retain_waiting(&mut probing);
            if !probing.is_empty() {
                self.decide(probing);
            }
        }
    }

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

    /// Loads both scripts on every master (a master that already has them
    /// keeps them).
    fn load_scripts(&mut self) -> RedisResult<()> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        for source in [BATCH_SCRIPT, GIVE_BACK_SCRIPT] {
            let mut load = redis::cmd("SCRIPT");
            load.arg("LOAD").arg(source);
            conn.route_command(
                &load,
                RoutingInfo::MultiNode((
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::AllSucceeded),
                )),
            )?;
        }
        Ok(())
    }

    /// Notes an error on the connection: one that may have left it out of
    /// step is dropped.
    fn note(&mut self, e: &redis::RedisError) {
        if spoils(e) && !e.is_cluster_error() {
            self.conn = None;
        }
    }

    fn decide(&mut self, batch: Vec<Job>) {
        let mut groups = group_by_slot(&batch);
        let replies = self.call_groups(&batch, &mut groups);

        // Per job and check: what each group decided.
        let mut taken: Vec<Vec<Option<Taken>>> =
            batch.iter().map(|j| vec![None; j.checks.len()]).collect();
        // A job is failed unless every one of its checks gets decided.
        let mut failed: Vec<Option<LimiterError>> = vec![None; batch.len()];
        for (group, reply) in groups.iter().zip(replies) {
            match reply {
                Ok(values) => {
                    let mut at = 0;
                    for part in &group.parts {
                        let job = &batch[part.job];
                        let checks = part.checks.iter().map(|&c| &job.checks[c]);
                        let decision = match wire::job(checks, &values, &mut at) {
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
                    for part in &group.parts {
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
        let mut give_backs = Vec::new();
        for ((job, mut taken), failed) in batch.into_iter().zip(taken).zip(failed) {
            let Job {
                checks,
                now_ms,
                reply,
                ..
            } = job;
            let job = JobChecks {
                checks: &checks,
                now_ms,
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
            let answer = match failed {
                Some(e) => {
                    match e {
                        // Redis answered: it skipped the call, which came
                        // after its caller's deadline.
                        LimiterError::Late => self.shared.late.fetch_add(1, Ordering::Relaxed),
                        // No call was made.
                        LimiterError::BreakerOpen => 0,
                        _ => self.shared.errors.fetch_add(1, Ordering::Relaxed),
                    };
                    Err(e)
                }
                None => Ok(Decision {
                    outcomes: taken
                        .iter()
                        .map(|t| t.map(|t| t.outcome).unwrap_or_else(denied_outcome))
                        .collect(),
                    allowed,
                }),
            };
            if let Err(Ok(decision)) = reply.send(answer) {
                // The caller gave up before its answer came (the reply of
                // another master was slow, and this one was read after
                // it): it was answered without Redis's decision, so what
                // this decision took goes back.
                if decision.allowed {
                    job.give_back(&mut taken, &mut give_backs);
                }
            }
        }
        if !give_backs.is_empty() {
            self.give_back(give_backs);
        }
    }

    /// One script call per slot group. The groups whose master the slot
    /// map knows go to it as one pipeline per master, all written before
    /// any reply is read: one round trip for the batch. A group that did
    /// not run (redirected, `NOSCRIPT`, its master unreachable or unknown)
    /// is sent again through the crate's cluster connection, which follows
    /// redirections; a group that may have run is never sent again.
    fn call_groups(
        &mut self,
        batch: &[Job],
        groups: &mut [Group],
    ) -> Vec<Result<Vec<i64>, LimiterError>> {
        let sha = self.batch.get_hash().to_string();
        let replies = self.pipeline(batch, groups, &sha);
        groups
            .iter_mut()
            .zip(replies)
            .map(|(group, reply)| {
                let reply = match reply {
                    Reply::Done(_) | Reply::Failed(_) | Reply::Abandoned => reply,
                    not_run => self.resend(batch, group, &sha, not_run),
                };
                match reply {
                    Reply::Done(values) => Ok(values),
                    Reply::Failed(e) => Err(e),
                    Reply::Redirected(e) | Reply::NoScript(e) => Err(LimiterError::from(e.clone())),
                    Reply::Unsent | Reply::Abandoned => Err(LimiterError::Timeout),
                }
            })
            .collect()
    }

    /// Writes every group whose master is known to that master, one
    /// pipeline per master, then reads the replies. Groups of no known
    /// master, or whose master could not be written to without risk, come
    /// back [`Reply::Unsent`].
    ///
    /// Each master's breaker is asked first: the groups of a master held as
    /// failed get [`LimiterError::BreakerOpen`] at once, unless this batch
    /// is that master's probe. What the master's pipeline comes to moves
    /// its breaker: an answer closes it, a timeout or a lost connection
    /// opens it. Each master's calls carry deadlines on that master's own
    /// clock, and its replies tell that clock alone.
    fn pipeline(&mut self, batch: &[Job], groups: &mut [Group], sha: &str) -> Vec<Reply> {
        let mut replies: Vec<Reply> = groups.iter().map(|_| Reply::Unsent).collect();
        if self.masters.wants_reading() && self.connect().is_ok() {
            if let Some(conn) = self.conn.as_mut() {
                self.masters.read(conn);
            }
        }
        let now = Instant::now();
        let mut by_master: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (g, group) in groups.iter_mut().enumerate() {
            // A caller that gave up must not have quota taken for it.
            group
                .parts
                .retain(|p| batch[p.job].deadline > now && !batch[p.job].reply.is_closed());
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
        for (m, gs) in by_master {
            let Some(health) = self.masters.health(m).map(Arc::clone) else {
                continue;
            };
            match Breaker::gate(Arc::clone(&health.breaker)) {
                Gate::Closed => {}
                Gate::Probe(probe) => probing.push(probe),
                Gate::Open => {
                    for &g in &gs {
                        replies[g] = Reply::Failed(LimiterError::BreakerOpen);
                    }
                    continue;
                }
            }
            self.packed.clear();
            let mut expected = Vec::with_capacity(gs.len());
            for &g in &gs {
                let n = write_group(&mut self.cmd, sha, batch, &groups[g].parts, |job| {
                    health.clock.redis_ms(job.deadline - margin)
                });
                self.cmd.write_packed_command(&mut self.packed);
                expected.push((g, n));
            }
            match self.masters.send(m, &self.packed) {
                Ok(()) => sent.push((m, health, expected)),
                // Nothing was written: the crate's connection may try (the
                // slot may have moved), but this master is held as failed.
                Err(Unwritten::NotSent(e)) => {
                    health.breaker.trip(&LimiterError::from(e.clone()));
                    log::debug!("cluster master unreachable, its groups go another way: {e}")
                }
                // A write that failed part way may have delivered some of
                // the pipeline's calls whole; none is sent again.
                Err(Unwritten::Failed(e)) if gs.len() > 1 || e.is_timeout() => {
                    health.breaker.trip(&LimiterError::from(e.clone()));
                    for &g in &gs {
                        replies[g] = Reply::Failed(LimiterError::from(e.clone()));
                    }
                }
                // One call that was not written whole did not run.
                Err(Unwritten::Failed(e)) => health.breaker.trip(&LimiterError::from(e.clone())),
            }
        }
        for (m, health, expected) in sent {
            let mut answered = true;
            for (k, &(g, n)) in expected.iter().enumerate() {
                let value = match self.masters.recv(m) {
                    Ok(value) => value,
                    Err(e) => {
                        // This call and the ones after it may have run.
                        health.breaker.trip(&LimiterError::from(e.clone()));
                        answered = false;
                        for &(g, _) in &expected[k..] {
                            replies[g] = Reply::Failed(LimiterError::from(e.clone()));
                        }
                        break;
                    }
                };
                replies[g] = match classify(Ok(value), n, Some(&health.clock)) {
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
                    other => other,
                };
            }
            if answered {
                health.breaker.close();
            }
        }
        drop(probing);
        replies
    }

    /// Sends a group that did not run through the crate's cluster
    /// connection, again (at most twice more) while it still does not run:
    /// after a redirection, and after loading the scripts where it landed.
    fn resend(&mut self, batch: &[Job], group: &mut Group, sha: &str, first: Reply) -> Reply {
        let mut reply = first;
        for _ in 0..3 {
            match &reply {
                Reply::Unsent => {}
                Reply::Redirected(e) => log::debug!("slot {} sent again: {e}", group.slot),
                Reply::NoScript(_) => {
                    // A master without the scripts may be a new or
                    // restarted one that lost every key: the denials
                    // remembered from before are forgotten.
                    if let Some(cache) = &self.shared.deny_cache {
                        cache.clear();
                    }
                    if let Err(e) = self.load_scripts() {
                        self.note(&e);
                        return Reply::Failed(LimiterError::from(e.clone()));
                    }
                }
                Reply::Done(_) | Reply::Failed(_) | Reply::Abandoned => break,
            }
            reply = self.call_group(batch, group, sha);
        }
        reply
    }

    /// Sends one group, through the cluster connection (which follows
    /// MOVED and ASK), for the callers still waiting: the parts of callers
    /// that gave up are dropped from the group first (they would take
    /// quota for a request answered without it).
    fn call_group(&mut self, batch: &[Job], group: &mut Group, sha: &str) -> Reply {
        let now = Instant::now();
        group
            .parts
            .retain(|p| batch[p.job].deadline > now && !batch[p.job].reply.is_closed());
        if group.parts.is_empty() {
            return Reply::Abandoned;
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
        let expected = write_group(&mut cmd, sha, batch, &group.parts, |job| {
            health
                .as_ref()
                .and_then(|h| h.clock.redis_ms(job.deadline - margin))
        });
        let conn = match self.connect() {
            Ok(conn) => conn,
            Err(e) => return Reply::Failed(e),
        };
        let reply = conn.req_command(&cmd);
        if let Err(e) = &reply {
            self.note(e);
        }
        // The crate may have followed a redirection to another node than
        // the map names: its clock is not told.
        classify(reply, expected, None)
    }

    /// Gives back units, one script call per slot.
    fn give_back(&mut self, give_backs: Vec<GiveBack>) {
        let mut by_slot: BTreeMap<u16, Vec<GiveBack>> = BTreeMap::new();
        for g in give_backs {
            by_slot.entry(g.slot).or_default().push(g);
        }
        let sha = self.give_back.get_hash().to_string();
        let cmds: Vec<redis::Cmd> = by_slot
            .values()
            .map(|gs| {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(&sha).arg(gs.len());
                for g in gs {
                    cmd.arg(g.key.as_str());
                }
                for g in gs {
                    wire::algorithm(&mut cmd, &g.algorithm);
                    cmd.put(g.cost).put_opt(g.now_ms);
                }
                cmd
            })
            .collect();
        for (cmd, gs) in cmds.iter().zip(by_slot.values()) {
            self.give_back_one(cmd);
            // Given back (or maybe): a remembered denial of these keys may
            // no longer hold.
            if let Some(cache) = &self.shared.deny_cache {
                for g in gs {
                    cache.forget(&g.key);
                }
            }
        }
    }

    /// One slot's give-back call, retried when it cannot have run.
    fn give_back_one(&mut self, cmd: &redis::Cmd) {
        let mut reply = match self.connect() {
            Ok(conn) => conn.req_command(cmd).and_then(|v| v.extract_error()),
            Err(e) => {
                self.shared.errors.fetch_add(1, Ordering::Relaxed);
                crate::logging::repeated!(
                    &crate::logging::GIVE_BACK_FAILED,
                    "could not give back units: {}",
                    crate::logging::Escaped(&e.to_string())
                );
                return;
            }
        };
        for _ in 0..2 {
            let Err(e) = &reply else { break };
            match e.kind() {
                ErrorKind::Server(ServerErrorKind::NoScript) => {
                    if let Err(e) = self.load_scripts() {
                        self.note(&e);
                        break;
                    }
                }
                _ if e.is_cluster_error()
                    || e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) => {}
                _ => break,
            }
            reply = match self.connect() {
                Ok(conn) => conn.req_command(cmd).and_then(|v| v.extract_error()),
                Err(_) => break,
            };
        }
        if let Err(e) = reply {
            self.note(&e);
            self.shared.errors.fetch_add(1, Ordering::Relaxed);
            crate::logging::repeated!(
                &crate::logging::GIVE_BACK_FAILED,
                "could not give back units: {}",
                crate::logging::Escaped(&e.to_string())
            );
        }
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
    }
}

/// Writes one slot group as `EVALSHA sha` laid out as `lua/batch.lua` reads
/// it (each part is a job there). Returns the number of values the reply
/// must hold: three per check, and Redis's clock.
fn write_group(
    cmd: &mut redis::Cmd,
    sha: &str,
    batch: &[Job],
    parts: &[Part],
    deadline: impl Fn(&Job) -> Option<i64>,
) -> usize {
    let jobs = parts.iter().map(|part| {
        let job = &batch[part.job];
        wire::JobArgs {
            now_ms: job.now_ms,
            deadline: deadline(job),
            checks: part.checks.iter().map(|&c| &job.checks[c]),
        }
    });
    wire::batch(cmd, sha, jobs)
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use tokio::sync::oneshot;

    use super::*;

    fn job(keys: &[&str]) -> Job {
        let (reply, _) = oneshot::channel();
        Job {
            checks: keys
                .iter()
                .map(|k| Check {
                    key: k.to_string(),
                    algorithm: Algorithm::SlidingWindow {
                        limit: NonZeroU32::new(5).unwrap(),
                        window: Duration::from_secs(10),
                    },
                    cost: 1,
                    enforce: true,
                    penalty: None,
                })
                .collect(),
            now_ms: None,
            deadline: Instant::now(),
            probe: false,
            reply,
        }
    }

    #[test]
    fn a_batch_splits_by_slot_and_one_identity_stays_one_part() {
        let batch = vec![
            job(&["p:a:ip:{1.2.3.4}", "p:b:ip:{1.2.3.4}"]),
            job(&["p:a:ip:{5.6.7.8}"]),
            job(&["p:a:ip:{1.2.3.4}", "p:c:form:{+15550100}"]),
        ];
        let groups = group_by_slot(&batch);
        let slot = |k: &str| key_slot(k.as_bytes());
        let find = |s: u16| groups.iter().find(|g| g.slot == s).unwrap();
        assert_eq!(groups.len(), 3);
        assert_eq!(
            find(slot("{1.2.3.4}")).parts,
            vec![
                Part {
                    job: 0,
                    checks: vec![0, 1]
                },
                Part {
                    job: 2,
                    checks: vec![0]
                }
            ]
        );
        assert_eq!(
            find(slot("{+15550100}")).parts,
            vec![Part {
                job: 2,
                checks: vec![1]
            }]
        );
        let mut cmd = redis::Cmd::new();
        let g = find(slot("{1.2.3.4}"));
        assert_eq!(write_group(&mut cmd, "SHA", &batch, &g.parts, |_| None), 10);
        let packed = String::from_utf8_lossy(&cmd.get_packed_command()).into_owned();
        let args: Vec<&str> = packed
            .split("\r\n")
            .filter(|l| !l.starts_with(['*', '$']))
            .collect();
        assert_eq!(
            args,
            [
                "EVALSHA",
                "SHA",
                "3",
                "p:a:ip:{1.2.3.4}",
                "p:b:ip:{1.2.3.4}",
                "p:a:ip:{1.2.3.4}",
                "2",
                "",
                "",
                "2",
                "1",
                "5",
                "10000",
                "1",
                "1",
                "1",
                "5",
                "10000",
                "1",
                "1",
                "",
                "",
                "1",
                "1",
                "5",
                "10000",
                "1",
                "1",
                ""
            ]
        );
    }
}
