//! One-sided operations: the caller's registered buffers, async and sync
//! RDMA READ and WRITE.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;

use crate::runtime::{Error, Result};
use crate::verbs::{AccessFlags, MemoryRegion, RemoteAddr, SendOp, SendRequest, Sge};

use super::park::Until;
use super::{
    wr_id, ConnState, Connection, State, CMD_RESERVE, K_READ, K_SYNC, K_WRITE, MAX_SEND_WR,
    SYNC_OP_TIMEOUT,
};

/// One-sided operations one post chains without a heap allocation (a kv
/// batch's READs: up to 64).
const ON_STACK: usize = 64;

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

/// Whether `[addr, addr+len)` lies in `mr` (a caller's range may pass the
/// end of the address space).
fn holds(mr: &MemoryRegion, addr: u64, len: usize) -> bool {
    addr >= mr.addr()
        && addr
            .checked_add(len as u64)
            .is_some_and(|end| end <= mr.addr() + mr.len() as u64)
}

impl Connection {
    /// The lkey of the buffer registered on this connection (by
    /// [`Connection::register`]) that holds `[addr, addr+len)`.
    pub fn registered_lkey(&self, addr: u64, len: usize) -> Option<u32> {
        let mrs = self.inner.user_mrs.lock().expect("mr lock");
        mrs.values()
            .find(|mr| holds(mr, addr, len))
            .map(|mr| mr.lkey())
    }

