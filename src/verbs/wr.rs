//! Send-queue work requests: what each does, and how one becomes the
//! provider's `ibv_send_wr` (checked first: atomics' alignment and sizes).

use rdma_sys as sys;

use super::error::{Error, Result};
use super::mr::{RemoteAddr, Sge};

/// What a send-queue work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided send; consumes a receive at the peer.
    Send,
    /// Send carrying a 32-bit immediate (host byte order).
    SendWithImm(u32),
    /// One-sided write to the peer's memory.
    Write(RemoteAddr),
    /// Write that also consumes a receive at the peer and delivers the
    /// immediate in its completion.
    WriteWithImm(RemoteAddr, u32),
    /// One-sided read of the peer's memory into the local SGEs.
    Read(RemoteAddr),
    /// 64-bit compare-and-swap at an 8-byte aligned remote address; the old
    /// value lands in the 8-byte local SGE.
    CompareSwap {
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    },
    /// 64-bit fetch-and-add; the old value lands in the 8-byte local SGE.
    FetchAdd { remote: RemoteAddr, add: u64 },
}

impl SendOp {
    fn opcode(&self) -> sys::ibv_wr_opcode::Type {
        use sys::ibv_wr_opcode as O;
        match self {
            SendOp::Send => O::IBV_WR_SEND,
            SendOp::SendWithImm(_) => O::IBV_WR_SEND_WITH_IMM,
            SendOp::Write(_) => O::IBV_WR_RDMA_WRITE,
            SendOp::WriteWithImm(..) => O::IBV_WR_RDMA_WRITE_WITH_IMM,
            SendOp::Read(_) => O::IBV_WR_RDMA_READ,
            SendOp::CompareSwap { .. } => O::IBV_WR_ATOMIC_CMP_AND_SWP,
            SendOp::FetchAdd { .. } => O::IBV_WR_ATOMIC_FETCH_AND_ADD,
        }
    }
}

/// One send-queue work request.
#[derive(Debug, Clone, Copy)]
pub struct SendRequest<'a> {
    pub wr_id: u64,
    pub op: SendOp,
    pub sges: &'a [Sge],
    /// Whether the request produces a completion on success (failures always
    /// do).
    pub signaled: bool,
    /// Whether the payload is copied into the work request (needs
    /// `max_inline_data`; the buffer may be reused as soon as the post returns).
    pub inline: bool,
}

impl<'a> SendRequest<'a> {
    /// A signaled, non-inline request.
    pub fn new(wr_id: u64, op: SendOp, sges: &'a [Sge]) -> Self {
        SendRequest {
            wr_id,
            op,
            sges,
            signaled: true,
            inline: false,
        }
    }

    /// The same request without a completion on success.
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }

    /// The same request with its payload inline.
    pub fn inline(mut self) -> Self {
        self.inline = true;
        self
    }

    pub(super) fn fill(&self, wr: &mut sys::ibv_send_wr) -> Result<()> {
        use sys::ibv_send_flags as F;
        wr.wr_id = self.wr_id;
        wr.sg_list = self.sges.as_ptr() as *mut sys::ibv_sge;
        wr.num_sge = i32::try_from(self.sges.len()).map_err(|_| Error::invalid("too many SGEs"))?;
        wr.opcode = self.op.opcode();
        let mut flags = F(0);
        if self.signaled {
            flags |= F::IBV_SEND_SIGNALED;
        }
        if self.inline {
            flags |= F::IBV_SEND_INLINE;
        }
        wr.send_flags = flags.0;
        match self.op {
            SendOp::Send => {}
            SendOp::SendWithImm(imm) => wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be(),
            SendOp::Write(r) | SendOp::Read(r) => {
                wr.wr.rdma = sys::rdma_t {
                    remote_addr: r.addr,
                    rkey: r.rkey,
                }
            }
            SendOp::WriteWithImm(r, imm) => {
                wr.wr.rdma = sys::rdma_t {
                    remote_addr: r.addr,
                    rkey: r.rkey,
                };
                wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            }
            SendOp::CompareSwap {
                remote,
                compare,
                swap,
            } => {
                self.check_atomic(remote)?;
                wr.wr.atomic = sys::atomic_t {
                    remote_addr: remote.addr,
                    compare_add: compare,
                    swap,
                    rkey: remote.rkey,
                };
            }
            SendOp::FetchAdd { remote, add } => {
                self.check_atomic(remote)?;
                wr.wr.atomic = sys::atomic_t {
                    remote_addr: remote.addr,
                    compare_add: add,
                    swap: 0,
                    rkey: remote.rkey,
                };
            }
        }
        Ok(())
    }

    fn check_atomic(&self, remote: RemoteAddr) -> Result<()> {
        if remote.addr % 8 != 0 {
            return Err(Error::invalid(format!(
                "atomic target {:#x} is not 8-byte aligned",
                remote.addr
            )));
        }
        if self.sges.len() != 1 || self.sges[0].length != 8 {
            return Err(Error::invalid(
                "an atomic needs exactly one 8-byte local SGE",
            ));
        }
        Ok(())
    }
}
