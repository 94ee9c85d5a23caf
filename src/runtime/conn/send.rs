//! The send path: messages into the peer's ring (RDMA WRITE WITH IMM from
//! the staging buffer), commands, and the credit this side returns. The
//! messages that find no room wait in the send queue: `queued`.

use std::sync::atomic::Ordering;
use std::sync::{MutexGuard, PoisonError};
use std::time::Instant;

use crate::runtime::options::CommMode;
use crate::runtime::proto::{Cmd, ExtKind, CMD_LEN, EXT_HEADER_LEN, IMM_EXTENDED, VERSION};
use crate::runtime::send_queue::{Push, SendQueueStats};
use crate::runtime::{Error, Result};
use crate::verbs::{MemoryRegion, RemoteAddr, SendOp, SendRequest, Sge};

use super::{
    wr_id, ConnState, Connection, Deferred, State, CMD_RESERVE, K_CMD, K_DATA, MAX_SEND_WR,
    PEER_CMD_RESERVE, SIGNAL_EVERY,
};

/// A message as the pieces it is gathered from (a header, a key, a value),
/// and its length, summed once: the send path asks for it at every step.
#[derive(Clone, Copy)]
pub(crate) struct Parts<'a> {
    pieces: &'a [&'a [u8]],
    len: usize,
}

impl<'a> Parts<'a> {
    pub(crate) fn new(pieces: &'a [&'a [u8]]) -> Self {
        Parts {
            pieces,
            len: pieces.iter().map(|p| p.len()).sum(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn pieces(&self) -> &'a [&'a [u8]] {
        self.pieces
    }
}

/// Most pieces (an extension header and the caller's parts) a message that
/// fits inline is posted from where they are, with no copy of ours: the
/// provider takes inline bytes at the post.
pub(super) const INLINE_PARTS: usize = 4;

/// A message copied into the staging buffer and accounted for, to be posted.
#[derive(Clone, Copy)]
pub(super) struct StagedMessage {
    pub(super) sge: Sge,
    op: SendOp,
    wr_id: u64,
    signal: bool,
    inline: bool,
}

impl StagedMessage {
    /// Fills the unused places of a batch; never posted.
    pub(super) const NONE: StagedMessage = StagedMessage {
        sge: Sge::EMPTY,
        op: SendOp::Send,
        wr_id: 0,
        signal: false,
        inline: false,
    };

    /// Its WRITE WITH IMM, gathering `sges` (`[self.sge]`, or the message's
    /// parts where it is posted inline from them).
    pub(super) fn request<'a>(&self, sges: &'a [Sge]) -> SendRequest<'a> {
        let mut req = SendRequest::new(self.wr_id, self.op, sges);
        if !self.signal {
            req = req.unsignaled();
        }
        if self.inline {
            req = req.inline();
        }
        req
    }
}

