//! The per-worker lane ([`Dispatch::Worker`](super::Dispatch::Worker)):
//! each worker thread (actix's, or a tokio runtime's) sends the decisions
//! of one scheduler tick as one script call on a connection of its own,
//! and reads the reply itself when Redis answers within [`WORKER_WAIT`]. No thread hand-off, no wake-up of
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

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};
use std::time::Duration;

use tokio::sync::oneshot;

use super::clock::deadline_margin;
use super::conn::Conn;
use super::conn::{no_longer_named, reply, wait_briefly, wait_until, write, Brief, SendError};
use super::dispatch::single::{results, Single};
use super::dispatch::{conclude, Transport};
use super::dispatch::{process, Job, MAX_BATCH};
use super::shared::Shared;
use super::tick::Gather;
use super::Limiter;
use super::{wire, Decision, LimiterError};
use std::sync::mpsc::Sender;
use std::time::Instant;

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
    static LANES: RefCell<HashMap<u64, Arc<Lane>>> = RefCell::new(HashMap::new());
}

/// One worker thread's way to Redis ([`Dispatch::Worker`]): the jobs of the
/// current scheduler tick, and a connection of its own. A worker thread is
/// an actix worker, or a thread of a tokio runtime; on a multi-threaded
/// one, a tick's flush (or a caller awaiting it) may run on another of the
/// runtime's threads, hence the locks, which are otherwise uncontended.
pub(crate) struct Lane {
    /// The jobs of the current tick.
    pub(crate) gathered: Gather,
    /// Flushes begun so far: a job queued when this read `n` has been
    /// taken by the flush once it reads more. Read and advanced with
    /// `waiting` held.
    flushes: AtomicU64,
    /// The callers awaiting the next flush (see
    /// [`Limiter::lane_answer`]), woken once it has answered what it could.
    waiting: Mutex<Vec<Waker>>,
    sender: Mutex<LaneSender>,
}

/// What makes a [`Single`] a worker lane's transport, which never keeps
/// its worker waiting for a Redis that does not answer: the worker waits
/// `budget` at most for Redis's first reply, and what would wait longer
/// goes to the lane's helper thread (see `lane.rs`).
struct LaneLink {
    /// How long the worker waits for Redis's first reply.
    budget: Duration,
    /// The lane's helper thread.
    helper: Sender<Handoff>,
    /// Where the helper leaves a connection for the lane.
    home: Arc<Mutex<Option<Conn>>>,
}

/// Written just before a worker lane's script call: the reply the worker
/// waits for within its budget, and the one the connection skips when the
/// worker stops waiting (so the script's reply is the next one read, on
/// the helper thread). Redis answers it with the script's reply, in one
/// write: its time includes the script's. It is a script (`EVAL "return
/// 0" 0`, which writes nothing), not a PING, so that whatever holds the
/// script call holds it too: `CLIENT PAUSE WRITE` (what `FAILOVER` does)
/// answers a PING at once and keeps every script waiting.
const MARKER: &[u8] = b"*3\r\n$4\r\nEVAL\r\n$8\r\nreturn 0\r\n$1\r\n0\r\n";

/// A worker lane's transport: a [`Single`] whose calls never keep the
/// worker waiting for a Redis that does not answer ([`LaneLink`]); without
/// a helper thread (it could not start), a plain [`Single`].
pub(crate) struct LaneSender {
    single: Single,
    link: Option<LaneLink>,
}

impl Transport for LaneSender {
    fn shared(&self) -> &Shared {
        self.single.shared()
    }

    fn reset(&mut self) {
        self.single.reset();
    }

    fn holds(&self, job: &Job) -> bool {
        self.single.holds(job)
    }

