//! Giving back what the slot groups of a request took, when the request
//! is not allowed after all (another group denied or failed) or its
//! decision could no longer be handed over: one call of the give-back
//! script per slot.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use redis::{ConnectionLike as _, ErrorKind, ServerErrorKind};

use super::slot::key_slot;
use super::Cluster;
use crate::limiter::wire::{self, Args as _};
use crate::limiter::{Check, Decision, Outcome};
use crate::rule::Algorithm;

/// What one check of a job came to across the groups.
#[derive(Clone, Copy)]
pub(super) struct Taken {
    pub(super) outcome: Outcome,
    /// The script recorded it (its part was allowed).
    pub(super) committed: bool,
    pub(super) slot: u16,
}

/// A job's checks, once its reply has been taken apart from it.
pub(super) struct JobChecks<'a> {
    pub(super) checks: &'a [Check],
    pub(super) now_ms: Option<u64>,
}

impl JobChecks<'_> {
    /// Adds to `give_backs` what the job's groups recorded, and notes
    /// it given back.
    pub(super) fn give_back(&self, taken: &mut [Option<Taken>], give_backs: &mut Vec<GiveBack>) {
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
pub(super) struct GiveBack {
    slot: u16,
    key: String,
    algorithm: Algorithm,
    cost: u32,
    now_ms: Option<u64>,
}

/// What an allowed decision recorded, to give back: every check it
/// allowed (every part of an allowed request was allowed, so each allowed
/// check was recorded).
pub(super) fn recorded(
    checks: &[Check],
    now_ms: Option<u64>,
    decision: &Decision,
    into: &mut Vec<GiveBack>,
) {
    for (check, outcome) in checks.iter().zip(&decision.outcomes) {
        if outcome.allowed {
            into.push(GiveBack {
                slot: key_slot(check.key.as_bytes()),
                key: check.key.clone(),
                algorithm: check.algorithm,
                cost: check.cost,
                now_ms,
            });
        }
    }
}

impl Cluster {
    /// Gives back units, one script call per slot.
    pub(super) fn give_back(&mut self, give_backs: Vec<GiveBack>) {
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
        for ((&slot, gs), cmd) in by_slot.iter().zip(&cmds) {
            self.give_back_one(slot, cmd);
            // Given back (or maybe): a remembered denial of these keys may
            // no longer hold.
            if let Some(cache) = &self.shared.deny_cache {
                for g in gs {
                    cache.forget(&g.key);
                }
            }
        }
    }

    /// One slot's give-back call, retried when it cannot have run (after a
    /// failover the crate may not place it: see `placed`).
    fn give_back_one(&mut self, slot: u16, cmd: &redis::Cmd) {
        let mut reply = match self.connect() {
            Ok(conn) => {
                let first = conn.req_command(cmd);
                self.placed(slot, cmd, first)
                    .and_then(|v| v.extract_error())
            }
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
                    // (Loading on every master fails while the crate still
                    // names one a failover replaced: the promoted replica,
                    // which has no script cache, gets the script alone.)
                    if let Err(e) = self.load_scripts() {
                        self.note(&e);
                        if let Err(e) = self.load_give_back_on(slot) {
                            self.note(&e);
                            break;
                        }
                    }
                }
                _ if e.is_cluster_error()
                    || e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) => {}
                _ => break,
            }
            reply = match self.connect() {
                Ok(conn) => {
                    let again = conn.req_command(cmd);
                    self.placed(slot, cmd, again)
                        .and_then(|v| v.extract_error())
                }
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
