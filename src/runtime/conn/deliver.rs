//! Handing what arrived to the handler: messages from the ring and the
//! callbacks queued for the completion thread, in order.

use std::sync::atomic::Ordering;
use std::sync::{MutexGuard, TryLockError};

use crate::runtime::proto::{ExtKind, EXT_HEADER_LEN, IMM_EXTENDED};

use super::{ConnState, Connection, Deferred, Delivery, InRing, State};

impl Connection {
    /// A message arrived in our ring; its receive took command slot `slot`
    /// (whose bytes a message leaves unread). The slot is queued for
    /// reposting (or reposted, for a legacy peer) before the message is
    /// counted as received, under the lock a delivery's checks take
    /// anyway, so no credit can report the message before its receive is
    /// on its way back.
    pub(super) fn handle_message(&self, imm: u32, len: usize, slot: u32, inline: bool) {
        let delivery = Delivery {
            offset: (imm & !IMM_EXTENDED) as usize,
            len,
            extended: imm & IMM_EXTENDED != 0,
        };
        let mut st = self.lock();
        let reposted = if self.reposts_no_receives() {
            Ok(())
        } else {
            self.repost_message_slot(&mut st, slot)
        };
        // Checked when delivered, under this lock or `deliver`'s when
        // deferred: the ring (`RecvRing::accept` bounds it) and what the
        // peer may send.
        self.callback_locked(st, Deferred::Message(delivery), inline);
        // The message arrived whole: it is delivered before the connection
        // ends for want of a receive.
        if let Err(e) = reposted {
            self.fail(&format!("reposting a receive: {e}"));
        }
    }

    /// Runs a callback now when this is the completion thread at top level
    /// and nothing is owed before it; queues it otherwise (in order), and
    /// wakes the completion thread when another thread queued it.
    pub(super) fn callback(&self, cb: Deferred, inline: bool) {
        self.callback_locked(self.lock(), cb, inline);
    }

    /// [`Connection::callback`], the state lock taken.
    fn callback_locked(&self, mut st: MutexGuard<'_, State>, cb: Deferred, inline: bool) {
        let on_cq_thread = self.on_callback_thread();
        if inline || !on_cq_thread || !st.deferred.is_empty() {
            st.deferred.push_back(cb);
            self.inner.deferred_any.store(true, Ordering::SeqCst);
            drop(st);
            // A thread in a round of this connection runs the queue when
            // the round ends; any other (a caller, or the completion thread
            // busy with another connection) leaves it to a round it asks for.
            if !self.polled_here() {
                self.ask_for_round();
            }
            return;
        }
        match cb {
            // Its checks under the lock already held.
            Deferred::Message(d) => self.deliver_locked(st, d),
            other => {
                drop(st);
                self.run_callback(other);
            }
        }
    }

    /// Has the completion thread run a round of this connection soon
    /// (`after_round`: queued callbacks, a peer's leaving, an owed end),
    /// even when its CQs bring nothing.
    pub(super) fn ask_for_round(&self) {
        self.inner.owed.store(true, Ordering::Release);
        self.inner.rt.cq.wake();
    }

    pub(super) fn run_callback(&self, cb: Deferred) {
        // Nothing follows `disconnected`: what completes after it (taken
        // from the CQ by another thread meanwhile) goes unreported, as the
        // connection, and every operation on it, is over.
        if !matches!(cb, Deferred::Message(_)) && self.inner.disconnect_fired.load(Ordering::SeqCst)
        {
            return;
        }
        match cb {
            Deferred::Message(d) => self.deliver(d),
            Deferred::WriteDone(len) => {
                self.call_data_handler("write", |h| h.write_done(self, len))
            }
            Deferred::ReadDone(len) => self.call_data_handler("read", |h| h.read_done(self, len)),
        }
    }

    pub(super) fn deliver_deferred(&self) {
        while self.inner.deferred_any.load(Ordering::SeqCst) {
            let cb = {
                let mut st = self.lock();
                let cb = st.deferred.pop_front();
                if cb.is_none() {
                    self.inner.deferred_any.store(false, Ordering::SeqCst);
                }
                cb
            };
            let Some(cb) = cb else {
                return;
            };
            self.run_callback(cb);
        }
    }

