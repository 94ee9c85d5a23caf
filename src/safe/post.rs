//! Posting: every operation takes its memory by value and returns an
//! [`Op`] future that gives it back, so no `unsafe` is needed to post.
//! Remote accesses are checked against the remote region's length first.

use std::marker::PhantomData;

use super::cq::Ticket;
use super::error::{Error, Result};
use super::op::{BatchOp, Op};
use super::qp::{CanRecv, Connected, Qp, QpCore, Rc, Rts};
use super::region::{AtomicTarget, Local, RawHold, Writable, TOKEN};
use crate::verbs::{RemoteAddr, RemoteRegion, SendOp, SendRequest, Sge};

/// The remote address `offset` bytes into `remote`, for an access of `len`
/// bytes that must lie wholly inside it.
pub(crate) fn remote_at(remote: &RemoteRegion, offset: u64, len: u64) -> Result<RemoteAddr> {
    let outside = || Error::RemoteOutOfBounds {
        wanted: offset..offset.saturating_add(len),
        len: remote.len,
    };
    let end = offset.checked_add(len).ok_or_else(outside)?;
    if end > remote.len {
        return Err(outside());
    }
    let addr = remote.addr.checked_add(offset).ok_or_else(outside)?;
    Ok(RemoteAddr {
        addr,
        rkey: remote.rkey,
    })
}

fn bytes(sge: Option<Sge>) -> u64 {
    sge.map_or(0, |s| u64::from(s.length))
}

fn sges(sge: &Option<Sge>) -> &[Sge] {
    sge.as_slice()
}

impl QpCore {
    /// Posts one signaled send-queue request over `mem`.
    fn post_one<S: Local>(&self, op: SendOp, mem: S) -> Result<Op<S>> {
        let sge = mem.sge(TOKEN);
        let ticket = self.send.open(self.qp.qp_num(), 1)?;
        let req = SendRequest::new(ticket.wr_id(true), op, sges(&sge));
        // SAFETY: `mem` moves into the returned Op, which keeps it (or parks
        // it with the CQ when dropped) until the completion is reaped.
        match unsafe { self.qp.post_send(&[req]) } {
            Ok(()) => Ok(Op::new(self.send.clone(), ticket, mem)),
            Err(e) => {
                // A single request that fails to post was not posted.
                self.send.abandon(ticket);
                Err(e.into())
            }
        }
    }

    pub(crate) fn post_recv<W: Writable>(&self, mem: W) -> Result<Op<W>> {
        let sge = mem.sge(TOKEN);
        let ticket = self.recv.open(self.qp.qp_num(), 1)?;
        // SAFETY: as in post_one; the segment is read-write, so nobody else
        // reads or writes it meanwhile.
        match unsafe { self.qp.post_recv(ticket.wr_id(true), sges(&sge)) } {
            Ok(()) => Ok(Op::new(self.recv.clone(), ticket, mem)),
            Err(e) => {
                self.recv.abandon(ticket);
                Err(e.into())
            }
        }
    }
}

impl<T: Connected, S: CanRecv> Qp<T, S> {
    /// Receives one message into `mem` (a [`NoBuffer`](super::NoBuffer) for
    /// a WRITE WITH IMM or an empty message).
    pub fn recv<W: Writable>(&self, mem: W) -> Result<Op<W>> {
        self.core.post_recv(mem)
    }
}

impl<T: Connected> Qp<T, Rts> {
    /// Sends `mem` as one message.
    pub fn send<S: Local>(&self, mem: S) -> Result<Op<S>> {
        self.core.post_one(SendOp::Send, mem)
    }

    /// Sends `mem` with an immediate.
    pub fn send_with_imm<S: Local>(&self, mem: S, imm: u32) -> Result<Op<S>> {
        self.core.post_one(SendOp::SendWithImm(imm), mem)
    }

    /// Writes `mem` to `offset` bytes into `remote`; refused before posting
    /// when it does not fit.
    pub fn write<S: Local>(&self, mem: S, remote: &RemoteRegion, offset: u64) -> Result<Op<S>> {
        let to = remote_at(remote, offset, bytes(mem.sge(TOKEN)))?;
        self.core.post_one(SendOp::Write(to), mem)
    }

    /// [`Qp::write`] that also consumes a receive at the peer and hands it
    /// the immediate.
    pub fn write_with_imm<S: Local>(
        &self,
        mem: S,
        remote: &RemoteRegion,
        offset: u64,
        imm: u32,
    ) -> Result<Op<S>> {
        let to = remote_at(remote, offset, bytes(mem.sge(TOKEN)))?;
        self.core.post_one(SendOp::WriteWithImm(to, imm), mem)
    }

    /// A batch of requests posted with one doorbell. It borrows the queue
    /// pair, so nothing else is posted in between.
    pub fn batch(&mut self) -> Batch<'_, T> {
        Batch {
            core: &self.core,
            reqs: Vec::new(),
            holds: Vec::new(),
            _t: PhantomData,
        }
    }
}

impl Qp<Rc, Rts> {
    /// Reads `offset` bytes into `remote` into `mem`.
    pub fn read<W: Writable>(&self, mem: W, remote: &RemoteRegion, offset: u64) -> Result<Op<W>> {
        let from = remote_at(remote, offset, bytes(mem.sge(TOKEN)))?;
        self.core.post_one(SendOp::Read(from), mem)
    }

