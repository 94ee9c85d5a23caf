//! Credit: telling the peer how much of our receive ring it may use again.
//! A credit command covers every message consumed before it; it rides with
//! an outgoing message when one comes (no doorbell of its own), and goes
//! alone only when the peer could run short, or a tick passes with nothing
//! sent to carry it.

use std::sync::atomic::Ordering;

use crate::runtime::proto::{Cmd, Opcode};
use crate::runtime::Result;
use crate::verbs::Sge;

use super::{ConnState, Connection, State};

/// Consumed receive space not yet reported, by how pressing it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Owed {
    Nothing,
    /// Some: a tick reports it if nothing else does.
    Some,
    /// An eighth of the ring or of the receive queue: reported with the
    /// next message, or alone when this side has not been sending.
    Enough,
    /// Half of either: reported now, alone if need be.
    Urgent,
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
        let ring = self.inner.recv_ring.len() as u64;
        let depth = u64::from(self.inner.opts.recv_depth);
        if bytes >= ring / 2 || msgs >= (depth / 2).max(1) {
            Owed::Urgent
        } else if bytes >= ring / 8 || msgs >= (depth / 8).max(1) {
            Owed::Enough
        } else {
            Owed::Some
        }
    }

    /// Stages the credit command reporting everything consumed so far, the
    /// receives of the messages it reports reposted first; `None` when no
    /// command slot or send-queue room is free (a command completion frees
    /// one, and a later round reports it, still unreported until then).
    fn stage_credit(&self, st: &mut State) -> Result<Option<(u16, Sge)>> {
        if st.cmd_free.is_empty() || st.sq_used >= super::MAX_SEND_WR {
            return Ok(None);
        }
        self.flush_reposts(st)?;
        let consumed = st.rx.take_report();
        // Until something more is received and read; a message read while
        // this holder had the lock is not in this report yet.
        self.inner.rx_owed.store(false, Ordering::SeqCst);
        if self.inner.rx_read.load(Ordering::SeqCst) != 0 {
            self.inner.rx_owed.store(true, Ordering::SeqCst);
        }
        st.rx_msgs_reported = st.rx_msgs;
        st.tx_msgs_at_credit = st.tx_msgs;
        let cmd = Cmd::new(Opcode::Credit, consumed, st.rx_msgs as u32, 0);
        Ok(self.stage_cmd(st, cmd))
    }

    /// The credit command an outgoing message should carry, staged: when an
    /// eighth or more is owed.
    pub(super) fn credit_to_carry(&self, st: &mut State) -> Result<Option<(u16, Sge)>> {
        if self.credit_owed(st) < Owed::Enough {
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
    /// thread about to wait while the peer may be waiting for it).
    pub(super) fn send_owed_credit(&self, st: &mut State) {
        let sent = self.credit_to_carry(st).and_then(|credit| match credit {
            Some((slot, sge)) => self.post_staged_cmd(st, slot, sge),
            None => Ok(()),
        });
        if let Err(e) = sent {
            // Failing the connection needs the lock, which the caller
            // holds; the broken QP fails every later post too.
            log::warn!("connection to {:?}: returning credit: {e}", self.inner.peer);
        }
    }

    /// Sends the credit owed alone when it cannot wait for a message to
    /// carry it: half the ring or receive queue is owed, or an eighth while
    /// this side has sent nothing since its last report; at a `tick` (of
    /// the completion thread), whatever is owed if nothing was sent since
    /// the last tick. A sender so waits at most about a tick, and one
    /// credit covers many messages.
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
        let owed = self.credit_owed(&st);
        let sent_since_tick = st.tx_msgs != st.tx_msgs_at_tick;
        if tick {
            st.tx_msgs_at_tick = st.tx_msgs;
        }
        let due = match owed {
            Owed::Nothing => false,
            Owed::Urgent => true,
            Owed::Enough => st.tx_msgs == st.tx_msgs_at_credit || (tick && !sent_since_tick),
            Owed::Some => tick && !sent_since_tick,
        };
        if !due {
            return;
        }
        if let Err(e) = self.post_credit(&mut st) {
            drop(st);
            self.fail(&format!("returning credit: {e}"));
        }
    }
}
