//! Unreliable datagrams: a `Qp<Ud, Rts>` sends to any peer through an
//! address handle. A received datagram starts with the 40-byte GRH the
//! device writes in front of it, so a receive segment must have room for it.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as sys;

use super::error::{Error, Result};
use super::op::Op;
use super::qp::{CanRecv, Qp, Rts, Ud};
use super::region::{Holder, Local, RawHold, Writable, TOKEN};
use super::segments::HoldId;
use crate::verbs::{self, QpInfo};

/// Bytes of the global routing header in front of every received datagram.
pub const GRH_LEN: usize = 40;

struct AhInner {
    ah: NonNull<sys::ibv_ah>,
    /// The PD it was made in: only QPs of that PD may send through it.
    pd: verbs::ProtectionDomain,
}

// SAFETY: an address handle is an immutable provider object.
unsafe impl Send for AhInner {}
unsafe impl Sync for AhInner {}

impl Drop for AhInner {
    fn drop(&mut self) {
        // SAFETY: created in `UdPeer::new`, destroyed once, after every send
        // that used it (sends hold the handle until they complete).
        unsafe { sys::ibv_destroy_ah(self.ah.as_ptr()) };
    }
}

impl Holder for AhInner {
    fn release(&self, _: HoldId) {}
}

/// Where datagrams go: an address handle, a QP number and its queue key.
/// Cheap to clone.
#[derive(Clone)]
pub struct UdPeer {
    ah: Arc<AhInner>,
    qpn: u32,
    qkey: u32,
}

impl<S> Qp<Ud, S> {
    /// The address of the UD queue pair at `remote`, reached through this
    /// one's port and GID, with the queue key `qkey` the receiver set.
    pub fn peer(&self, remote: &QpInfo, qkey: u32) -> Result<UdPeer> {
        let mut attr = self.core.ah_attr(remote);
        let pd = self.core.qp.pd().clone();
        // SAFETY: the PD is alive; attr is filled.
        let ah = unsafe { sys::ibv_create_ah(pd.as_raw(), &mut attr) };
        let ah = NonNull::new(ah).ok_or_else(|| verbs::Error::last_os("ibv_create_ah"))?;
        Ok(UdPeer {
            ah: Arc::new(AhInner { ah, pd }),
            qpn: remote.qpn,
            qkey,
        })
    }
}

impl<S: CanRecv> Qp<Ud, S> {
    /// Receives one datagram into `mem`: the first [`GRH_LEN`] bytes get the
    /// routing header, the payload follows.
    pub fn recv<W: Writable>(&self, mem: W) -> Result<Op<W>> {
        let room = mem.sge(TOKEN).map_or(0, |s| s.length as usize);
        if room < GRH_LEN {
            return Err(Error::invalid(format!(
                "a datagram receive needs {GRH_LEN} bytes for the GRH, the segment has {room}"
            )));
        }
        self.core.post_recv(mem)
    }
}

impl Qp<Ud, Rts> {
    /// Sends `mem` as one datagram to `to` (at most the path MTU).
    pub fn send_to<S: Local>(&self, mem: S, to: &UdPeer) -> Result<Op<S>> {
        self.post_ud(mem, to, None)
    }

    /// [`Qp::send_to`] with an immediate.
    pub fn send_to_with_imm<S: Local>(&self, mem: S, to: &UdPeer, imm: u32) -> Result<Op<S>> {
        self.post_ud(mem, to, Some(imm))
    }

    fn post_ud<S: Local>(&self, mem: S, to: &UdPeer, imm: Option<u32>) -> Result<Op<S>> {
        // An address handle is the provider's object of one PD (and one
        // device): another's would be handed to a provider that does not
        // know it.
        if to.ah.pd.as_raw() != self.core.qp.pd().as_raw() {
            return Err(Error::invalid(
                "this peer's address was made by a queue pair of another protection domain",
            ));
        }
        let sge = mem.sge(TOKEN);
        let send = &self.core.send;
        let ticket = send.open(self.core.qp.qp_num(), 1)?;
        // SAFETY: all-zero is a valid ibv_send_wr.
        let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = ticket.wr_id(true);
        wr.sg_list = sge.as_ref().map_or(std::ptr::null_mut(), |s| {
            s as *const verbs::Sge as *mut sys::ibv_sge
        });
        wr.num_sge = i32::from(sge.is_some());
        wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.opcode = match imm {
            Some(imm) => {
                wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                sys::ibv_wr_opcode::IBV_WR_SEND_WITH_IMM
            }
            None => sys::ibv_wr_opcode::IBV_WR_SEND,
        };
        wr.wr.ud = sys::ud_t {
            ah: to.ah.ah.as_ptr(),
            remote_qpn: to.qpn,
            remote_qkey: to.qkey,
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: the QP is alive; wr and its SGE live for the call; the
        // memory and the address handle move into the Op until completion.
        let rc = unsafe {
            crate::costs::post_send(&wr);
            sys::ibv_post_send(self.core.qp.as_raw(), &mut wr, &mut bad)
        };
        if rc != 0 {
            send.abandon(ticket);
            return Err(verbs::Error::from_code("ibv_post_send(UD)", rc).into());
        }
        Ok(Op::new(send.clone(), ticket, mem).keeping(RawHold::shared(to.ah.clone())))
    }
}
