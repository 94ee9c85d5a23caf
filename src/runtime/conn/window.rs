//! Memory only this connection's peer may write: a region exposed through a
//! memory window bound to this connection's QP. In a protection domain that
//! many connections share (a server's), another peer that learns or guesses
//! the rkey gets a remote access error from the NIC.

use crate::runtime::Result;
use crate::verbs::{AccessFlags, MemoryRegion, MemoryWindow, QueuePair, RemoteRegion};

use super::{wr_id, Connection, K_BIND, MAX_SEND_WR};

/// A region and the window that exposes it to one peer. Dropping it ends
/// the peer's access first, then frees the region. It keeps the QP alive:
/// rxe holds a bound window's QP, and destroying the QP first stalls.
pub struct Window {
    // Field order is drop order: the window before the QP it is bound to
    // and the region it covers.
    _mw: MemoryWindow,
    _qp: QueuePair,
    mr: MemoryRegion,
    remote: RemoteRegion,
}

impl Window {
    /// What the peer needs to reach the region.
    pub fn remote(&self) -> RemoteRegion {
        self.remote
    }

    /// The region (our side).
    pub fn region(&self) -> &MemoryRegion {
        &self.mr
    }
}

impl Connection {
    /// Exposes `mr` (registered in this connection's PD with
    /// [`AccessFlags::MW_BIND`]) to the peer alone, with `access` (remote
    /// write and/or read). The bind is posted, not waited for: the send
    /// queue runs in order, so anything sent after this returns (such as
    /// the message that tells the peer the rkey) reaches the peer after the
    /// window is usable. A failed bind ends the connection.
    pub fn expose(&self, mr: MemoryRegion, access: AccessFlags) -> Result<Window> {
        let mw = self.inner.pd.alloc_mw()?;
        let mut st = self.lock();
        if st.sq_used >= MAX_SEND_WR {
            return Err(crate::runtime::Error::InvalidArgument(
                "the send queue is full".into(),
            ));
        }
        let _order = self.post_order();
        // SAFETY: the window and region live in the returned Window, which
        // drops the window first; the QP outlives the bind's completion
        // (the connection owns it).
        let remote = unsafe {
            self.inner
                .qp
                .post_bind(wr_id(K_BIND, 0), &mw, &mr, 0, mr.len(), access)?
        };
        st.sq_used += 1;
        Ok(Window {
            _mw: mw,
            _qp: self.inner.qp.clone(),
            mr,
            remote,
        })
    }
}
