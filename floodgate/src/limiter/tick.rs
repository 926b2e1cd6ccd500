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

use super::dispatch::{Job, MAX_BATCH};
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

    /// How many jobs are gathered.
    pub(crate) fn len(&self) -> usize {
        self.jobs().len()
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

/// How many more scheduler ticks a batch waits for, at most, while it grows
/// (a busy thread; see [`waits_for_more`]): every call to Redis costs a
/// fixed share (the round trip, the call's start in Redis) that a larger
/// batch divides among more requests. It stops waiting at the second tick
/// in a row that added nothing (so a lone request waits for one).
const MORE_TICKS: usize = 6;

/// Ticks in a row that add nothing to a batch after which it stops waiting.
const IDLE_TICKS: usize = 2;

/// Whether this thread runs a current-thread tokio runtime (not an actix
/// worker): a thread that serves its connections alone, as the Envoy
/// service's threads do. There a batch that grew in one tick keeps growing
/// in the next few (an HTTP/2 connection's next calls arrive as its last
/// answers leave), and waiting for them measured 8% more calls a second
/// with a fifth less of Redis's time per call (and waiting on through one
/// tick that added nothing, 1 to 2% more again). On actix's workers (HTTP/1,
/// a task per connection) and on a multi-threaded runtime it measured no
/// better, or worse: the workers idled more than Redis saved.
fn waits_for_more() -> bool {
    !on_actix()
        && tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread)
}

/// Runs `flush` once every task made ready in the current scheduler tick
/// of this thread has run (a spawned task that yields), and, where
/// [`waits_for_more`], while the batch grows (`pending` is how many
/// requests it holds), after up to [`MORE_TICKS`] more. On an actix worker it is a local task of
/// that worker; on a tokio runtime, a task of that runtime (which a
/// multi-threaded one may run on another thread). Must run where
/// [`on_runtime`] holds.
pub(crate) fn after_tick(
    pending: impl Fn() -> usize + Send + 'static,
    flush: impl FnOnce() + Send + 'static,
) {
    let more = if waits_for_more() { MORE_TICKS } else { 0 };
    // (The batch is counted only where it may wait: an actix worker's
    // flush takes no lock for it.)
    let mut seen = if more > 0 { pending() } else { 0 };
    let task = async move {
        tokio::task::yield_now().await;
        let mut idle = 0;
        for _ in 0..more {
            let now = pending();
            if now >= MAX_BATCH {
                break;
            }
            idle = if now == seen { idle + 1 } else { 0 };
            if idle == IDLE_TICKS {
                break;
            }
            seen = now;
            tokio::task::yield_now().await;
        }
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
        let (queue, shared, gathered) = (queue.clone(), Arc::clone(shared), Arc::clone(&tick));
        after_tick(
            move || gathered.len(),
            move || hand_over(&queue, &shared, tick.take()),
        );
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
