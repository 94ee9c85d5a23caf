//! One SnowRDMA connection: an RC QP set up through RDMA CM, the receive ring
//! the peer writes messages into, the staging buffer our messages leave from,
//! and the command buffers. Completions are handled on the runtime's
//! completion thread; RDMA CM events on its CM thread.

mod batch;
mod credit;
mod deliver;
mod dispatch;
mod in_ring;
mod lifecycle;
mod one_sided;
mod park;
mod queued;
mod retire;
mod send;
mod setup;
mod sources;
mod sync_ops;
mod window;

pub use batch::{BatchMessage, WriteAhead, MESSAGES_PER_DOORBELL};
pub use dispatch::DRAIN_BUDGET;
pub use in_ring::InRing;
pub use one_sided::PendingReads;
pub(crate) use setup::warn_no_phys_addr;
pub(crate) use sources::{CmSource, CqSource};
pub use window::Window;

use std::cell::Cell;
use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use std::fmt;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock, TryLockError};
use std::time::Duration;

use crate::verbs::{
    self, CmId, Completion, CompletionQueue, MemoryRegion, MemoryWindow, ProtectionDomain,
    QueuePair, RemoteRegion,
};

use super::options::Options;
use super::ring::{RecvRing, SendRing};
use super::send_queue::SendQueue;
use super::socket::SocketLink;
use super::{Result, Runtime};

thread_local! {
    /// The connection whose data callback runs innermost on this thread,
    /// and how many of its data callbacks are nested there: `close` called
    /// from one does not wait for itself.
    static IN_DATA_CALLBACK: Cell<(usize, usize)> =
        const { Cell::new((0, 0)) };
}

/// Send-queue depth of every connection.
const MAX_SEND_WR: u32 = 1024;
/// Send-queue slots only commands (credits, goodbye) may use, so returning
/// credit never waits behind data.
const CMD_RESERVE: u32 = 16;
/// Command send buffers.
const CMD_SLOTS: u16 = CMD_RESERVE as u16;
/// Receives kept free at the peer for its commands.
const PEER_CMD_RESERVE: u64 = 16;
/// Completions taken per poll at most (`rdmaMaxConcurrentWorkRequests`
/// is capped to this). Small: the batch array is zeroed on every wakeup of
/// the completion thread, and draining loops until the CQ is empty anyway.
const MAX_POLL_BATCH: usize = 32;
/// Every this many data writes, one asks for a completion.
const SIGNAL_EVERY: u32 = 16;
/// Bound on a sync operation; on expiry the connection is failed so the
/// device stops touching the caller's buffer.
const SYNC_OP_TIMEOUT: Duration = Duration::from_secs(30);

// Work request ids: kind in the top byte, a slot, length or op id below.
const K_RECV: u64 = 1;
const K_DATA: u64 = 2;
const K_CMD: u64 = 3;
const K_WRITE: u64 = 4;
const K_READ: u64 = 5;
const K_SYNC: u64 = 6;
/// The bind of a memory window (the receive ring's, the credit slot's).
const K_BIND: u64 = 7;
/// The READ of the peer's credit slot.
const K_CREDIT: u64 = 8;
const KIND_SHIFT: u32 = 56;
const LOW_MASK: u64 = (1 << KIND_SHIFT) - 1;

fn wr_id(kind: u64, low: u64) -> u64 {
    (kind << KIND_SHIFT) | (low & LOW_MASK)
}

/// Connection state, numbered as the legacy `RdmaConnState`: the C header's
/// `RdmaConnState` (`RDMA_CONN_STATE_*`) is generated from this enum.
///
/// cbindgen:prefix-with-name
/// cbindgen:rename-all=ScreamingSnakeCase
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub enum ConnState {
    None = 0,
    Connecting = 1,
    Accepting = 2,
    /// RDMA CM connected; the peer's receive buffer is not known yet.
    Connected = 3,
    /// Data can flow.
    MrReady = 4,
    Closed = 5,
    Error = 6,
}

/// Which side made the connection, numbered and named as the legacy
/// `ConnectionType` (`ACCEPTED_CONN`, `CONNECTED_CONN`), which the C header
/// generates from this enum.
///
/// cbindgen:rename-all=ScreamingSnakeCase
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub enum ConnKind {
    AcceptedConn = 0,
    ConnectedConn = 1,
}

