//! Posting: handing out send slots, queueing SEND, WRITE and READ with
//! their checks (the slot was handed out, the local bytes lie in a slot or
//! the data region, the remote bytes in the peer's region), and ringing the
//! doorbell once per batch.

use std::time::{Duration, Instant};

use super::peer::{Pending, Slot};
use super::{Broker, BrokerError, EventKind, Local, Remote, Result, SendBuf};
use crate::verbs::{RemoteAddr, SendOp, Sge};

impl Broker {
    /// The next send slot for `server`; [`BrokerError::Full`] when it is
    /// still in flight (poll the send side and try again).
    pub fn send_buf(&self, server: usize) -> Result<SendBuf<'_>> {
        Ok(SendBuf {
            broker: self,
            peer: server,
            slot: self.hand_out(server)?,
            posted: false,
        })
    }

    /// Hands out the next send slot of `server` with no guard: it stays
    /// handed out until posted (for callers that keep the slot's address, as
    /// the C API does).
    pub fn hand_out(&self, server: usize) -> Result<u32> {
        let peer = self.peer(server)?;
        let mut send = peer.send.borrow_mut();
        let slot = send.next;
        if send.slots[slot as usize] != Slot::Free {
            return Err(BrokerError::Full(server));
        }
        send.slots[slot as usize] = Slot::Handed;
        send.next = (slot + 1) % self.shared.config.slots;
        Ok(slot)
    }

    /// The data region's memory (peers may write it at any time).
    pub fn data_ptr(&self) -> (*mut u8, usize) {
        (
            self.shared.data.addr() as usize as *mut u8,
            self.shared.data.len(),
        )
    }

    /// Where a local buffer the C API was given lies: a handed-out slot of
    /// `server`, or the data region.
    pub fn locate(&self, server: usize, ptr: *const u8, len: u32) -> Option<Local> {
        if let Some(slot) = self.slot_at(server, ptr) {
            return Some(Local::Slot(slot));
        }
        let (base, size) = self.data_ptr();
        let off = (ptr as usize).checked_sub(base as usize)?;
        (off.checked_add(len as usize)? <= size).then_some(Local::Data(off as u64))
    }

    /// [`Broker::send_buf`], polling while the ring is full, up to
    /// `timeout`: the send side, which frees slots, and the receive side
    /// (callbacks run), because a peer that is itself waiting for room
    /// frees ours only once we take its messages. Inside a callback nothing
    /// can be polled, so it does not wait: a full ring is
    /// [`BrokerError::Full`] at once.
    pub fn send_buf_wait(&self, server: usize, timeout: Duration) -> Result<SendBuf<'_>> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.send_buf(server) {
                Err(BrokerError::Full(_)) if Instant::now() < deadline && !self.in_callback() => {
                    self.flush(server)?;
                    self.poll_sq(None)?;
                    self.poll_rq(None)?;
                }
                r => return r,
            }
        }
    }

    /// The address and length of `server`'s send slot `slot`.
    pub fn slot_ptr(&self, server: usize, slot: u32) -> (*mut u8, usize) {
        let (a, l) = self.shared.send_slot(server, slot);
        (a as *mut u8, l)
    }

    /// Finds the handed-out slot of `server` at `ptr` (for callers that
    /// pass the slot's address back, as the seed's API does).
    pub fn slot_at(&self, server: usize, ptr: *const u8) -> Option<u32> {
        let (first, size) = self.shared.send_slot(server, 0);
        let off = (ptr as usize).checked_sub(first)?;
        let slot = u32::try_from(off / size).ok()?;
        (off % size == 0 && slot < self.shared.config.slots).then_some(slot)
    }

    /// Queues a SEND of the first `len` bytes of a handed-out slot (`imm`
    /// 0: none); goes out with the batch. Returns its id.
    pub fn post_send(&self, server: usize, slot: u32, len: u32, imm: u32) -> Result<u64> {
        let sge = self.slot_sge(server, slot, len)?;
        let op = if imm == 0 {
            SendOp::Send
        } else {
            SendOp::SendWithImm(imm)
        };
        self.queue(server, op, sge, EventKind::SendDone, Some(slot))
    }

    /// Queues a WRITE of `len` bytes from `local` to `remote` (`imm` != 0:
    /// WRITE WITH IMM, which consumes a receive at the peer).
    pub fn post_write(
        &self,
        server: usize,
        local: Local,
        len: u32,
        remote: Remote,
        imm: u32,
    ) -> Result<u64> {
        let (sge, slot) = self.local_sge(server, local, len)?;
        let to = self.remote_addr(server, remote, len)?;
        let op = if imm == 0 {
            SendOp::Write(to)
        } else {
            SendOp::WriteWithImm(to, imm)
        };
        self.queue(server, op, sge, EventKind::WriteDone, slot)
    }

    /// Queues a READ of `len` bytes at `remote` into `local`.
    pub fn post_read(&self, server: usize, local: Local, len: u32, remote: Remote) -> Result<u64> {
        let (sge, slot) = self.local_sge(server, local, len)?;
        let from = self.remote_addr(server, remote, len)?;
        self.queue(server, SendOp::Read(from), sge, EventKind::ReadDone, slot)
    }

    fn slot_sge(&self, server: usize, slot: u32, len: u32) -> Result<Sge> {
        let peer = self.peer(server)?;
        let send = peer.send.borrow();
        if send.slots.get(slot as usize) != Some(&Slot::Handed) {
            return Err(BrokerError::InvalidArgument(format!(
                "slot {slot} of server {server} was not handed out by send_buf"
            )));
        }
        if len > self.shared.config.slot_size {
            return Err(BrokerError::InvalidArgument(format!(
                "{len} bytes do not fit a {}-byte slot",
                self.shared.config.slot_size
            )));
        }
        let (addr, _) = self.shared.send_slot(server, slot);
        Ok(Sge {
            addr: addr as u64,
            length: len,
            lkey: self.shared.rings.lkey(),
        })
    }

    fn local_sge(&self, server: usize, local: Local, len: u32) -> Result<(Sge, Option<u32>)> {
        match local {
            Local::Slot(slot) => Ok((self.slot_sge(server, slot, len)?, Some(slot))),
            Local::Data(off) => {
                let data = &self.shared.data;
                if off
                    .checked_add(u64::from(len))
                    .is_none_or(|end| end > data.len() as u64)
                {
                    return Err(BrokerError::InvalidArgument(format!(
                        "{len} bytes at {off} are outside the {}-byte data region",
                        data.len()
                    )));
                }
                Ok((
                    Sge {
                        addr: data.addr() + off,
                        length: len,
                        lkey: data.lkey(),
                    },
                    None,
                ))
            }
        }
    }

    fn remote_addr(&self, server: usize, remote: Remote, len: u32) -> Result<RemoteAddr> {
        let r = self.peer(server)?.remote;
        let off = match remote {
            Remote::Offset(o) => Some(o),
            Remote::Addr(a) => a.checked_sub(r.addr),
        };
        match off {
            Some(o)
                if o.checked_add(u64::from(len))
                    .is_some_and(|end| end <= r.len) =>
            {
                Ok(RemoteAddr {
                    addr: r.addr + o,
                    rkey: r.rkey,
                })
            }
            _ => Err(BrokerError::InvalidArgument(format!(
                "{len} bytes at {remote:?} are outside server {server}'s {}-byte region",
                r.len
            ))),
        }
    }

    fn queue(
        &self,
        server: usize,
        op: SendOp,
        sge: Sge,
        kind: EventKind,
        slot: Option<u32>,
    ) -> Result<u64> {
        let peer = self.peer(server)?;
        let full = {
            let mut send = peer.send.borrow_mut();
            if send.in_queue + send.pending.len() >= self.shared.max_send_wr() as usize {
                return Err(BrokerError::Full(server));
            }
            send.seq += 1;
            let seq = send.seq;
            if let Some(s) = slot {
                // Used up: not handed out again until its completion.
                send.slots[s as usize] = Slot::Posted;
            }
            send.pending.push(Pending {
                seq,
                op,
                sge,
                kind,
                slot,
            });
            send.pending.len() >= self.shared.config.doorbell_batch as usize
        };
        let c = &self.shared.stats;
        match kind {
            EventKind::SendDone => c.sends.set(c.sends.get() + 1),
            EventKind::WriteDone => c.writes.set(c.writes.get() + 1),
            _ => c.reads.set(c.reads.get() + 1),
        }
        if full {
            peer.flush(&self.shared)?;
        }
        Ok(peer.send.borrow().seq)
    }

    /// Posts `server`'s queued requests now (a partial batch).
    pub fn flush(&self, server: usize) -> Result<()> {
        self.peer(server)?.flush(&self.shared).map(drop)
    }

    /// Posts every peer's queued requests.
    pub fn flush_all(&self) -> Result<()> {
        self.check_owner()?;
        for p in self.all().iter().flatten().filter(|p| !p.failed.get()) {
            p.flush(&self.shared)?;
        }
        Ok(())
    }
}

