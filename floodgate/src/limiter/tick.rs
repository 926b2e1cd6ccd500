//! The jobs of one scheduler tick, handed to the dispatcher threads as one
//! message (a cluster, or [`Dispatch::Threads`](super::Dispatch::Threads)).
//!
//! Each worker thread gathers the jobs its requests make in one tick, as its
//! lane does (`lane.rs`), and puts them on the dispatchers' queue together:
//! one send and one wake-up of a dispatcher per tick instead of per
//! request, and batches as large as the worker's tick, so a cluster's call
//! to each master carries more decisions. The worker never waits on Redis:
//! the dispatcher threads still do.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};

use super::dispatch::Job;
use super::shared::Shared;
use super::LimiterError;

thread_local! {
    /// This thread's tick of each limiter used on it.
    static TICKS: RefCell<HashMap<u64, Arc<Gather>>> = RefCell::new(HashMap::new());
}

/// The jobs gathered on one worker thread in the current scheduler tick
/// (for the dispatcher threads here, for Redis itself in a worker lane).
/// Shared with the task that flushes them, which a multi-threaded tokio
/// runtime may run on another of its threads.
#[derive(Default)]
pub(crate) struct Gather {
    jobs: Mutex<Vec<Job>>,
    /// A task that will take the jobs is spawned and has not run yet.
    scheduled: AtomicBool,
}

impl Gather {
    /// Adds `job`; true when it is the tick's first, whose caller then
    /// schedules the flush with [`after_tick`].
    pub(crate) fn add(&self, job: Job) -> bool {
        let mut jobs = self.jobs();
        jobs.push(job);
        !self.scheduled.swap(true, Ordering::AcqRel)
    }

    /// Takes the jobs gathered (a flush's first step): a job added from now
    /// on is the first of the next tick.
    pub(crate) fn take(&self) -> Vec<Job> {
        let mut jobs = self.jobs();
        self.scheduled.store(false, Ordering::Release);
        std::mem::take(&mut *jobs)
    }

    fn jobs(&self) -> MutexGuard<'_, Vec<Job>> {
        // A panic while the lock was held left a vector, still whole.
        self.jobs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Whether this thread runs an async runtime whose ticks can gather
/// decisions: an actix worker (an arbiter), or a thread of a tokio runtime
/// (axum's, tonic's, hyper's). Elsewhere a decision goes straight to the
/// dispatcher threads.
pub(crate) fn on_runtime() -> bool {
    on_actix() || tokio::runtime::Handle::try_current().is_ok()
}

/// Whether this thread is an actix worker (an arbiter), whose tasks are
/// local to it.
fn on_actix() -> bool {
    #[cfg(feature = "actix")]
    return actix_rt::Arbiter::try_current().is_some();
    #[cfg(not(feature = "actix"))]
    false
}

/// Runs `flush` once every task made ready in the current scheduler tick
/// of this thread has run: a spawned task that yields once. On an actix
/// worker it is a local task of that worker; on a tokio runtime, a task of
/// that runtime (which a multi-threaded one may run on another thread).
/// Must run where [`on_runtime`] holds.
pub(crate) fn after_tick(flush: impl FnOnce() + Send + 'static) {
    let task = async move {
        tokio::task::yield_now().await;
        flush();
    };
    #[cfg(feature = "actix")]
    if on_actix() {
        actix_rt::spawn(task);
        return;
    }
    tokio::spawn(task);
}

/// Queues `job` on this thread's tick of the limiter `id`; the first job of
/// a tick has the tick's jobs put on `queue` as one message once the tick
/// is over. Must run where [`on_runtime`] holds.
pub(crate) fn push(id: u64, job: Job, queue: &SyncSender<Vec<Job>>, shared: &Arc<Shared>) {
    let tick = TICKS.with(|ticks| Arc::clone(ticks.borrow_mut().entry(id).or_default()));
    if tick.add(job) {
        let (queue, shared) = (queue.clone(), Arc::clone(shared));
        after_tick(move || hand_over(&queue, &shared, tick.take()));
    }
}

/// Puts `jobs` on the dispatchers' queue as one message; when it is full
/// (or the dispatchers are gone), answers each job with that error.
pub(crate) fn hand_over(queue: &SyncSender<Vec<Job>>, shared: &Shared, jobs: Vec<Job>) {
    let (jobs, error) = match queue.try_send(jobs) {
        Ok(()) => return,
        Err(TrySendError::Full(jobs)) => {
            shared
                .errors
                .fetch_add(jobs.len() as u64, Ordering::Relaxed);
            (jobs, LimiterError::Overloaded)
        }
        Err(TrySendError::Disconnected(jobs)) => (jobs, LimiterError::Stopped),
    };
    for job in jobs {
        let _ = job.reply.send(Err(error.clone()));
    }
}
