//! One SnowRDMA connection: an RC QP set up through RDMA CM, the receive ring
//! the peer writes messages into, the staging buffer our messages leave from,
//! and the command buffers. Completions are handled on the runtime's
//! completion thread; RDMA CM events on its CM thread.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, TryLockError};
use std::time::{Duration, Instant};

use crate::verbs::{
    self, AccessFlags, CmEvent, CmEventKind, CmId, Completion, CompletionQueue, ConnParam, Context,
    MemoryRegion, PreparedQp, ProtectionDomain, QpCaps, QpOptions, QueuePair, RemoteAddr,
    RemoteRegion, SendOp, SendRequest, Sge, WcOpcode, WcStatus,
};

use super::options::{CommMode, Options};
use super::proto::{Cmd, ExtKind, Opcode, CMD_LEN, EXT_HEADER_LEN, IMM_EXTENDED};
use super::ring::{RecvRing, SendRing};
use super::send_queue::{Push, SendQueue, SendQueueStats};
use super::socket::{handshake, SocketLink, SocketWatch};
use super::{runtime, Error, Result, Runtime};

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
const KIND_SHIFT: u32 = 56;
const LOW_MASK: u64 = (1 << KIND_SHIFT) - 1;

fn wr_id(kind: u64, low: u64) -> u64 {
    (kind << KIND_SHIFT) | (low & LOW_MASK)
}

thread_local! {
    static THREAD_MARK: u8 = const { 0 };
}

/// A number unique to the calling thread while it lives (never 0).
pub(crate) fn thread_token() -> usize {
    THREAD_MARK.with(|m| m as *const u8 as usize)
}

/// READs posted by [`Connection::start_reads`], waited for in posting
/// order; dropping it waits for the rest, so the device is done with the
/// buffers before anyone else can use them.
pub struct PendingReads<'a> {
    conn: &'a Connection,
    first: u64,
    /// Operation ids below this are waited for.
    done: u64,
    end: u64,
}

impl PendingReads<'_> {
    /// Waits for the READs up to the `i`-th (from 0; past the last: all).
    /// An error if one of them failed (which also ends the connection).
    pub fn wait_through(&mut self, i: usize) -> Result<()> {
        let upto = self
            .end
            .min(self.first.saturating_add(i as u64).saturating_add(1));
        if upto <= self.done {
            return Ok(());
        }
        let ids = self.done..upto;
        self.done = upto;
        self.conn.wait_sync_ops(ids)
    }
}

impl Drop for PendingReads<'_> {
    fn drop(&mut self) {
        // Errors were (or will be) reported to whoever waited; here only the
        // buffers' release matters.
        let _ = self.wait_through(usize::MAX);
    }
}

/// Connection state, numbered as the legacy `RdmaConnState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
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

/// Which side made the connection, numbered as the legacy `ConnectionType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum ConnKind {
    Accepted = 0,
    Connected = 1,
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
    /// An asynchronous RDMA WRITE of `len` bytes completed.
    fn write_done(&self, _conn: &Connection, _len: usize) {}
    /// An asynchronous RDMA READ of `len` bytes completed.
    fn read_done(&self, _conn: &Connection, _len: usize) {}
    /// The peer went away or an operation failed; called once, never after a
    /// local `close`.
    fn disconnected(&self, _conn: &Connection) {}
    /// The state changed (for mirrors of it, such as the C struct).
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
    cmd_free: Vec<u16>,
    sync_ops: HashMap<u64, Option<std::result::Result<(), String>>>,
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
    rx_msgs_reported: u64,
    last_errno: i32,
}

/// How a connection was set up, and so how its end is noticed.
pub(crate) enum Link {
    /// RDMA CM: events arrive on the id's channel.
    Cm(CmId),
    /// Socket mode: QP information went over TCP; the TCP connection's end
    /// is the connection's end.
    Socket(SocketLink),
}

pub(crate) struct ConnInner {
    rt: Arc<Runtime>,
    link: Link,
    qp: QueuePair,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    /// Serialises polling of the send CQ, which a thread waiting for its
    /// sync operation may do itself instead of waiting for a wakeup.
    send_poll: Mutex<()>,
    /// Serialises polling of the receive CQ and the callbacks that runs, so
    /// messages are delivered one at a time and in order whichever thread
    /// polls (the completion thread, or a caller with `caller_polls`).
    recv_poll: Mutex<()>,
    /// The thread holding `recv_poll` ([`thread_token`]), 0 when none.
    recv_poller: AtomicUsize,
    /// Async READs/WRITEs in flight, whose completions owe a callback. The
    /// send CQ is armed only while there are some (or someone sleeps on a
    /// send completion): sync operations' waiters poll it themselves, and
    /// waking the completion thread for them would cost more than the wait.
    async_pending: AtomicUsize,
    /// Whether the send CQ may be armed (cleared at each channel event).
    send_armed: AtomicBool,
    pd: ProtectionDomain,
    recv_ring: MemoryRegion,
    staging: MemoryRegion,
    cmd_recv: MemoryRegion,
    cmd_send: MemoryRegion,
    opts: Options,
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
    /// Another thread queued callbacks for the completion thread.
    owed: AtomicBool,
    user_mrs: Mutex<HashMap<usize, MemoryRegion>>,
    disconnect_fired: AtomicBool,
    closed_locally: AtomicBool,
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
    /// Builds the QP, buffers and posted receives on the link's device, in
    /// the protection domain `pds` gives for that device (a fresh one
    /// without). A socket-mode QP comes back still to be connected.
    pub(crate) fn build(
        rt: Arc<Runtime>,
        link: Link,
        opts: &Options,
        kind: ConnKind,
        pds: Option<&PdProvider>,
    ) -> Result<(Connection, Option<PreparedQp>)> {
        let ctx = match &link {
            Link::Cm(id) => id
                .context()
                .ok_or_else(|| Error::InvalidArgument("the RDMA CM id has no device".into()))?,
            Link::Socket(s) => s.ctx.clone(),
        };
        let pd = match pds {
            Some(provide) => provide(&ctx)?,
            None => ctx.alloc_pd()?,
        };
        let channel = ctx.create_comp_channel()?;
        let recv_depth = opts.recv_depth.max(2 * PEER_CMD_RESERVE as u32);
        let send_cq = ctx.create_cq(MAX_SEND_WR + 16, Some(&channel))?;
        let recv_cq = ctx.create_cq(recv_depth + 16, Some(&channel))?;
        let caps = QpCaps {
            max_send_wr: MAX_SEND_WR,
            max_recv_wr: recv_depth,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: opts.max_inline_data,
        };
        let (qp, prepared) = match &link {
            Link::Cm(id) => (id.create_qp(&pd, &send_cq, &recv_cq, &caps)?, None),
            Link::Socket(_) => {
                let qp_opts = QpOptions {
                    caps,
                    retry_cnt: opts.retry_count.min(7),
                    ..QpOptions::default()
                };
                let prepared = pd.create_rc_qp(&send_cq, &recv_cq, &qp_opts)?;
                (prepared.queue_pair().clone(), Some(prepared))
            }
        };
        let peer = match &link {
            Link::Cm(id) => id.peer_addr(),
            Link::Socket(s) => Some(s.peer),
        };
        let remote =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let recv_ring = pd.allocate(opts.recv_buf_len, remote)?;
        let staging = pd.allocate(opts.recv_buf_len, AccessFlags::LOCAL_WRITE)?;
        let cmd_recv = pd.allocate(recv_depth as usize * CMD_LEN, AccessFlags::LOCAL_WRITE)?;
        let cmd_send = pd.allocate(CMD_SLOTS as usize * CMD_LEN, AccessFlags::LOCAL_WRITE)?;
        if opts.enable_phys_addr_access {
            warn_no_phys_addr();
        }
        let state = if kind == ConnKind::Connected {
            ConnState::Connecting
        } else {
            ConnState::Accepting
        };
        let conn = Connection {
            inner: Arc::new(ConnInner {
                rt,
                peer,
                link,
                qp,
                send_cq,
                recv_cq,
                send_poll: Mutex::new(()),
                recv_poll: Mutex::new(()),
                recv_poller: AtomicUsize::new(0),
                async_pending: AtomicUsize::new(0),
                send_armed: AtomicBool::new(false),
                pd,
                recv_ring,
                staging,
                cmd_recv,
                cmd_send,
                opts: opts.clone(),
                kind,
                handler: RwLock::new(Arc::new(NoHandler)),
                st: Mutex::new(State {
                    state,
                    peer_ring: None,
                    peer_version: 0,
                    peer_recv_depth: 0,
                    peer_pa_rkey: None,
                    tx: SendRing::default(),
                    tx_msgs: 0,
                    tx_msgs_acked: 0,
                    rx: RecvRing::new(opts.recv_buf_len),
                    rx_msgs: 0,
                    sq_used: 0,
                    cmd_free: (0..CMD_SLOTS).collect(),
                    sync_ops: HashMap::new(),
                    next_op: 1,
                    deferred: VecDeque::new(),
                    queue: SendQueue::new(opts.send_queue_bytes),
                    legacy_exhausted: false,
                    unsignaled_data: 0,
                    rx_msgs_reported: 0,
                    last_errno: 0,
                }),
                cond: Condvar::new(),
                sleep_lock: Mutex::new(()),
                sleepers: AtomicUsize::new(0),
                wakeups: AtomicU64::new(0),
                owed: AtomicBool::new(false),
                user_mrs: Mutex::new(HashMap::new()),
                disconnect_fired: AtomicBool::new(false),
                closed_locally: AtomicBool::new(false),
                peer_left: AtomicBool::new(false),
                retired: AtomicBool::new(false),
                cm_source: AtomicU64::new(0),
                cq_source: AtomicU64::new(0),
            }),
        };
        for slot in 0..recv_depth {
            conn.post_recv_slot(slot)?;
        }
        Ok((conn, prepared))
    }