impl SendBuf<'_> {
    pub fn slot(&self) -> u32 {
        self.slot
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let (p, l) = self.broker.slot_ptr(self.peer, self.slot);
        // SAFETY: the slot is handed to this value only, and no request
        // uses it until it is posted (which consumes the value).
        unsafe { std::slice::from_raw_parts_mut(p, l) }
    }

    /// Queues a SEND of the first `len` bytes (`imm` 0: none).
    /// On an error before the message was queued (a bad length or range)
    /// the slot is free again when this value is dropped; one after (the
    /// batch it completed failed to post, and with it the peer) leaves the
    /// slot to the failed peer's requests.
    pub fn send(mut self, len: u32, imm: u32) -> Result<u64> {
        let queued = self.broker.post_send(self.peer, self.slot, len, imm);
        self.posted = queued.is_ok();
        queued
    }

    /// Queues a WRITE of the first `len` bytes to `remote`.
    /// On an error, as [`SendBuf::send`].
    pub fn write(mut self, len: u32, remote: Remote, imm: u32) -> Result<u64> {
        let queued = self
            .broker
            .post_write(self.peer, Local::Slot(self.slot), len, remote, imm);
        self.posted = queued.is_ok();
        queued
    }
}

impl Drop for SendBuf<'_> {
    fn drop(&mut self) {
        if self.posted {
            return;
        }
        // Never posted (or its post failed before queueing it): the slot
        // is free again.
        if let Some(Some(p)) = self.broker.all().get(self.peer) {
            let mut send = p.send.borrow_mut();
            if send.slots[self.slot as usize] == Slot::Handed {
                send.slots[self.slot as usize] = Slot::Free;
            }
        }
    }
}
