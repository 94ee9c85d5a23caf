//! Enforcing the [`Limits`] on the request path: queued replies and
//! requests, leases past their time, and checking a new set of limits.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::{Sender, TrySendError};

use crate::kv::limits::{Limits, MAX_WORKER_QUEUE};
use crate::kv::proto::Reply;
use crate::kv::{KvError, Result};
use crate::runtime::Connection;

use super::answer::Answer;
use super::{bump, ClientState, Job, Shared, SPARE_MSG_BYTES};

/// The longest the housekeeping thread sleeps between two lease sweeps.
const SWEEP_AT_LEAST_EVERY: Duration = Duration::from_secs(3600);
/// The shortest it sleeps.
const SWEEP_AT_MOST_EVERY: Duration = Duration::from_millis(1);

impl Shared {
    /// One of the current limits.
    pub(super) fn limit<T>(&self, pick: impl FnOnce(&Limits) -> T) -> T {
        pick(&self.limits.read().expect("limits lock"))
    }

    /// Sends a reply, or (the client lets more than its cap of replies
    /// wait: it withholds credit) disconnects the client.
    pub(super) fn reply(&self, conn: &Connection, client: &ClientState, reply: &Answer) {
        match reply.send(conn) {
            Ok(n) if n > 0 => return,
            Ok(_) => {}
            Err(e) => return self.reply_failed(conn, client, &e),
        }
        if client.gone.load(Ordering::Acquire) {
            return;
        }
        bump(&self.counters.reply_overflows);
        let cap = conn.options().send_queue_bytes;
        self.episodes.overflow.hit(|| {
            format!(
                "closing {:?}: it does not take its replies ({cap} bytes of them waiting)",
                conn.peer_addr()
            )
        });
        // Dropped first: its targets then end without waiting for their
        // binds, which a client that takes no replies may hold up.
        conn.drop_peer("it does not take its replies");
        self.forget(client);
    }

    /// A reply could not be sent: the connection ended (its end is
    /// reported on its own), and its client goes.
    pub(super) fn reply_failed(
        &self,
        conn: &Connection,
        client: &ClientState,
        e: &crate::runtime::Error,
    ) {
        log::debug!("no reply to {:?}: {e}", conn.peer_addr());
        conn.drop_peer("no reply could be sent");
        self.forget(client);
    }

    /// A client with `queued` requests waiting already gets no more queued:
    /// this one is answered "no memory" at once.
    pub(super) fn refuse_busy(
        &self,
        conn: &Connection,
        client: &ClientState,
        id: u64,
        queued: usize,
    ) {
        bump(&self.counters.busy_refusals);
        self.episodes.busy.hit(|| {
            format!(
                "{:?} has {queued} requests waiting: refusing more until they are done",
                conn.peer_addr()
            )
        });
        self.reply(
            conn,
            client,
            &Answer::plain(Reply::error(id, KvError::NoMemory)),
        );
    }

    /// Hands a job to a worker, waiting for room when its queue is full
    /// (the worker only ever waits for the store, so room comes); false if
    /// the worker is gone.
    pub(super) fn queue_job(&self, tx: &Sender<Job>, job: Job) -> bool {
        match tx.try_send(job) {
            Ok(()) => true,
            Err(TrySendError::Disconnected(_)) => false,
            Err(TrySendError::Full(job)) => {
                bump(&self.counters.worker_queue_full);
                self.episodes.worker_queue.hit(|| {
                    format!(
                        "a worker's queue is full ({} requests): requests wait for room",
                        tx.capacity().unwrap_or(0)
                    )
                });
                tx.send(job).is_ok()
            }
        }
    }

    /// A job's copy of request `data`, in a buffer from the spare pool
    /// (full from the start, refilled by finished jobs): a stream of
    /// worker requests (large PUTs) allocates nothing.
    pub(super) fn job_message(&self, data: &[u8]) -> Vec<u8> {
        let mut msg = self
            .spare_msgs
            .1
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(SPARE_MSG_BYTES));
        msg.clear();
        msg.extend_from_slice(data);
        msg
    }

    /// Keeps a finished job's buffer for the next one, unless enough are
    /// kept or it grew past what a request usually needs.
    pub(super) fn recycle(&self, msg: Vec<u8>) {
        if msg.capacity() <= SPARE_MSG_BYTES {
            let _ = self.spare_msgs.0.try_send(msg);
        }
    }

    /// Ends the leases held past `ttl` (housekeeping thread), and
    /// says when the next one will be: the oldest lease's end, or a lease
    /// time from now while none is held (no lease taken later ends
    /// sooner). `clients` is the sweeper's own list, kept between sweeps
    /// so that a sweep allocates nothing.
    pub(super) fn expire_leases(
        &self,
        ttl: Duration,
        clients: &mut Vec<Arc<ClientState>>,
    ) -> Instant {
        // Any lease time is allowed: a sweep at least every hour keeps the
        // sums far from the clock's end.
        let mut next = Instant::now() + ttl.min(SWEEP_AT_LEAST_EVERY);
        clients.extend(
            self.clients
                .lock()
                .expect("clients lock")
                .iter()
                .filter_map(Weak::upgrade),
        );
        let mut ended = 0;
        for client in clients.drain(..) {
            // Poisoned: a request of this client panicked, and it is being
            // forgotten; the sweep goes on for everyone else.
            let mut leases = client.leases.lock().unwrap_or_else(PoisonError::into_inner);
            ended += leases.expire(ttl);
            if let Some(end) = leases.first_end(ttl) {
                next = next.min(end);
            }
        }
        if ended > 0 {
            self.counters
                .leases_expired
                .fetch_add(ended, Ordering::Relaxed);
            self.episodes
                .leases
                .hit(|| format!("{ended} leases not released within {ttl:?} ended"));
        }
        // However short the lease time, the thread does not spin on it.
        next.max(Instant::now() + SWEEP_AT_MOST_EVERY)
    }
}

/// Limits of zero would refuse everything: a mistake, not a setting. A
/// worker queue past [`MAX_WORKER_QUEUE`] is refused too: it is allocated
/// whole at start, where a failed allocation aborts the process.
pub(super) fn check_limits(l: &Limits) -> Result<()> {
    if l.worker_queue > MAX_WORKER_QUEUE {
        return Err(KvError::InvalidArgument(format!(
            "the limit worker_queue is {}, more than the maximum of {MAX_WORKER_QUEUE}",
            l.worker_queue
        )));
    }
    let zero = [
        ("max_connections", l.max_connections == 0),
        ("host_connections", l.host_connections == 0),
        ("setup_deadline", l.setup_deadline.is_zero()),
        ("reply_queue_bytes", l.reply_queue_bytes == 0),
        ("worker_queue", l.worker_queue == 0),
        ("client_jobs", l.client_jobs == 0),
        ("lease_bytes", l.lease_bytes == 0),
        ("target_bytes", l.target_bytes == 0),
        ("lease_time", l.lease_time.is_zero()),
    ];
    match zero.iter().find(|(_, z)| *z) {
        Some((name, _)) => Err(KvError::InvalidArgument(format!(
            "the limit {name} must be positive"
        ))),
        None => Ok(()),
    }
}