    /// Connects to a SnowRDMA server at `addr`; returns once data can flow.
    /// Fails with an error when the server rejects, is unreachable, or does
    /// not answer within `opts.timeout` per step.
    pub fn connect(
        addr: SocketAddr,
        opts: &Options,
        handler: Arc<dyn ConnHandler>,
    ) -> Result<Connection> {
        let rt = runtime()?;
        let id = CmId::resolve(addr, None, opts.timeout)?;
        let (conn, _) =
            Connection::build(rt, Link::Cm(id.clone()), opts, ConnKind::Connected, None)?;
        conn.set_handler(handler);
        conn.notify_state(ConnState::Connecting);
        id.connect(&conn.conn_param())?;
        let setup = setup_time(opts);
        if let Err(e) = id.expect_event(CmEventKind::ESTABLISHED, setup) {
            conn.set_state(ConnState::Error);
            return Err(e.into());
        }
        conn.finish_connect(Arc::new(CmSource::Client(conn.clone())), setup)
    }

    /// Connects in socket mode: QP information goes over a TCP connection to
    /// `addr` (a socket-mode listener); the QP is on `device` (a name, or the
    /// first device, `SNOWRDMA_DEVICE`). Returns once data can flow.
    pub fn connect_socket(
        addr: SocketAddr,
        device: Option<&str>,
        opts: &Options,
        handler: Arc<dyn ConnHandler>,
    ) -> Result<Connection> {
        let rt = runtime()?;
        let setup = setup_time(opts);
        let stream = std::net::TcpStream::connect_timeout(&addr, setup)
            .map_err(|e| Error::Socket(format!("connecting to {addr}: {e}")))?;
        let _ = stream.set_nodelay(true);
        let link = SocketLink {
            stream: stream
                .try_clone()
                .map_err(|e| Error::Socket(format!("duplicating the socket: {e}")))?,
            peer: addr,
            ctx: Context::open(device)?,
        };
        let (conn, prepared) =
            Connection::build(rt, Link::Socket(link), opts, ConnKind::Connected, None)?;
        conn.set_handler(handler);
        conn.notify_state(ConnState::Connecting);
        let prepared = prepared.expect("socket-mode connections come back prepared");
        if let Err(e) = handshake(&stream, prepared, setup) {
            conn.set_state(ConnState::Error);
            return Err(e);
        }
        conn.finish_connect(Arc::new(SocketWatch(conn.clone())), setup)
    }

    /// The common end of connecting: watch the link for its end, take
    /// completions, advertise our ring and wait for the peer's.
    fn finish_connect(
        &self,
        watch: Arc<dyn super::poller::Source>,
        setup: Duration,
    ) -> Result<Connection> {
        self.set_state(ConnState::Connected);
        let cm_key = self.inner.rt.cm.add(watch);
        self.inner.cm_source.store(cm_key, Ordering::SeqCst);
        self.start_completions();
        self.send_reg_local_addr()?;
        let waited = self.wait_until(Instant::now() + setup, |st| match st.state {
            ConnState::MrReady => Some(Ok(())),
            ConnState::Closed | ConnState::Error => Some(Err(Error::Disconnected)),
            _ => None,
        });
        if let Err(e) = waited {
            self.close();
            return Err(e);
        }
        Ok(self.clone())
    }

    /// An accepted socket-mode connection whose QP is connected: watch its
    /// socket and start as RDMA CM's ESTABLISHED would (CM thread).
    pub(crate) fn socket_accepted(&self) {
        let key = self.inner.rt.cm.add(Arc::new(SocketWatch(self.clone())));
        self.inner.cm_source.store(key, Ordering::SeqCst);
        self.start_completions();
        self.established();
    }

    pub(crate) fn socket_link(&self) -> Option<&SocketLink> {
        match &self.inner.link {
            Link::Socket(s) => Some(s),
            Link::Cm(_) => None,
        }
    }

    /// Tells the peer we are going (RDMA CM disconnect, or the socket shut).
    fn disconnect_link(&self) {
        match &self.inner.link {
            Link::Cm(id) => {
                let _ = id.disconnect();
            }
            Link::Socket(s) => s.shutdown(),
        }
    }

    pub(crate) fn conn_param(&self) -> ConnParam {
        let rd = match self.inner.opts.max_outstanding_rd_atomic {
            0 => u8::MAX, // capped to the device's maximum by the verbs layer
            n => n.min(255) as u8,
        };
        ConnParam {
            responder_resources: rd,
            initiator_depth: rd,
            retry_count: self.inner.opts.retry_count,
            rnr_retry_count: self.inner.opts.rnr_retry_count,
            private_data: Vec::new(),
        }
    }

    pub(crate) fn start_completions(&self) {
        let key = self.inner.rt.cq.add(Arc::new(CqSource(self.clone())));
        self.inner.cq_source.store(key, Ordering::SeqCst);
    }

    /// A number that identifies this connection while it lives.
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    pub fn downgrade(&self) -> WeakConnection {
        WeakConnection(Arc::downgrade(&self.inner))
    }

    /// The lkey of the buffer registered on this connection (by
    /// [`Connection::register`]) that holds `[addr, addr+len)`.
    pub fn registered_lkey(&self, addr: u64, len: usize) -> Option<u32> {
        let mrs = self.inner.user_mrs.lock().expect("mr lock");
        mrs.values()
            .find(|mr| addr >= mr.addr() && addr + len as u64 <= mr.addr() + mr.len() as u64)
            .map(|mr| mr.lkey())
    }

    /// Replaces the handler (callbacks already running finish with the old).
    pub fn set_handler(&self, handler: Arc<dyn ConnHandler>) {
        *self.inner.handler.write().expect("handler lock") = handler;
    }

    fn handler(&self) -> Arc<dyn ConnHandler> {
        self.inner.handler.read().expect("handler lock").clone()
    }

    /// Wakes every thread waiting on this connection.
    fn wake(&self) {
        self.inner.wakeups.fetch_add(1, Ordering::SeqCst);
        if self.inner.sleepers.load(Ordering::SeqCst) > 0 {
            // Under the sleep lock: a sleeper checks `wakeups` under it, so
            // it has either seen this wake or is already waiting.
            let _guard = self.inner.sleep_lock.lock().expect("sleep lock");
            self.inner.cond.notify_all();
        }
    }

    /// Releases the lock until something changes or `deadline`: spins
    /// first (`Options::spin`), since completions usually come sooner than a
    /// sleeping thread can be woken, then sleeps in short bounded waits.
    fn park<'a>(&'a self, st: MutexGuard<'a, State>, deadline: Instant) -> MutexGuard<'a, State> {
        let seen = self.inner.wakeups.load(Ordering::SeqCst);
        drop(st);
        let caller_polls = self.inner.opts.caller_polls;
        let spin_until = Instant::now() + self.inner.opts.spin;
        while Instant::now() < spin_until.min(deadline) {
            // A caller-polled connection's round covers the send CQ too.
            let polled = if caller_polls {
                self.poll_round()
            } else {
                self.poll_send_here()
            };
            if polled || self.inner.wakeups.load(Ordering::SeqCst) != seen {
                return self.lock();
            }
            std::hint::spin_loop();
        }
        self.sleep(seen, deadline);
        self.lock()
    }

