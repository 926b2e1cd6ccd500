//! A batch split by hash slot, and the calls of the batch script made of
//! the slot groups: one per master (every group its master serves), or one
//! per group; and how a call's reply is sorted.

use std::collections::BTreeMap;
use std::time::Instant;

use redis::{ErrorKind, RedisResult, ServerErrorKind, Value};

use super::slot::{key_slot, probe_key};
use crate::limiter::clock::RedisClock;
use crate::limiter::dispatch::Job;
use crate::limiter::program;
use crate::limiter::wire;
use crate::limiter::LimiterError;

/// The checks of one job that fall in one slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Part {
    pub(super) job: usize,
    pub(super) checks: Vec<usize>,
}

/// One slot's share of a batch: one script call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Group {
    pub(super) slot: u16,
    pub(super) parts: Vec<Part>,
}

/// Splits a batch by slot, keeping the order of jobs and checks.
pub(super) fn group_by_slot(batch: &[Job]) -> Vec<Group> {
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
pub(super) enum Reply {
    /// Three values per check.
    Done(wire::Replied),
    /// Did not run; send it again where the cluster says.
    Redirected(redis::RedisError),
    /// Did not run: the library or the script is missing where it went, or
    /// `FCALL` is refused (see `program::missing`). Load them and send it again.
    Unloaded(redis::RedisError),
    /// A per-master call that ran nothing: one of its slots is not served
    /// there, or is being moved. Send its groups one by one.
    Elsewhere,
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
pub(super) fn classify(
    reply: RedisResult<Value>,
    expected: usize,
    clock: Option<&RedisClock>,
) -> Reply {
    match reply.and_then(|v| v.extract_error()) {
        Ok(value) => match redis::from_redis_value::<wire::Values>(value) {
            Ok(wire::Values(values)) if values == [-3] => Reply::Elsewhere,
            Ok(wire::Values(values)) => match wire::replied(values, expected) {
                Ok((reply, redis_us)) => {
                    if let Some(clock) = clock {
                        clock.sample(redis_us, Instant::now());
                    }
                    Reply::Done(reply)
                }
                Err(e) => Reply::Failed(e),
            },
            Err(e) => Reply::Failed(LimiterError::Other(format!("unexpected reply: {e}"))),
        },
        Err(e) if program::missing(&e).is_some() => Reply::Unloaded(e),
        Err(e) => match e.kind() {
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

/// Writes one slot group as a call of `target` (see `program.rs`) laid out as `lua/batch.lua` reads
/// it (each part is a job there). Returns the number of values the reply
/// must hold: three per check, and Redis's clock.
pub(super) fn write_group(
    cmd: &mut redis::Cmd,
    target: (&str, &str),
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
    wire::batch(cmd, target, jobs)
}

/// Writes the groups of one master as one call of `target`, the cluster's
/// batch function or script (flagged allow-cross-slot-keys): no declared keys (Redis
/// still wants those in one slot), and ARGV laid out as `lua/batch.lua`
/// reads a per-master call: `cluster`, the number of slots, per slot its
/// probe key, its number of keys and the keys, then the jobs, slot by slot
/// as [`write_group`] writes them. Returns the number of values the reply
/// must hold when it ran.
pub(super) fn write_master_call(
    cmd: &mut redis::Cmd,
    target: (&str, &str),
    batch: &[Job],
    groups: &[&Group],
    deadline: impl Fn(&Job) -> Option<i64>,
) -> usize {
    cmd.clear();
    cmd.arg(target.0)
        .arg(target.1)
        .arg(0)
        .arg("cluster")
        .arg(groups.len());
    let mut keys = 0;
    for group in groups {
        let n: usize = group.parts.iter().map(|p| p.checks.len()).sum();
        cmd.arg(probe_key(group.slot)).arg(n);
        for part in &group.parts {
            for &c in &part.checks {
                cmd.arg(batch[part.job].checks[c].key.as_str());
            }
        }
        keys += n;
    }
    let deadline = &deadline;
    let jobs = groups.iter().flat_map(|g| g.parts.iter()).map(|part| {
        let job = &batch[part.job];
        wire::JobArgs {
            now_ms: job.now_ms,
            deadline: deadline(job),
            checks: part.checks.iter().map(|&c| &job.checks[c]),
        }
    });
    wire::batch_jobs(cmd, jobs);
    3 * keys + 1
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use tokio::sync::oneshot;

    use std::time::Duration;

    use super::*;
    use crate::limiter::Check;
    use crate::rule::Algorithm;

    fn job(keys: &[&str]) -> Job {
        let (reply, _) = oneshot::channel();
        Job {
            asked: Instant::now(),
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
        assert_eq!(
            write_group(&mut cmd, ("FCALL", "NAME"), &batch, &g.parts, |_| None),
            10
        );
        let packed = String::from_utf8_lossy(&cmd.get_packed_command()).into_owned();
        let args: Vec<&str> = packed
            .split("\r\n")
            .filter(|l| !l.starts_with(['*', '$']))
            .collect();
        assert_eq!(
            args,
            [
                "FCALL",
                "NAME",
                "3",
                "p:a:ip:{1.2.3.4}",
                "p:b:ip:{1.2.3.4}",
                "p:a:ip:{1.2.3.4}",
                // The one spec the three checks share, written once.
                "1",
                "1",
                "5",
                "10000",
                "1",
                "1",
                "2",
                "|1,1",
                "|1",
                ""
            ]
        );
    }
}
