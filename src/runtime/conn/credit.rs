//! Credit: telling the peer how much of our receive ring it may use again.
//!
//! With a version-1 peer, a credit command covers every message consumed
//! before it; it rides with an outgoing message when one comes (no doorbell
//! of its own), and goes alone only when the peer could run short, or a
//! tick passes with nothing sent to carry it.
//!
//! With a version-2 peer, we also publish what we consumed in our credit
//! slot, which the peer READs with a READ chained behind its messages, so a
//! receiver that only receives (a stream's sink) posts nothing. A sender
//! that finds no room says what it needs (CREDIT_WANTED); the receiver
//! answers with a credit command, alone, once it has consumed that much.

use std::sync::atomic::Ordering;

use crate::runtime::proto::{Cmd, CreditWords, Opcode, CREDIT_SLOT_LEN};
use crate::runtime::Result;
use crate::verbs::{AccessFlags, RemoteAddr, RemoteRegion, SendOp, SendRequest, Sge};

use super::{
    wr_id, ConnState, Connection, State, CMD_RESERVE, K_CREDIT, MAX_SEND_WR, PEER_CMD_RESERVE,
};

/// Where our published credit sits in the connection's credit region, and
/// where the peer's lands when we READ it.
const PUBLISHED_AT: usize = 0;
const READ_INTO: usize = CREDIT_SLOT_LEN;
/// Size of the connection's credit region.
pub(super) const CREDIT_REGION_LEN: usize = 2 * CREDIT_SLOT_LEN;

/// Consumed receive space not yet reported, by how pressing it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Owed {
    Nothing,
    /// Some: a tick reports it if nothing else does.
    Some,
    /// An eighth of the ring (as the peer uses it) or of the receive
    /// queue: reported with the next message, or alone when this side has
    /// not been sending.
    Enough,
    /// Half of either: reported now, alone if need be.
    Urgent,
}

/// Version 2's credit by READ, in both roles.
#[derive(Debug, Default)]
pub(super) struct ReadCredit {
    /// Receiver: our slot as the peer may READ it, once our ring is
    /// advertised (and, in a shared PD, the slot's window bound).
    own_slot: Option<RemoteRegion>,
    /// Receiver: the peer was told where our slot is; it READs our credit,
    /// which we then send alone only when it asks.
    offered: bool,
    /// Receiver: what a peer that found no room needs consumed (ring
    /// bytes, messages wrapping at 32 bits); answered once met.
    wanted: Option<(u64, u32)>,
    /// Sender: the peer's slot.
    peer_slot: Option<RemoteRegion>,
    /// Sender: how much we had sent (ring bytes, messages) at the last READ.
    read_at: (u64, u64),
    /// Sender: we asked for credit and none came since.
    want_out: bool,
    /// Our ring's advertisement is posted: the slot may follow it.
    ring_advertised: bool,
}

/// A READ of the peer's credit slot, accounted for, to chain.
pub(super) struct CreditRead {
    from: RemoteAddr,
    into: [Sge; 1],
}

impl CreditRead {
    pub(super) fn request(&self) -> SendRequest<'_> {
        SendRequest::new(wr_id(K_CREDIT, 0), SendOp::Read(self.from), &self.into)
    }
}

impl ReadCredit {
    /// Sender: the peer's slot, once offered.
    pub(super) fn peer_slot(&self) -> Option<RemoteRegion> {
        self.peer_slot
    }

    /// Our ring's advertisement is posted.
    pub(super) fn ring_advertised(&mut self) {
        self.ring_advertised = true;
    }

    /// Whether our ring's advertisement is posted.
    pub(super) fn is_ring_advertised(&self) -> bool {
        self.ring_advertised
    }
}

impl Connection {
    fn credit_owed(&self, st: &State) -> Owed {
        if st.peer_version < 1 || st.state != ConnState::MrReady {
            return Owed::Nothing;
        }
        let bytes = st.rx.unreported();
        if bytes == 0 {
            return Owed::Nothing;
        }
        let msgs = st.rx_msgs - st.rx_msgs_reported;
        // The ring as this sender uses it (its staging size, when smaller):
        // measured against the whole ring, a sender with less than an
        // eighth of it never had an eighth in flight, and its credit went
        // only at a tick on which this side sent nothing.
        let ring = st.rx.capacity() as u64;
        let depth = u64::from(self.inner.opts.recv_depth);
        if bytes >= ring / 2 || msgs >= (depth / 2).max(1) {
            Owed::Urgent
        } else if bytes >= ring / 8 || msgs >= (depth / 8).max(1) {
            Owed::Enough
        } else {
            Owed::Some
        }
    }