    /// Sleeps until a wake after the one numbered `seen`, or `deadline`, or
    /// 10 ms. With `caller_polls` the CQs are armed first, since a sleeping
    /// caller leaves its completions to the completion thread.
    fn sleep(&self, seen: u64, deadline: Instant) {
        self.inner.sleepers.fetch_add(1, Ordering::SeqCst);
        self.arm_send();
        if self.inner.opts.caller_polls && self.inner.recv_cq.arm(false).is_err() {
            log::warn!("arming the receive CQ failed; waiting in 10 ms steps");
        }
        // Completions that came before arming raise no event.
        if self.inner.opts.caller_polls {
            while self.poll_round() {}
        } else {
            self.poll_send_here();
        }
        let guard = self.inner.sleep_lock.lock().expect("sleep lock");
        if self.inner.wakeups.load(Ordering::SeqCst) == seen {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(10));
            drop(
                self.inner
                    .cond
                    .wait_timeout(guard, left)
                    .expect("sleep lock"),
            );
        }
        self.inner.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Waits until `done` returns true (then true) or `deadline` passes (then
    /// false), for a caller whose answer a callback brings, such as the reply
    /// to its request. With [`Options::caller_polls`] the caller polls the
    /// connection itself meanwhile and may run callbacks (see there).
    pub fn wait_for(&self, deadline: Instant, mut done: impl FnMut() -> bool) -> bool {
        let spin = self.inner.opts.spin;
        let mut spin_until = Instant::now() + spin;
        loop {
            // Read before `done`, so a wake in between is not slept through.
            let seen = self.inner.wakeups.load(Ordering::SeqCst);
            if done() {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            if now < spin_until {
                if self.inner.opts.caller_polls {
                    self.poll_round();
                }
                std::hint::spin_loop();
                continue;
            }
            self.sleep(seen, deadline);
            spin_until = Instant::now() + spin;
        }
    }

    /// Arms the send CQ unless it already is.
    fn arm_send(&self) {
        if !self.inner.send_armed.swap(true, Ordering::SeqCst)
            && self.inner.send_cq.arm(false).is_err()
        {
            self.inner.send_armed.store(false, Ordering::SeqCst);
            log::warn!("arming the send CQ failed; its completions wait for the next tick");
        }
    }

    /// Runs `f` holding the receive-poll role: at once when this thread
    /// already holds it, `None` when another thread does.
    fn with_recv_poll<R>(&self, f: impl FnOnce() -> R) -> Option<R> {
        struct Release<'a>(&'a AtomicUsize);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                self.0.store(0, Ordering::Release);
            }
        }
        let me = thread_token();
        if self.inner.recv_poller.load(Ordering::Acquire) == me {
            return Some(f());
        }
        let _guard = match self.inner.recv_poll.try_lock() {
            Ok(g) => g,
            // A callback panicked while polling: the lock itself is sound.
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        self.inner.recv_poller.store(me, Ordering::Release);
        let _release = Release(&self.inner.recv_poller);
        Some(f())
    }

    /// Whether callbacks of this connection run on this thread: the
    /// completion thread, or a caller polling it.
    fn on_callback_thread(&self) -> bool {
        self.inner.rt.cq.is_current()
            || self.inner.recv_poller.load(Ordering::Acquire) == thread_token()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.st.lock().expect("connection lock")
    }

