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
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::cluster::{ClusterClient, ClusterConnection};
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::{ConnectionLike as _, ErrorKind, RedisResult, ServerErrorKind};

use self::give_back::{GiveBack, JobChecks, Taken};
use self::groups::{classify, group_by_slot, write_group, Group, Reply};
use self::masters::{Masters, Unwritten};
use self::slot::key_slot;
use super::{Job, Transport};
use crate::limiter::breaker::{Breaker, Gate};
use crate::limiter::conn::spoils;
use crate::limiter::decide::Shared;
use crate::limiter::topology::cluster_client;
use crate::limiter::wire;
use crate::limiter::{Check, Decision, LimiterError, Outcome, RedisConfig};

mod give_back;
mod groups;
pub(crate) mod masters;
mod slot;

/// The batch script, the same as on one server: one call per slot group.
const BATCH_SCRIPT: &str = crate::limiter::wire::SCRIPT_SOURCE;

/// Gives back what the allowed groups of a denied request took.
const GIVE_BACK_SCRIPT: &str = crate::limiter::wire::CLUSTER_GIVE_BACK_SOURCE;

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
        let transport = Cluster {
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
    /// What the batch being decided gives back once its answers are out.
    give_backs: Vec<GiveBack>,
}

impl Transport for Cluster {
    fn shared(&self) -> &Shared {
        &self.shared
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

    fn send(
        &mut self,
        batch: &mut Vec<Job>,
    ) -> Result<Vec<Result<Decision, LimiterError>>, LimiterError> {
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

    /// Decides every job of `batch`: each slot group is one call, and a
    /// request allowed by some groups but not all gives back what those
    /// took (once the answers are out, see [`Transport::answered`]).
    fn decide(&mut self, batch: &[Job]) -> Vec<Result<Decision, LimiterError>> {
        let mut groups = group_by_slot(batch);
        let replies = self.call_groups(batch, &mut groups);

        // Per job and check: what each group decided.
        let mut taken: Vec<Vec<Option<Taken>>> =
            batch.iter().map(|j| vec![None; j.checks.len()]).collect();
        // A job is failed unless every one of its checks gets decided.
        let mut failed: Vec<Option<LimiterError>> = vec![None; batch.len()];
        for (group, reply) in groups.iter().zip(replies) {
            match reply {
                Ok(reply) => {
                    let mut at = 0;
                    for part in &group.parts {
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
    ) -> Vec<Result<wire::Replied, LimiterError>> {
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
                    job.redis_deadline(&health.clock, margin)
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
        let expected = write_group(&mut cmd, sha, batch, &group.parts, |job| {
            health
                .as_ref()
                .and_then(|h| job.redis_deadline(&h.clock, margin))
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