    /// Reports everything consumed so far: the receives of the messages it
    /// covers reposted first, the counts published in our slot (the peer
    /// may READ it at any time, so it never shows more than a command
    /// reported). Returns the counts for a credit command.
    fn take_report(&self, st: &mut State) -> Result<CreditWords> {
        self.flush_reposts(st)?;
        let words = CreditWords {
            bytes: st.rx.take_report(),
            msgs: st.rx_msgs,
        };
        // Until something more is received and read; a message read while
        // this holder had the lock is not in this report yet.
        self.inner.rx_owed.store(false, Ordering::SeqCst);
        if self.inner.rx_read.load(Ordering::SeqCst) != 0 {
            self.inner.rx_owed.store(true, Ordering::SeqCst);
        }
        st.rx_msgs_reported = st.rx_msgs;
        let slot = (self.inner.credit.addr() as usize + PUBLISHED_AT) as *mut u64;
        // SAFETY: the credit region is ours, 8-byte aligned and lives as
        // long as the connection; only the state lock's holder writes it.
        // Each count is one aligned store, so a READ sees it whole.
        unsafe {
            slot.write_volatile(words.bytes.to_le());
            slot.add(1).write_volatile(words.msgs.to_le());
        }
        Ok(words)
    }

    /// Stages the credit command reporting everything consumed so far;
    /// `None` when no command slot or send-queue room is free (a command
    /// completion frees one, and a later round reports it, still
    /// unreported until then).
    fn stage_credit(&self, st: &mut State) -> Result<Option<(u16, Sge)>> {
        if st.cmd_free.is_empty() || st.sq_used >= MAX_SEND_WR {
            return Ok(None);
        }
        let words = self.take_report(st)?;
        st.tx_msgs_at_credit = st.tx_msgs;
        st.carry_some = false;
        // It reports everything: whatever the peer wanted, it now knows all
        // there is (and asks again if that is not enough).
        st.rc.wanted = None;
        let cmd = Cmd::new(Opcode::Credit, words.bytes, words.msgs as u32, 0);
        Ok(self.stage_cmd(st, cmd))
    }

    /// The credit command an outgoing message should carry, staged: when an
    /// eighth or more is owed, or any after a tick passed it by.
    pub(super) fn credit_to_carry(&self, st: &mut State) -> Result<Option<(u16, Sge)>> {
        let owed = self.credit_owed(st);
        if owed < Owed::Enough && !(st.carry_some && owed > Owed::Nothing) {
            return Ok(None);
        }
        self.stage_credit(st)
    }

    /// Sends the credit owed now, alone (later when no command slot is
    /// free: a command's completion frees one).
    fn post_credit(&self, st: &mut State) -> Result<()> {
        match self.stage_credit(st)? {
            Some((slot, sge)) => self.post_staged_cmd(st, slot, sge),
            None => Ok(()),
        }
    }

    /// Sends the credit owed, alone, if an eighth or more is owed (a
    /// thread about to wait while the peer may be waiting for it); to a
    /// peer that READs our credit, only what it asked for.
    pub(super) fn send_owed_credit(&self, st: &mut State) {
        let sent = if st.rc.offered {
            self.answer_or_publish(st)
        } else {
            self.credit_to_carry(st).and_then(|credit| match credit {
                Some((slot, sge)) => self.post_staged_cmd(st, slot, sge),
                None => Ok(()),
            })
        };
        if let Err(e) = sent {
            // Failing the connection needs the lock, which the caller
            // holds; the broken QP fails every later post too.
            log::warn!("connection to {:?}: returning credit: {e}", self.inner.peer);
        }
    }

