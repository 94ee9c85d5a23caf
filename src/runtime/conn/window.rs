//! Memory only this connection's peer may write: a region exposed through a
//! memory window bound to this connection's QP. In a protection domain that
//! many connections share (a server's), another peer that learns or guesses
//! the rkey gets a remote access error from the NIC.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::runtime::Result;
use crate::verbs::{AccessFlags, MemoryRegion, MemoryWindow, QueuePair, RemoteRegion};

use super::park::Until;
use super::{Connection, State, WeakConnection, MAX_SEND_WR};

/// A region and the window that exposes it to one peer. Dropping it ends
/// the peer's access first, then frees the region. It keeps the QP alive:
/// rxe holds a bound window's QP, and destroying the QP first stalls.
pub struct Window {
    /// Its bind, which must have completed (or the QP have stopped) before
    /// the window and region go: a bind the device runs later would work
    /// on a window freed, perhaps already another's.
    bind: u64,
    /// Known to have completed (or the QP to have stopped): dropping waits
    /// for nothing.
    settled: bool,
    conn: WeakConnection,
    // Field order is drop order: the window before the QP it is bound to
    // and the region it covers.
    _mw: MemoryWindow,
    _qp: QueuePair,
    mr: MemoryRegion,
    remote: RemoteRegion,
}

/// A window let go before its bind completed ([`Window::release_with`]),
/// and what must outlive it (the memory under its region). Field order is
/// drop order.
pub(super) struct Unsettled {
    kept_since: Instant,
    window: Window,
    _keep: Box<dyn Send>,
}

/// How long a window's bind may wait once the window is let go: dropped,
/// it waits this long before it stops the QP; released
/// ([`Window::release_with`]), the connection is failed on the first tick
/// after this long. A bind waits only behind sends the peer has not taken,
/// which one that follows the protocol takes within a round trip.
const BIND_WAIT: Duration = crate::runtime::MIN_DEVICE_WAIT;

/// Windows a connection keeps for binds that have not completed: a peer
/// this many behind is taking none of our sends, and its connection is
/// failed at once. It bounds what such a peer holds beyond its share (two
/// kv clients' shares of write targets), for the second it may hold it.
const MAX_UNSETTLED: usize = 16;

impl Drop for Window {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
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

    /// Whether dropping the window now ends the peer's access at once: its
    /// bind has completed (the send completions already in are taken
    /// first), or the connection has ended. When not, the peer has not
    /// learnt the rkey from anything sent after the bind, but may once the
    /// bind completes.
    pub(crate) fn drops_at_once(&self) -> bool {
        let Some(conn) = self.conn.upgrade() else {
            return true;
        };
        let settled = |conn: &Connection| conn.has_ended() || conn.lock().binds_done >= self.bind;
        settled(&conn) || {
            while conn.poll_send(false) {}
            settled(&conn)
        }
    }

    /// Drops the window, then `keep` (what its region covers), without
    /// waiting for the bind as dropping the window alone does: a bind not
    /// complete yet, which waits behind sends the peer has not taken,
    /// leaves both with the connection until the bind completes or the
    /// connection ends. The peer may use the window until then, so `keep`
    /// must not be reused meanwhile: it is dropped only after the window,
    /// perhaps on the completion thread and under the connection's send
    /// poll lock, so it must not own this connection or its windows. A
    /// connection that keeps a window for a second, or
    /// [`MAX_UNSETTLED`] at once, is failed, which ends them all.
    pub(crate) fn release_with(mut self, keep: impl Send + 'static) {
        let Some(conn) = self.conn.upgrade() else {
            drop(self);
            return drop(keep);
        };
        let mut st = conn.lock();
        if st.binds_done >= self.bind || conn.has_ended() {
            drop(st);
            self.settled = true;
            drop(self);
            return drop(keep);
        }
        if st.unsettled.len() >= MAX_UNSETTLED {
            drop(st);
            // Stops the QP: the bind will not run, and nothing waits.
            conn.fail("the peer takes none of our sends: memory windows wait behind them");
            self.settled = true;
            drop(self);
            return drop(keep);
        }
        st.unsettled.push(Unsettled {
            kept_since: Instant::now(),
            window: self,
            _keep: Box::new(keep),
        });
        conn.inner.windows_unsettled.store(true, Ordering::SeqCst);
        drop(st);
        // Its completion must wake the completion thread (`drain` arms the
        // send CQ while any is kept); what completed before is taken now.
        conn.arm_send_and_take(false);
        conn.release_settled_windows();
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

    /// Fails the connection when a window has been kept for its bind for
    /// [`BIND_WAIT`] (a tick's look): the peer takes none of our sends.
    pub(super) fn expire_unsettled_windows(&self) {
        if !self.inner.windows_unsettled.load(Ordering::SeqCst) {
            return;
        }
        // Completions already in settle what they can first (a failed one
        // fails the connection, which ends the wait too).
        while self.poll_send(false) {}
        let (expired, settled) = {
            let mut st = self.lock();
            let settled = self.take_settled_windows(&mut st);
            let oldest = st.unsettled.first();
            (
                oldest.is_some_and(|u| u.kept_since.elapsed() >= BIND_WAIT),
                settled,
            )
        };
        // Unregistered and unmapped outside the lock.
        drop(settled);
        if expired {
            // Stops the QP, which ends the windows' wait.
            self.fail(
                "the peer took none of our sends for a second: a memory window waits behind them",
            );
        }
    }

    /// Lets go of the windows kept for binds that have since completed, or
    /// all of them once the connection has ended (its QP is stopped first).
    pub(super) fn release_settled_windows(&self) {
        let settled = self.take_settled_windows(&mut self.lock());
        // Outside the lock: unregistering and unmapping take system calls.
        drop(settled);
    }

    /// The kept windows whose binds have completed (all, once the
    /// connection has ended), marked so that dropping them waits for
    /// nothing.
    pub(super) fn take_settled_windows(&self, st: &mut State) -> Vec<Unsettled> {
        if st.unsettled.is_empty() {
            return Vec::new();
        }
        let (done, ended) = (st.binds_done, self.has_ended());
        let (mut settled, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut st.unsettled)
            .into_iter()
            .partition(|u| ended || u.window.bind <= done);
        st.unsettled = kept;
        self.inner
            .windows_unsettled
            .store(!st.unsettled.is_empty(), Ordering::SeqCst);
        for u in &mut settled {
            u.window.settled = true;
        }
        settled
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
            settled: false,
            conn: self.downgrade(),
            _mw: mw,
            _qp: self.inner.qp.clone(),
            mr,
            remote,
        })
    }
}