/// Gives the protection domain connections on a device are built in, so a
/// server can share memory registered once among all its connections.
pub type PdProvider = dyn Fn(&verbs::Context) -> Result<ProtectionDomain> + Send + Sync;

/// What a connection tells its owner. Every method has a default that does
/// nothing. Data callbacks (`recv`, `write_done`, `read_done`) and
/// `connected` run on the completion thread; `disconnected` runs on whichever
/// runtime thread noticed (or on the thread whose sync operation failed).
/// Callbacks may call any connection method, including blocking ones.
pub trait ConnHandler: Send + Sync {
    /// Data can flow (the peer's receive buffer is known).
    fn connected(&self, _conn: &Connection) {}
    /// A message arrived; `data` is valid only during the call.
    fn recv(&self, _conn: &Connection, _data: &[u8], _imm: Option<u32>) {}
    /// A message without an immediate arrived, offered where it lies, before
    /// it is copied out for `recv`: true when this took it (then `recv` is
    /// not called for it), false to have it copied and passed to `recv`.
    /// A handler that takes a message's payload straight to its
    /// destination saves a copy of it.
    fn recv_in_ring(&self, _conn: &Connection, _msg: &InRing<'_>) -> bool {
        false
    }
    /// The messages of one round of completions have been delivered: called
    /// on the thread that delivered them, before it polls again or waits. A
    /// handler that held back what its `recv` calls answered sends it now,
    /// several messages with one doorbell ([`Connection::send_batch`]).
    fn round_done(&self, _conn: &Connection) {}
    /// An asynchronous RDMA WRITE of `len` bytes completed, or `len` bytes
    /// of [`Connection::write_silent`] were accepted
    /// ([`Connection::notify_written`]).
    fn write_done(&self, _conn: &Connection, _len: usize) {}
    /// An asynchronous RDMA READ of `len` bytes completed.
    fn read_done(&self, _conn: &Connection, _len: usize) {}
    /// The peer went away or an operation failed; called once, never after a
    /// local `close`. It runs on the completion thread at the end of a round
    /// of the connection, never inside a call of another thread that found
    /// the failure (that call returns its error first), and no write or
    /// read callback follows it. On a caller-polled connection it runs on
    /// the thread that found the end.
    fn disconnected(&self, _conn: &Connection) {}
    /// The state changed (for mirrors of it, such as the C struct). Reports
    /// come from the thread that made each change, outside the connection's
    /// lock, so two can arrive out of order: a mirror reads
    /// [`Connection::state`] rather than trust the order.
    fn state_changed(&self, _conn: &Connection, _state: ConnState) {}
    /// The peer advertised its receive buffer.
    fn peer_buffer(&self, _conn: &Connection, _buf: RemoteRegion) {}
    /// The runtime let go of an accepted connection after it ended.
    fn retired(&self, _conn: &Connection) {}
}

struct NoHandler;
impl ConnHandler for NoHandler {}

/// A message to hand to the `recv` callback.
struct Delivery {
    offset: usize,
    len: usize,
    extended: bool,
}

/// A callback to run on the completion thread.
enum Deferred {
    Message(Delivery),
    WriteDone(usize),
    ReadDone(usize),
}

