//! Reliable-connected queue pairs: creation, the manual RESET -> INIT -> RTR
//! -> RTS handshake, and posting work requests on the classic
//! `ibv_post_send` / `ibv_post_recv` path.

use std::fmt;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as sys;

use super::cm::CmId;
use super::cq::CompletionQueue;
use super::device::{Gid, Mtu};
use super::error::{check_code, Error, Result};
use super::mr::{AccessFlags, Sge};
use super::pd::ProtectionDomain;
use super::wr::SendRequest;

const _: () = assert!(std::mem::size_of::<Sge>() == std::mem::size_of::<sys::ibv_sge>());

/// Queue sizes of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    /// Largest payload a send may carry inline (0: no inline sends).
    pub max_inline_data: u32,
}

impl Default for QpCaps {
    fn default() -> Self {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        }
    }
}

/// Everything a manually connected RC QP needs besides its CQs.
#[derive(Debug, Clone)]
pub struct QpOptions {
    pub caps: QpCaps,
    /// Device port, from 1.
    pub port: u8,
    /// GID table index; `None` picks [`super::Context::default_gid_index`].
    pub gid_index: Option<u8>,
    /// Path MTU; `None` uses the port's active MTU (capped by the peer's).
    pub mtu: Option<Mtu>,
    /// Local ACK timeout exponent: 4.096 us * 2^timeout.
    pub timeout: u8,
    /// Transport retries before a send fails with RETRY_EXC_ERR.
    pub retry_cnt: u8,
    /// RNR retries (7 means forever; avoid it, a peer that never posts a
    /// receive would freeze the sender).
    pub rnr_retry: u8,
    /// RNR NAK timer this side advertises (12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// Outstanding READs/atomics, both as initiator and as target; capped by
    /// the device.
    pub max_rd_atomic: u8,
    /// What the peer may do to our memory through this QP.
    pub access: AccessFlags,
}

impl Default for QpOptions {
    fn default() -> Self {
        QpOptions {
            caps: QpCaps::default(),
            port: 1,
            gid_index: None,
            mtu: None,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 6,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            access: AccessFlags::all(),
        }
    }
}

/// Size of [`QpInfo::to_bytes`].
pub const QP_INFO_WIRE_LEN: usize = 30;

/// What one side of a manual connection tells the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInfo {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: Gid,
    pub mtu: Mtu,
}

impl QpInfo {
    /// Big-endian encoding for exchange over any byte stream.
    pub fn to_bytes(&self) -> [u8; QP_INFO_WIRE_LEN] {
        let mut b = [0; QP_INFO_WIRE_LEN];
        b[..4].copy_from_slice(&self.qpn.to_be_bytes());
        b[4..8].copy_from_slice(&self.psn.to_be_bytes());
        b[8..10].copy_from_slice(&self.lid.to_be_bytes());
        b[10..26].copy_from_slice(&self.gid.0);
        b[26..].copy_from_slice(&self.mtu.0.to_be_bytes());
        b
    }

    /// Decodes [`QpInfo::to_bytes`].
    pub fn from_bytes(b: &[u8]) -> Result<QpInfo> {
        if b.len() != QP_INFO_WIRE_LEN {
            return Err(Error::invalid(format!(
                "QP info is {} bytes, got {}",
                QP_INFO_WIRE_LEN,
                b.len()
            )));
        }
        let info = QpInfo {
            qpn: u32::from_be_bytes(b[..4].try_into().expect("4 bytes")),
            psn: u32::from_be_bytes(b[4..8].try_into().expect("4 bytes")),
            lid: u16::from_be_bytes(b[8..10].try_into().expect("2 bytes")),
            gid: Gid(b[10..26].try_into().expect("16 bytes")),
            mtu: Mtu(u32::from_be_bytes(b[26..].try_into().expect("4 bytes"))),
        };
        if info.qpn >= 1 << 24 || info.psn >= 1 << 24 || info.mtu.bytes() == 0 {
            return Err(Error::invalid(format!("malformed QP info {info:?}")));
        }
        Ok(info)
    }
}