    pub fn state(&self) -> ConnState {
        self.lock().state
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

    /// The errno of the last failure on this connection (0: none).
    pub fn last_errno(&self) -> i32 {
        self.lock().last_errno
    }

    fn set_state(&self, state: ConnState) {
        self.lock().state = state;
        self.wake();
        self.notify_state(state);
    }

    fn notify_state(&self, state: ConnState) {
        self.handler().state_changed(self, state);
    }

    fn post_recv_slot(&self, slot: u32) -> Result<()> {
        let sge = self
            .inner
            .cmd_recv
            .sge(slot as usize * CMD_LEN..(slot as usize + 1) * CMD_LEN);
        // SAFETY: the slot is only read after its receive completes and is
        // reposted only after that; the MR lives as long as the QP.
        unsafe {
            self.inner
                .qp
                .post_recv(wr_id(K_RECV, slot as u64), &[sge])?
        };
        Ok(())
    }

    /// Copies `bytes` into one of our own registered buffers at `offset`.
    ///
    /// # Safety
    /// The range must be inside `mr` and no posted operation may be reading
    /// it; callers hold the state lock, which owns staging and command slots.
    unsafe fn copy_into(mr: &MemoryRegion, offset: usize, bytes: &[u8]) {
        debug_assert!(offset + bytes.len() <= mr.len());
        let dst =
            std::slice::from_raw_parts_mut((mr.addr() as usize + offset) as *mut u8, bytes.len());
        crate::copy::copy(dst, bytes);
    }

    /// Posts a command if a slot and send-queue room are free.
    fn post_cmd(&self, st: &mut State, cmd: Cmd) -> Result<bool> {
        if st.sq_used >= MAX_SEND_WR {
            return Ok(false);
        }
        let Some(slot) = st.cmd_free.pop() else {
            return Ok(false);
        };
        let off = slot as usize * CMD_LEN;
        // SAFETY: the slot is free (its previous send completed); we hold the lock.
        unsafe { Self::copy_into(&self.inner.cmd_send, off, &cmd.encode()) };
        let sge = self.inner.cmd_send.sge(off..off + CMD_LEN);
        // SAFETY: the slot stays untouched until the send completes.
        let posted = unsafe {
            self.inner.qp.post_send(&[SendRequest::new(
                wr_id(K_CMD, slot as u64),
                SendOp::Send,
                &[sge],
            )])
        };
        match posted {
            Ok(()) => {
                st.sq_used += 1;
                Ok(true)
            }
            Err(e) => {
                st.cmd_free.push(slot);
                Err(e.into())
            }
        }
    }

    fn send_reg_local_addr(&self) -> Result<()> {
        let ring = self.inner.recv_ring.remote();
        let mut cmd = Cmd::new(Opcode::RegLocalAddr, ring.addr, ring.len as u32, ring.rkey);
        cmd.recv_depth = self.inner.opts.recv_depth.max(2 * PEER_CMD_RESERVE as u32);
        cmd.ring_use = self.inner.staging.len() as u32;
        let mut st = self.lock();
        if !self.post_cmd(&mut st, cmd)? {
            return Err(Error::InvalidArgument(
                "no room to advertise the receive buffer".into(),
            ));
        }
        Ok(())
    }

    /// Sends a message: the peer's `recv` callback gets exactly these bytes,
    /// whole, in order, once. Returns the bytes accepted. A message that
    /// finds no room in the peer's ring now is copied into the connection's
    /// send queue and posted, in order, as room returns; in blocking mode
    /// outside callbacks the call first waits for room, up to the timeout.
    /// 0 when the send queue is full ([`Options::send_queue_bytes`]), in
    /// blocking mode when the wait timed out, and when a legacy peer's
    /// buffer is used up for good (legacy peers never return space).
    pub fn send(&self, data: &[u8]) -> Result<usize> {
        self.send_message(data, None, None)
    }

    /// RDMA WRITEs `len` bytes from a buffer registered on this connection to
    /// `remote`, then sends `data` as [`Connection::send`] does, both with
    /// one doorbell. The peer has the written bytes when it gets the message
    /// (same queue pair, in order). The write owes no callback and takes no
    /// completion of its own; if it fails, the connection ends.
    ///
    /// # Safety
    /// The local range must stay unchanged until the peer has the message
    /// (for a request, until its reply).
    pub unsafe fn write_then_send(
        &self,
        local_addr: u64,
        lkey: u32,
        remote: RemoteAddr,
        len: u32,
        data: &[u8],
    ) -> Result<usize> {
        if len == 0 {
            return Err(Error::InvalidArgument("length 0".into()));
        }
        let sge = self.check_local(local_addr, lkey, len)?;
        self.send_message(data, None, Some((sge, remote)))
    }

    /// Sends a message that also delivers `imm` to the peer's `recv`
    /// callback. Needs a snowrdma peer (legacy peers cannot receive it).
    pub fn send_with_imm(&self, imm: u32, data: &[u8]) -> Result<usize> {
        self.send_message(data, Some(ExtKind::WithImm(imm)), None)
    }

    /// Writes `data` into the peer's receive buffer without notifying it
    /// (`rdmaConnWrite`); `write_done` fires when the write completes.
    pub fn write_silent(&self, data: &[u8]) -> Result<usize> {
        let legacy = self.lock().peer_version < 1;
        // A legacy peer's buffer is written as the legacy library did; ours
        // is told to skip the bytes so its ring stays in step.
        self.send_message(
            data,
            if legacy { None } else { Some(ExtKind::Silent) },
            None,
        )
        .inspect(|&n| {
            if n > 0 {
                self.handler().write_done(self, n);
            }
        })
    }

    /// Sends a message, after a one-sided write (`before`) when given.
    fn send_message(
        &self,
        data: &[u8],
        ext: Option<ExtKind>,
        before: Option<(Sge, RemoteAddr)>,
    ) -> Result<usize> {
        if data.is_empty() {
            return Err(Error::InvalidArgument("a message cannot be empty".into()));
        }
        let blocking = self.inner.opts.comm_mode == CommMode::Blocking;
        let on_cq_thread = self.on_callback_thread();
        let deadline = Instant::now() + self.inner.opts.timeout.max(Duration::from_secs(1));
        let mut st = self.lock();
        loop {
            self.check_sendable(&st, data.len(), ext)?;
            // Queued messages go first, so order holds.
            if st.queue.is_empty() {
                match self.try_post_message(&mut st, data, ext, before) {
                    Ok(true) => return Ok(data.len()),
                    Ok(false) => {}
                    Err(e) => {
                        if before.is_some() {
                            // The write may be posted without the message:
                            // the send queue's accounting no longer holds.
                            drop(st);
                            self.fail(&format!("posting a write and a message: {e}"));
                        }
                        return Err(e);
                    }
                }
            }
            // Blocking mode waits for room, except inside a callback, where
            // nobody else would hand room back.
            let waits = blocking && !on_cq_thread;
            if waits && Instant::now() < deadline {
                st = self.park(st, deadline);
                continue;
            }
            // A write ahead of the message reads the caller's buffer, which
            // is theirs again once we return: it cannot wait in the queue.
            if waits || before.is_some() {
                return Ok(0);
            }
            return Ok(self.enqueue(st, data, ext, on_cq_thread));
        }
    }

    /// Queues a message that found no room; returns the bytes accepted (0
    /// when the queue is full or a legacy peer's buffer is used up).
    fn enqueue(
        &self,
        mut st: MutexGuard<'_, State>,
        data: &[u8],
        ext: Option<ExtKind>,
        on_cq_thread: bool,
    ) -> usize {
        // A legacy peer never returns space: once what is sent and queued
        // fills its buffer, nothing more will ever fit (the legacy contract:
        // 0, for good).
        if st.peer_version < 1
            && st.tx.in_flight() as usize + st.queue.payload_bytes() + data.len() > st.tx.capacity()
        {
            if !std::mem::replace(&mut st.legacy_exhausted, true) {
                log::warn!(
                    "connection to {:?}: the legacy peer's {} byte buffer is used up; sends return 0 from now on",
                    self.inner.peer,
                    st.tx.capacity()
                );
            }
            return 0;
        }
        match st.queue.push(data, ext) {
            Push::Queued => {}
            Push::Refused { first } => {
                if first {
                    log::warn!(
                        "connection to {:?}: the send queue is full ({} messages, bound {} bytes); \
                         refusing messages until it drains",
                        self.inner.peer,
                        st.queue.len(),
                        self.inner.opts.send_queue_bytes
                    );
                }
                return 0;
            }
        }
        drop(st);
        if !on_cq_thread {
            // The room may come from a send completion, which raises an
            // event only when the send CQ is armed; one that came before
            // arming is taken here.
            self.arm_send();
            if self.poll_send_here() {
                self.flush_queued();
            }
        }
        data.len()
    }

    /// The send queue's counts (messages that waited, were refused, or were
    /// dropped at the end).
    pub fn send_queue_stats(&self) -> SendQueueStats {
        self.lock().queue.stats()
    }

    fn check_sendable(&self, st: &State, len: usize, ext: Option<ExtKind>) -> Result<()> {
        match st.state {
            ConnState::MrReady => {}
            ConnState::Closed | ConnState::Error => return Err(Error::Disconnected),
            _ => return Err(Error::NotConnected),
        }
        if ext.is_some() && st.peer_version < 1 {
            return Err(Error::Unsupported(
                "the peer runs the legacy library, which cannot receive immediates".into(),
            ));
        }
        let header = if ext.is_some() { EXT_HEADER_LEN } else { 0 };
        let cap = st.tx.capacity();
        if len + header > cap {
            return Err(Error::TooLarge {
                len,
                max: cap.saturating_sub(header),
            });
        }
        Ok(())
    }

    /// Posts the message (after the write `before`) if the peer's ring, its
    /// receive queue and our send queue all have room; false when one of
    /// them is full.
    fn try_post_message(
        &self,
        st: &mut State,
        data: &[u8],
        ext: Option<ExtKind>,
        before: Option<(Sge, RemoteAddr)>,
    ) -> Result<bool> {
        let total = data.len() + if ext.is_some() { EXT_HEADER_LEN } else { 0 };
        let msgs_ok = st.peer_version < 1
            || st.tx_msgs - st.tx_msgs_acked
                < u64::from(st.peer_recv_depth).saturating_sub(PEER_CMD_RESERVE);
        let wrs = 1 + u32::from(before.is_some());
        if st.sq_used + wrs > MAX_SEND_WR - CMD_RESERVE || !msgs_ok {
            return Ok(false);
        }
        match st.tx.reserve(total) {
            Some(offset) => self
                .post_message(st, offset, data, ext, before)
                .map(|()| true),
            None => Ok(false),
        }
    }

    /// Sends queued messages while there is room.
    fn flush_queued(&self) {
        let mut st = self.lock();
        if let Err(e) = self.post_queued(&mut st) {
            drop(st);
            self.fail(&format!("sending a queued message: {e}"));
        }
    }

    /// Posts queued messages while there is room, under the state lock.
    fn post_queued(&self, st: &mut State) -> Result<()> {
        while let Some(q) = st.queue.pop() {
            match self.try_post_message(st, &q.data, q.ext, None) {
                Ok(true) => {}
                Ok(false) => {
                    st.queue.unpop(q);
                    return Ok(());
                }
                Err(e) => {
                    st.queue.unpop(q);
                    return Err(e);
                }
            }
        }
        if let Some(ep) = st.queue.end_episode() {
            log::warn!(
                "connection to {:?}: the send queue drained; {} messages ({} bytes) were refused while it was full",
                self.inner.peer,
                ep.refused,
                ep.refused_bytes
            );
        }
        Ok(())
    }

    fn post_message(
        &self,
        st: &mut State,
        offset: usize,
        data: &[u8],
        ext: Option<ExtKind>,
        before: Option<(Sge, RemoteAddr)>,
    ) -> Result<()> {
        let peer = st.peer_ring.ok_or(Error::NotConnected)?;
        let mut len = data.len();
        // SAFETY: [offset, offset+total) was just reserved, so no in-flight
        // write reads it; we hold the state lock.
        unsafe {
            match ext {
                Some(kind) => {
                    Self::copy_into(&self.inner.staging, offset, &kind.encode());
                    Self::copy_into(&self.inner.staging, offset + EXT_HEADER_LEN, data);
                    len += EXT_HEADER_LEN;
                }
                None => Self::copy_into(&self.inner.staging, offset, data),
            }
        }
        let imm = offset as u32 | if ext.is_some() { IMM_EXTENDED } else { 0 };
        let sge = self.inner.staging.sge(offset..offset + len);
        let op = SendOp::WriteWithImm(peer.at(offset as u64), imm);
        // Only every SIGNAL_EVERY-th message asks for a completion; it
        // accounts for the unsignaled requests before it (completions are in
        // order), which saves the completion thread most of the work. A
        // write ahead of the message is one of those.
        let wrs = 1 + u32::from(before.is_some());
        let covered = st.unsignaled_data + wrs;
        let sges = [sge];
        let mut req = SendRequest::new(wr_id(K_DATA, covered as u64), op, &sges);
        let signal = covered >= SIGNAL_EVERY || st.sq_used + wrs >= MAX_SEND_WR - CMD_RESERVE;
        if !signal {
            req = req.unsignaled();
        }
        // Inline, the device takes the bytes with the work request instead of
        // fetching them through the staging registration.
        if len <= self.inner.opts.max_inline_data as usize {
            req = req.inline();
        }
        match before {
            Some((local, remote)) => {
                let local = [local];
                let write =
                    SendRequest::new(wr_id(K_DATA, 0), SendOp::Write(remote), &local).unsignaled();
                // SAFETY: the caller keeps the written range unchanged until
                // the peer has the message; the staging range stays reserved
                // until the peer returns it, after this write has landed.
                unsafe { self.inner.qp.post_send(&[write, req])? }
            }
            // SAFETY: the staging range stays reserved until the peer
            // returns it, which is after this write has landed.
            None => unsafe { self.inner.qp.post_send(&[req])? },
        }
        st.unsignaled_data = if signal { 0 } else { covered };
        st.sq_used += wrs;
        st.tx_msgs += 1;
        Ok(())
    }

    /// Registers a zeroed buffer of `size` bytes for local write and remote
    /// read/write on this connection; it lives until [`Connection::deregister`]
    /// or the connection's end.
    pub fn register(&self, size: usize) -> Result<*mut rdma_sys::ibv_mr> {
        let access =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let mr = self.inner.pd.allocate(size, access)?;
        let raw = mr.as_raw();
        self.inner
            .user_mrs
            .lock()
            .expect("mr lock")
            .insert(raw as usize, mr);
        Ok(raw)
    }

    /// Deregisters and frees a buffer from [`Connection::register`]; false
    /// when `mr` is not one of this connection's.
    pub fn deregister(&self, mr: *mut rdma_sys::ibv_mr) -> bool {
        self.inner
            .user_mrs
            .lock()
            .expect("mr lock")
            .remove(&(mr as usize))
            .is_some()
    }

    /// Checks that `[addr, addr+len)` lies in a buffer registered on this
    /// connection under `lkey`.
    fn check_local(&self, addr: u64, lkey: u32, len: u32) -> Result<Sge> {
        let mrs = self.inner.user_mrs.lock().expect("mr lock");
        let own = [&self.inner.recv_ring, &self.inner.staging];
        let found = mrs.values().chain(own).find(|mr| mr.lkey() == lkey);
        match found {
            None => Err(Error::InvalidArgument(format!(
                "lkey {lkey:#x} is not a buffer registered on this connection (rdmaConnRegMem)"
            ))),
            Some(mr) if addr < mr.addr() || addr + len as u64 > mr.addr() + mr.len() as u64 => {
                Err(Error::InvalidArgument(format!(
                    "{len} bytes at {addr:#x} are outside the registered buffer of lkey {lkey:#x}"
                )))
            }
            Some(_) => Ok(Sge {
                addr,
                length: len,
                lkey,
            }),
        }
    }

    /// Posts one-sided READs or WRITEs with one doorbell; returns the op id
    /// of the first for sync waits (the others follow it in order). Async
    /// posts are one at a time.
    fn post_one_sided(&self, read: bool, ops: &[(Sge, RemoteAddr)], sync: bool) -> Result<u64> {
        let n = ops.len() as u32;
        if ops.iter().any(|(local, _)| local.length == 0) {
            return Err(Error::InvalidArgument("length 0".into()));
        }
        debug_assert!(sync || n == 1);
        if n > MAX_SEND_WR / 2 {
            return Err(Error::InvalidArgument(format!(
                "{n} operations at once (at most {})",
                MAX_SEND_WR / 2
            )));
        }
        let deadline = Instant::now() + self.inner.opts.timeout.max(Duration::from_secs(1));
        let mut st = self
            .wait_until(deadline, |st| match st.state {
                ConnState::Closed | ConnState::Error => Some(Err(Error::Disconnected)),
                ConnState::Connected | ConnState::MrReady
                    if st.sq_used + n <= MAX_SEND_WR - CMD_RESERVE =>
                {
                    Some(Ok(()))
                }
                ConnState::Connected | ConnState::MrReady => None,
                _ => Some(Err(Error::NotConnected)),
            })
            .and_then(|room| room)
            .map(|()| self.lock())?;
        let first = st.next_op;
        let ids: Vec<u64> = if sync {
            st.next_op += u64::from(n);
            (first..first + u64::from(n))
                .map(|id| {
                    st.sync_ops.insert(id, None);
                    wr_id(K_SYNC, id)
                })
                .collect()
        } else {
            // Armed before posting, so the completion raises an event.
            self.inner.async_pending.fetch_add(1, Ordering::SeqCst);
            self.arm_send();
            vec![wr_id(
                if read { K_READ } else { K_WRITE },
                ops[0].0.length as u64,
            )]
        };
        let sges: Vec<[Sge; 1]> = ops.iter().map(|(local, _)| [*local]).collect();
        let reqs: Vec<SendRequest> = ops
            .iter()
            .zip(&sges)
            .zip(&ids)
            .map(|(((_, remote), sge), &id)| {
                let op = if read {
                    SendOp::Read(*remote)
                } else {
                    SendOp::Write(*remote)
                };
                SendRequest::new(id, op, sge)
            })
            .collect();
        // SAFETY: the caller's buffers were checked to be registered here;
        // the C contract (and `read`/`write`'s docs) leave them to the device
        // until the completion.
        let posted = unsafe { self.inner.qp.post_send(&reqs) };
        if let Err(e) = posted {
            if n > 1 {
                // A prefix of the list may be posted, and its completions
                // still come: only the connection's end is safe.
                drop(st);
                self.fail(&format!("posting one-sided operations: {e}"));
            } else if sync {
                st.sync_ops.remove(&first);
            } else {
                self.inner.async_pending.fetch_sub(1, Ordering::SeqCst);
            }
            return Err(e.into());
        }
        st.sq_used += n;
        Ok(first)
    }

    /// Starts an RDMA READ of `len` bytes from `remote` into a buffer
    /// registered on this connection; `read_done` fires on completion.
    ///
    /// # Safety
    /// The local range must not be read or freed until `read_done`.
    pub unsafe fn read(
        &self,
        local_addr: u64,
        lkey: u32,
        remote: RemoteAddr,
        len: u32,
    ) -> Result<usize> {
        self.one_sided_async(true, local_addr, lkey, remote, len)
    }

    /// Starts an RDMA WRITE; `write_done` fires on completion.
    ///
    /// # Safety
    /// The local range must not be changed or freed until `write_done`.
    pub unsafe fn write(
        &self,
        local_addr: u64,
        lkey: u32,
        remote: RemoteAddr,
        len: u32,
    ) -> Result<usize> {
        self.one_sided_async(false, local_addr, lkey, remote, len)
    }

    fn one_sided_async(
        &self,
        read: bool,
        local_addr: u64,
        lkey: u32,
        remote: RemoteAddr,
        len: u32,
    ) -> Result<usize> {
        let sge = self.check_local(local_addr, lkey, len)?;
        self.post_one_sided(read, &[(sge, remote)], false)
            .map(|_| len as usize)
    }

    /// RDMA READ that returns once its own completion arrived (an error if
    /// it failed, which also ends the connection).
    pub fn read_sync(
        &self,
        local_addr: u64,
        lkey: u32,
        remote: RemoteAddr,
        len: u32,
    ) -> Result<usize> {
        self.one_sided_sync(true, local_addr, lkey, remote, len)
    }

    /// Several RDMA READs into one registered buffer (`lkey`), posted with
    /// one doorbell so they are in flight together; returns once all have
    /// completed. `ops`: (local address, remote, length) each. An error if
    /// any failed (which also ends the connection).
    pub fn read_sync_many(&self, lkey: u32, ops: &[(u64, RemoteAddr, u32)]) -> Result<()> {
        // SAFETY: waited for before returning (and the guard is not leaked).
        unsafe { self.start_reads(lkey, ops)? }.wait_through(usize::MAX)
    }

    /// Posts RDMA READs as [`Connection::read_sync_many`] does (one
    /// doorbell) and returns without waiting; the guard waits for them one
    /// by one, in order, so the first values can be used while the rest are
    /// still in flight.
    ///
    /// # Safety
    /// The local ranges belong to the device until their READ has been
    /// waited for. The guard waits for all of them when dropped; it must not
    /// be leaked (`mem::forget`).
    pub unsafe fn start_reads(
        &self,
        lkey: u32,
        ops: &[(u64, RemoteAddr, u32)],
    ) -> Result<PendingReads<'_>> {
        let checked = ops
            .iter()
            .map(|&(local, remote, len)| Ok((self.check_local(local, lkey, len)?, remote)))
            .collect::<Result<Vec<_>>>()?;
        let first = if checked.is_empty() {
            0
        } else {
            self.post_one_sided(true, &checked, true)?
        };
        Ok(PendingReads {
            conn: self,
            first,
            done: first,
            end: first + checked.len() as u64,
        })
    }

