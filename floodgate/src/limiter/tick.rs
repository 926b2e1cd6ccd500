//! The jobs of one scheduler tick, handed to the dispatcher threads as one
//! message (a cluster, or [`Dispatch::Threads`](super::Dispatch::Threads)).
//!
//! Each actix worker gathers the jobs its requests make in one tick, as its
//! lane does (`lane.rs`), and puts them on the dispatchers' queue together:
//! one send and one wake-up of a dispatcher per tick instead of per
//! request, and batches as large as the worker's tick, so a cluster's call
//! to each master carries more decisions. The worker never waits on Redis:
//! the dispatcher threads still do.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::Arc;

use super::dispatch::Job;
use super::shared::Shared;
use super::LimiterError;

thread_local! {
    /// This thread's tick of each limiter used on it.
    static TICKS: RefCell<HashMap<u64, Rc<Gather>>> = RefCell::new(HashMap::new());
}

/// The jobs gathered on one worker in the current scheduler tick (for the
/// dispatcher threads here, for Redis itself in a worker lane).
#[derive(Default)]
pub(crate) struct Gather {
    jobs: RefCell<Vec<Job>>,
    /// A task that will take the jobs is spawned and has not run yet.
    scheduled: Cell<bool>,
}

impl Gather {
    /// Adds `job`; true when it is the tick's first, whose caller then
    /// schedules the flush with [`after_tick`].
    pub(crate) fn add(&self, job: Job) -> bool {
        self.jobs.borrow_mut().push(job);
        !self.scheduled.replace(true)
    }

    /// Takes the jobs gathered (a flush's first step): a job added from now
    /// on is the first of the next tick.
    pub(crate) fn take(&self) -> Vec<Job> {
        self.scheduled.set(false);
        std::mem::take(&mut *self.jobs.borrow_mut())
    }

    /// Puts back jobs that were taken and not flushed.
    pub(crate) fn put_back(&self, mut jobs: Vec<Job>) {
        self.jobs.borrow_mut().append(&mut jobs);
    }
}

/// Runs `flush` on this worker once every request made ready in the
/// current scheduler tick has run (a spawned task that yields once). Must
/// run on an actix worker (an arbiter).
pub(crate) fn after_tick(flush: impl FnOnce() + 'static) {
    actix_rt::spawn(async move {
        tokio::task::yield_now().await;
        flush();
    });
}

/// Queues `job` on this worker's tick of the limiter `id`; the first job of
/// a tick has the tick's jobs put on `queue` as one message once the tick
/// is over. Must run on an actix worker (an arbiter).
pub(crate) fn push(id: u64, job: Job, queue: &SyncSender<Vec<Job>>, shared: &Arc<Shared>) {
    let tick = TICKS.with(|ticks| Rc::clone(ticks.borrow_mut().entry(id).or_default()));
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