/// QP state (`enum ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpState(pub u32);

impl QpState {
    pub const RESET: QpState = QpState(sys::ibv_qp_state::IBV_QPS_RESET);
    pub const INIT: QpState = QpState(sys::ibv_qp_state::IBV_QPS_INIT);
    pub const RTR: QpState = QpState(sys::ibv_qp_state::IBV_QPS_RTR);
    pub const RTS: QpState = QpState(sys::ibv_qp_state::IBV_QPS_RTS);
    pub const ERR: QpState = QpState(sys::ibv_qp_state::IBV_QPS_ERR);
}

pub(crate) struct QpInner {
    qp: NonNull<sys::ibv_qp>,
    /// Set for QPs made by `rdma_create_qp`: they are destroyed through the
    /// id, which must outlive them.
    cm_id: Option<CmId>,
    _pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    /// What the device may use for as long as the QP exists (memory of
    /// work that went out without a completion to tell when it is done):
    /// let go of once the QP is destroyed, and never if that fails.
    until_destroyed: std::sync::Mutex<Vec<Box<dyn Send>>>,
}

// SAFETY: posting and modifying QPs is thread-safe in libibverbs.
unsafe impl Send for QpInner {}
unsafe impl Sync for QpInner {}

impl Drop for QpInner {
    fn drop(&mut self) {
        match &self.cm_id {
            // SAFETY: the id's QP is this one; destroyed once.
            Some(id) => unsafe { sys::rdma_destroy_qp(id.as_raw()) },
            None => {
                // SAFETY: created by ibv_create_qp; destroyed once.
                let rc = unsafe { sys::ibv_destroy_qp(self.qp.as_ptr()) };
                if rc != 0 {
                    log::warn!(
                        "ibv_destroy_qp failed: {}",
                        std::io::Error::from_raw_os_error(rc)
                    );
                    // The QP may live on: what it may use is never let go.
                    let kept = self.until_destroyed.get_mut().map(std::mem::take);
                    std::mem::forget(kept);
                }
            }
        }
        // `until_destroyed` drops after this, the QP gone.
    }
}

/// A queue pair. Cheap to clone; keeps its PD, CQs and (for RDMA CM) its
/// CM id alive.
#[derive(Clone)]
pub struct QueuePair {
    inner: Arc<QpInner>,
}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qp_num", &self.qp_num())
            .finish()
    }
}

pub(crate) fn init_attr(
    send_cq: &CompletionQueue,
    recv_cq: &CompletionQueue,
    caps: &QpCaps,
) -> sys::ibv_qp_init_attr {
    // SAFETY: all-zero is a valid ibv_qp_init_attr.
    let mut attr: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    attr.send_cq = send_cq.as_raw();
    attr.recv_cq = recv_cq.as_raw();
    attr.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
    attr.sq_sig_all = 0;
    attr.cap.max_send_wr = caps.max_send_wr;
    attr.cap.max_recv_wr = caps.max_recv_wr;
    attr.cap.max_send_sge = caps.max_send_sge;
    attr.cap.max_recv_sge = caps.max_recv_sge;
    attr.cap.max_inline_data = caps.max_inline_data;
    attr
}

impl QueuePair {
    pub(crate) fn from_raw(
        qp: NonNull<sys::ibv_qp>,
        cm_id: Option<CmId>,
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
    ) -> QueuePair {
        QueuePair {
            inner: Arc::new(QpInner {
                qp,
                cm_id,
                _pd: pd.clone(),
                send_cq: send_cq.clone(),
                recv_cq: recv_cq.clone(),
                until_destroyed: std::sync::Mutex::default(),
            }),
        }
    }

    /// Keeps `what` until the QP is destroyed (for good, if destroying it
    /// fails): for memory of work that went out with no completion to tell
    /// when the device is done with it.
    pub(crate) fn keep_until_destroyed(&self, what: Box<dyn Send>) {
        self.inner
            .until_destroyed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(what);
    }