    /// Sends the credit owed alone when it cannot wait for a message to
    /// carry it. To a version-1 peer: half the ring or receive queue is
    /// owed, or an eighth while this side has sent nothing since its last
    /// report; at a `tick` (of the completion thread), whatever is owed if
    /// nothing was sent since the last tick. A sender so waits at most
    /// about a tick, and one credit covers many messages. To a peer that
    /// READs our credit: only what it asked for, once consumed; an eighth
    /// owed is published in the slot instead.
    pub(super) fn maybe_send_credit(&self, tick: bool) {
        // Between ticks, only what was received since the last report can
        // be owed, and a sender holding the lock carries it when enough is
        // owed (else a later round or the tick sends it).
        if !tick && !self.inner.rx_owed.load(Ordering::SeqCst) {
            return;
        }
        let mut st = match tick {
            true => self.lock(),
            false => match self.try_lock() {
                Some(st) => st,
                None => {
                    // The next round looks again (a holder about to wait
                    // sends it itself: `park`).
                    self.inner.owed.store(true, Ordering::Release);
                    return;
                }
            },
        };
        if st.rc.offered {
            if let Err(e) = self.answer_or_publish(&mut st) {
                drop(st);
                self.fail(&format!("returning credit: {e}"));
            }
            return;
        }
        let owed = self.credit_owed(&st);
        let sent_since_tick = st.tx_msgs != st.tx_msgs_at_tick;
        if tick {
            st.tx_msgs_at_tick = st.tx_msgs;
        }
        let due = match owed {
            Owed::Nothing => false,
            Owed::Urgent => true,
            Owed::Enough => st.tx_msgs == st.tx_msgs_at_credit || (tick && !sent_since_tick),
            Owed::Some => {
                // Sending, this side passes it on with its next message.
                st.carry_some |= tick && sent_since_tick;
                tick && !sent_since_tick
            }
        };
        if !due {
            return;
        }
        if let Err(e) = self.post_credit(&mut st) {
            drop(st);
            self.fail(&format!("returning credit: {e}"));
        }
    }

    /// To a peer that READs our credit: answers its request once we have
    /// consumed what it needs, else publishes an eighth or more owed.
    fn answer_or_publish(&self, st: &mut State) -> Result<()> {
        let met = st.rc.wanted.is_some_and(|(bytes, msgs)| {
            st.rx.consumed() >= bytes && (st.rx_msgs as u32).wrapping_sub(msgs) < 1 << 31
        });
        if met {
            return self.post_credit(st);
        }
        if self.credit_owed(st) >= Owed::Enough {
            self.take_report(st)?;
        }
        Ok(())
    }

    /// A command's slot came back: an answer to a request for credit that
    /// found none free goes now.
    pub(super) fn command_slot_freed(&self, st: &mut State) {
        if st.rc.wanted.is_none() {
            return;
        }
        if let Err(e) = self.answer_or_publish(st) {
            log::warn!("connection to {:?}: returning credit: {e}", self.inner.peer);
        }
    }

    /// Our ring is advertised: tells a version-2 peer where our credit
    /// slot is (once), the slot's window bound first in a shared PD. A
    /// peer never told goes on getting credit as a version-1 peer does, so
    /// a failure here is logged, not fatal (one that broke the QP shows in
    /// the next post or completion).
    pub(super) fn offer_credit_slot(&self, st: &mut State) {
        if let Err(e) = self.try_offer_credit_slot(st) {
            log::warn!(
                "connection to {:?}: offering the credit slot: {e}",
                self.inner.peer
            );
        }
    }

    fn try_offer_credit_slot(&self, st: &mut State) -> Result<()> {
        if st.rc.offered || st.peer_version < 2 || !st.rc.ring_advertised {
            return Ok(());
        }
        let slot = match (&self.inner.credit_window, st.rc.own_slot) {
            (_, Some(slot)) => slot,
            (None, None) => RemoteRegion {
                addr: self.inner.credit.addr() + PUBLISHED_AT as u64,
                len: CREDIT_SLOT_LEN as u64,
                rkey: self.inner.credit.rkey(),
            },
            (Some(window), None) => self.bind_window(
                st,
                window,
                &self.inner.credit,
                PUBLISHED_AT..READ_INTO,
                AccessFlags::REMOTE_READ,
            )?,
        };
        st.rc.own_slot = Some(slot);
        let cmd = Cmd::new(Opcode::CreditSlot, slot.addr, slot.len as u32, slot.rkey);
        // Without a free command slot the peer never learns of ours, and we
        // go on returning credit as to a version-1 peer.
        st.rc.offered = self.post_cmd(st, cmd)?;
        Ok(())
    }

