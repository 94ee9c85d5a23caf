//! Memory only this connection's peer may write: a region exposed through a
//! memory window bound to this connection's QP. In a protection domain that
//! many connections share (a server's), another peer that learns or guesses
//! the rkey gets a remote access error from the NIC.

use std::time::Duration;

use crate::runtime::Result;
use crate::verbs::{AccessFlags, MemoryRegion, MemoryWindow, QueuePair, RemoteRegion};

use super::park::Until;
use super::{Connection, WeakConnection, MAX_SEND_WR};

/// A region and the window that exposes it to one peer. Dropping it ends
/// the peer's access first, then frees the region. It keeps the QP alive:
/// rxe holds a bound window's QP, and destroying the QP first stalls.
pub struct Window {
    /// Its bind, which must have completed (or the QP have stopped) before
    /// the window and region go: a bind the device runs later would work
    /// on a window freed, perhaps already another's.
    bind: u64,
    conn: WeakConnection,
    // Field order is drop order: the window before the QP it is bound to
    // and the region it covers.
    _mw: MemoryWindow,
    _qp: QueuePair,
    mr: MemoryRegion,
    remote: RemoteRegion,
}

/// How long a dropped window waits for its bind before it stops the QP.
const BIND_WAIT: Duration = Duration::from_secs(1);

impl Drop for Window {
    fn drop(&mut self) {
        match self.conn.upgrade() {
            Some(conn) => conn.settle_bind(self.bind),
            // The connection is gone: its QP (ours too) may not be stopped.
            None => {
                if let Err(e) = self._qp.to_error() {
                    log::debug!("dropping a window: {e}");
                }
            }
        }
    }
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
    /// Returns once bind number `bind` has completed, or the QP is stopped
    /// (an ended connection's, whose end stopped it, or this one's after
    /// [`BIND_WAIT`]): the device will not run it later.
    fn settle_bind(&self, bind: u64) {
        let done = self.wait_on(Until::Within(BIND_WAIT), |st| {
            (st.binds_done >= bind || self.has_ended()).then_some(())
        });
        if done.is_err() {
            // Stops the QP, as every end does before it shows.
            self.fail("a memory window's bind did not complete");
        }
    }

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
        // The window and region live in the returned Window, whose drop
        // waits for the bind's completion (or stops the QP) before it lets
        // them go; the QP outlives the completion (the Window holds it).
        let remote = self.bind_window(&mut st, &mw, &mr, 0..mr.len(), access)?;
        Ok(Window {
            bind: st.binds_posted,
            conn: self.downgrade(),
            _mw: mw,
            _qp: self.inner.qp.clone(),
            mr,
            remote,
        })
    }
}