    /// The raw `ibv_qp`.
    pub fn as_raw(&self) -> *mut sys::ibv_qp {
        self.inner.qp.as_ptr()
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the QP is alive.
        unsafe { (*self.as_raw()).qp_num }
    }

    pub fn send_cq(&self) -> &CompletionQueue {
        &self.inner.send_cq
    }

    /// The protection domain the QP was made in.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner._pd
    }

    pub fn recv_cq(&self) -> &CompletionQueue {
        &self.inner.recv_cq
    }

    /// The current state, as the device reports it.
    pub fn state(&self) -> Result<QpState> {
        // SAFETY: all-zero attributes are valid out-parameters.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the QP is alive; both structs are writable.
        check_code("ibv_query_qp", unsafe {
            sys::ibv_query_qp(
                self.as_raw(),
                &mut attr,
                sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
                &mut init,
            )
        })?;
        Ok(QpState(attr.qp_state))
    }

    /// Moves the QP to the error state: it starts no more work, and its
    /// outstanding work completes flushed (a provider may still finish a
    /// request under way; its completion tells when). Moving an errored QP
    /// there again is harmless.
    pub fn to_error(&self) -> Result<()> {
        // SAFETY: all-zero is a valid ibv_qp_attr; only the state is read.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = QpState::ERR.0;
        self.modify(
            &mut attr,
            sys::ibv_qp_attr_mask::IBV_QP_STATE,
            "ibv_modify_qp(->ERR)",
        )
    }

    pub(crate) fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        mask: sys::ibv_qp_attr_mask,
        verb: &'static str,
    ) -> Result<()> {
        // SAFETY: the QP is alive; attr is filled for every bit of mask.
        check_code(verb, unsafe {
            sys::ibv_modify_qp(self.as_raw(), attr, mask.0 as i32)
        })
    }

    /// Posts send-queue work requests, chained into one `ibv_post_send`.
    ///
    /// # Safety
    /// Every local SGE must point into a live memory region that nothing else
    /// writes (for sends, writes and atomics' compare values) or reads (for
    /// READ and atomic results) until the request's completion has been
    /// polled, or, for unsignaled requests, until a later signaled request on
    /// this QP has completed.
    pub unsafe fn post_send(&self, reqs: &[SendRequest<'_>]) -> Result<()> {
        self.post_send_counted(reqs).map_err(|(_, e)| e)
    }

    /// [`QueuePair::post_send`], telling on failure how many of the
    /// requests, from the first, were posted before the one that failed:
    /// those are on the device and complete (or flush) as posted ones do.
    ///
    /// # Safety
    /// As [`QueuePair::post_send`].
    pub unsafe fn post_send_counted(
        &self,
        reqs: &[SendRequest<'_>],
    ) -> std::result::Result<(), (usize, Error)> {
        if reqs.is_empty() {
            return Ok(());
        }
        let mut bad = std::ptr::null_mut();
        if let [req] = reqs {
            // The common case, without a heap allocation.
            // SAFETY: all-zero is a valid ibv_send_wr.
            let mut wr: sys::ibv_send_wr = std::mem::zeroed();
            req.fill(&mut wr).map_err(|e| (0, e))?;
            crate::costs::post_send(&wr);
            return check_code(
                "ibv_post_send",
                sys::ibv_post_send(self.as_raw(), &mut wr, &mut bad),
            )
            .map_err(|e| (0, e));
        }
        // Batches up to STACK_BATCH requests (every batch the library makes)
        // chain on the stack; only longer ones allocate.
        let mut on_stack = [const { MaybeUninit::<sys::ibv_send_wr>::uninit() }; STACK_BATCH];
        let mut on_heap = Vec::new();
        // SAFETY: all-zero is a valid ibv_send_wr.
        let wrs = zeroed_chain(&mut on_stack, &mut on_heap, reqs.len());
        for (wr, req) in wrs.iter_mut().zip(reqs) {
            req.fill(wr).map_err(|e| (0, e))?;
        }
        for i in 1..wrs.len() {
            let next: *mut sys::ibv_send_wr = &mut wrs[i];
            wrs[i - 1].next = next;
        }
        crate::costs::post_send(wrs.as_ptr());
        check_code(
            "ibv_post_send",
            sys::ibv_post_send(self.as_raw(), wrs.as_mut_ptr(), &mut bad),
        )
        .map_err(|e| {
            // `bad` is the first request not posted; one outside the chain
            // (a provider that did not say) counts as all of them posted,
            // whose memory is then kept.
            let posted = wrs
                .iter()
                .position(|wr| std::ptr::eq(wr, bad))
                .unwrap_or(wrs.len());
            (posted, e)
        })
    }

    /// Posts one receive into `sges` (none: a receive for a zero-length
    /// message or a WRITE WITH IMM).
    ///
    /// # Safety
    /// The SGEs must point into live memory regions registered with local
    /// write that nothing else touches until the receive completes.
    pub unsafe fn post_recv(&self, wr_id: u64, sges: &[Sge]) -> Result<()> {
        // SAFETY: all-zero is a valid ibv_recv_wr.
        let mut wr: sys::ibv_recv_wr = std::mem::zeroed();
        wr.wr_id = wr_id;
        wr.sg_list = sges.as_ptr() as *mut sys::ibv_sge;
        wr.num_sge = sges.len() as i32;
        let mut bad = std::ptr::null_mut();
        crate::costs::post_recv(&wr);
        check_code(
            "ibv_post_recv",
            sys::ibv_post_recv(self.as_raw(), &mut wr, &mut bad),
        )
    }
}

/// Work requests chained on the stack, at most; longer chains go on the heap.
const STACK_BATCH: usize = 129;

/// `n` all-zero work requests: the first `n` of `stack` (only those are
/// written: a chain of one does not zero 64), or `heap` when `n` is longer.
///
/// # Safety
/// All-zero must be a valid `T`.
unsafe fn zeroed_chain<'a, T>(
    stack: &'a mut [MaybeUninit<T>; STACK_BATCH],
    heap: &'a mut Vec<T>,
    n: usize,
) -> &'a mut [T] {
    if n <= STACK_BATCH {
        for slot in &mut stack[..n] {
            slot.write(std::mem::zeroed());
        }
        // SAFETY: the first n are initialised just above.
        std::slice::from_raw_parts_mut(stack.as_mut_ptr().cast::<T>(), n)
    } else {
        *heap = (0..n).map(|_| std::mem::zeroed()).collect();
        heap
    }
}

