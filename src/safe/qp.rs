//! Queue pairs whose state is a type: `Qp<Rc | Uc | Ud, Init | Rtr | Rts>`.
//! Each transition consumes the previous state, so sending exists only in
//! RTS and receiving only from RTR on; the compiler refuses the rest:
//!
//! ```compile_fail
//! # use snowrdma::safe::*;
//! fn too_early(qp: &Qp<Rc, Rtr>, seg: RoSegment<u8>) {
//!     let _ = qp.send(seg); // no `send` before RTS
//! }
//! ```
//!
//! ```compile_fail
//! # use snowrdma::safe::*;
//! fn no_receive_yet(qp: &Qp<Rc, Init>, seg: RwSegment<u8>) {
//!     let _ = qp.recv(seg); // no `recv` before RTR
//! }
//! ```

use std::marker::PhantomData;
use std::sync::Arc;

use rdma_sys as sys;

use super::cq::{CompletionQueue, CqShared};
use super::error::{Error, Result};
use super::region::ProtectionDomain;
use super::srq::SharedReceiveQueue;
use crate::verbs::{self, AccessFlags, CmId, Mtu, QpCaps, QpInfo, QpState};

/// Reliable connection: every operation, acknowledged and in order.
#[derive(Debug)]
pub enum Rc {}
/// Unreliable connection: SEND and WRITE, no acknowledgements.
#[derive(Debug)]
pub enum Uc {}
/// Unreliable datagram: SEND to any peer through an address handle.
#[derive(Debug)]
pub enum Ud {}

/// Freshly created: receives cannot be posted yet.
#[derive(Debug)]
pub enum Init {}
/// Ready to receive.
#[derive(Debug)]
pub enum Rtr {}
/// Ready to send (and receive).
#[derive(Debug)]
pub enum Rts {}

mod sealed {
    pub trait Sealed {}
}

/// A transport: [`Rc`], [`Uc`] or [`Ud`].
pub trait Transport: sealed::Sealed + 'static {
    #[doc(hidden)]
    const QP_TYPE: u32;
}
/// A connected transport: [`Rc`] or [`Uc`].
pub trait Connected: Transport {}
/// A state: [`Init`], [`Rtr`] or [`Rts`].
pub trait State: sealed::Sealed + 'static {}
/// A state in which receives may be posted: [`Rtr`] or [`Rts`].
pub trait CanRecv: State {}

impl sealed::Sealed for Rc {}
impl sealed::Sealed for Uc {}
impl sealed::Sealed for Ud {}
impl sealed::Sealed for Init {}
impl sealed::Sealed for Rtr {}
impl sealed::Sealed for Rts {}
impl Transport for Rc {
    const QP_TYPE: u32 = sys::ibv_qp_type::IBV_QPT_RC;
}
impl Transport for Uc {
    const QP_TYPE: u32 = sys::ibv_qp_type::IBV_QPT_UC;
}
impl Transport for Ud {
    const QP_TYPE: u32 = sys::ibv_qp_type::IBV_QPT_UD;
}
impl Connected for Rc {}
impl Connected for Uc {}
impl State for Init {}
impl State for Rtr {}
impl State for Rts {}
impl CanRecv for Rtr {}
impl CanRecv for Rts {}

/// The attributes of a queue pair, set on its builder.
#[derive(Debug, Clone)]
pub(crate) struct Attrs {
    pub caps: QpCaps,
    pub port: u8,
    pub gid_index: Option<u8>,
    pub mtu: Option<Mtu>,
    pub sq_psn: u32,
    pub rq_psn: Option<u32>,
    pub traffic_class: u8,
    pub hop_limit: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub qkey: u32,
}

impl Default for Attrs {
    fn default() -> Self {
        Attrs {
            caps: QpCaps::default(),
            port: 1,
            gid_index: None,
            mtu: None,
            sq_psn: verbs::random_psn(),
            rq_psn: None,
            traffic_class: 0,
            hop_limit: 64,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 6,
            min_rnr_timer: 12,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 16,
            qkey: 0x1111_1111,
        }
    }
}

/// Builds a queue pair: [`ProtectionDomain::qp`].
pub struct QpBuilder<T> {
    pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    srq: Option<SharedReceiveQueue>,
    attrs: Attrs,
    _t: PhantomData<fn() -> T>,
}

impl ProtectionDomain {
    /// A builder for a queue pair of transport `T` (`Rc`, `Uc`, `Ud`) whose
    /// sends complete on `send_cq` and receives on `recv_cq`.
    pub fn qp<T: Transport>(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
    ) -> QpBuilder<T> {
        QpBuilder {
            pd: self.clone(),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            srq: None,
            attrs: Attrs::default(),
            _t: PhantomData,
        }
    }
}

macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident: $ty:ty => $($field:ident).+;)*) => {
        $($(#[$doc])* pub fn $name(mut self, v: $ty) -> Self {
            self.attrs.$($field).+ = v.into();
            self
        })*
    };
}

impl<T: Transport> QpBuilder<T> {
    setters! {
        /// Send queue depth (default 128).
        max_send_wr: u32 => caps.max_send_wr;
        /// Receive queue depth (default 128).
        max_recv_wr: u32 => caps.max_recv_wr;
        /// Scatter/gather entries per send (default 1).
        max_send_sge: u32 => caps.max_send_sge;
        /// Scatter/gather entries per receive (default 1).
        max_recv_sge: u32 => caps.max_recv_sge;
        /// Largest inline payload (default 0).
        max_inline_data: u32 => caps.max_inline_data;
        /// Device port, from 1 (default 1).
        port: u8 => port;
        /// GID index (default: [`verbs::Context::default_gid_index`]).
        gid_index: u8 => gid_index;
        /// Path MTU (default: the port's active MTU, capped by the peer's).
        path_mtu: Mtu => mtu;
        /// Our first send PSN, 24 bits (default random).
        sq_psn: u32 => sq_psn;
        /// The first PSN we expect from the peer (default: what its endpoint says).
        rq_psn: u32 => rq_psn;
        /// Traffic class of the GRH (default 0).
        traffic_class: u8 => traffic_class;
        /// Hop limit of the GRH (default 64).
        hop_limit: u8 => hop_limit;
        /// RC: local ACK timeout exponent, 4.096 us x 2^n (default 14).
        timeout: u8 => timeout;
        /// RC: transport retries (default 7).
        retry_cnt: u8 => retry_cnt;
        /// RC: RNR retries; 7 is forever (default 6).
        rnr_retry: u8 => rnr_retry;
        /// RC: RNR NAK timer we advertise (default 12 = 0.64 ms).
        min_rnr_timer: u8 => min_rnr_timer;
        /// RC: READs and atomics we may have outstanding (default 16, capped by the device).
        max_rd_atomic: u8 => max_rd_atomic;
        /// RC: READs and atomics the peer may have outstanding at us (default 16, capped).
        max_dest_rd_atomic: u8 => max_dest_rd_atomic;
        /// UD: the queue key (default 0x11111111).
        qkey: u32 => qkey;
    }

    /// Takes receives from `srq` (and completes them on its CQ) instead of a
    /// receive queue of its own.
    pub fn srq(mut self, srq: &SharedReceiveQueue) -> Self {
        self.recv_cq = srq.inner.cq.clone();
        self.srq = Some(srq.clone());
        self
    }

    pub(crate) fn into_parts(
        self,
    ) -> Result<(ProtectionDomain, CompletionQueue, CompletionQueue, Attrs)> {
        if self.srq.is_some() {
            return Err(Error::invalid(
                "a shared receive queue cannot be used through RDMA CM yet",
            ));
        }
        Ok((self.pd, self.send_cq, self.recv_cq, self.attrs))
    }

    /// Creates the queue pair, in INIT.
    pub fn build(self) -> Result<Qp<T, Init>> {
        if self.attrs.sq_psn >= 1 << 24 || self.attrs.rq_psn.is_some_and(|p| p >= 1 << 24) {
            return Err(Error::invalid("PSNs are 24 bits"));
        }
        let pd = self.pd.verbs();
        let mut init = verbs::init_attr(
            self.send_cq.device_cq(),
            self.recv_cq.device_cq(),
            &self.attrs.caps,
        );
        init.qp_type = T::QP_TYPE;
        if let Some(srq) = &self.srq {
            init.srq = srq.as_raw();
        }
        // SAFETY: the PD and CQs are alive; init is filled.
        let raw = unsafe { sys::ibv_create_qp(pd.as_raw(), &mut init) };
        let raw =
            std::ptr::NonNull::new(raw).ok_or_else(|| verbs::Error::last_os("ibv_create_qp"))?;
        let qp = verbs::QueuePair::from_raw(
            raw,
            None,
            pd,
            self.send_cq.device_cq(),
            self.recv_cq.device_cq(),
        );
        let mut attrs = self.attrs;
        if attrs.gid_index.is_none() {
            attrs.gid_index = Some(pd.context().default_gid_index(attrs.port)?);
        }
        let core = QpCore {
            ctx: pd.context().clone(),
            qp,
            cm_id: None,
            _srq: self.srq,
            send: self.send_cq.shared.clone(),
            recv: self.recv_cq.shared.clone(),
            attrs,
        };
        core.to_init::<T>()?;
        Ok(Qp::from_core(core))
    }
}