    /// RDMA WRITE that returns once its own completion arrived.
    pub fn write_sync(
        &self,
        local_addr: u64,
        lkey: u32,
        remote: RemoteAddr,
        len: u32,
    ) -> Result<usize> {
        self.one_sided_sync(false, local_addr, lkey, remote, len)
    }

    fn one_sided_sync(
        &self,
        read: bool,
        local_addr: u64,
        lkey: u32,
        remote: RemoteAddr,
        len: u32,
    ) -> Result<usize> {
        let sge = self.check_local(local_addr, lkey, len)?;
        self.sync_ops(read, &[(sge, remote)]).map(|()| len as usize)
    }

    fn sync_ops(&self, read: bool, ops: &[(Sge, RemoteAddr)]) -> Result<()> {
        let first = self.post_one_sided(read, ops, true)?;
        self.wait_sync_ops(first..first + ops.len() as u64)
    }

    /// Waits for the synchronous operations `ids` and forgets them.
    fn wait_sync_ops(&self, ids: std::ops::Range<u64>) -> Result<()> {
        let result = self.wait_until(Instant::now() + SYNC_OP_TIMEOUT, |st| {
            let mut outcome = Ok(());
            for id in ids.clone() {
                match st.sync_ops.get(&id) {
                    Some(Some(Err(reason))) => outcome = outcome.and(Err(reason.clone())),
                    Some(Some(Ok(()))) => {}
                    Some(None) => return None,
                    None => return Some(Err("the connection closed".to_string())),
                }
            }
            for id in ids.clone() {
                st.sync_ops.remove(&id);
            }
            Some(outcome)
        });
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(reason)) => Err(Error::OperationFailed(reason)),
            Err(e) => {
                let mut st = self.lock();
                for id in ids {
                    st.sync_ops.remove(&id);
                }
                drop(st);
                if matches!(e, Error::Timeout(_)) {
                    // Stop the device from touching the buffers any later.
                    self.fail("a synchronous operation timed out");
                }
                Err(e)
            }
        }
    }

    /// Waits until `check` gives a value. On the completion thread (inside a
    /// callback) it handles this connection's completions itself, since
    /// nobody else will.
    fn wait_until<T>(
        &self,
        deadline: Instant,
        mut check: impl FnMut(&mut State) -> Option<T>,
    ) -> Result<T> {
        let on_cq_thread = self.on_callback_thread();
        loop {
            {
                let mut st = self.lock();
                if let Some(v) = check(&mut st) {
                    return Ok(v);
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(Error::Timeout("waiting on the connection".into()));
                }
                if !on_cq_thread {
                    drop(self.park(st, deadline));
                    continue;
                }
            }
            if self.drive_inline() == 0 {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Polls one CQ once and dispatches what it got; the send CQ under its
    /// lock. Returns how many completions there were.
    fn poll_cq(&self, send: bool, wcs: &mut [Completion], inline: bool) -> usize {
        let _guard = send.then(|| self.inner.send_poll.lock().expect("poll lock"));
        let cq = if send {
            &self.inner.send_cq
        } else {
            &self.inner.recv_cq
        };
        let n = match cq.poll(wcs) {
            Ok(n) => n,
            Err(e) => {
                log::error!("polling the CQ failed: {e}");
                return 0;
            }
        };
        for wc in &wcs[..n] {
            self.dispatch(wc, inline);
        }
        n
    }

    /// A waiting thread (not the completion thread) takes its own send
    /// completions when nobody else is polling; callbacks they owe are left
    /// to the completion thread.
    fn poll_send_here(&self) -> bool {
        let Ok(_guard) = self.inner.send_poll.try_lock() else {
            return false;
        };
        let mut wcs: [Completion; 4] = Default::default();
        let n = match self.inner.send_cq.poll(&mut wcs) {
            Ok(n) => n,
            Err(_) => return false,
        };
        for wc in &wcs[..n] {
            self.dispatch(wc, false);
        }
        n > 0
    }

    /// Handles this connection's pending completions from inside a callback;
    /// callbacks are queued to run after the current one returns.
    fn drive_inline(&self) -> usize {
        let mut wcs: [Completion; 16] = Default::default();
        let mut handled = 0;
        loop {
            let n = self
                .with_recv_poll(|| self.poll_cq(false, &mut wcs, true))
                .unwrap_or(0)
                + self.poll_cq(true, &mut wcs, true);
            if n == 0 {
                return handled;
            }
            handled += n;
        }
    }

    /// Handles everything on both CQs (completion thread, top level), unless
    /// a caller is polling the connection right now.
    pub(crate) fn process_completions(&self) {
        self.take_cq_event();
        self.with_recv_poll(|| self.drain_and_arm());
    }

    /// Takes the completion channel's event, if there is one.
    fn take_cq_event(&self) {
        let channel = self
            .inner
            .recv_cq
            .channel()
            .expect("connections have a completion channel");
        if let Err(e) = channel.get_event(Duration::ZERO) {
            log::error!("completion channel: {e}");
        }
        // The event may have been the send CQ's, which disarms it.
        self.inner.send_armed.store(false, Ordering::SeqCst);
    }

    fn drain_and_arm(&self) {
        let mut batch: [Completion; MAX_POLL_BATCH] = Default::default();
        let take = (self.inner.opts.max_concurrent_work_requests as usize).clamp(1, MAX_POLL_BATCH);
        let wcs = &mut batch[..take];
        loop {
            let mut n = self.poll_cq(false, wcs, false) + self.poll_cq(true, wcs, false);
            if n == 0 {
                // Callers poll their own connection while they wait and arm
                // it when they sleep; unwatched, it is looked at every tick.
                if self.inner.opts.caller_polls && self.inner.sleepers.load(Ordering::SeqCst) == 0 {
                    self.after_round();
                    return;
                }
                // Arm, then poll once more: a completion that arrived before
                // arming would otherwise wait for the next one.
                if self.inner.recv_cq.arm(false).is_err() {
                    return;
                }
                if self.inner.async_pending.load(Ordering::SeqCst) > 0
                    || self.inner.sleepers.load(Ordering::SeqCst) > 0
                    || !self.lock().queue.is_empty()
                {
                    self.arm_send();
                }
                n = self.poll_cq(false, wcs, false) + self.poll_cq(true, wcs, false);
            }
            self.after_round();
            if n == 0 {
                return;
            }
        }
    }

    fn dispatch(&self, wc: &Completion, inline: bool) {
        let kind = wc.wr_id() >> KIND_SHIFT;
        let low = wc.wr_id() & LOW_MASK;
        if !wc.is_ok() {
            let ending = matches!(self.state(), ConnState::Closed | ConnState::Error)
                || self.inner.peer_left.load(Ordering::SeqCst);
            if kind == K_SYNC {
                let reason = format!("completed with {}", wc.status());
                if let Some(slot) = self.lock().sync_ops.get_mut(&low) {
                    *slot = Some(Err(reason));
                }
            }
            if !(ending && wc.status() == WcStatus::WR_FLUSH_ERR) {
                self.fail(&format!(
                    "work request {:#x} completed with {}",
                    wc.wr_id(),
                    wc.status()
                ));
            }
            self.wake();
            return;
        }
        match kind {
            K_RECV => {
                match wc.opcode() {
                    WcOpcode::RECV => self.handle_cmd(low as u32, wc.byte_len() as usize),
                    WcOpcode::RECV_RDMA_WITH_IMM => {
                        self.handle_message(wc.imm().unwrap_or(0), wc.byte_len() as usize, inline)
                    }
                    other => log::warn!("unexpected receive completion {other}"),
                }
                if !matches!(self.state(), ConnState::Closed | ConnState::Error) {
                    if let Err(e) = self.post_recv_slot(low as u32) {
                        self.fail(&format!("reposting a receive: {e}"));
                    }
                }
            }
            K_DATA => {
                let mut st = self.lock();
                st.sq_used = st.sq_used.saturating_sub(low as u32);
                drop(st);
                self.wake();
            }
            K_CMD => {
                let mut st = self.lock();
                st.sq_used -= 1;
                st.cmd_free.push(low as u16);
                drop(st);
                // A closing thread waits for its goodbye to complete.
                self.wake();
            }
            K_WRITE | K_READ => {
                self.inner.async_pending.fetch_sub(1, Ordering::SeqCst);
                self.lock().sq_used -= 1;
                self.wake();
                let done = if kind == K_WRITE {
                    Deferred::WriteDone(low as usize)
                } else {
                    Deferred::ReadDone(low as usize)
                };
                self.callback(done, inline);
            }
            K_SYNC => {
                let mut st = self.lock();
                st.sq_used -= 1;
                if let Some(slot) = st.sync_ops.get_mut(&low) {
                    *slot = Some(Ok(()));
                }
                drop(st);
                self.wake();
            }
            _ => log::error!("completion with unknown work request id {:#x}", wc.wr_id()),
        }
    }

    fn handle_cmd(&self, slot: u32, len: usize) {
        let off = slot as usize * CMD_LEN;
        let bytes = &self.inner.cmd_recv.as_slice()[off..off + CMD_LEN];
        let cmd = match Cmd::decode(&bytes[..len.min(CMD_LEN)]) {
            Ok(c) => c,
            Err(e) => return self.fail(&format!("bad command from the peer: {e}")),
        };
        match cmd.opcode {
            Opcode::RegLocalAddr => {
                let ring = RemoteRegion {
                    addr: cmd.addr,
                    len: cmd.length as u64,
                    rkey: cmd.key,
                };
                let first = {
                    let mut st = self.lock();
                    st.peer_ring = Some(ring);
                    st.peer_version = cmd.version;
                    st.peer_recv_depth = cmd.recv_depth;
                    // A REG_LOCAL_ADDR restarts the sender at offset 0; our
                    // staging buffer bounds how much of the peer's ring we use.
                    st.tx
                        .reset((cmd.length as usize).min(self.inner.staging.len()));
                    st.tx_msgs = 0;
                    st.tx_msgs_acked = 0;
                    // On the accepting side the peer's advertisement can be
                    // handled before the CM thread has seen ESTABLISHED.
                    let first = matches!(st.state, ConnState::Connected | ConnState::Accepting);
                    if first {
                        st.state = ConnState::MrReady;
                        // The peer wraps where its staging buffer ends, when
                        // that is before the end of our ring (RC delivers
                        // this before any of its messages).
                        let own = self.inner.recv_ring.len();
                        let cap = match cmd.ring_use as usize {
                            0 => own,
                            n => n.min(own),
                        };
                        st.rx = RecvRing::new(cap);
                    }
                    first
                };
                self.wake();
                let h = self.handler();
                h.peer_buffer(self, ring);
                if first {
                    h.state_changed(self, ConnState::MrReady);
                    h.connected(self);
                }
            }
            Opcode::RegPhysAddr => {
                self.lock().peer_pa_rkey = Some(cmd.key);
                log::info!("peer offers physical-address access (rkey {:#x}); PA operations are unavailable here", cmd.key);
            }
            Opcode::ConnGoodbye => log::debug!("peer said goodbye"),
            Opcode::Credit => {
                let mut st = self.lock();
                if !st.tx.ack(cmd.addr) {
                    drop(st);
                    return self.fail("the peer returned credit it was never given");
                }
                let acked = st.tx_msgs_acked;
                st.tx_msgs_acked = acked + u64::from(cmd.length.wrapping_sub(acked as u32));
                drop(st);
                self.wake();
            }
        }
    }

    fn handle_message(&self, imm: u32, len: usize, inline: bool) {
        let delivery = Delivery {
            offset: (imm & !IMM_EXTENDED) as usize,
            len,
            extended: imm & IMM_EXTENDED != 0,
        };
        if delivery.offset + len > self.inner.recv_ring.len() {
            return self.fail(&format!(
                "the peer wrote {len} bytes at {} outside the ring",
                delivery.offset
            ));
        }
        self.callback(Deferred::Message(delivery), inline);
    }

    /// Runs a callback now when this is the completion thread at top level
    /// and nothing is owed before it; queues it otherwise (in order), and
    /// wakes the completion thread when another thread queued it.
    fn callback(&self, cb: Deferred, inline: bool) {
        let on_cq_thread = self.on_callback_thread();
        {
            let mut st = self.lock();
            if inline || !on_cq_thread || !st.deferred.is_empty() {
                st.deferred.push_back(cb);
                drop(st);
                if !on_cq_thread {
                    self.inner.owed.store(true, Ordering::Release);
                    self.inner.rt.cq.wake();
                }
                return;
            }
        }
        self.run_callback(cb);
    }

    fn run_callback(&self, cb: Deferred) {
        match cb {
            Deferred::Message(d) => self.deliver(d),
            Deferred::WriteDone(len) => self.handler().write_done(self, len),
            Deferred::ReadDone(len) => self.handler().read_done(self, len),
        }
    }

    fn deliver_deferred(&self) {
        loop {
            let Some(cb) = self.lock().deferred.pop_front() else {
                return;
            };
            self.run_callback(cb);
        }
    }

    fn deliver(&self, d: Delivery) {
        {
            let mut st = self.lock();
            if !matches!(st.state, ConnState::MrReady | ConnState::Connected) {
                return;
            }
            if !st.rx.accept(d.offset, d.len) {
                drop(st);
                return self.fail(&format!(
                    "the peer wrote {} bytes at {}, out of order",
                    d.len, d.offset
                ));
            }
            st.rx_msgs += 1;
        }
        let bytes = &self.inner.recv_ring.as_slice()[d.offset..d.offset + d.len];
        let h = self.handler();
        if !d.extended {
            return h.recv(self, bytes, None);
        }
        match (ExtKind::decode(bytes), bytes.get(EXT_HEADER_LEN..)) {
            (Some(ExtKind::Silent), _) => {}
            (Some(ExtKind::WithImm(imm)), Some(payload)) => h.recv(self, payload, Some(imm)),
            _ => self.fail("the peer sent a malformed extended message"),
        }
    }

    /// Returns consumed ring space to the peer once an eighth of the ring or
    /// of the receive queue is waiting, or whatever is waiting when `force`d
    /// (every tick of the completion thread), so a sender never waits longer
    /// than a tick while one credit message covers many messages.
    fn maybe_send_credit(&self, force: bool) {
        let mut st = self.lock();
        if st.peer_version < 1 || st.state != ConnState::MrReady {
            return;
        }
        let unreported = st.rx.unreported();
        let unreported_msgs = st.rx_msgs - st.rx_msgs_reported;
        let enough = unreported >= self.inner.recv_ring.len() as u64 / 8
            || unreported_msgs >= u64::from(self.inner.opts.recv_depth / 8).max(1);
        if unreported == 0 || !(force || enough) {
            return;
        }
        // No free slot: a command completion will free one, and a later
        // round sends the credit (still unreported until then).
        if st.cmd_free.is_empty() || st.sq_used >= MAX_SEND_WR {
            return;
        }
        let consumed = st.rx.take_report();
        st.rx_msgs_reported = st.rx_msgs;
        let cmd = Cmd::new(Opcode::Credit, consumed, st.rx_msgs as u32, 0);
        if let Err(e) = self.post_cmd(&mut st, cmd) {
            drop(st);
            self.fail(&format!("returning credit: {e}"));
        }
    }

    /// After completions were handled: owed callbacks, then credit, then
    /// messages that waited for room.
    /// Last, a wake, for callers waiting on what a callback did.
    fn after_round(&self) {
        self.deliver_deferred();
        self.maybe_send_credit(false);
        self.flush_queued();
        if self.inner.peer_left.load(Ordering::SeqCst) {
            self.finish_peer_left();
        }
        self.wake();
    }

    /// The peer disconnected (RDMA CM DISCONNECTED, or its socket closed;
    /// runtime thread). What it sent before is still in the receive CQ:
    /// the thread that polls completions delivers that first, then ends the
    /// connection ([`Connection::finish_peer_left`]).
    pub(crate) fn peer_left(&self) {
        if self.inner.peer_left.swap(true, Ordering::SeqCst) {
            return;
        }
        if self.inner.cq_source.load(Ordering::SeqCst) == 0 {
            // Nobody polls: end it here.
            return self.peer_disconnected();
        }
        self.inner.owed.store(true, Ordering::Release);
        self.inner.rt.cq.wake();
        self.wake();
    }

    /// Delivers every message the peer sent before it left, then ends the
    /// connection (on the thread holding the receive-poll role).
    fn finish_peer_left(&self) {
        let mut wcs: [Completion; 16] = Default::default();
        while self.poll_cq(false, &mut wcs, false) > 0 {}
        self.deliver_deferred();
        self.peer_disconnected();
    }

    /// One non-blocking pass over both CQs (a spinning thread): returns
    /// whether there was anything; drain with `while poll_round() {}`.
    pub(crate) fn poll_round(&self) -> bool {
        self.with_recv_poll(|| {
            // Small: this runs in spin loops, mostly finding nothing, and the
            // array is zeroed each time.
            let mut wcs: [Completion; 4] = Default::default();
            // One pass, not until empty: the caller's loop comes back at
            // once, and a waiting caller gets to see its reply a pass sooner.
            let n = self.poll_cq(false, &mut wcs, false) + self.poll_cq(true, &mut wcs, false);
            // Checked without the state lock: this runs in the spin loop.
            let owed = self.inner.owed.swap(false, Ordering::AcqRel);
            if n > 0 || owed {
                self.after_round();
            }
            n > 0
        })
        .unwrap_or(false)
    }

    /// Ends the connection after a failure: state Error, waiters woken,
    /// `disconnected` fired once, the peer told.
    pub(crate) fn fail(&self, reason: &str) {
        {
            let mut st = self.lock();
            if matches!(st.state, ConnState::Closed | ConnState::Error) {
                return;
            }
            log::warn!("connection to {:?} failed: {reason}", self.inner.peer);
            st.state = ConnState::Error;
            st.last_errno = libc::ECONNABORTED;
            for slot in st.sync_ops.values_mut() {
                slot.get_or_insert_with(|| Err(reason.to_string()));
            }
        }
        self.wake();
        self.disconnect_link();
        self.notify_state(ConnState::Error);
        self.fire_disconnected();
        // Again, for waiters whose answer the callback gave.
        self.wake();
        if self.inner.kind == ConnKind::Accepted {
            self.retire();
        }
    }

    fn fire_disconnected(&self) {
        if !self.inner.closed_locally.load(Ordering::SeqCst)
            && !self.inner.disconnect_fired.swap(true, Ordering::SeqCst)
        {
            self.handler().disconnected(self);
        }
    }

    /// The QPs are connected: an accepted connection moves on, and each
    /// side advertises its ring.
    fn established(&self) {
        let upgraded = {
            let mut st = self.lock();
            let accepting = st.state == ConnState::Accepting;
            if accepting {
                st.state = ConnState::Connected;
            }
            accepting
        };
        if upgraded {
            self.notify_state(ConnState::Connected);
        }
        if let Err(e) = self.send_reg_local_addr() {
            self.fail(&format!("advertising the receive buffer: {e}"));
        }
    }

    /// Ends the connection after the peer left.
    fn peer_disconnected(&self) {
        let was = {
            let mut st = self.lock();
            let was = st.state;
            if !matches!(was, ConnState::Closed | ConnState::Error) {
                st.state = ConnState::Closed;
            }
            for slot in st.sync_ops.values_mut() {
                slot.get_or_insert_with(|| Err("the peer disconnected".into()));
            }
            was
        };
        self.wake();
        // Answer, so the peer's own DISCONNECTED arrives.
        self.disconnect_link();
        if !matches!(was, ConnState::Closed | ConnState::Error) {
            self.notify_state(ConnState::Closed);
            self.fire_disconnected();
            self.wake();
        }
        if self.inner.kind == ConnKind::Accepted {
            self.retire();
        }
    }

    /// An RDMA CM event for this connection (CM thread).
    pub(crate) fn on_cm_event(&self, ev: &CmEvent) {
        match ev.kind {
            CmEventKind::ESTABLISHED => self.established(),
            CmEventKind::DISCONNECTED => self.peer_left(),
            CmEventKind::REJECTED
            | CmEventKind::UNREACHABLE
            | CmEventKind::CONNECT_ERROR
            | CmEventKind::DEVICE_REMOVAL => {
                self.fail(&format!("{} (status {})", ev.kind, ev.status));
            }
            _ => log::debug!("RDMA CM event {} on a connection", ev.kind),
        }
    }

    /// Stops the runtime's watch over this connection.
    fn unwatch(&self) {
        let cm = self.inner.cm_source.swap(0, Ordering::SeqCst);
        if cm != 0 {
            self.inner.rt.cm.remove(cm);
        }
        let cq = self.inner.cq_source.swap(0, Ordering::SeqCst);
        if cq != 0 {
            self.inner.rt.cq.remove(cq);
        }
    }

    /// Says how much the send queue was used, once the connection ended
    /// (how often messages found no room is a measure of flow control).
    fn log_queue_use(&self) {
        let s = self.lock().queue.stats();
        if s.queued > 0 || s.refused > 0 {
            log::info!(
                "connection to {:?}: {} messages waited in the send queue (at most {} bytes at once), {} were refused, {} dropped",
                self.inner.peer,
                s.queued,
                s.peak_bytes,
                s.refused,
                s.dropped
            );
        }
    }

    /// While closing: waits until `done` holds, the connection ends, or
    /// `deadline`, posting queued messages as room returns (inside a
    /// callback no completion round would).
    fn wait_closing(&self, deadline: Instant, done: impl Fn(&State) -> bool) {
        let mut failed = None;
        let _ = self.wait_until(deadline, |st| {
            if let Err(e) = self.post_queued(st) {
                failed = Some(e);
                return Some(());
            }
            (done(st) || st.state != ConnState::MrReady).then_some(())
        });
        if let Some(e) = failed {
            self.fail(&format!("sending a queued message: {e}"));
        }
    }

    /// The runtime lets go of an accepted connection that ended (once: a
    /// failure and the peer's disconnect may both get here).
    fn retire(&self) {
        if self.inner.retired.swap(true, Ordering::SeqCst) {
            return;
        }
        self.log_queue_use();
        self.unwatch();
        self.inner.rt.forget_accepted(self);
        self.handler().retired(self);
    }

    /// Closes the connection: says goodbye to the peer, disconnects, and
    /// frees everything once the last handle is gone. No callback fires for a
    /// local close; a second close does nothing.
    pub fn close(&self) {
        if self.inner.closed_locally.swap(true, Ordering::SeqCst) {
            return;
        }
        let deadline = Instant::now() + self.inner.opts.timeout.max(Duration::from_secs(1));
        // Queued messages were accepted: they go first, while the peer
        // returns room (bounded by the timeout).
        self.wait_closing(deadline, |st| st.queue.is_empty());
        let (was, goodbye) = {
            let mut st = self.lock();
            let was = st.state;
            let goodbye = was == ConnState::MrReady
                && matches!(
                    self.post_cmd(&mut st, Cmd::new(Opcode::ConnGoodbye, 0, 0, 0)),
                    Ok(true)
                );
            let (n, bytes) = st.queue.drop_all();
            if n > 0 {
                log::warn!(
                    "connection to {:?} closed with {n} messages ({bytes} bytes) still queued: the peer returned no room in time; they are dropped",
                    self.inner.peer
                );
            }
            (was, goodbye)
        };
        if goodbye {
            // The goodbye completes after every message before it has
            // landed: disconnecting earlier could flush them unsent.
            self.wait_closing(deadline, |st| st.cmd_free.len() == CMD_SLOTS as usize);
        }
        {
            let mut st = self.lock();
            st.state = ConnState::Closed;
            for slot in st.sync_ops.values_mut() {
                slot.get_or_insert_with(|| Err("the connection was closed".into()));
            }
        }
        self.wake();
        if matches!(was, ConnState::Connected | ConnState::MrReady) || self.socket_link().is_some()
        {
            self.disconnect_link();
        }
        self.notify_state(ConnState::Closed);
        self.unwatch();
        if self.inner.kind == ConnKind::Accepted {
            self.inner.rt.forget_accepted(self);
        }
    }
}

/// Connection setup crosses the wire several times; each step gets the
/// configured timeout, and the whole at least a few seconds.
fn setup_time(opts: &Options) -> Duration {
    (opts.timeout * 4).max(Duration::from_secs(5))
}

/// Logs once per process that physical-address access is unavailable.
pub(crate) fn warn_no_phys_addr() {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        log::warn!(
            "physical-address access needs MLNX_OFED experimental verbs (ibv_exp_reg_mr), which this \
             rdma-core stack lacks: PA operations will fail with RDMA_ERR"
        )
    });
}