    fn send(
        &mut self,
        batch: &mut Vec<Job>,
    ) -> Result<Vec<Result<Decision, LimiterError>>, LimiterError> {
        let Some(link) = &self.link else {
            return self.single.send(batch);
        };
        match self.single.call_lane(link, batch) {
            Ok(Some(reply)) => Ok(results(batch, &reply)),
            // The helper thread has the batch now.
            Ok(None) => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }
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
        self.flushes.fetch_add(1, Ordering::AcqRel);
        let mut jobs = self.gathered.take();
        {
            // Another flush of this lane may still run on another thread
            // (a multi-threaded tokio runtime): this one waits for it, as
            // it would wait for the connection anyway.
            let mut sender = lock(&self.sender);
            while !jobs.is_empty() {
                let rest = jobs.split_off(jobs.len().min(MAX_BATCH));
                process(&mut *sender, jobs);
                jobs = rest;
            }
        }
        // Those answered are woken already; the others (their jobs went to
        // the helper thread) now wait with a timer.
        let waiting = std::mem::take(&mut *lock(&self.waiting));
        for waker in waiting {
            waker.wake();
        }
    }

    /// The flushes begun so far: what [`Limiter::lane_answer`] is given
    /// for a job queued now.
    pub(crate) fn flushes(&self) -> u64 {
        self.flushes.load(Ordering::Acquire)
    }
}

/// A lane's lock; a panic while it was held left its value whole.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
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
    /// Awaits the answer to a job queued on `lane` when [`Lane::flushes`]
    /// read `queued`, until the flush that takes it has run: `Some` when
    /// that flush answered it (as it does whenever Redis replies within
    /// [`WORKER_WAIT`]), `None` when the job went on to the helper thread
    /// (the caller then waits for it with a timer). No timer is needed
    /// before: the flush runs in this scheduler tick, and takes no longer
    /// than [`WORKER_WAIT`] per call.
    pub(crate) fn lane_answer<'a, T>(
        answer: &'a mut oneshot::Receiver<T>,
        lane: &'a Lane,
        queued: u64,
    ) -> impl Future<Output = Option<Result<T, oneshot::error::RecvError>>> + Send + 'a
    where
        T: Send,
    {
        std::future::poll_fn(move |cx| {
            if let Poll::Ready(result) = Pin::new(&mut *answer).poll(cx) {
                return Poll::Ready(Some(result));
            }
            // A flush advances the count before it takes the waiting list:
            // read under that list's lock, a count still at `queued` means
            // the flush that takes this job will wake it.
            let mut waiting = lock(&lane.waiting);
            if lane.flushes() == queued {
                waiting.push(cx.waker().clone());
                Poll::Pending
            } else {
                Poll::Ready(None)
            }
        })
    }

    /// This thread's lane for this limiter (made on first use, with its
    /// helper thread).
    pub(crate) fn lane(&self) -> Arc<Lane> {
        LANES.with(|lanes| {
            let mut lanes = lanes.borrow_mut();
            let lane = lanes.entry(self.id).or_insert_with(|| {
                Arc::new(Lane {
                    gathered: Gather::default(),
                    flushes: AtomicU64::new(0),
                    waiting: Mutex::new(Vec::new()),
                    sender: Mutex::new(self.lane_sender()),
                })
            });
            Arc::clone(lane)
        })
    }

    /// A lane's transport, and its helper thread. Should the thread not
    /// start, the lane waits for Redis on the worker, as a dispatcher does.
    fn lane_sender(&self) -> LaneSender {
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
            Ok(_) => LaneSender {
                single: single(),
                link: Some(LaneLink {
                    budget: WORKER_WAIT.min(self.timeout),
                    helper,
                    home,
                }),
            },
            Err(e) => {
                log::warn!("cannot start a worker lane's helper thread ({e}); this worker waits on Redis itself");
                LaneSender {
                    single: single(),
                    link: None,
                }
            }
        }
    }
}