/// A queue pair of transport `T` in state `S`. Operations take `&self`; a
/// [`Batch`](super::Batch) takes `&mut self`. Dropping it moves the QP to
/// the error state, so work in flight is flushed and its memory released.
pub struct Qp<T, S> {
    pub(crate) core: QpCore,
    _m: PhantomData<fn() -> (T, S)>,
}

impl<T, S> std::fmt::Debug for Qp<T, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp")
            .field("qp_num", &self.core.qp.qp_num())
            .field("transport", &std::any::type_name::<T>())
            .field("state", &std::any::type_name::<S>())
            .finish()
    }
}

pub(crate) struct QpCore {
    pub(crate) ctx: verbs::Context,
    pub(crate) qp: verbs::QueuePair,
    /// Set for queue pairs made through RDMA CM.
    pub(crate) cm_id: Option<CmId>,
    /// Outlives the QP that takes its receives.
    pub(crate) _srq: Option<SharedReceiveQueue>,
    pub(crate) send: Arc<CqShared>,
    pub(crate) recv: Arc<CqShared>,
    pub(crate) attrs: Attrs,
}

impl Drop for QpCore {
    fn drop(&mut self) {
        // Into the error state (a disconnect does it for RDMA CM's), which
        // flushes the work in flight, then its flushed completions are
        // reaped before the QP is destroyed: they resolve its futures and
        // release the memory of dropped ones.
        if let Some(id) = &self.cm_id {
            super::cm::disconnect(id);
        }
        // Again after a disconnect, which may not have reached the QP (one
        // never connected): what follows needs it stopped.
        if let Err(e) = self.qp.to_error() {
            // Nothing flushes (waiting for it would only stall), and the
            // device may still use what is parked: it stays parked.
            log::debug!("dropping a queue pair: {e}");
            return;
        }
        let qpn = self.qp.qp_num();
        self.send.reap_flushed(qpn);
        let tailless = self.send.take_tailless(qpn);
        if !tailless.is_empty() {
            self.qp.keep_until_destroyed(Box::new(tailless));
        }
        if !Arc::ptr_eq(&self.send, &self.recv) {
            self.recv.reap_flushed(qpn);
        }
    }
}

impl QpCore {
    fn gid_index(&self) -> u8 {
        self.attrs.gid_index.unwrap_or(0)
    }

    fn to_init<T: Transport>(&self) -> Result<()> {
        use sys::ibv_qp_attr_mask as M;
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = QpState::INIT.0;
        attr.pkey_index = 0;
        attr.port_num = self.attrs.port;
        let mut mask = M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT;
        if T::QP_TYPE == Ud::QP_TYPE {
            attr.qkey = self.attrs.qkey;
            mask |= M::IBV_QP_QKEY;
        } else {
            // What peers may do through this QP; which memory they reach is
            // decided by the windows of offers.
            attr.qp_access_flags = if T::QP_TYPE == Rc::QP_TYPE {
                (AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC)
                    .bits()
            } else {
                AccessFlags::REMOTE_WRITE.bits()
            };
            mask |= M::IBV_QP_ACCESS_FLAGS;
        }
        Ok(self
            .qp
            .modify(&mut attr, mask, "ibv_modify_qp(RESET->INIT)")?)
    }

    fn endpoint(&self) -> Result<QpInfo> {
        let ctx = self.qp_context();
        let port = ctx.query_port(self.attrs.port)?;
        let gid = ctx.query_gid(self.attrs.port, self.gid_index())?;
        Ok(QpInfo {
            qpn: self.qp.qp_num(),
            psn: self.attrs.sq_psn,
            lid: port.lid,
            gid,
            mtu: self
                .attrs
                .mtu
                .unwrap_or(port.active_mtu)
                .min(port.active_mtu),
        })
    }

    fn qp_context(&self) -> &verbs::Context {
        &self.ctx
    }

    pub(crate) fn ah_attr(&self, remote: &QpInfo) -> sys::ibv_ah_attr {
        // SAFETY: all-zero is a valid ibv_ah_attr.
        let mut ah: sys::ibv_ah_attr = unsafe { std::mem::zeroed() };
        ah.dlid = remote.lid;
        ah.port_num = self.attrs.port;
        if !remote.gid.is_zero() {
            ah.is_global = 1;
            ah.grh.dgid = sys::ibv_gid { raw: remote.gid.0 };
            ah.grh.sgid_index = self.gid_index();
            ah.grh.hop_limit = self.attrs.hop_limit;
            ah.grh.traffic_class = self.attrs.traffic_class;
        }
        ah
    }