/// The completion channel of one connection, watched by the completion thread.
pub(crate) struct CqSource(pub(crate) Connection);

impl super::poller::Source for CqSource {
    fn fd(&self) -> std::os::fd::RawFd {
        self.0.inner.recv_cq.channel().map_or(-1, |c| c.fd())
    }

    fn ready(&self) {
        self.0.process_completions();
    }

    fn poll_once(&self) -> bool {
        // A caller-polled connection is left to its waiters (both polling one
        // CQ would only fight over its lock); sleeping ones arm it.
        !self.0.inner.opts.caller_polls && self.0.poll_round()
    }

    fn woken(&self) -> bool {
        if self.0.inner.opts.caller_polls {
            self.ready();
            return false;
        }
        // The spinning thread polls it from now on: no re-arming.
        self.0.take_cq_event();
        self.0.poll_round();
        true
    }

    fn tick(&self) {
        if self.0.inner.opts.caller_polls {
            // Nobody may be waiting on it: what came meanwhile is handled now.
            while self.0.poll_round() {}
        }
        self.0.maybe_send_credit(true);
    }
}

/// RDMA CM event sources: a client connection's own channel, or a listener's
/// (which also carries its accepted connections' events).
pub(crate) enum CmSource {
    Client(Connection),
    Listener(super::listener::Listener),
}

impl super::poller::Source for CmSource {
    fn fd(&self) -> std::os::fd::RawFd {
        match self {
            CmSource::Client(c) => c.cm_id().map_or(-1, |id| id.channel().fd()),
            CmSource::Listener(l) => l.fd(),
        }
    }

    fn ready(&self) {
        let channel = match self {
            CmSource::Client(c) => match c.cm_id() {
                Some(id) => id.channel().clone(),
                None => return,
            },
            CmSource::Listener(l) => match l.cm_id() {
                Some(id) => id.channel().clone(),
                None => return l.accept_sockets(),
            },
        };
        loop {
            let ev = match channel.get_event(Duration::ZERO) {
                Ok(ev) => ev,
                Err(verbs::Error::Timeout { .. }) => return,
                Err(e) => {
                    log::error!("RDMA CM event channel: {e}");
                    return;
                }
            };
            match self {
                CmSource::Client(c) => c.on_cm_event(&ev),
                CmSource::Listener(l) => l.on_cm_event(ev),
            }
        }
    }
}
