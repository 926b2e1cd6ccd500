//! The per-worker lane ([`Dispatch::Worker`](super::Dispatch::Worker)):
//! each actix worker sends the decisions of one scheduler tick as one
//! script call on a connection of its own, blocking for that round trip.
//! No thread hand-off, no wake-up of another thread, per request.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use super::clock::deadline_margin;
use super::dispatch::single::Single;
use super::dispatch::{process, Job, MAX_BATCH};
use super::Limiter;

thread_local! {
    /// This thread's worker lane of each limiter used on it.
    static LANES: RefCell<HashMap<u64, Rc<Lane>>> = RefCell::new(HashMap::new());
}

/// One actix worker's way to Redis ([`Dispatch::Worker`]): the jobs of the
/// current scheduler tick, and a connection of its own.
pub(crate) struct Lane {
    pub(crate) queue: RefCell<Vec<Job>>,
    /// A task that will send the queue is spawned and has not run yet.
    pub(crate) scheduled: Cell<bool>,
    sender: RefCell<Single>,
}

impl Lane {
    /// Sends what the tick gathered: ONE script call per [`MAX_BATCH`]
    /// jobs, blocking this worker for the round trip.
    pub(crate) fn flush(&self) {
        self.scheduled.set(false);
        let mut jobs = std::mem::take(&mut *self.queue.borrow_mut());
        let Ok(mut sender) = self.sender.try_borrow_mut() else {
            // Not reachable: a flush runs to its end before another starts.
            self.queue.borrow_mut().append(&mut jobs);
            return;
        };
        while !jobs.is_empty() {
            let rest = jobs.split_off(jobs.len().min(MAX_BATCH));
            process(&mut *sender, jobs);
            jobs = rest;
        }
    }
}

impl Limiter {
    /// This thread's lane for this limiter (made on first use).
    pub(crate) fn lane(&self) -> Rc<Lane> {
        LANES.with(|lanes| {
            let mut lanes = lanes.borrow_mut();
            let lane = lanes.entry(self.id).or_insert_with(|| {
                Rc::new(Lane {
                    queue: RefCell::new(Vec::new()),
                    scheduled: Cell::new(false),
                    sender: RefCell::new(Single::new(
                        self.manager.clone(),
                        Arc::clone(&self.script),
                        Arc::clone(&self.shared),
                        deadline_margin(self.timeout),
                    )),
                })
            });
            Rc::clone(lane)
        })
    }
}