    /// The peer told us where its credit slot is.
    pub(super) fn learn_peer_slot(st: &mut State, cmd: &Cmd) -> std::result::Result<(), String> {
        if st.peer_ring.is_none() || st.peer_version < 2 {
            return Err("a credit slot from a peer that cannot have one".into());
        }
        if st.rc.peer_slot.is_some() {
            return Err("it told us its credit slot twice".into());
        }
        if cmd.length as usize != CREDIT_SLOT_LEN {
            return Err(format!("a credit slot of {} bytes", cmd.length));
        }
        st.rc.peer_slot = Some(RemoteRegion {
            addr: cmd.addr,
            len: CREDIT_SLOT_LEN as u64,
            rkey: cmd.key,
        });
        Ok(())
    }

    /// The peer found no room and says what it needs; answered now if we
    /// have consumed that much, else once we have.
    pub(super) fn credit_wanted(&self, cmd: &Cmd) -> std::result::Result<(), String> {
        let mut st = self.lock();
        if !st.rc.offered {
            return Err("it asked for credit without being able to read ours".into());
        }
        st.rc.wanted = Some((cmd.addr, cmd.length));
        if let Err(e) = self.answer_or_publish(&mut st) {
            log::warn!("connection to {:?}: returning credit: {e}", self.inner.peer);
        }
        Ok(())
    }

    /// Takes a report of what the peer consumed: `msgs` wrap at 32 bits.
    /// From a version-2 peer, a report may be older than one we already
    /// have (the slot and commands cross) and is then ignored; any report
    /// beyond what was sent is refused, and nothing changes then.
    pub(super) fn take_credit(
        &self,
        st: &mut State,
        bytes: u64,
        msgs: u32,
    ) -> std::result::Result<(), String> {
        let may_be_stale = st.peer_version >= 2;
        let acked = st.tx_msgs_acked;
        let outstanding = st.tx_msgs - acked;
        let mut newly = u64::from(msgs.wrapping_sub(acked as u32));
        if newly > outstanding {
            if !(may_be_stale && (acked as u32).wrapping_sub(msgs) < 1 << 31) {
                return Err(format!(
                    "it returned credit for {newly} messages, {outstanding} were outstanding"
                ));
            }
            newly = 0;
        }
        let ring = if may_be_stale {
            st.tx.ack_at_least(bytes)
        } else {
            Some(st.tx.ack(bytes)).filter(|&advanced| advanced)
        };
        let Some(ring_advanced) = ring else {
            return Err(format!(
                "it returned credit for ring byte {bytes} it was never given"
            ));
        };
        st.tx_msgs_acked = acked + newly;
        if ring_advanced || newly > 0 {
            // What we asked for may have come: we may ask again.
            st.rc.want_out = false;
        }
        Ok(())
    }

    /// The READ of the peer's credit slot to chain behind messages being
    /// posted, accounted for: when the peer publishes its credit, none is in
    /// flight, half its ring or receive queue is unacknowledged and a
    /// quarter more was sent since the last READ. (At a quarter and an
    /// eighth, a 64 KiB stream into a 1 MiB ring READ every second message;
    /// half leaves the sender the other half to send into while the READ
    /// is out.) Nothing arms the send CQ for the READ, as its completion
    /// owes nobody a callback: a thread about to send takes it
    /// ([`Connection::reap_credit_read`]); a sender short of room polls
    /// that CQ as it waits and arms it before it sleeps; a thread that
    /// queues a message arms and polls it; a drain polls it, and arms it
    /// while messages are queued. Armed for it, the completion thread was
    /// woken for each READ and took a CPU from the peer, and on Soft-RoCE
    /// the event's delivery ran in the sender's doorbell.
    pub(super) fn credit_read(&self, st: &mut State) -> Option<CreditRead> {
        let slot = st.rc.peer_slot?;
        if self.credit_read_out() || st.sq_used >= MAX_SEND_WR - CMD_RESERVE {
            return None;
        }
        let ring = st.tx.capacity() as u64;
        let depth = u64::from(st.peer_recv_depth).saturating_sub(PEER_CMD_RESERVE);
        let (head, msgs) = (st.tx.head(), st.tx_msgs);
        let unacked = head - st.tx.acked() >= ring / 2 || msgs - st.tx_msgs_acked >= depth / 2;
        let (read_head, read_msgs) = st.rc.read_at;
        let moved = head - read_head >= ring / 4 || msgs - read_msgs >= depth / 4;
        if !(unacked && moved) {
            return None;
        }
        st.rc.read_at = (head, msgs);
        st.sq_used += 1;
        self.inner.credit_read_out.store(true, Ordering::Release);
        Some(CreditRead {
            from: slot.at(0),
            into: [self
                .inner
                .credit
                .sge(READ_INTO..READ_INTO + CREDIT_SLOT_LEN)],
        })
    }

