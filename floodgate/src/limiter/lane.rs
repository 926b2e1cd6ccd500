//! The per-worker lane ([`Dispatch::Worker`](super::Dispatch::Worker)):
//! each actix worker sends the decisions of one scheduler tick as one
//! script call on a connection of its own, and reads the reply itself when
//! Redis answers within [`WORKER_WAIT`]. No thread hand-off, no wake-up of
//! another thread, per request.
//!
//! A Redis that does not answer within that wait never holds the worker
//! any longer: the connection and its batch, reply still to come, go to the
//! lane's helper thread, which waits for the reply until the batch's
//! deadline and answers the jobs, then leaves the connection for the lane
//! to take back. While the lane has no connection that answers (it is
//! with the helper, it broke, or it was never opened), its batches go to
//! the helper unsent, and the helper decides them as a dispatcher thread
//! does, opening connections off the worker.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::mpsc::{channel, Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::Duration;

use tokio::sync::oneshot;

use super::clock::deadline_margin;
use super::conn::Conn;
use super::dispatch::single::{LaneLink, Single};
use super::dispatch::{process, Job, MAX_BATCH};
use super::tick::Gather;
use super::Limiter;

/// The longest a worker waits for Redis's reply before it hands the call
/// to its lane's helper thread (or `redis.timeout`, if shorter). A healthy
/// Redis on the same network answers a batch in well under a millisecond;
/// the slowest script call measured (limit 100000, thousands of entries
/// expiring at once) took 7.7 ms, and such a call only costs a hand-off.
/// It bounds what a stalled Redis adds to the requests of that worker that
/// never needed it (`/healthz`): at most this, once per breaker period.
pub(crate) const WORKER_WAIT: Duration = Duration::from_millis(5);

thread_local! {
    /// This thread's worker lane of each limiter used on it.
    static LANES: RefCell<HashMap<u64, Rc<Lane>>> = RefCell::new(HashMap::new());
}

/// One actix worker's way to Redis ([`Dispatch::Worker`]): the jobs of the
/// current scheduler tick, and a connection of its own.
pub(crate) struct Lane {
    /// The jobs of the current tick.
    pub(crate) gathered: Gather,
    /// Flushes begun so far: a job queued when this read `n` has been
    /// taken by the flush once it reads more.
    flushes: Cell<u64>,
    /// The callers awaiting the next flush (see
    /// [`Limiter::lane_answer`]), woken once it has answered what it could.
    waiting: RefCell<Vec<Waker>>,
    sender: RefCell<Single>,
}

/// What a lane gives its helper thread.
pub(crate) enum Handoff {
    /// Jobs the lane could not send without waiting (it has no connection
    /// that answers): the helper decides them as a dispatcher does.
    Jobs(Vec<Job>),
    /// A batch written on `conn` whose reply had not come within
    /// [`WORKER_WAIT`]; `expected` is the length its reply must have.
    Stalled {
        conn: Conn,
        batch: Vec<Job>,
        expected: usize,
    },
}

impl Lane {
    /// Sends what the tick gathered: ONE script call per [`MAX_BATCH`]
    /// jobs, the worker waiting at most [`WORKER_WAIT`] for each.
    pub(crate) fn flush(&self) {
        self.flushes.set(self.flushes.get() + 1);
        let mut jobs = self.gathered.take();
        if let Ok(mut sender) = self.sender.try_borrow_mut() {
            while !jobs.is_empty() {
                let rest = jobs.split_off(jobs.len().min(MAX_BATCH));
                process(&mut *sender, jobs);
                jobs = rest;
            }
        } else {
            // Not reachable: a flush runs to its end before another starts.
            self.gathered.put_back(jobs);
        }
        // Those answered are woken already; the others (their jobs went to
        // the helper thread) now wait with a timer.
        let waiting = std::mem::take(&mut *self.waiting.borrow_mut());
        for waker in waiting {
            waker.wake();
        }
    }

    /// The flushes begun so far: what [`Limiter::lane_answer`] is given
    /// for a job queued now.
    pub(crate) fn flushes(&self) -> u64 {
        self.flushes.get()
    }
}