struct State {
    state: ConnState,
    peer_ring: Option<RemoteRegion>,
    peer_version: u8,
    peer_recv_depth: u32,
    peer_pa_rkey: Option<u32>,
    tx: SendRing,
    tx_msgs: u64,
    tx_msgs_acked: u64,
    rx: RecvRing,
    rx_msgs: u64,
    sq_used: u32,
    /// Memory-window binds posted, and those completed (in order: the send
    /// queue completes in order, and binds are signaled).
    binds_posted: u64,
    binds_done: u64,
    /// Windows let go before their binds completed, kept until they do
    /// (or the connection ends): [`Window::release_with`].
    unsettled: Vec<window::Unsettled>,
    cmd_free: Vec<u16>,
    sync_ops: sync_ops::SyncOps,
    next_op: u64,
    /// Callbacks owed, in order: messages that arrived while a callback
    /// drove the CQ itself, and completions another thread polled.
    deferred: VecDeque<Deferred>,
    /// Messages that found no room, waiting in order to be posted.
    queue: SendQueue,
    /// A legacy peer's buffer ran out for good (logged once).
    legacy_exhausted: bool,
    /// Data writes posted without a completion since the last signaled one.
    unsignaled_data: u32,
    /// Data work requests (messages and the writes ahead of them) ever
    /// posted; [`Inner::data_retired`] counts those completed.
    data_posted: u64,
    rx_msgs_reported: u64,
    /// `tx_msgs` when the last credit was staged, and at the last tick:
    /// whether this side has been sending (credit can ride with messages).
    tx_msgs_at_credit: u64,
    tx_msgs_at_tick: u64,
    /// Less than an eighth was owed at a tick on which this side had been
    /// sending: the next message carries it, whatever its size (else a
    /// sender blocked with less than an eighth in flight would wait for
    /// as long as this side kept sending).
    carry_some: bool,
    last_errno: i32,
    /// Receive slots of received messages not yet reposted: reposted
    /// [`REPOST_BATCH`] to a doorbell, and all before a credit reports
    /// their messages (the peer sends only into receives it was told of).
    reposts: Vec<u32>,
    /// Credit by READ (protocol version 2), both roles.
    rc: credit::ReadCredit,
}

/// Message receives reposted with one doorbell.
const REPOST_BATCH: usize = 16;

/// How a connection was set up, and so how its end is noticed.
pub(crate) enum Link {
    /// RDMA CM: events arrive on the id's channel.
    Cm(CmId),
    /// Socket mode: QP information went over TCP; the TCP connection's end
    /// is the connection's end.
    Socket(SocketLink),
}