    fn to_rtr<T: Transport>(&self, remote: Option<&QpInfo>) -> Result<()> {
        use sys::ibv_qp_attr_mask as M;
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = QpState::RTR.0;
        let mut mask = M::IBV_QP_STATE;
        if let Some(remote) = remote {
            let local = self.endpoint()?;
            attr.path_mtu = local.mtu.min(remote.mtu).0;
            attr.dest_qp_num = remote.qpn;
            attr.rq_psn = self.attrs.rq_psn.unwrap_or(remote.psn);
            attr.ah_attr = self.ah_attr(remote);
            mask |= M::IBV_QP_AV | M::IBV_QP_PATH_MTU | M::IBV_QP_DEST_QPN | M::IBV_QP_RQ_PSN;
            if T::QP_TYPE == Rc::QP_TYPE {
                let dev = self.qp_context().query_device()?;
                attr.max_dest_rd_atomic = cap(self.attrs.max_dest_rd_atomic, dev.max_qp_rd_atom);
                attr.min_rnr_timer = self.attrs.min_rnr_timer;
                mask |= M::IBV_QP_MAX_DEST_RD_ATOMIC | M::IBV_QP_MIN_RNR_TIMER;
            }
        }
        Ok(self
            .qp
            .modify(&mut attr, mask, "ibv_modify_qp(INIT->RTR)")?)
    }

    fn to_rts<T: Transport>(&self) -> Result<()> {
        use sys::ibv_qp_attr_mask as M;
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = QpState::RTS.0;
        attr.sq_psn = self.attrs.sq_psn;
        let mut mask = M::IBV_QP_STATE | M::IBV_QP_SQ_PSN;
        if T::QP_TYPE == Rc::QP_TYPE {
            let dev = self.qp_context().query_device()?;
            attr.timeout = self.attrs.timeout;
            attr.retry_cnt = self.attrs.retry_cnt;
            attr.rnr_retry = self.attrs.rnr_retry;
            attr.max_rd_atomic = cap(self.attrs.max_rd_atomic, dev.max_qp_init_rd_atom);
            mask |= M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_MAX_QP_RD_ATOMIC;
        }
        Ok(self.qp.modify(&mut attr, mask, "ibv_modify_qp(RTR->RTS)")?)
    }
}

fn cap(want: u8, max: i32) -> u8 {
    (want as i32).min(max).clamp(1, 255) as u8
}

impl<T, S> Qp<T, S> {
    pub(crate) fn from_core(core: QpCore) -> Self {
        Qp {
            core,
            _m: PhantomData,
        }
    }

    fn into_state<S2>(self) -> Qp<T, S2> {
        Qp {
            core: self.core,
            _m: PhantomData,
        }
    }

    /// What the peer needs to connect to this queue pair (exchange it out of
    /// band, e.g. with [`QpInfo::to_bytes`]).
    pub fn endpoint(&self) -> Result<QpInfo> {
        self.core.endpoint()
    }

    pub fn qp_num(&self) -> u32 {
        self.core.qp.qp_num()
    }

    /// The verbs-layer queue pair: the escape hatch.
    ///
    /// # Safety
    /// As for [`CompletionQueue::verbs`](super::CompletionQueue::verbs):
    /// polling its CQs (`send_cq()`, `recv_cq()`) takes completions their
    /// futures wait for. Do not; nor post there, unsafe in its own right.
    ///
    /// ```compile_fail
    /// fn steal(qp: &snowrdma::safe::Qp<snowrdma::safe::Rc, snowrdma::safe::Rts>) {
    ///     let mut room = snowrdma::verbs::CompletionRoom::<4>::new();
    ///     let _ = room.poll(qp.verbs().send_cq());
    /// }
    /// ```
    pub unsafe fn verbs(&self) -> &verbs::QueuePair {
        &self.core.qp
    }
}

impl<T: Connected> Qp<T, Init> {
    /// INIT -> RTR, towards the peer at `remote`.
    pub fn into_rtr(self, remote: &QpInfo) -> Result<Qp<T, Rtr>> {
        self.core.to_rtr::<T>(Some(remote))?;
        Ok(self.into_state())
    }

    /// INIT -> RTR -> RTS, towards the peer at `remote`.
    pub fn connect(self, remote: &QpInfo) -> Result<Qp<T, Rts>> {
        self.into_rtr(remote)?.into_rts()
    }
}

impl Qp<Ud, Init> {
    /// INIT -> RTR: datagrams can be received.
    pub fn into_rtr(self) -> Result<Qp<Ud, Rtr>> {
        self.core.to_rtr::<Ud>(None)?;
        Ok(self.into_state())
    }

    /// INIT -> RTR -> RTS.
    pub fn activate(self) -> Result<Qp<Ud, Rts>> {
        self.into_rtr()?.into_rts()
    }
}

impl<T: Transport> Qp<T, Rtr> {
    /// RTR -> RTS: operations can be posted.
    pub fn into_rts(self) -> Result<Qp<T, Rts>> {
        self.core.to_rts::<T>()?;
        Ok(self.into_state())
    }
}
