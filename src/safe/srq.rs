//! Shared receive queues: one pool of receives that many queue pairs
//! consume. Each completion names the queue pair that received
//! ([`Completion::qp_num`](super::Completion::qp_num)).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use rdma_sys as sys;

use super::cq::{CompletionQueue, SRQ_TAG};
use super::error::Result;
use super::op::Op;
use super::region::{ProtectionDomain, Writable, TOKEN};
use crate::verbs;

/// Tells the shared receive queues of a process apart in their receives'
/// slots.
static NEXT_SRQ: AtomicU32 = AtomicU32::new(0);

pub(crate) struct SrqInner {
    srq: NonNull<sys::ibv_srq>,
    /// Its receives' `qp` in the CQ's slots.
    tag: u32,
    pub(crate) cq: CompletionQueue,
    _pd: verbs::ProtectionDomain,
}

// SAFETY: posting to an SRQ is thread-safe in libibverbs.
unsafe impl Send for SrqInner {}
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // SAFETY: created in `create_srq`; every QP using it holds this
        // value, so none is left.
        let rc = unsafe { sys::ibv_destroy_srq(self.srq.as_ptr()) };
        if rc != 0 {
            // Its receives' memory stays parked: the device may write it.
            log::warn!(
                "ibv_destroy_srq failed: {}",
                std::io::Error::from_raw_os_error(rc)
            );
            return;
        }
        // Nothing completes its receives now: their futures resolve.
        self.cq.shared.srq_destroyed(self.tag);
    }
}

/// A shared receive queue. Cheap to clone; queue pairs built with
/// [`QpBuilder::srq`](super::QpBuilder::srq) take their receives from it,
/// and its receives complete on the CQ it was made with.
#[derive(Clone)]
pub struct SharedReceiveQueue {
    pub(crate) inner: Arc<SrqInner>,
}

impl ProtectionDomain {
    /// A shared receive queue of `max_wr` receives of up to `max_sge`
    /// scatter/gather entries each, completing on `cq`.
    pub fn create_srq(
        &self,
        cq: &CompletionQueue,
        max_wr: u32,
        max_sge: u32,
    ) -> Result<SharedReceiveQueue> {
        // SAFETY: all-zero is a valid ibv_srq_init_attr.
        let mut attr: sys::ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        attr.attr.max_wr = max_wr;
        attr.attr.max_sge = max_sge.max(1);
        // SAFETY: the PD is alive; attr is filled.
        let srq = unsafe { sys::ibv_create_srq(self.verbs().as_raw(), &mut attr) };
        let srq = NonNull::new(srq).ok_or_else(|| verbs::Error::last_os("ibv_create_srq"))?;
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner {
                srq,
                tag: SRQ_TAG | (NEXT_SRQ.fetch_add(1, Ordering::Relaxed) & !SRQ_TAG),
                cq: cq.clone(),
                _pd: self.verbs().clone(),
            }),
        })
    }
}

impl SharedReceiveQueue {
    pub(crate) fn as_raw(&self) -> *mut sys::ibv_srq {
        self.inner.srq.as_ptr()
    }

    /// Posts a receive into `mem`, for whichever queue pair gets a message
    /// first.
    pub fn recv<W: Writable>(&self, mem: W) -> Result<Op<W>> {
        let sge = mem.sge(TOKEN);
        let cq = &self.inner.cq.shared;
        let ticket = cq.open(self.inner.tag, 1)?;
        // SAFETY: all-zero is a valid ibv_recv_wr.
        let mut wr: sys::ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = ticket.wr_id(true);
        wr.sg_list = sge.as_ref().map_or(std::ptr::null_mut(), |s| {
            s as *const verbs::Sge as *mut sys::ibv_sge
        });
        wr.num_sge = i32::from(sge.is_some());
        let mut bad = std::ptr::null_mut();
        // SAFETY: the SRQ is alive; wr lives for the call; `mem` moves into
        // the Op until the completion is reaped.
        let rc = unsafe {
            crate::costs::post_recv(&wr);
            sys::ibv_post_srq_recv(self.as_raw(), &mut wr, &mut bad)
        };
        if rc != 0 {
            cq.abandon(ticket);
            return Err(verbs::Error::from_code("ibv_post_srq_recv", rc).into());
        }
        Ok(Op::new(cq.clone(), ticket, mem))
    }
}
