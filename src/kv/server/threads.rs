//! The server's own threads: the workers, which serve the requests that
//! copy or register large values, and the housekeeping thread, which
//! ends leases held past their time and lets go of large memory off the
//! completion thread.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, TryRecvError};

use crate::runtime::{self, Connection};

use super::answer::{Answer, REPLIES_PER_DOORBELL};
use super::{Chore, ClientState, Job, Shared};

/// How long an answer may wait for others to share its doorbell: a
/// client whose requests are answered late sends its next ones late (its
/// window of requests in flight moves with the answers).
const HOLD_AT_MOST: Duration = Duration::from_micros(100);

/// A worker: serves its queue's jobs in order. The answers to a run of one
/// client's jobs that were queued together go with one doorbell, sent
/// when the queue holds nothing more of that client's, a doorbell's worth
/// is held, or the next job (if it takes as long as the last) would keep
/// the first answer past [`HOLD_AT_MOST`]. The client's `queued` count
/// keeps them until then, so its later requests still follow them here
/// and are answered after them.
pub(super) fn worker(shared: Arc<Shared>, jobs: Receiver<Job>, spin: Duration) {
    let mut held = Held::default();
    loop {
        let job = match jobs.try_recv() {
            Ok(job) => job,
            Err(TryRecvError::Disconnected) => return held.send(&shared),
            Err(TryRecvError::Empty) => {
                held.send(&shared);
                match next_job(&jobs, spin) {
                    Some(job) => job,
                    None => return, // The server stops.
                }
            }
        };
        if !held.is_for(&job.client) {
            held.send(&shared);
        }
        // A defect met serving one request ends that client, not the
        // worker its neighbours share.
        let start = Instant::now();
        let served = std::panic::catch_unwind(AssertUnwindSafe(|| {
            shared.serve(&job.conn, &job.client, &job.msg)
        }));
        let took = start.elapsed();
        let Job { conn, client, msg } = job;
        shared.recycle(msg);
        match served {
            Ok(answer) => {
                held.add(conn, client, answer);
                if held.answers.len() >= REPLIES_PER_DOORBELL || held.age() + took >= HOLD_AT_MOST {
                    held.send(&shared);
                }
            }
            Err(_) => {
                held.send(&shared);
                client.queued.fetch_sub(1, Ordering::AcqRel);
                shared.serving_panicked(&conn, &client);
            }
        }
    }
}

/// The next job, polled for under the runtime's spin policy and budget
/// (`SNOWRDMA_SPIN_US`) before the worker sleeps on its queue, as the
/// runtime's waiters poll for completions: a wakeup costs a system call
/// each way. `None`: the queue closed (the server stops).
fn next_job(jobs: &Receiver<Job>, spin: Duration) -> Option<Job> {
    let polled = runtime::spin::poll_for(spin, || match jobs.try_recv() {
        Ok(job) => Some(Some(job)),
        Err(TryRecvError::Disconnected) => Some(None),
        Err(TryRecvError::Empty) => None,
    });
    polled.unwrap_or_else(|| jobs.recv().ok())
}

/// Answers of one client's jobs served but not yet sent, and how many jobs
/// they answer (a RELEASE takes no answer).
#[derive(Default)]
struct Held {
    /// Whose they are, and when the first was ready.
    owner: Option<(Connection, Arc<ClientState>, Instant)>,
    answers: Vec<Answer>,
    jobs: usize,
}

impl Held {
    fn is_for(&self, client: &Arc<ClientState>) -> bool {
        self.owner
            .as_ref()
            .is_none_or(|(_, owner, _)| Arc::ptr_eq(owner, client))
    }

    fn add(&mut self, conn: Connection, client: Arc<ClientState>, answer: Option<Answer>) {
        if self.owner.is_none() {
            self.owner = Some((conn, client, Instant::now()));
            // Room for a doorbell's worth from the first client on.
            self.answers.reserve(REPLIES_PER_DOORBELL);
        }
        self.answers.extend(answer);
        self.jobs += 1;
    }

    /// How long the first answer held has waited.
    fn age(&self) -> Duration {
        self.owner
            .as_ref()
            .map_or(Duration::ZERO, |(_, _, since)| since.elapsed())
    }

    /// Sends what is held, with one doorbell, and lets the client's next
    /// requests be answered wherever they arrive.
    fn send(&mut self, shared: &Shared) {
        let Some((conn, client, _)) = self.owner.take() else {
            return;
        };
        let sent = std::panic::catch_unwind(AssertUnwindSafe(|| {
            shared.reply_all(&conn, &client, &self.answers)
        }));
        self.answers.clear();
        client.queued.fetch_sub(self.jobs, Ordering::AcqRel);
        self.jobs = 0;
        if sent.is_err() {
            shared.serving_panicked(&conn, &client);
        }
    }
}

/// The housekeeping thread: ends leases at their time (it sleeps until the oldest one's end, not on a fixed tick:
/// a server whose clients release their leases is not woken for them).
pub(super) fn housekeeping(shared: Arc<Shared>, chores: Receiver<Chore>) {
    // Room for the clients of a busy server from the start, so a sweep
    // allocates only when there are more.
    let mut swept = Vec::with_capacity(64);
    let lease_time = || shared.limit(|l| l.lease_time);
    let mut swept_with = lease_time();
    let mut next_sweep = shared.expire_leases(swept_with, &mut swept);
    loop {
        match chores.recv_deadline(next_sweep) {
            Ok(Chore::Sweep) | Err(RecvTimeoutError::Timeout) => {}
            Ok(Chore::Discard(what)) => drop(what),
            Ok(Chore::Stop) | Err(RecvTimeoutError::Disconnected) => return,
        }
        // At once when the lease time changed.
        let ttl = lease_time();
        if ttl != swept_with || Instant::now() >= next_sweep {
            swept_with = ttl;
            next_sweep = shared.expire_leases(ttl, &mut swept);
        }
    }
}