/// The lane's side of [`Single`]: its calls never keep the worker waiting.
impl Single {
    /// A worker lane's call: never waits more than the budget on the
    /// worker. Without a connection that answered a moment ago or answers a
    /// `TIME` within the budget, the batch goes to the helper thread
    /// unsent; a batch whose first reply does not come within the budget
    /// goes there with its connection, and the helper waits for the reply
    /// (until the batch's deadline) and answers the jobs. `Ok(None)`: the
    /// helper has the batch (it is left empty).
    fn call_lane(
        &mut self,
        link: &LaneLink,
        batch: &mut Vec<Job>,
    ) -> Result<Option<wire::Replied>, LimiterError> {
        let budget = link.budget;
        if !self.ready_within(link, budget) {
            hand_over(link, Handoff::Jobs(std::mem::take(batch)));
            return Ok(None);
        }
        let expected = self.build(batch);
        let timeout = self.manager.timeout();
        let Some(conn) = self.conn.as_mut() else {
            return Err(LimiterError::Stopped);
        };
        self.packed.clear();
        self.packed.extend_from_slice(MARKER);
        self.cmd.write_packed_command(&mut self.packed);
        if let Err(e) = write(conn, &self.packed) {
            // Redis never received the call: the helper sends it on a new
            // connection.
            log::info!(
                "redis connection broken before the call was sent ({}); the lane's helper sends it again",
                e.error()
            );
            self.conn = None;
            hand_over(link, Handoff::Jobs(std::mem::take(batch)));
            return Ok(None);
        }
        match wait_briefly(conn, budget, timeout) {
            Ok(Brief::Answered) => {}
            Ok(Brief::Waiting) => {
                if let Some(conn) = self.conn.take() {
                    let batch = std::mem::take(batch);
                    hand_over(
                        link,
                        Handoff::Stalled {
                            conn,
                            batch,
                            expected,
                        },
                    );
                }
                return Ok(None);
            }
            // Written whole: it may have run, and is not sent again.
            Err(e) => {
                self.conn = None;
                return Err(LimiterError::from(e.error().clone()));
            }
        }
        let first = reply(conn);
        self.finish(first, expected, batch)
            .map(Some)
            .map_err(|(SendError::Unsent(e) | SendError::Failed(e))| e)
    }

    /// Whether the lane holds a connection Redis answers on, checked
    /// within `budget` (the lane's own, or one the helper left for it):
    /// as [`Single::connect`] does, without opening one and without waiting
    /// longer. A connection whose `TIME` did not come in time is dropped
    /// (nothing that counts was sent on it).
    fn ready_within(&mut self, link: &LaneLink, budget: Duration) -> bool {
        if self.conn.is_none() {
            self.conn = link.home.try_lock().ok().and_then(|mut home| home.take());
        }
        let timeout = self.manager.timeout();
        let Some(conn) = self.conn.as_mut() else {
            return false;
        };
        if !self.manager.still_named(conn) {
            log::info!(
                "{}: the lane's helper opens a connection to the master the Sentinels name now",
                no_longer_named(conn)
            );
            self.conn = None;
            return false;
        }
        if conn.recently_answered() {
            return true;
        }
        let checked = conn
            .set_read_timeout(Some(budget))
            .and_then(|()| conn.time(&self.shared.clock))
            .and_then(|()| conn.set_read_timeout(Some(timeout)));
        match checked {
            Ok(()) => true,
            Err(e) => {
                log::debug!("redis connection slow or broken ({e}); the lane's helper takes over");
                self.conn = None;
                false
            }
        }
    }

    /// The helper's side of a stalled call: `batch` was written on `conn`
    /// and its reply had not come within the worker's budget. Waits for it
    /// until the batch's deadline and answers the jobs, as the dispatch
    /// loop does. Blocking.
    fn finish_stalled(&mut self, mut conn: Conn, batch: Vec<Job>, expected: usize) {
        let deadline = batch
            .iter()
            .map(|j| j.deadline)
            .max()
            .unwrap_or_else(Instant::now);
        let first = wait_until(&mut conn, deadline).and_then(|()| reply(&mut conn));
        if let Err(e) = conn.set_read_timeout(Some(self.manager.timeout())) {
            log::debug!("redis connection: cannot set its read timeout ({e})");
            conn.spoil();
        }
        self.conn = Some(conn);
        let results = self
            .finish(first, expected, &batch)
            .map(|reply| results(&batch, &reply))
            .map_err(|(SendError::Unsent(e) | SendError::Failed(e))| e);
        conclude(self, batch, results);
    }
}

/// Gives the helper thread `handoff`. Without a helper (it is gone, the
/// limiter with it), the jobs are answered [`LimiterError::Stopped`].
fn hand_over(link: &LaneLink, handoff: Handoff) {
    if let Err(std::sync::mpsc::SendError(handoff)) = link.helper.send(handoff) {
        let batch = match handoff {
            Handoff::Jobs(batch) | Handoff::Stalled { batch, .. } => batch,
        };
        for job in batch {
            let _ = job.reply.send(Err(LimiterError::Stopped));
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