impl QueuePair {
    /// Posts one receive per entry of `recvs` (a work request id and its
    /// one SGE), chained into one `ibv_post_recv`.
    ///
    /// # Safety
    /// As [`QueuePair::post_recv`], for every SGE.
    pub unsafe fn post_recvs(&self, recvs: &[(u64, Sge)]) -> Result<()> {
        if recvs.is_empty() {
            return Ok(());
        }
        let mut on_stack = [const { MaybeUninit::<sys::ibv_recv_wr>::uninit() }; STACK_BATCH];
        let mut on_heap = Vec::new();
        // SAFETY: all-zero is a valid ibv_recv_wr.
        let wrs = zeroed_chain(&mut on_stack, &mut on_heap, recvs.len());
        for (wr, (id, sge)) in wrs.iter_mut().zip(recvs) {
            wr.wr_id = *id;
            wr.sg_list = sge as *const Sge as *mut sys::ibv_sge;
            wr.num_sge = 1;
        }
        for i in 1..wrs.len() {
            let next: *mut sys::ibv_recv_wr = &mut wrs[i];
            wrs[i - 1].next = next;
        }
        let mut bad = std::ptr::null_mut();
        crate::costs::post_recv(wrs.as_ptr());
        check_code(
            "ibv_post_recv",
            sys::ibv_post_recv(self.as_raw(), wrs.as_mut_ptr(), &mut bad),
        )
    }
}