    /// A thread about to send takes the completion of a READ of the peer's
    /// credit that is in flight, if it came, before it looks for room.
    /// Not inside a callback: the thread running it polls the send CQ when
    /// the callback returns, and may be holding its poll lock now.
    pub(super) fn reap_credit_read(&self) {
        if self.credit_read_out() && !self.on_callback_thread() {
            self.poll_send(false);
        }
    }

    /// Whether a READ of the peer's credit slot is in flight (set and
    /// cleared under the state lock; read without it too).
    pub(super) fn credit_read_out(&self) -> bool {
        self.inner.credit_read_out.load(Ordering::Acquire)
    }

    /// The READ of the peer's credit slot completed: its counts, read once,
    /// are taken as a credit command's. An error (the peer broke the
    /// protocol) is the caller's to end the connection with.
    pub(super) fn credit_read_done(&self) -> Result<(), String> {
        let mut st = self.lock();
        st.sq_used -= 1;
        self.inner.credit_read_out.store(false, Ordering::Release);
        let at = (self.inner.credit.addr() as usize + READ_INTO) as *const u64;
        // SAFETY: the READ that wrote these bytes completed, and none is in
        // flight; the region lives as long as the connection.
        let words = unsafe {
            CreditWords {
                bytes: u64::from_le(at.read_volatile()),
                msgs: u64::from_le(at.add(1).read_volatile()),
            }
        };
        let taken = self.take_credit(&mut st, words.bytes, words.msgs as u32);
        drop(st);
        taken.map_err(|why| format!("the peer broke the protocol: {why}"))?;
        self.wake();
        Ok(())
    }

    /// A message of `len` bytes (headers included) found no room: asks a
    /// peer that publishes its credit for what it needs, unless asked
    /// already or a READ of its slot is in flight (which may bring it).
    /// It asks for an eighth of the ring and of the receive queue more
    /// than it has (or all it sent, if less), at least what the message
    /// needs: behind a slow receiver, one request then frees many messages'
    /// room, not one's.
    pub(super) fn want_credit(&self, st: &mut State, len: usize) {
        if st.rc.peer_slot.is_none() || st.rc.want_out || self.credit_read_out() {
            return;
        }
        let bytes = st.tx.needed_for(len);
        let depth = u64::from(st.peer_recv_depth).saturating_sub(PEER_CMD_RESERVE);
        let msgs = (st.tx_msgs + 1).saturating_sub(depth);
        if bytes <= st.tx.acked() && msgs <= st.tx_msgs_acked {
            // Our own send queue is full, not the peer's ring.
            return;
        }
        let ring = st.tx.capacity() as u64;
        let bytes = bytes.max((st.tx.acked() + ring / 8).min(st.tx.head()));
        let msgs = msgs.max((st.tx_msgs_acked + depth / 8).min(st.tx_msgs));
        let cmd = Cmd::new(Opcode::CreditWanted, bytes, msgs as u32, 0);
        match self.post_cmd(st, cmd) {
            Ok(posted) => st.rc.want_out = posted,
            Err(e) => log::warn!(
                "connection to {:?}: asking for credit: {e}",
                self.inner.peer
            ),
        }
    }
}