    /// Compare-and-swap of the 8 bytes at `offset` into `remote`; the old
    /// value lands in `old`.
    pub fn cas<A: AtomicTarget>(
        &self,
        old: A,
        remote: &RemoteRegion,
        offset: u64,
        compare: u64,
        swap: u64,
    ) -> Result<Op<A>> {
        let at = atomic_at(&old, remote, offset)?;
        self.core.post_one(
            SendOp::CompareSwap {
                remote: at,
                compare,
                swap,
            },
            old,
        )
    }

    /// Fetch-and-add on the 8 bytes at `offset` into `remote`; the old value
    /// lands in `old`.
    pub fn faa<A: AtomicTarget>(
        &self,
        old: A,
        remote: &RemoteRegion,
        offset: u64,
        add: u64,
    ) -> Result<Op<A>> {
        let at = atomic_at(&old, remote, offset)?;
        self.core
            .post_one(SendOp::FetchAdd { remote: at, add }, old)
    }
}

fn atomic_at<A: AtomicTarget>(old: &A, remote: &RemoteRegion, offset: u64) -> Result<RemoteAddr> {
    if bytes(old.sge(TOKEN)) != 8 {
        return Err(Error::invalid("an atomic's result segment is one u64"));
    }
    let at = remote_at(remote, offset, 8)?;
    if at.addr % 8 != 0 {
        return Err(Error::invalid(format!(
            "atomic target {:#x} is not 8-byte aligned",
            at.addr
        )));
    }
    Ok(at)
}

/// Requests gathered for one doorbell: [`Qp::batch`]. All but the last are
/// unsignaled, which is safe because the batch holds every segment until the
/// last completes (or the first failure and the flush after it are reaped).
pub struct Batch<'q, T> {
    core: &'q QpCore,
    reqs: Vec<(SendOp, Option<Sge>)>,
    holds: Vec<RawHold>,
    _t: PhantomData<fn() -> T>,
}

impl<T: Connected> Batch<'_, T> {
    fn push<S: Local>(&mut self, op: SendOp, mem: S) -> &mut Self {
        self.reqs.push((op, mem.sge(TOKEN)));
        mem.park(&mut self.holds, TOKEN);
        self
    }

    pub fn send<S: Local>(&mut self, mem: S) -> &mut Self {
        self.push(SendOp::Send, mem)
    }

    pub fn send_with_imm<S: Local>(&mut self, mem: S, imm: u32) -> &mut Self {
        self.push(SendOp::SendWithImm(imm), mem)
    }

    pub fn write<S: Local>(
        &mut self,
        mem: S,
        remote: &RemoteRegion,
        offset: u64,
    ) -> Result<&mut Self> {
        let to = remote_at(remote, offset, bytes(mem.sge(TOKEN)))?;
        Ok(self.push(SendOp::Write(to), mem))
    }

    pub fn write_with_imm<S: Local>(
        &mut self,
        mem: S,
        remote: &RemoteRegion,
        offset: u64,
        imm: u32,
    ) -> Result<&mut Self> {
        let to = remote_at(remote, offset, bytes(mem.sge(TOKEN)))?;
        Ok(self.push(SendOp::WriteWithImm(to, imm), mem))
    }

    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Posts the batch with one `ibv_post_send`.
    pub fn post(self) -> Result<BatchOp> {
        let Some(last) = self.reqs.len().checked_sub(1) else {
            return Err(Error::invalid("an empty batch"));
        };
        let ticket: Ticket = self
            .core
            .send
            .open(self.core.qp.qp_num(), self.reqs.len())?;
        let reqs: Vec<SendRequest<'_>> = self
            .reqs
            .iter()
            .enumerate()
            .map(|(i, (op, sge))| {
                let req = SendRequest::new(ticket.wr_id(i == last), *op, sges(sge));
                if i == last {
                    req
                } else {
                    req.unsignaled()
                }
            })
            .collect();
        // SAFETY: the holds move into the BatchOp (or are parked with the
        // CQ below), which keeps them until the tail's completion is reaped.
        match unsafe { self.core.qp.post_send_counted(&reqs) } {
            Ok(()) => Ok(BatchOp::new(self.core.send.clone(), ticket, self.holds)),
            Err((0, e)) => {
                // Nothing went out: the memory is free at once.
                self.core.send.abandon(ticket);
                Err(e.into())
            }
            Err((posted, e)) => {
                // The requests before the failing one are on the device,
                // without a signaled tail: their memory stays parked until
                // the queue pair is stopped.
                self.core.send.disown(ticket, posted, self.holds);
                Err(e.into())
            }
        }
    }
}

impl Batch<'_, Rc> {
    pub fn read<W: Writable>(
        &mut self,
        mem: W,
        remote: &RemoteRegion,
        offset: u64,
    ) -> Result<&mut Self> {
        let from = remote_at(remote, offset, bytes(mem.sge(TOKEN)))?;
        Ok(self.push(SendOp::Read(from), mem))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_accesses_stay_inside_the_region() {
        let r = RemoteRegion {
            addr: 0x1000,
            len: 64,
            rkey: 7,
        };
        assert_eq!(remote_at(&r, 0, 64).unwrap().addr, 0x1000);
        assert_eq!(remote_at(&r, 60, 4).unwrap().addr, 0x103c);
        assert!(matches!(
            remote_at(&r, 60, 8),
            Err(Error::RemoteOutOfBounds { len: 64, .. })
        ));
        assert!(remote_at(&r, u64::MAX, 2).is_err());
        let high = RemoteRegion {
            addr: u64::MAX - 4,
            len: 64,
            rkey: 7,
        };
        assert!(remote_at(&high, 8, 1).is_err());
    }
}