impl Connection {
    /// `len` bytes at `offset` of one of our own registered buffers.
    ///
    /// # Safety
    /// The range must be inside `mr` and no posted operation may be reading
    /// it; callers hold the state lock, which owns staging and command slots.
    // The bytes are registered memory the connection owns, not `mr`'s own
    // fields: a `&MemoryRegion` lends no Rust borrow of them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_of(mr: &MemoryRegion, offset: usize, len: usize) -> &mut [u8] {
        debug_assert!(offset + len <= mr.len());
        std::slice::from_raw_parts_mut((mr.addr() as usize + offset) as *mut u8, len)
    }

    /// Copies the parts of a message, one after the other, into one of our
    /// own registered buffers at `offset`.
    ///
    /// # Safety
    /// As [`Connection::bytes_of`], for the whole message.
    unsafe fn copy_parts_into(mr: &MemoryRegion, offset: usize, data: Parts<'_>) {
        crate::copy::gather(Self::bytes_of(mr, offset, data.len()), data.pieces());
    }

    /// Posts a command if a slot and send-queue room are free.
    pub(super) fn post_cmd(&self, st: &mut State, cmd: Cmd) -> Result<bool> {
        let Some((slot, sge)) = self.stage_cmd(st, cmd) else {
            return Ok(false);
        };
        self.post_staged_cmd(st, slot, sge).map(|()| true)
    }

    /// Posts a command staged in `slot`, alone.
    pub(super) fn post_staged_cmd(&self, st: &mut State, slot: u16, sge: Sge) -> Result<()> {
        // SAFETY: the slot stays untouched until the send completes.
        let posted = unsafe { self.post_in_order(st, &[self.cmd_request(slot, &[sge])]) };
        // Its send-queue entry, or its slot back when the post failed.
        match posted {
            Ok(()) => st.sq_used += 1,
            Err(_) => st.cmd_free.push(slot),
        }
        posted
    }

    /// Writes a command into a free slot: the slot and its bytes, or `None`
    /// when no slot or send-queue room is free.
    pub(super) fn stage_cmd(&self, st: &mut State, cmd: Cmd) -> Option<(u16, Sge)> {
        if st.sq_used >= MAX_SEND_WR {
            return None;
        }
        let slot = st.cmd_free.pop()?;
        let off = slot as usize * CMD_LEN;
        // What this side speaks (lowered for an older peer's sake).
        let cmd = Cmd {
            version: self.inner.opts.protocol_version.min(VERSION),
            ..cmd
        };
        // SAFETY: the slot is inside the command buffer and free (its
        // previous send completed); we hold the lock. The protocol's own
        // 32 bytes, not payload: not counted as a copy.
        unsafe { Self::bytes_of(&self.inner.cmd_send, off, CMD_LEN) }
            .copy_from_slice(&cmd.encode());
        Some((slot, self.inner.cmd_send.sge(off..off + CMD_LEN)))
    }

    /// Posts `chain`, a credit command at its head when `credit` (staged
    /// by `credit_to_carry`). A failed post may have posted part of the
    /// chain, the command with it, so the command's slot and send-queue
    /// entry stay taken either way (its completion gives them back; after a
    /// failed post the connection ends).
    ///
    /// # Safety
    /// As [`QueuePair::post_send`](crate::verbs::QueuePair::post_send), for
    /// every request of the chain.
    pub(super) unsafe fn post_chain(
        &self,
        st: &mut State,
        chain: &[SendRequest<'_>],
        credit: bool,
    ) -> Result<()> {
        if credit {
            st.sq_used += 1;
        }
        self.post_in_order(st, chain)
    }

    /// Posts `chain` to the send queue, after any post whose place was
    /// taken before; `_st`: the caller holds the state lock.
    ///
    /// # Safety
    /// As [`QueuePair::post_send`](crate::verbs::QueuePair::post_send).
    pub(super) unsafe fn post_in_order(
        &self,
        _st: &mut State,
        chain: &[SendRequest<'_>],
    ) -> Result<()> {
        let _order = self.post_order();
        self.inner.posts.fetch_add(1, Ordering::Relaxed);
        self.inner.qp.post_send(chain).map_err(Into::into)
    }

    /// The turn to post to the send queue: taken under the state lock, it
    /// waits for a post whose place was taken before.
    pub(super) fn post_order(&self) -> MutexGuard<'_, ()> {
        self.inner
            .post_order
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Lets go of the state lock for the post of `chain` (staged and
    /// accounted for under it), still in the order its places were taken.
    ///
    /// # Safety
    /// As [`QueuePair::post_send`](crate::verbs::QueuePair::post_send); and
    /// nothing the chain points at may be in the state.
    pub(super) unsafe fn post_unlocked(
        &self,
        st: MutexGuard<'_, State>,
        chain: &[SendRequest<'_>],
    ) -> Result<()> {
        let _order = self.post_order();
        drop(st);
        self.inner.posts.fetch_add(1, Ordering::Relaxed);
        self.inner.qp.post_send(chain).map_err(Into::into)
    }

    /// Sends a message: the peer's `recv` callback gets exactly these bytes,
    /// whole, in order, once. Returns the bytes accepted. A message that
    /// finds no room in the peer's ring now is copied into the connection's
    /// send queue and posted, in order, as room returns; in blocking mode
    /// outside callbacks the call first waits for room, up to the timeout.
    /// 0 when the send queue is full ([`Options::send_queue_bytes`](crate::runtime::Options::send_queue_bytes)), in
    /// blocking mode when the wait timed out, and when a legacy peer's
    /// buffer is used up for good (legacy peers never return space).
    pub fn send(&self, data: &[u8]) -> Result<usize> {
        self.send_message(&[data], None, None)
    }

    /// Sends the concatenation of `parts` as one message, as
    /// [`Connection::send`] does; the parts are copied straight into the
    /// ring (or the send queue), never joined first.
    pub fn send_parts(&self, parts: &[&[u8]]) -> Result<usize> {
        self.send_message(parts, None, None)
    }

    /// RDMA WRITEs `len` bytes from a buffer registered on this connection to
    /// `remote`, then sends `data` as [`Connection::send`] does, both with
    /// one doorbell. The peer has the written bytes when it gets the message
    /// (same queue pair, in order). The write owes no callback and takes no
    /// completion of its own; if it fails, the connection ends.
    ///
    /// # Safety
    /// The local range must stay unchanged until the peer has the message
    /// (for a request, until its reply).
    pub unsafe fn write_then_send(
        &self,
        local_addr: u64,
        lkey: u32,
        remote: RemoteAddr,
        len: u32,
        parts: &[&[u8]],
    ) -> Result<usize> {
        if len == 0 {
            return Err(Error::InvalidArgument("length 0".into()));
        }
        let sge = self.check_local(local_addr, lkey, len)?;
        self.send_message(parts, None, Some((sge, remote)))
    }

    /// Sends a message that also delivers `imm` to the peer's `recv`
    /// callback. Needs a snowrdma peer (legacy peers cannot receive it).
    pub fn send_with_imm(&self, imm: u32, data: &[u8]) -> Result<usize> {
        self.send_message(&[data], Some(ExtKind::WithImm(imm)), None)
    }

    /// Writes `data` into the peer's receive buffer without notifying it
    /// (`rdmaConnWrite`); `write_done` follows (see
    /// [`Connection::notify_written`]).
    pub fn write_silent(&self, data: &[u8]) -> Result<usize> {
        let legacy = self.lock().peer_version < 1;
        // A legacy peer's buffer is written as the legacy library did; ours
        // is told to skip the bytes so its ring stays in step.
        self.send_message(
            &[data],
            if legacy { None } else { Some(ExtKind::Silent) },
            None,
        )
        .inspect(|&n| {
            if n > 0 {
                self.notify_written(n);
            }
        })
    }

    /// Has `write_done(len)` called for bytes this connection just
    /// accepted (sent, or queued in order), on the completion thread after
    /// the round or call that accepted them, not inside that call: a
    /// caller may hold its own lock around the send that the callback
    /// takes, and a callback that writes again must not recurse. (With
    /// [`Options::caller_polls`](crate::runtime::Options::caller_polls) it
    /// runs where that connection's callbacks run: in a call of the caller
    /// that polls, a later one or a wait of this one.) The legacy library's
    /// write callback came from its completion thread too. `close` returns
    /// once it ran.
    pub fn notify_written(&self, len: usize) {
        self.callback(Deferred::WriteDone(len), true);
    }

    /// Sends a message, after a one-sided write (`before`) when given.
    pub(super) fn send_message(
        &self,
        parts: &[&[u8]],
        ext: Option<ExtKind>,
        before: Option<(Sge, RemoteAddr)>,
    ) -> Result<usize> {
        let data = Parts::new(parts);
        if data.len() == 0 {
            return Err(Error::InvalidArgument("a message cannot be empty".into()));
        }
        self.reap_credit_read();
        let blocking = self.inner.opts.comm_mode == CommMode::Blocking;
        // Only a message that finds no room needs these: most never do.
        let mut on_cq_thread = None;
        let mut deadline = None;
        let mut st = self.lock();
        loop {
            self.check_sendable(&st, data.len(), ext)?;
            // Queued messages go first, so order holds.
            if st.queue.is_empty() {
                match self.try_post_message(st, data, ext, before) {
                    Ok(None) => return Ok(data.len()),
                    Ok(Some(no_room)) => st = no_room,
                    Err(e) => {
                        // Its place in the peer's ring was taken and will
                        // never be filled, a write ahead of it may have
                        // gone alone, and a credit it carried is reported
                        // here but never reached the peer: the connection
                        // cannot go on.
                        self.fail(&format!("posting a message: {e}"));
                        return Err(e);
                    }
                }
            }
            // Blocking mode waits for room, except inside a callback, where
            // nobody else would hand room back.
            let on_cq_thread = *on_cq_thread.get_or_insert_with(|| self.on_callback_thread());
            let waits = blocking && !on_cq_thread;
            let now = Instant::now();
            let deadline = *deadline.get_or_insert_with(|| now + self.inner.opts.device_wait());
            if waits && now < deadline {
                st = self.park(st, deadline, now);
                continue;
            }
            // A write ahead of the message reads the caller's buffer, which
            // is theirs again once we return: it cannot wait in the queue.
            if waits || before.is_some() {
                return Ok(0);
            }
            return Ok(self.enqueue(st, data, ext, on_cq_thread));
        }
    }

    /// Queues a message that found no room; returns the bytes accepted (0
    /// when the queue is full or a legacy peer's buffer is used up).
    pub(super) fn enqueue(
        &self,
        mut st: MutexGuard<'_, State>,
        data: Parts<'_>,
        ext: Option<ExtKind>,
        on_cq_thread: bool,
    ) -> usize {
        // A legacy peer never returns space: once what is sent and queued
        // fills its buffer, nothing more will ever fit (the legacy contract:
        // 0, for good).
        if st.peer_version < 1
            && st.tx.in_flight() as usize + st.queue.payload_bytes() + data.len() > st.tx.capacity()
        {
            if !std::mem::replace(&mut st.legacy_exhausted, true) {
                log::warn!(
                    "connection to {:?}: the legacy peer's {} byte buffer is used up; sends return 0 from now on",
                    self.inner.peer,
                    st.tx.capacity()
                );
            }
            return 0;
        }
        match st.queue.push_parts(data.pieces(), ext) {
            Push::Queued => self.inner.queued.store(true, Ordering::SeqCst),
            Push::Refused { first } => {
                if first {
                    log::warn!(
                        "connection to {:?}: the send queue is full ({} messages, bound {} bytes); \
                         refusing messages until it drains",
                        self.inner.peer,
                        st.queue.len(),
                        self.inner.opts.send_queue_bytes
                    );
                }
                return 0;
            }
        }
        drop(st);
        // The room comes from a send completion (one that frees the send
        // queue, or a READ of the peer's credit), which raises an event
        // only when the send CQ is armed; one that came before arming is
        // taken here. A thread in a round of this connection (a callback
        // of it) polls the send CQ when the callback returns and arms it
        // at the round's end while messages are queued, and a spin over
        // it polls that CQ on every pass (and arms it when the spin ends:
        // `spun_on` is cleared first, both SeqCst); any other thread (a
        // caller, or a callback of another connection) arms it here.
        // A thread outside callbacks holds none of the runtime's locks: it
        // waits for its turn at the poll.
        if !self.polled_here()
            && !self.inner.spun_on.load(Ordering::SeqCst)
            && self.arm_send_and_take(!on_cq_thread)
        {
            self.flush_queued();
        }
        data.len()
    }

    /// The send queue's counts (messages that waited, were refused, or were
    /// dropped at the end).
    pub fn send_queue_stats(&self) -> SendQueueStats {
        self.lock().queue.stats()
    }

    pub(super) fn check_sendable(
        &self,
        st: &State,
        len: usize,
        ext: Option<ExtKind>,
    ) -> Result<()> {
        match st.state {
            ConnState::MrReady => {}
            ConnState::Closed | ConnState::Error => return Err(Error::Disconnected),
            _ => return Err(Error::NotConnected),
        }
        if ext.is_some() && st.peer_version < 1 {
            return Err(Error::Unsupported(
                "the peer runs the legacy library, which cannot receive immediates".into(),
            ));
        }
        let cap = st.tx.capacity();
        if Self::ring_len(len, ext) > cap {
            return Err(Error::TooLarge {
                len,
                max: cap.saturating_sub(Self::ring_len(0, ext)),
            });
        }
        Ok(())
    }

    /// Posts the message (after the write `before`) if the peer's ring, its
    /// receive queue and our send queue all have room, letting go of the
    /// state lock for the post; the lock back when one of them is full.
    /// The caller fails the connection if this fails.
    pub(super) fn try_post_message<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        data: Parts<'_>,
        ext: Option<ExtKind>,
        before: Option<(Sge, RemoteAddr)>,
    ) -> Result<Option<MutexGuard<'a, State>>> {
        let Some(offset) = Self::reserve(&mut st, data.len(), ext, before.is_some()) else {
            self.want_credit(&mut st, Self::ring_len(data.len(), ext));
            return Ok(Some(st));
        };
        // Inline, the header is read at the post, from here.
        let ext_header = ext.map(ExtKind::encode);
        let ready = self.stage_ready(&mut st, offset, data, ext_header.as_ref(), before)?;
        self.post_ready(st, std::slice::from_ref(&ready))
            .map(|()| None)
    }

    /// Reserves room for a message in the peer's ring if its receive queue
    /// and our send queue have room too: the offset in the ring.
    pub(super) fn reserve(
        st: &mut State,
        len: usize,
        ext: Option<ExtKind>,
        before: bool,
    ) -> Option<usize> {
        let total = Self::ring_len(len, ext);
        let msgs_ok = st.peer_version < 1
            || st.tx_msgs - st.tx_msgs_acked
                < u64::from(st.peer_recv_depth).saturating_sub(PEER_CMD_RESERVE);
        let wrs = 1 + u32::from(before);
        if st.sq_used + wrs > MAX_SEND_WR - CMD_RESERVE || !msgs_ok {
            return None;
        }
        st.tx.reserve(total)
    }

    /// The ring bytes a message of `len` payload bytes takes.
    pub(super) fn ring_len(len: usize, ext: Option<ExtKind>) -> usize {
        len + if ext.is_some() { EXT_HEADER_LEN } else { 0 }
    }

    /// Copies a message into the staging buffer at `offset` (reserved in the
    /// send ring) and accounts for its work requests (one more when a write
    /// goes `before` it); returns the WRITE WITH IMM to post.
    /// `copy`: whether the message is copied into the staging buffer
    /// (not when it is posted inline from its parts).
    pub(super) fn stage_message(
        &self,
        st: &mut State,
        offset: usize,
        data: Parts<'_>,
        ext_header: Option<[u8; EXT_HEADER_LEN]>,
        before: bool,
        copy: bool,
    ) -> Result<StagedMessage> {
        // Not `ok_or`: it would build (and drop) the error on every message.
        let Some(peer) = st.peer_ring else {
            return Err(Error::NotConnected);
        };
        let len = data.len()
            + if ext_header.is_some() {
                EXT_HEADER_LEN
            } else {
                0
            };
        // SAFETY: [offset, offset+total) was just reserved, so no in-flight
        // write reads it; we hold the state lock.
        unsafe {
            match ext_header {
                _ if !copy => {}
                Some(header) => {
                    // The protocol's own 8 bytes, not payload: not counted
                    // as a copy.
                    Self::bytes_of(&self.inner.staging, offset, EXT_HEADER_LEN)
                        .copy_from_slice(&header);
                    Self::copy_parts_into(&self.inner.staging, offset + EXT_HEADER_LEN, data);
                }
                None => Self::copy_parts_into(&self.inner.staging, offset, data),
            }
        }
        let imm = offset as u32
            | if ext_header.is_some() {
                IMM_EXTENDED
            } else {
                0
            };
        // Only every SIGNAL_EVERY-th message asks for a completion; it
        // accounts for the unsignaled requests before it (completions are in
        // order), which saves the completion thread most of the work. A
        // write ahead of the message is one of those.
        let wrs = 1 + u32::from(before);
        let signal = st.unsignaled_data + wrs >= SIGNAL_EVERY
            || st.sq_used + wrs >= MAX_SEND_WR - CMD_RESERVE;
        let covered = Self::take_data_places(st, wrs, signal);
        st.tx_msgs += 1;
        Ok(StagedMessage {
            sge: self.inner.staging.sge(offset..offset + len),
            op: SendOp::WriteWithImm(peer.at(offset as u64), imm),
            wr_id: wr_id(K_DATA, covered as u64),
            signal,
            // Inline, the device takes the bytes with the work request
            // instead of fetching them through the staging registration.
            inline: self.fits_inline(len),
        })
    }

    /// Takes send-queue places for `wrs` data work requests about to be
    /// posted, the last of them `signal`ed or not; returns how many data
    /// requests its completion will account for (its wr_id's low part).
    /// The one place the counts behind [`Connection::retire_sends`] move.
    pub(super) fn take_data_places(st: &mut State, wrs: u32, signal: bool) -> u32 {
        let covered = st.unsignaled_data + wrs;
        st.unsignaled_data = if signal { 0 } else { covered };
        st.sq_used += wrs;
        st.data_posted += u64::from(wrs);
        covered
    }

    /// The SEND of the command in `slot`: inline where the connection's
    /// inline size takes a command.
    pub(super) fn cmd_request<'a>(&self, slot: u16, sge: &'a [Sge; 1]) -> SendRequest<'a> {
        let req = SendRequest::new(wr_id(K_CMD, u64::from(slot)), SendOp::Send, sge);
        if self.fits_inline(CMD_LEN) {
            req.inline()
        } else {
            req
        }
    }

    /// Whether a message of `len` bytes (headers included) goes inline.
    pub(super) fn fits_inline(&self, len: usize) -> bool {
        len <= self.inner.inline_max as usize
    }
}

/// The non-empty `pieces` as SGEs in `out` (the provider reads inline SGEs
/// by address alone: no key), or `None` when there are more than it holds.
pub(super) fn gather_sges<'a, 'b>(
    pieces: impl Iterator<Item = &'b [u8]>,
    out: &'a mut [Sge; INLINE_PARTS],
) -> Option<&'a [Sge]> {
    let mut n = 0;
    for piece in pieces.filter(|p| !p.is_empty()) {
        *out.get_mut(n)? = Sge {
            addr: piece.as_ptr() as u64,
            length: piece.len() as u32,
            lkey: 0,
        };
        n += 1;
    }
    Some(&out[..n])
}
