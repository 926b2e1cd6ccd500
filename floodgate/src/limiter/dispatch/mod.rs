//! The dispatchers: what takes queued jobs to Redis and answers them.
//!
//! A job is one request's checks and the oneshot its caller awaits; a
//! worker thread queues the jobs of one scheduler tick together
//! (`tick.rs`). A dispatcher thread takes the first waiting message, drains
//! whatever else is already queued (never waiting to fill a batch) and
//! sends the whole batch as ONE script call; one reply per batch means a silent server costs one
//! read timeout, not one per job. `single.rs` sends to one server (also
//! for the per-worker lane), `cluster/` splits the batch by slot.

use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub(crate) use super::shared::Job;
use super::shared::Shared;
use super::{Check, Decision, LimiterError};

#[cfg(feature = "cluster")]
pub(crate) mod cluster;
pub(crate) mod single;

/// Most jobs sent in one script call.
pub(crate) const MAX_BATCH: usize = 256;

/// How batches reach Redis: one server ([`single::Single`]) or the masters
/// of a cluster (`cluster::Cluster`). What every transport shares, the
/// callers still waiting, the breaker's hold, the answers and their
/// counting, is [`process`]'s.
pub(crate) trait Transport {
    /// The counters, the denial cache and the breakers.
    fn shared(&self) -> &Shared;

    /// Whether a call for `job` is held back now: the breaker of a server
    /// its keys are on is open and its period has not run out.
    fn holds(&self, job: &Job) -> bool;

    /// Whether `job` would probe a breaker whose period is over. Such jobs
    /// go last, in a call of their own, so that a server that still stalls
    /// holds nobody else.
    fn probes(&self, _job: &Job) -> bool {
        false
    }

    /// Sends `batch` (each caller still waiting when it was handed over;
    /// the transport may drop the jobs of callers that gave up since) and
    /// reads the decision of every job left, in order. `Err`: the whole
    /// call failed, and every job gets that error.
    fn send(
        &mut self,
        batch: &mut Vec<Job>,
    ) -> Result<Vec<Result<Decision, LimiterError>>, LimiterError>;

    /// Called once a batch's answers are out, with the allowed decisions
    /// whose caller had given up by the time they came (its answer was the
    /// error policy), each as `(checks, pinned clock, decision)`: what they
    /// took may be given back. One server keeps them: a job reaches Redis
    /// before its deadline less the margin for the reply's way back, or is
    /// skipped as late.
    fn answered(&mut self, _undelivered: Vec<(Vec<Check>, Option<u64>, Decision)>) {}

    /// Drops every connection, after a panic while they were in use (their
    /// state cannot be trusted): the next call opens new ones.
    fn reset(&mut self);
}

/// Runs a dispatcher thread: takes batches off `rx` until the limiter is
/// dropped, and decides each in calls of at most [`MAX_BATCH`] jobs.
///
/// A panic while a batch is decided (a bug here or in the Redis client)
/// fails that batch alone: its callers' answers are the error policy, the
/// error is counted and logged, and the thread goes on with new
/// connections, so that the limiter never loses a dispatcher.
pub(crate) fn run<T: Transport>(rx: &Mutex<Receiver<Vec<Job>>>, mut transport: T) {
    while let Some(mut batch) = next_batch(rx) {
        let decided = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            while batch.len() > MAX_BATCH {
                let rest = batch.split_off(MAX_BATCH);
                process(&mut transport, batch);
                batch = rest;
            }
            process(&mut transport, batch);
        }));
        if decided.is_err() {
            transport.shared().errors.fetch_add(1, Ordering::Relaxed);
            log::error!(
                "a dispatcher thread panicked while deciding a batch: its requests got the error policy; it goes on with new connections"
            );
            transport.reset();
        }
    }
}

/// Starts a dispatcher thread named `name` on `rx`.
pub(crate) fn spawn<T: Transport + Send + 'static>(
    name: String,
    rx: &Arc<Mutex<Receiver<Vec<Job>>>>,
    transport: T,
) -> Result<(), LimiterError> {
    let rx = Arc::clone(rx);
    std::thread::Builder::new()
        .name(name)
        .spawn(move || run(&rx, transport))
        .map(|_| ())
        .map_err(|e| LimiterError::Other(format!("cannot start a dispatcher: {e}")))
}

