//! Setting a connection up: its QP, buffers and posted receives, connecting
//! (RDMA CM or socket mode), and advertising the receive ring.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

use crate::runtime::options::{Options, CHOSEN_INLINE_DATA};
use crate::runtime::proto::{Cmd, Opcode, CMD_LEN};
use crate::runtime::ring::{RecvRing, SendRing};
use crate::runtime::send_queue::SendQueue;
use crate::runtime::socket::{handshake, SocketLink, SocketWatch};
use crate::runtime::{runtime, Error, Result, Runtime};
use crate::verbs::{
    AccessFlags, CmEventKind, CmId, CompletionQueue, ConnParam, Context, MemoryRegion,
    MemoryWindow, PreparedQp, ProtectionDomain, QpCaps, QpOptions, QueuePair, RemoteRegion, Sge,
};

use super::credit::{ReadCredit, CREDIT_REGION_LEN};
use super::park::Until;
use super::send::INLINE_PARTS;
use super::sync_ops::SyncOps;
use super::{
    wr_id, CmSource, ConnHandler, ConnInner, ConnKind, ConnState, Connection, CqSource, Link,
    NoHandler, PdProvider, State, CMD_SLOTS, K_BIND, K_RECV, MAX_POLL_BATCH, MAX_SEND_WR,
    PEER_CMD_RESERVE, REPOST_BATCH,
};

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
        // Offsets travel in 31 bits of an immediate (bit 31 marks extended
        // messages) and the length in a 32-bit field.
        if opts.recv_buf_len > MAX_RING_LEN || opts.recv_buf_len == 0 {
            return Err(Error::InvalidArgument(format!(
                "recv_buf_len {} is not between 1 and {MAX_RING_LEN} bytes",
                opts.recv_buf_len
            )));
        }
        let pd = match pds {
            Some(provide) => provide(&ctx)?,
            None => ctx.alloc_pd()?,
        };
        let channel = ctx.create_comp_channel()?;
        let recv_depth = opts.recv_depth.max(2 * PEER_CMD_RESERVE as u32);
        let send_cq = ctx.create_cq(MAX_SEND_WR + 16, Some(&channel))?;
        let recv_cq = ctx.create_cq(recv_depth + 16, Some(&channel))?;
        let asked = opts.max_inline_data;
        let inline = if asked > 0 { asked } else { CHOSEN_INLINE_DATA };
        let (qp, prepared, inline) =
            match create_qp(&link, &pd, &send_cq, &recv_cq, opts, recv_depth, inline) {
                Ok((qp, prepared)) => (qp, prepared, inline),
                // Our choice, not the caller's: the device may take less.
                Err(e) if asked == 0 => {
                    log::info!("a QP with {inline} bytes inline: {e}; going without inline");
                    let (qp, prepared) =
                        create_qp(&link, &pd, &send_cq, &recv_cq, opts, recv_depth, 0)?;
                    (qp, prepared, 0)
                }
                Err(e) => return Err(e),
            };
        let peer = match &link {
            Link::Cm(id) => id.peer_addr(),
            Link::Socket(s) => Some(s.peer),
        };
        // In a PD shared with other connections (a server's), the ring is
        // exposed through a window bound to this QP alone, write-only, so
        // another client holding its rkey is refused by the NIC. In a PD of
        // its own, the peer may also READ it, as the legacy library allowed
        // (its sample reads the ring with `tx_addr`/`tx_key`).
        let shared_pd = pds.is_some();
        let ring_access = if shared_pd {
            AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND
        } else {
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ
        };
        let recv_ring = pd.allocate(opts.recv_buf_len, ring_access)?;
        let ring_window = if shared_pd {
            Some(pd.alloc_mw()?)
        } else {
            None
        };
        // The credit slot likewise: through a window bound to this QP alone
        // in a shared PD; the peer may only READ it.
        let (credit_access, credit_window) = if shared_pd {
            (
                AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
                Some(pd.alloc_mw()?),
            )
        } else {
            (AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ, None)
        };
        let credit = pd.allocate(CREDIT_REGION_LEN, credit_access)?;
        let staging = pd.allocate(opts.recv_buf_len, AccessFlags::LOCAL_WRITE)?;
        let cmd_recv = pd.allocate(recv_depth as usize * CMD_LEN, AccessFlags::LOCAL_WRITE)?;
        let cmd_send = pd.allocate(CMD_SLOTS as usize * CMD_LEN, AccessFlags::LOCAL_WRITE)?;
        if opts.enable_phys_addr_access {
            warn_no_phys_addr();
        }
        let state = if kind == ConnKind::ConnectedConn {
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
                post_order: Mutex::new(()),
                send_cq,
                recv_cq,
                send_poll: Mutex::new(()),
                recv_poll: Mutex::new(()),
                recv_poller: AtomicUsize::new(0),
                recv_backlog: Mutex::new(VecDeque::with_capacity(MAX_POLL_BATCH)),
                recv_backlogged: AtomicBool::new(false),
                async_pending: AtomicUsize::new(0),
                credit_read_out: AtomicBool::new(false),
                send_armed: AtomicBool::new(false),
                spun_on: AtomicBool::new(false),
                recv_armed: AtomicBool::new(false),
                pd,
                recv_ring,
                ring_window,
                credit_window,
                credit,
                staging,
                rx_copy: Mutex::new(Vec::with_capacity(opts.recv_buf_len)),
                cmd_recv,
                cmd_send,
                opts: opts.clone(),
                inline_max: inline,
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
                    binds_posted: 0,
                    binds_done: 0,
                    unsettled: Vec::new(),
                    cmd_free: (0..CMD_SLOTS).collect(),
                    sync_ops: SyncOps::with_capacity(2 * SYNC_OPS_UNGROWN),
                    next_op: 1,
                    deferred: VecDeque::new(),
                    queue: SendQueue::new(opts.send_queue_bytes),
                    legacy_exhausted: false,
                    unsignaled_data: 0,
                    data_posted: 0,
                    rx_msgs_reported: 0,
                    tx_msgs_at_credit: 0,
                    tx_msgs_at_tick: 0,
                    carry_some: false,
                    last_errno: 0,
                    reposts: Vec::with_capacity(REPOST_BATCH),
                    rc: ReadCredit::default(),
                }),
                cond: Condvar::new(),
                sleep_lock: Mutex::new(()),
                sleepers: AtomicUsize::new(0),
                wakeups: AtomicU64::new(0),
                posts: AtomicU64::new(0),
                waiting: AtomicUsize::new(0),
                owed: AtomicBool::new(false),
                queued: AtomicBool::new(false),
                windows_unsettled: AtomicBool::new(false),
                deferred_any: AtomicBool::new(false),
                rx_owed: AtomicBool::new(false),
                sq_done: AtomicU32::new(0),
                data_retired: AtomicU64::new(0),
                rx_read: AtomicU32::new(0),
                user_mrs: Mutex::new(FxHashMap::default()),
                disconnect_fired: AtomicBool::new(false),
                end_owed: AtomicBool::new(false),
                end_ready: AtomicBool::new(false),
                closed_locally: AtomicBool::new(false),
                data_callbacks_shut: AtomicBool::new(false),
                in_data_callbacks: AtomicUsize::new(0),
                ended: AtomicBool::new(false),
                delivered: AtomicBool::new(false),
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
        let (conn, _) = Connection::build(
            rt,
            Link::Cm(id.clone()),
            opts,
            ConnKind::ConnectedConn,
            None,
        )?;
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
            Connection::build(rt, Link::Socket(link), opts, ConnKind::ConnectedConn, None)?;
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
    pub(super) fn finish_connect(
        &self,
        watch: Arc<dyn crate::runtime::poller::Source>,
        setup: Duration,
    ) -> Result<Connection> {
        self.set_state(ConnState::Connected);
        let cm_key = self.inner.rt.cm.add(watch);
        self.inner.cm_source.store(cm_key, Ordering::SeqCst);
        self.start_completions();
        if let Err(e) = self.send_reg_local_addr() {
            self.close();
            return Err(e);
        }
        let waited = self.wait_on(Until::Within(setup), |st| match st.state {
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
    pub(super) fn disconnect_link(&self) {
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

    pub(super) fn post_recv_slot(&self, slot: u32) -> Result<()> {
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

    /// Reposts the receive a message took: at once for a legacy peer (whose
    /// library posted one per completion and whose sends count on it), in
    /// batches otherwise.
    pub(super) fn repost_message_slot(&self, st: &mut State, slot: u32) -> Result<()> {
        if st.peer_version < 1 {
            return self.post_recv_slot(slot);
        }
        st.reposts.push(slot);
        if st.reposts.len() >= REPOST_BATCH {
            self.flush_reposts(st)?;
        }
        Ok(())
    }

    /// Reposts every receive waiting in `st.reposts`, with one doorbell.
    pub(super) fn flush_reposts(&self, st: &mut State) -> Result<()> {
        let mut recvs = [(0u64, Sge::EMPTY); REPOST_BATCH];
        let n = st.reposts.len().min(REPOST_BATCH);
        for (r, &slot) in recvs.iter_mut().zip(&st.reposts[..n]) {
            let at = slot as usize * CMD_LEN;
            *r = (
                wr_id(K_RECV, u64::from(slot)),
                self.inner.cmd_recv.sge(at..at + CMD_LEN),
            );
        }
        // SAFETY: as post_recv_slot: each slot's receive completed and was
        // handled; the MR lives as long as the QP.
        unsafe { self.inner.qp.post_recvs(&recvs[..n])? };
        st.reposts.drain(..n);
        Ok(())
    }

    /// Binds `window` to `range` of `mr` (one of the connection's own
    /// regions) with `access`, for this QP alone. The QP is ready to send:
    /// the bind goes first on its send queue, so the peer can use the rkey
    /// it is about to learn.
    pub(super) fn bind_window(
        &self,
        st: &mut State,
        window: &MemoryWindow,
        mr: &MemoryRegion,
        range: std::ops::Range<usize>,
        access: AccessFlags,
    ) -> Result<RemoteRegion> {
        st.sq_used += 1;
        let _order = self.post_order();
        // SAFETY: the connection's windows and regions live as long as it,
        // its windows are dropped first (field order), and the QP outlives
        // its completions.
        let bound = unsafe {
            self.inner.qp.post_bind(
                wr_id(K_BIND, 0),
                window,
                mr,
                range.start,
                range.len(),
                access,
            )
        };
        if bound.is_ok() {
            st.binds_posted += 1;
        }
        bound.map_err(|e| {
            st.sq_used -= 1;
            e.into()
        })
    }

    /// Advertises our receive ring, unless it went already: the peer's
    /// advertisement, handled first, sends ours before its `connected`.
    pub(super) fn send_reg_local_addr(&self) -> Result<()> {
        self.advertise_ring(&mut self.lock())
    }

    /// [`Connection::send_reg_local_addr`], the state lock held: posted at
    /// most once, and before anything of ours that needs it (a message
    /// written into the peer's ring before the peer knows ours is refused
    /// there).
    pub(super) fn advertise_ring(&self, st: &mut State) -> Result<()> {
        if matches!(st.state, ConnState::Closed | ConnState::Error) {
            return Err(Error::Disconnected);
        }
        if !st.rc.is_ring_advertised() {
            self.post_ring_advertisement(st)?;
        }
        // The peer's advertisement may have come first: its version says
        // whether it takes our credit slot.
        self.offer_credit_slot(st);
        Ok(())
    }

    fn post_ring_advertisement(&self, st: &mut State) -> Result<()> {
        let ring = match &self.inner.ring_window {
            None => self.inner.recv_ring.remote(),
            Some(window) => self.bind_window(
                st,
                window,
                &self.inner.recv_ring,
                0..self.inner.recv_ring.len(),
                AccessFlags::REMOTE_WRITE,
            )?,
        };
        let mut cmd = Cmd::new(Opcode::RegLocalAddr, ring.addr, ring.len as u32, ring.rkey);
        cmd.recv_depth = self.inner.opts.recv_depth.max(2 * PEER_CMD_RESERVE as u32);
        cmd.ring_use = self.inner.staging.len() as u32;
        if !self.post_cmd(st, cmd)? {
            return Err(Error::InvalidArgument(
                "no room to advertise the receive buffer".into(),
            ));
        }
        st.rc.ring_advertised();
        Ok(())
    }

    /// An accepted connection's QPs are connected (CM thread): it moves on
    /// and advertises its ring, unless the peer's advertisement, handled
    /// first, sent ours already.
    pub(super) fn established(&self) {
        let (upgraded, advertised) = {
            let mut st = self.lock();
            if matches!(st.state, ConnState::Closed | ConnState::Error) {
                return;
            }
            let accepting = st.state == ConnState::Accepting;
            if accepting {
                st.state = ConnState::Connected;
            }
            (accepting, self.advertise_ring(&mut st))
        };
        if upgraded {
            self.notify_state(ConnState::Connected);
        }
        if let Err(e) = advertised {
            self.fail(&format!("advertising the receive buffer: {e}"));
        }
    }
}

/// One-sided operations a connection has in flight without its window of
/// them growing (the key-value client's batch READs up to 64 values at
/// once): room for twice as many, as an operation settled before one
/// posted earlier keeps its place until that one is removed too (a window
/// grown while a `PendingReads` was held is given back once empty).
const SYNC_OPS_UNGROWN: usize = 64;

/// The largest receive ring: message offsets are 31-bit.
const MAX_RING_LEN: usize = 1 << 31;

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

/// The connection's QP on `link`, sending up to `inline` bytes inline;
/// a socket-mode QP comes back still to be connected.
fn create_qp(
    link: &Link,
    pd: &ProtectionDomain,
    send_cq: &CompletionQueue,
    recv_cq: &CompletionQueue,
    opts: &Options,
    recv_depth: u32,
    inline: u32,
) -> Result<(QueuePair, Option<PreparedQp>)> {
    let caps = QpCaps {
        max_send_wr: MAX_SEND_WR,
        max_recv_wr: recv_depth,
        // Small messages go inline straight from their parts.
        max_send_sge: if inline > 0 { INLINE_PARTS as u32 } else { 1 },
        max_recv_sge: 1,
        max_inline_data: inline,
    };
    Ok(match link {
        Link::Cm(id) => (id.create_qp(pd, send_cq, recv_cq, &caps)?, None),
        Link::Socket(_) => {
            let qp_opts = QpOptions {
                caps,
                retry_cnt: opts.retry_count.min(7),
                ..QpOptions::default()
            };
            let prepared = pd.create_rc_qp(send_cq, recv_cq, &qp_opts)?;
            (prepared.queue_pair().clone(), Some(prepared))
        }
    })
}
