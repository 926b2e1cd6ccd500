//! The dispatchers: what takes queued jobs to Redis and answers them.
//!
//! A job is one request's checks and the oneshot its caller awaits. A
//! dispatcher thread takes the first waiting job, drains whatever else is
//! already queued (never waiting to fill a batch) and sends the whole batch
//! as ONE script call; one reply per batch means a silent server costs one
//! read timeout, not one per job. `single.rs` sends to one server (also
//! for the per-worker lane), `cluster/` splits the batch by slot.

use std::sync::mpsc::Receiver;
use std::sync::Mutex;
use std::time::Instant;

use tokio::sync::oneshot;

use super::{Check, Decision, LimiterError};

#[cfg(feature = "cluster")]
pub(crate) mod cluster;
pub(crate) mod single;

/// Most jobs sent in one script call.
pub(crate) const MAX_BATCH: usize = 256;

pub(crate) struct Job {
    pub(crate) checks: Vec<Check>,
    /// Pinned clock in ms (tests); `None` = Redis `TIME`.
    pub(crate) now_ms: Option<u64>,
    /// When the caller stops waiting.
    pub(crate) deadline: Instant,
    /// Whether this job probes Redis for the open breaker.
    pub(crate) probe: bool,
    pub(crate) reply: oneshot::Sender<Result<Decision, LimiterError>>,
}

/// Blocks for the first job, then takes whatever else is already queued.
pub(crate) fn next_batch(rx: &Mutex<Receiver<Job>>) -> Option<Vec<Job>> {
    let rx = match rx.lock() {
        Ok(rx) => rx,
        Err(poisoned) => poisoned.into_inner(),
    };
    let first = rx.recv().ok()?;
    let mut batch = vec![first];
    while batch.len() < MAX_BATCH {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
    Some(batch)
}

/// Keeps the jobs whose caller is still waiting for the answer.
pub(crate) fn retain_waiting(batch: &mut Vec<Job>) {
    let now = Instant::now();
    batch.retain(|j| j.deadline > now && !j.reply.is_closed());
}