/// Decides one batch and answers every job. Blocking.
///
/// Jobs whose caller has given up are dropped first. Jobs a breaker holds
/// (its server failed a moment ago) get [`LimiterError::BreakerOpen`] at
/// once instead of waiting behind it; a probe is sent. Jobs that would
/// probe go last, in a call of their own.
pub(crate) fn process<T: Transport>(transport: &mut T, mut batch: Vec<Job>) {
    retain_waiting(&mut batch);
    if batch.iter().any(|j| !j.probe && transport.holds(j)) {
        for job in batch.extract_if(.., |j| !j.probe && transport.holds(j)) {
            let _ = job.reply.send(Err(LimiterError::BreakerOpen));
        }
    }
    let mut probing = if batch.iter().any(|j| transport.probes(j)) {
        batch.extract_if(.., |j| transport.probes(j)).collect()
    } else {
        Vec::new()
    };
    decide(transport, batch);
    retain_waiting(&mut probing);
    decide(transport, probing);
}

/// Sends one batch and answers its jobs, counting what Redis could not
/// decide (the error count) and what it skipped as late.
fn decide<T: Transport>(transport: &mut T, mut batch: Vec<Job>) {
    if batch.is_empty() {
        return;
    }
    let results = transport.send(&mut batch);
    conclude(transport, batch, results);
}

/// Answers the jobs of a batch that was sent with what the call came to
/// (`results`: one per job, in order, or the error of the whole call),
/// counting what Redis could not decide and what it skipped as late. Also
/// for a worker lane's call that its helper thread waited out (`lane.rs`).
pub(crate) fn conclude<T: Transport>(
    transport: &mut T,
    batch: Vec<Job>,
    results: Result<Vec<Result<Decision, LimiterError>>, LimiterError>,
) {
    let results = match results {
        Ok(results) => results,
        Err(e) => {
            transport.shared().errors.fetch_add(1, Ordering::Relaxed);
            crate::logging::repeated!(
                &crate::logging::REDIS_FAILED,
                "redis error, {} decisions affected: {}",
                batch.len(),
                crate::logging::Escaped(&e.to_string())
            );
            for job in batch {
                let _ = job.reply.send(Err(e.clone()));
            }
            return;
        }
    };
    let (mut failed, mut late) = (0, 0);
    let mut undelivered = Vec::new();
    for (job, result) in batch.into_iter().zip(results) {
        match &result {
            Ok(_) => {}
            // Redis answered: it skipped the call, which came after its
            // caller's deadline.
            Err(LimiterError::Late) => late += 1,
            // No call was made.
            Err(LimiterError::BreakerOpen) => {}
            Err(_) => failed += 1,
        }
        let Job {
            checks,
            now_ms,
            asked,
            reply,
            ..
        } = job;
        if let Ok(decision) = &result {
            let shared = transport.shared();
            for (check, outcome) in checks.iter().zip(&decision.outcomes) {
                if outcome.banned {
                    // For the local fallback, should Redis go away.
                    shared
                        .bans
                        .learn(&check.key, outcome.wait, asked, Instant::now());
                }
                if !outcome.allowed && check.enforce {
                    shared.top.add(&check.key);
                }
                if let (true, Some(penalties)) = (outcome.ban_started, &shared.penalties) {
                    let _ = penalties.send((check.key.clone(), outcome.wait.as_millis() as u64));
                }
            }
        }
        if let Err(Ok(decision)) = reply.send(result) {
            if decision.allowed {
                undelivered.push((checks, now_ms, decision));
            }
        }
    }
    let shared = transport.shared();
    shared.errors.fetch_add(failed, Ordering::Relaxed);
    shared.late.fetch_add(late, Ordering::Relaxed);
    transport.answered(undelivered);
}

/// Blocks for the first message (a job, or one worker's tick of jobs), then
/// takes whatever else is already queued, up to [`MAX_BATCH`] jobs or just
/// over.
pub(crate) fn next_batch(rx: &Mutex<Receiver<Vec<Job>>>) -> Option<Vec<Job>> {
    let rx = match rx.lock() {
        Ok(rx) => rx,
        Err(poisoned) => poisoned.into_inner(),
    };
    let mut batch = rx.recv().ok()?;
    while batch.len() < MAX_BATCH {
        match rx.try_recv() {
            Ok(mut jobs) => batch.append(&mut jobs),
            Err(_) => break,
        }
    }
    Some(batch)
}

/// Keeps the jobs whose caller is still waiting for the answer.
pub(crate) fn retain_waiting(batch: &mut Vec<Job>) {
    let now = Instant::now();
    batch.retain(|j| j.waiting(now));
}