/// A manually connected RC QP that is in INIT: receives may be posted (do so
/// before connecting, so the peer's first send finds one); exchange
/// [`PreparedQp::local_info`] with the peer, then [`PreparedQp::connect`].
pub struct PreparedQp {
    qp: QueuePair,
    opts: QpOptions,
    gid_index: u8,
    psn: u32,
}

impl ProtectionDomain {
    /// Creates an RC QP and moves it to INIT, for a manual (out-of-band)
    /// connection.
    pub fn create_rc_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        opts: &QpOptions,
    ) -> Result<PreparedQp> {
        let mut init = init_attr(send_cq, recv_cq, &opts.caps);
        // SAFETY: the PD and CQs are alive; init is filled.
        let qp = unsafe { sys::ibv_create_qp(self.as_raw(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| Error::last_os("ibv_create_qp"))?;
        let qp = QueuePair::from_raw(qp, None, self, send_cq, recv_cq);
        let gid_index = match opts.gid_index {
            Some(i) => i,
            None => self.context().default_gid_index(opts.port)?,
        };

        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = opts.port;
        attr.qp_access_flags = opts.access.bits();
        use sys::ibv_qp_attr_mask as M;
        qp.modify(
            &mut attr,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(RESET->INIT)",
        )?;
        Ok(PreparedQp {
            qp,
            opts: opts.clone(),
            gid_index,
            // PSNs are 24 bits; a random start avoids mistaking a previous
            // incarnation's packets for ours.
            psn: random_psn(),
        })
    }
}

pub(crate) fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    (h.finish() as u32) & 0x00ff_ffff
}

impl PreparedQp {
    /// The QP (in INIT), e.g. to post receives before connecting.
    pub fn queue_pair(&self) -> &QueuePair {
        &self.qp
    }

    /// What the peer needs to connect to this QP.
    pub fn local_info(&self) -> Result<QpInfo> {
        let ctx = self.qp.inner._pd.context();
        let port = ctx.query_port(self.opts.port)?;
        let gid = ctx.query_gid(self.opts.port, self.gid_index)?;
        Ok(QpInfo {
            qpn: self.qp.qp_num(),
            psn: self.psn,
            lid: port.lid,
            gid,
            mtu: self
                .opts
                .mtu
                .unwrap_or(port.active_mtu)
                .min(port.active_mtu),
        })
    }

    /// Moves the QP through RTR to RTS, connected to `remote`.
    pub fn connect(self, remote: &QpInfo) -> Result<QueuePair> {
        let ctx = self.qp.inner._pd.context();
        let dev = ctx.query_device()?;
        let local = self.local_info()?;
        let rd_atomic_in = (self.opts.max_rd_atomic as i32)
            .min(dev.max_qp_rd_atom)
            .clamp(1, 255) as u8;
        let rd_atomic_out = (self.opts.max_rd_atomic as i32)
            .min(dev.max_qp_init_rd_atom)
            .clamp(1, 255) as u8;
        use sys::ibv_qp_attr_mask as M;

        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = local.mtu.min(remote.mtu).0;
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = rd_atomic_in;
        attr.min_rnr_timer = self.opts.min_rnr_timer;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = self.opts.port;
        if !remote.gid.is_zero() {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = sys::ibv_gid { raw: remote.gid.0 };
            attr.ah_attr.grh.sgid_index = self.gid_index;
            attr.ah_attr.grh.hop_limit = 64;
        }
        self.qp.modify(
            &mut attr,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(INIT->RTR)",
        )?;

        // SAFETY: as above.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        attr.sq_psn = self.psn;
        attr.timeout = self.opts.timeout;
        attr.retry_cnt = self.opts.retry_cnt;
        attr.rnr_retry = self.opts.rnr_retry;
        attr.max_rd_atomic = rd_atomic_out;
        self.qp.modify(
            &mut attr,
            M::IBV_QP_STATE
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTR->RTS)",
        )?;
        Ok(self.qp)
    }
}