/// The helper thread of one lane: decides what the lane hands it, and,
/// whenever nothing more waits, leaves its connection for the lane (when
/// the lane has none waiting already). Ends with the lane.
fn help(handoffs: &Receiver<Handoff>, mut single: Single, home: &Mutex<Option<Conn>>) {
    let mut next = handoffs.recv().ok();
    while let Some(handoff) = next {
        match handoff {
            Handoff::Jobs(jobs) => process(&mut single, jobs),
            Handoff::Stalled {
                conn,
                batch,
                expected,
            } => single.finish_stalled(conn, batch, expected),
        }
        next = match handoffs.try_recv() {
            Ok(handoff) => Some(handoff),
            Err(TryRecvError::Disconnected) => None,
            Err(TryRecvError::Empty) => {
                let mut home = match home.lock() {
                    Ok(home) => home,
                    Err(poisoned) => poisoned.into_inner(),
                };
                if home.is_none() {
                    *home = single.take_conn();
                }
                drop(home);
                handoffs.recv().ok()
            }
        };
    }
}

impl Limiter {
    /// Awaits the answer to a job queued on this thread's lane `lane` (its
    /// address) when [`Lane::flushes`] read `queued`, until the flush that
    /// takes it has run: `Some` when that flush answered it (as it does
    /// whenever Redis replies within [`WORKER_WAIT`]), `None` when the job
    /// went on to the helper thread (the caller then waits for it with a
    /// timer). No timer is needed before: the flush runs on this thread, in
    /// this scheduler tick, and while it runs no timer of this thread could
    /// fire anyway. Polled on another thread (not this lane's), it answers
    /// `None` at once. Holds no `Rc`, so the caller's future stays `Send`.
    pub(crate) fn lane_answer<'a, T>(
        &'a self,
        answer: &'a mut oneshot::Receiver<T>,
        lane: usize,
        queued: u64,
    ) -> impl Future<Output = Option<Result<T, oneshot::error::RecvError>>> + Send + 'a
    where
        T: Send,
    {
        std::future::poll_fn(move |cx| {
            if let Poll::Ready(result) = Pin::new(&mut *answer).poll(cx) {
                return Poll::Ready(Some(result));
            }
            let pending = LANES.with(|lanes| match lanes.borrow().get(&self.id) {
                Some(here) if Rc::as_ptr(here) as usize == lane && here.flushes() == queued => {
                    here.waiting.borrow_mut().push(cx.waker().clone());
                    true
                }
                _ => false,
            });
            if pending {
                Poll::Pending
            } else {
                Poll::Ready(None)
            }
        })
    }

    /// This thread's lane for this limiter (made on first use, with its
    /// helper thread).
    pub(crate) fn lane(&self) -> Rc<Lane> {
        LANES.with(|lanes| {
            let mut lanes = lanes.borrow_mut();
            let lane = lanes.entry(self.id).or_insert_with(|| {
                Rc::new(Lane {
                    gathered: Gather::default(),
                    flushes: Cell::new(0),
                    waiting: RefCell::new(Vec::new()),
                    sender: RefCell::new(self.lane_sender()),
                })
            });
            Rc::clone(lane)
        })
    }

    /// A lane's transport, and its helper thread. Should the thread not
    /// start, the lane waits for Redis on the worker, as a dispatcher does.
    fn lane_sender(&self) -> Single {
        let single = || {
            Single::new(
                self.manager.clone(),
                self.program,
                Arc::clone(&self.shared),
                deadline_margin(self.timeout),
            )
        };
        let (helper, handoffs) = channel();
        let home = Arc::new(Mutex::new(None));
        let started = {
            let (single, home) = (single(), Arc::clone(&home));
            std::thread::Builder::new()
                .name("floodgate-lane".to_owned())
                .spawn(move || help(&handoffs, single, &home))
        };
        match started {
            Ok(_) => single().for_lane(LaneLink {
                budget: WORKER_WAIT.min(self.timeout),
                helper,
                home,
            }),
            Err(e) => {
                log::warn!("cannot start a worker lane's helper thread ({e}); this worker waits on Redis itself");
                single()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// Awaiting a lane's flush holds nothing that is not `Send`: a caller
    /// may still move a decision's future between threads. (It compiles or
    /// it does not.)
    #[allow(dead_code)]
    fn a_decision_is_send(limiter: &super::Limiter) -> impl Send + '_ {
        limiter.decide(Vec::new())
    }
}