    pub(super) fn deliver(&self, d: Delivery) {
        self.deliver_locked(self.lock(), d);
    }

    /// [`Connection::deliver`], the state lock taken: it is let go before
    /// the callback.
    fn deliver_locked(&self, mut st: MutexGuard<'_, State>, d: Delivery) {
        // A peer writes only after advertising its own buffer (RC keeps
        // that order), and only version 1 has extended messages.
        let refused = match st.peer_ring.is_some().then_some(st.peer_version) {
            None => Some("the peer wrote before advertising its buffer"),
            Some(0) if d.extended => Some("a legacy peer sent an extended message"),
            _ => None,
        };
        if let Some(why) = refused {
            drop(st);
            return self.fail(why);
        }
        if !matches!(st.state, ConnState::MrReady | ConnState::Connected) {
            return;
        }
        if !st.rx.accept(d.offset, d.len) {
            drop(st);
            return self.fail(&format!(
                "the peer wrote {} bytes at {}, out of order",
                d.len, d.offset
            ));
        }
        st.rx_msgs += 1;
        drop(st);
        // Its bytes are reportable (the peer may write them again) only
        // once we are done with them: before the callback when it gets a
        // copy (a send from the callback may then carry the credit), after
        // it when it reads in the ring, and on every other path when this
        // is dropped.
        let mut release = Release {
            conn: self,
            armed: true,
        };
        // The peer can write its ring slot again while we look at it: each
        // byte is copied out once, and only the copy is parsed or shown.
        // The buffer is reused, held through the callback; a callback that
        // receives again (from a blocking call that polls) finds it taken
        // and uses a fresh one.
        let end = d.offset + d.len;
        let mut start = d.offset;
        let mut imm = None;
        if d.extended {
            let mut header = [0u8; EXT_HEADER_LEN];
            // In the ring: `accept` checked the range.
            let read =
                d.len >= EXT_HEADER_LEN && self.inner.recv_ring.copy_out_to(d.offset, &mut header);
            match read.then(|| ExtKind::decode(&header)).flatten() {
                // Bytes written with `write`: no callback.
                Some(ExtKind::Silent) => return,
                Some(ExtKind::WithImm(value)) => imm = Some(value),
                None => return self.fail("the peer sent a malformed extended message"),
            }
            start += EXT_HEADER_LEN;
        }
        self.inner.delivered.store(true, Ordering::Relaxed);
        self.call_data_handler("receive", |h| {
            // A message without an immediate is offered where it lies first.
            if imm.is_none()
                && h.recv_in_ring(
                    self,
                    &InRing::new(&self.inner.recv_ring, start, end - start),
                )
            {
                return;
            }
            let mut kept = match self.inner.rx_copy.try_lock() {
                Ok(buf) => Some(buf),
                // A callback panicked: the buffer is sound, it is cleared first.
                Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
                Err(TryLockError::WouldBlock) => None,
            };
            let mut fresh = Vec::new();
            let buf = kept.as_deref_mut().unwrap_or(&mut fresh);
            buf.clear();
            self.inner.recv_ring.copy_out(start..end, buf);
            release.now();
            crate::costs::copied_if_any(buf.len());
            h.recv(self, buf, imm);
        });
    }
}

/// The end of a delivery's look at its message in the ring, once: when
/// [`Release::now`] is called, or else when dropped. The lock's next holder
/// releases its bytes ([`RecvRing::release`](crate::runtime::ring::RecvRing::release)).
struct Release<'a> {
    conn: &'a Connection,
    armed: bool,
}

impl Release<'_> {
    fn now(&mut self) {
        if std::mem::replace(&mut self.armed, false) {
            // The bytes were read before this (AcqRel), so the holder that
            // releases them reports them after.
            self.conn.inner.rx_read.fetch_add(1, Ordering::AcqRel);
            self.conn.inner.rx_owed.store(true, Ordering::SeqCst);
        }
    }
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.now();
    }
}