pub(crate) struct ConnInner {
    /// In a shared PD, the window the peer writes the ring through (bound
    /// to this QP only). First, so it is dropped first: rxe holds a bound
    /// window's QP, and destroying the QP before it stalls for seconds.
    ring_window: Option<MemoryWindow>,
    /// In a shared PD, the window the peer READs our credit slot through,
    /// likewise bound to this QP alone.
    credit_window: Option<MemoryWindow>,
    rt: Arc<Runtime>,
    link: Link,
    qp: QueuePair,
    /// Every post to the send queue holds it, and takes it under the state
    /// lock: posts reach the QP in the order their places were taken,
    /// while a sender may let go of the state lock for the provider's post
    /// (a system call on Soft-RoCE, which runs the transmit path), and the
    /// completion thread need not wait for it.
    post_order: Mutex<()>,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    /// Serialises polling of the send CQ, which a thread waiting for its
    /// sync operation may do itself instead of waiting for a wakeup.
    send_poll: Mutex<()>,
    /// Serialises polling of the receive CQ and the callbacks that runs, so
    /// messages are delivered one at a time and in order whichever thread
    /// polls (the completion thread, or a caller with `caller_polls`).
    recv_poll: Mutex<()>,
    /// The thread holding `recv_poll` ([`thread_token`](crate::runtime::thread_token)), 0 when none.
    recv_poller: AtomicUsize,
    /// Receive completions polled and not yet handled, in order (only the
    /// `recv_poll` holder touches it).
    recv_backlog: Mutex<VecDeque<Completion>>,
    /// Whether `recv_backlog` holds anything: an empty poll need not lock it.
    recv_backlogged: AtomicBool,
    /// Async READs/WRITEs in flight, whose completions owe a callback. The
    /// send CQ is armed only while there are some (or someone sleeps on a
    /// send completion): sync operations' waiters poll it themselves, and
    /// waking the completion thread for them would cost more than the wait.
    async_pending: AtomicUsize,
    /// Sender: a READ of the peer's credit slot is in flight (set and
    /// cleared under the state lock, looked at without it by a thread about
    /// to send). Its completion owes nobody a callback,
    /// so it is not counted in `async_pending` and nothing arms the send CQ
    /// for it alone (see `credit_read`).
    credit_read_out: AtomicBool,
    /// Whether the send CQ may be armed (cleared at its channel events).
    send_armed: AtomicBool,
    /// Whether the completion thread polls this connection on every pass
    /// of its spin, unarmed. It clears this before it stops (`ready`, which
    /// arms the send CQ while `async_pending` is non-zero), so a post that
    /// sees it set after counting itself in `async_pending` need not arm:
    /// the spinner polls its completion, or arms for it.
    spun_on: AtomicBool,
    /// Whether the receive CQ is armed (cleared at its channel events): a
    /// sleeping caller leaves it alone when the completion thread has just
    /// armed it, which saves a system call per wait.
    recv_armed: AtomicBool,
    pd: ProtectionDomain,
    recv_ring: MemoryRegion,
    staging: MemoryRegion,
    /// Our published credit (the peer may READ it) and where the peer's
    /// lands when we READ it (`credit::CREDIT_REGION_LEN`).
    credit: MemoryRegion,
    /// Where a received message is copied before anyone looks at it.
    /// Room for the whole ring from the start, so it never moves: a C
    /// program that kept a receive callback's `data` (the legacy library's
    /// pointed into its ring, which stayed mapped) reads memory that a later
    /// message overwrites, never memory given back. Untouched room is
    /// address space only.
    rx_copy: Mutex<Vec<u8>>,
    cmd_recv: MemoryRegion,
    cmd_send: MemoryRegion,
    opts: Options,
    /// Messages up to this many bytes go inline: the caller's
    /// `max_inline_data`, or the runtime's choice when that is 0.
    inline_max: u32,
    kind: ConnKind,
    peer: Option<SocketAddr>,
    handler: RwLock<Arc<dyn ConnHandler>>,
    st: Mutex<State>,
    /// Sleeping waiters wait on `cond` under `sleep_lock` (not the state
    /// lock, so a wake never has to take that).
    cond: Condvar,
    sleep_lock: Mutex<()>,
    /// Threads asleep on `cond`: a wake makes no system call when there are
    /// none, which is almost always.
    sleepers: AtomicUsize,
    /// Bumped at every wake, so spinning waiters see changes without the lock.
    wakeups: AtomicU64,
    /// Posts to the send queue so far: whether a round of completions was
    /// answered.
    posts: AtomicU64,
    /// Threads waiting on the connection, spinning or asleep (`park`,
    /// `wait_for`).
    waiting: AtomicUsize,
    /// Another thread queued callbacks for the completion thread.
    owed: AtomicBool,
    /// Hints the completion thread reads instead of taking the state lock
    /// in every round (waiting for a holder costs two futex calls). Each is
    /// set under the lock when its state changes and cleared under the lock
    /// when that state is found empty, so a stale `true` only costs the
    /// lock, and a `false` is never stale past the lock hold that set it.
    /// The send queue may hold messages.
    queued: AtomicBool,
    /// Windows are kept for binds not yet completed: the send CQ is armed
    /// so that their completions are taken.
    windows_unsettled: AtomicBool,
    /// Callbacks may be deferred.
    deferred_any: AtomicBool,
    /// Received bytes or messages may be owed credit.
    rx_owed: AtomicBool,
    /// Send-queue places of completed data writes not yet given back: the
    /// completion thread leaves them here when the state lock is held, and
    /// the next holder gives them back ([`Connection::lock`]).
    sq_done: AtomicU32,
    /// Data work requests completed, in post order (the send queue
    /// completes in order; a signaled one accounts for those before it).
    data_retired: AtomicU64,
    /// Received messages read out of the ring since the lock was last
    /// taken: the next holder releases their bytes (`RecvRing::release`),
    /// so a delivery takes the lock once, not twice.
    rx_read: AtomicU32,
    user_mrs: Mutex<FxHashMap<usize, Arc<MemoryRegion>>>,
    disconnect_fired: AtomicBool,
    /// The connection's end was left to the completion thread:
    /// `disconnected` and an accepted connection's retirement are its
    /// (set under the state lock that ended the connection).
    end_owed: AtomicBool,
    /// The thread that ended it is done with its part (the state's
    /// handler told): the completion thread may run the owed end.
    end_ready: AtomicBool,
    closed_locally: AtomicBool,
    /// Set by `close` as it finishes: no data callback (receive, write,
    /// read) starts after it, and those already running are counted in
    /// `in_data_callbacks`, which `close` waits out (both SeqCst: either
    /// a starting callback sees the flag, or `close` sees it counted).
    data_callbacks_shut: AtomicBool,
    in_data_callbacks: AtomicUsize,
    /// A message reached the handler since its last `round_done`.
    delivered: AtomicBool,
    /// The state is Closed or Error, which it never leaves: the completion
    /// thread looks after every receive, without the lock a sender holds.
    ended: AtomicBool,
    /// The peer disconnected; the thread that polls completions finishes
    /// delivering what arrived before, then ends the connection.
    peer_left: AtomicBool,
    /// The runtime let go of the connection (at most once).
    retired: AtomicBool,
    cm_source: AtomicU64,
    cq_source: AtomicU64,
}