    /// Registers a zeroed buffer of `size` bytes for local write and remote
    /// read/write on this connection; it lives until [`Connection::deregister`]
    /// or the connection's end.
    pub fn register(&self, size: usize) -> Result<Arc<MemoryRegion>> {
        self.register_with(
            size,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
    }

    /// Registers like [`Connection::register`], with `access` (a buffer
    /// only this side's operations use needs no remote access at all).
    pub fn register_with(&self, size: usize, access: AccessFlags) -> Result<Arc<MemoryRegion>> {
        let mr = Arc::new(self.inner.pd.allocate(size, access)?);
        self.inner
            .user_mrs
            .lock()
            .expect("mr lock")
            .insert(mr.as_raw() as usize, mr.clone());
        Ok(mr)
    }

    /// Ends a registration from [`Connection::register`] (the memory is
    /// freed once no other holder is left); false when `mr` is not one of
    /// this connection's.
    pub fn deregister(&self, mr: &MemoryRegion) -> bool {
        self.inner
            .user_mrs
            .lock()
            .expect("mr lock")
            .remove(&(mr.as_raw() as usize))
            .is_some()
    }

    /// The registration of this connection that `pick` chooses. `pick`
    /// runs without the connection's locks: it may call the connection
    /// (register, deregister), and a panic in it leaves nothing poisoned.
    pub fn find_registered(
        &self,
        pick: impl Fn(&MemoryRegion) -> bool,
    ) -> Option<Arc<MemoryRegion>> {
        let mrs: Vec<Arc<MemoryRegion>> = self
            .inner
            .user_mrs
            .lock()
            .expect("mr lock")
            .values()
            .cloned()
            .collect();
        mrs.into_iter().find(|mr| pick(mr))
    }

    /// Checks that `[addr, addr+len)` lies in a buffer registered on this
    /// connection under `lkey`.
    pub(super) fn check_local(&self, addr: u64, lkey: u32, len: u32) -> Result<Sge> {
        let mrs = self.inner.user_mrs.lock().expect("mr lock");
        let own = [&self.inner.recv_ring, &self.inner.staging];
        let found = mrs
            .values()
            .map(|mr| &**mr)
            .chain(own)
            .find(|mr| mr.lkey() == lkey);
        match found {
            None => Err(Error::InvalidArgument(format!(
                "lkey {lkey:#x} is not a buffer registered on this connection"
            ))),
            Some(mr) if !holds(mr, addr, len as usize) => Err(Error::InvalidArgument(format!(
                "{len} bytes at {addr:#x} are outside the registered buffer of lkey {lkey:#x}"
            ))),
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
    pub(super) fn post_one_sided(
        &self,
        read: bool,
        ops: &[(Sge, RemoteAddr)],
        sync: bool,
    ) -> Result<u64> {
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
        let room = |st: &mut State| match st.state {
            ConnState::Closed | ConnState::Error => Some(Err(Error::Disconnected)),
            ConnState::Connected | ConnState::MrReady
                if st.sq_used + n <= MAX_SEND_WR - CMD_RESERVE =>
            {
                Some(Ok(()))
            }
            ConnState::Connected | ConnState::MrReady => None,
            _ => Some(Err(Error::NotConnected)),
        };
        // Mostly there is room at once: the wait (and its clock) only when
        // not. The room found may be taken by another sender before this
        // one locks again: it looks once more under the lock it posts with.
        let mut deadline = None;
        let mut st = loop {
            let mut st = self.lock();
            match room(&mut st) {
                Some(Ok(())) => break st,
                Some(Err(e)) => return Err(e),
                None => drop(st),
            }
            let deadline =
                *deadline.get_or_insert_with(|| Instant::now() + self.inner.opts.device_wait());
            self.wait_on(Until::At(deadline), room).and_then(|r| r)?;
        };
        // The credit owed to the peer rides in front, as it does with a
        // message, rather than going alone when this thread waits.
        let credit = match self.credit_to_carry(&mut st) {
            Ok(credit) => credit,
            Err(e) => {
                drop(st);
                self.fail(&format!("returning credit: {e}"));
                return Err(e);
            }
        };
        let credit_sge = credit.map(|(_, sge)| [sge]);
        let first = st.next_op;
        if sync {
            st.next_op += u64::from(n);
            for id in first..first + u64::from(n) {
                st.sync_ops.insert(id);
            }
        } else {
            self.async_posted();
        }
        let id = |i: u64| match sync {
            true => wr_id(K_SYNC, first + i),
            false => wr_id(if read { K_READ } else { K_WRITE }, ops[0].0.length as u64),
        };
        // A batch of up to ON_STACK operations allocates nothing; filled in
        // place (a collected SmallVec is moved out, a copy of all its room).
        let mut sges: SmallVec<[[Sge; 1]; ON_STACK]> = SmallVec::new();
        sges.extend(ops.iter().map(|(local, _)| [*local]));
        let mut reqs: SmallVec<[SendRequest; ON_STACK + 1]> = SmallVec::new();
        if let (Some((slot, _)), Some(sge)) = (credit, &credit_sge) {
            reqs.push(self.cmd_request(slot, sge));
        }
        for (i, ((_, remote), sge)) in ops.iter().zip(&sges).enumerate() {
            let op = if read {
                SendOp::Read(*remote)
            } else {
                SendOp::Write(*remote)
            };
            reqs.push(SendRequest::new(id(i as u64), op, sge));
        }
        // SAFETY: the caller's buffers were checked to be registered here;
        // the C contract (and `read`/`write`'s docs) leave them to the device
        // until the completion; the command slot stays untouched until its
        // send completes.
        let posted = unsafe { self.post_chain(&mut st, &reqs, credit.is_some()) };
        if let Err(e) = posted {
            if !sync {
                self.inner.async_pending.fetch_sub(1, Ordering::SeqCst);
            }
            if n > 1 || credit.is_some() {
                // A prefix of the list may be posted, and its completions
                // still come; a credit carried counts as reported: only the
                // connection's end is safe.
                drop(st);
                self.fail(&format!("posting one-sided operations: {e}"));
            } else if sync {
                st.sync_ops.remove(first);
            }
            return Err(e);
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

    pub(super) fn one_sided_async(
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
    /// still in flight. While the guard is held, the connection's record of
    /// synchronous operations keeps a place for every one posted after
    /// these (a few bytes each), until they are waited for.
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
            .collect::<Result<SmallVec<[_; ON_STACK]>>>()?;
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

    pub(super) fn one_sided_sync(
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

    pub(super) fn sync_ops(&self, read: bool, ops: &[(Sge, RemoteAddr)]) -> Result<()> {
        let first = self.post_one_sided(read, ops, true)?;
        self.wait_sync_ops(first..first + ops.len() as u64)
    }

    /// Waits for the synchronous operations `ids` and forgets them.
    pub(super) fn wait_sync_ops(&self, ids: std::ops::Range<u64>) -> Result<()> {
        let result = self.wait_on(Until::Within(SYNC_OP_TIMEOUT), |st| {
            let mut outcome = Ok(());
            for id in ids.clone() {
                match st.sync_ops.get(id) {
                    Some(Some(Err(reason))) => outcome = outcome.and(Err(reason.clone())),
                    Some(Some(Ok(()))) => {}
                    Some(None) => return None,
                    None => return Some(Err("the connection closed".to_string())),
                }
            }
            for id in ids.clone() {
                st.sync_ops.remove(id);
            }
            Some(outcome)
        });
        match result {
            Ok(Ok(())) => Ok(()),
            Ok(Err(reason)) => Err(Error::OperationFailed(reason)),
            Err(e) => {
                let mut st = self.lock();
                for id in ids {
                    st.sync_ops.remove(id);
                }
                drop(st);
                if matches!(e, Error::Timeout(_)) {
                    // Stops the QP (also when another thread ended the
                    // connection first): the device starts nothing more on
                    // the buffers.
                    self.fail("a synchronous operation timed out");
                }
                Err(e)
            }
        }
    }
}