/// A SnowRDMA connection. Cheap to clone; all clones are the same
/// connection.
#[derive(Clone)]
pub struct Connection {
    pub(crate) inner: Arc<ConnInner>,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("peer", &self.inner.peer)
            .field("kind", &self.inner.kind)
            .field("state", &self.state())
            .finish()
    }
}

/// A handle that does not keep the connection alive.
#[derive(Clone)]
pub struct WeakConnection(std::sync::Weak<ConnInner>);

impl WeakConnection {
    /// Whether this is a handle of `conn`.
    pub fn is(&self, conn: &Connection) -> bool {
        std::ptr::eq(self.0.as_ptr(), Arc::as_ptr(&conn.inner))
    }

    pub fn upgrade(&self) -> Option<Connection> {
        self.0.upgrade().map(|inner| Connection { inner })
    }
}

impl PartialEq for Connection {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Connection {
    /// A number that identifies this connection while it lives.
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    pub fn downgrade(&self) -> WeakConnection {
        WeakConnection(Arc::downgrade(&self.inner))
    }

    /// Replaces the handler (callbacks already running finish with the old).
    pub fn set_handler(&self, handler: Arc<dyn ConnHandler>) {
        *self.inner.handler.write().expect("handler lock") = handler;
    }

    fn handler(&self) -> Arc<dyn ConnHandler> {
        self.inner
            .handler
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.settled(self.inner.st.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The state lock if nobody holds it now: for work that can be left to
    /// the thread holding it (a sender carries credit) or to a later round.
    fn try_lock(&self) -> Option<MutexGuard<'_, State>> {
        match self.inner.st.try_lock() {
            Ok(st) => Some(self.settled(st)),
            Err(TryLockError::Poisoned(p)) => Some(self.settled(p.into_inner())),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// The state with what other threads left for the lock's next holder
    /// applied: the send-queue places of completed writes given back, the
    /// ring bytes of messages read released.
    fn settled<'a>(&self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        if self.inner.sq_done.load(Ordering::Relaxed) != 0 {
            let done = self.inner.sq_done.swap(0, Ordering::AcqRel);
            st.sq_used = st.sq_used.saturating_sub(done);
        }
        if self.inner.rx_read.load(Ordering::Relaxed) != 0 {
            for _ in 0..self.inner.rx_read.swap(0, Ordering::AcqRel) {
                st.rx.release();
            }
        }
        st
    }

    /// Runs a handler method: a panic in it ends this connection (logged),
    /// never the runtime thread that called it.
    /// [`Connection::call_handler`] for a callback that hands the program
    /// data (a message, a finished write or read): not once `close` has
    /// finished, and one running is waited for by `close`.
    fn call_data_handler(&self, what: &str, f: impl FnOnce(&dyn ConnHandler)) {
        let inner = &self.inner;
        inner.in_data_callbacks.fetch_add(1, Ordering::SeqCst);
        if !inner.data_callbacks_shut.load(Ordering::SeqCst) {
            let me = self.id();
            // `with` on the cell, not `LocalKey::get`/`set`: those go
            // through a lazy-initialisation path that is not inlined (80
            // instructions per echo round trip).
            let outer = IN_DATA_CALLBACK.with(|mark| {
                let outer = mark.get();
                let depth = if outer.0 == me { outer.1 + 1 } else { 1 };
                mark.set((me, depth));
                outer
            });
            // `call_handler` catches a panic: the mark is always undone.
            self.call_handler(what, f);
            IN_DATA_CALLBACK.with(|mark| mark.set(outer));
        }
        inner.in_data_callbacks.fetch_sub(1, Ordering::SeqCst);
    }

    /// How many of this connection's data callbacks run on this thread,
    /// below the caller (those under a callback of another connection that
    /// runs above them are not seen).
    fn data_callbacks_here(&self) -> usize {
        match IN_DATA_CALLBACK.with(Cell::get) {
            (id, depth) if id == self.id() => depth,
            _ => 0,
        }
    }

    fn call_handler(&self, what: &str, f: impl FnOnce(&dyn ConnHandler)) {
        let h = self.handler();
        if std::panic::catch_unwind(AssertUnwindSafe(|| f(&*h))).is_err() {
            log::error!(
                "the {what} callback for {:?} panicked: ending that connection",
                self.inner.peer
            );
            self.fail(&format!("its {what} callback panicked"));
        }
    }

    pub fn state(&self) -> ConnState {
        self.lock().state
    }

    /// The queue pair's state as the device reports it: `ERR` from the
    /// moment the connection ends (closed, failed or left by its peer), so
    /// the device starts no more work on its memory, nor the program's.
    pub fn qp_state(&self) -> Result<verbs::QpState> {
        Ok(self.inner.qp.state()?)
    }

    /// Moves to Closed or Error (which it never leaves), under the lock:
    /// with the flag the completion thread reads without the lock. The QP
    /// is stopped first (`ibv_modify_qp` calls back into nothing of ours):
    /// whoever sees the end, here or through a refused call, finds the
    /// device starting no more work. The synchronous operations still open
    /// fail with `why`, under the same lock: one that returns its failure
    /// finds the state ended. The caller wakes their waiters, and lets go
    /// of the windows kept for binds once it let go of the lock (the binds
    /// will not run now): [`Connection::release_settled_windows`].
    fn end_state(&self, st: &mut State, state: ConnState, why: &str) {
        self.stop_device();
        st.state = state;
        self.inner.ended.store(true, Ordering::Release);
        for slot in st.sync_ops.outcomes_mut() {
            slot.get_or_insert_with(|| Err(why.to_string()));
        }
    }

    /// Whether the connection is closed or failed, without the state lock.
    pub(crate) fn has_ended(&self) -> bool {
        self.inner.ended.load(Ordering::Acquire)
    }

    /// Ended, or the peer has left: a receive taken is not posted again.
    /// What the peer sent before it left is delivered from the receives
    /// already posted; a peer that left and kept writing would otherwise
    /// keep the thread that delivers them at it for as long as it wrote
    /// ([`Connection::finish_peer_left`] drains until the CQ is empty).
    pub(super) fn reposts_no_receives(&self) -> bool {
        self.has_ended() || self.inner.peer_left.load(Ordering::SeqCst)
    }

    pub fn kind(&self) -> ConnKind {
        self.inner.kind
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.inner.peer
    }

    pub fn options(&self) -> &Options {
        &self.inner.opts
    }

    /// The RDMA CM id (`None` in socket mode).
    pub fn cm_id(&self) -> Option<&CmId> {
        match &self.inner.link {
            Link::Cm(id) => Some(id),
            Link::Socket(_) => None,
        }
    }

    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// The receive CQ (messages and commands arrive here).
    pub fn recv_cq(&self) -> &CompletionQueue {
        &self.inner.recv_cq
    }

    /// Our receive ring (peers write messages into it).
    pub fn recv_ring(&self) -> &MemoryRegion {
        &self.inner.recv_ring
    }

    /// The staging buffer our messages are copied into before they leave.
    pub fn staging(&self) -> &MemoryRegion {
        &self.inner.staging
    }

    /// The receive buffers of commands.
    pub fn cmd_buffers(&self) -> &MemoryRegion {
        &self.inner.cmd_recv
    }

    /// The peer's receive buffer, once advertised.
    pub fn peer_buffer(&self) -> Option<RemoteRegion> {
        self.lock().peer_ring
    }

    /// Where the peer publishes the credit it returns (protocol version 2),
    /// once it offered it: READ-only, and only for this connection.
    pub fn peer_credit_slot(&self) -> Option<RemoteRegion> {
        self.lock().rc.peer_slot()
    }

    /// The errno of the last failure on this connection (0: none).
    pub fn last_errno(&self) -> i32 {
        self.lock().last_errno
    }

    fn set_state(&self, state: ConnState) {
        {
            let mut st = self.lock();
            match state {
                ConnState::Closed | ConnState::Error => {
                    self.end_state(&mut st, state, "the connection ended")
                }
                _ => st.state = state,
            }
        }
        self.release_settled_windows();
        self.wake();
        self.notify_state(state);
    }

    fn notify_state(&self, state: ConnState) {
        self.call_handler("state", |h| h.state_changed(self, state));
    }
}
