//! Ring accounting for two-sided sends. The receiver's buffer is a ring of
//! `cap` bytes; a message occupies a contiguous range, so one that does not
//! fit before the end starts again at 0 and the tail is skipped. The sender
//! counts bytes it has used (`head`, including skipped tails) and bytes the
//! receiver has returned (`acked`); the receiver infers skipped bytes from
//! the offset of the next message and returns what it consumed.

/// Sender side: where the next message goes and whether it fits.
#[derive(Debug, Clone, Default)]
pub struct SendRing {
    cap: u64,
    /// Bytes used since the ring was (re)advertised, skipped tails included.
    head: u64,
    /// Bytes the receiver has consumed and returned.
    acked: u64,
}

impl SendRing {
    pub fn new(cap: usize) -> SendRing {
        SendRing {
            cap: cap as u64,
            head: 0,
            acked: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.cap as usize
    }

    /// Bytes in flight (sent, not yet returned), skipped tails included.
    pub fn in_flight(&self) -> u64 {
        self.head - self.acked
    }

    /// Reserves `len` contiguous bytes; returns their offset, or `None` when
    /// there is no room right now.
    pub fn reserve(&mut self, len: usize) -> Option<usize> {
        let len = len as u64;
        if len == 0 || len > self.cap {
            return None;
        }
        let used = self.in_flight();
        let pos = self.head % self.cap;
        // `pos < cap`; `used` may pass `cap` by a skipped tail. Neither sum
        // may overflow, however large the ring.
        let skip = if len <= self.cap - pos {
            if used.saturating_add(len) > self.cap {
                return None;
            }
            0
        } else {
            // The message starts again at 0: it must not reach the oldest
            // unreturned byte, which sits at `pos - used` when nothing in
            // flight wraps. The skipped tail holds no data; it stays counted
            // until the receiver, seeing the message at 0, returns it.
            let fits = used == 0 || (used <= pos && len <= pos - used);
            if !fits {
                return None;
            }
            self.cap - pos
        };
        self.head += skip;
        let offset = self.head % self.cap;
        self.head += len;
        Some(offset as usize)
    }

    /// The receiver reports it has consumed `consumed` bytes in all. Returns
    /// false (and changes nothing) for a report that goes backwards, repeats
    /// the last one or goes beyond what was sent: a receiver reports only
    /// when it has consumed more, so none of these comes from an honest one.
    pub fn ack(&mut self, consumed: u64) -> bool {
        if consumed <= self.acked || consumed > self.head {
            return false;
        }
        self.acked = consumed;
        true
    }

    /// A report that may be stale: a version-2 receiver's credit comes by
    /// two paths (its slot, READ, and commands), which may cross. One at or
    /// below what is known changes nothing (`Some(false)`); one beyond what
    /// was sent is refused (`None`), as no honest receiver makes it.
    pub fn ack_at_least(&mut self, consumed: u64) -> Option<bool> {
        if consumed > self.head {
            return None;
        }
        Some(self.ack(consumed))
    }

    /// Bytes used so far, skipped tails included.
    pub fn head(&self) -> u64 {
        self.head
    }

    /// Bytes the receiver has returned so far.
    pub fn acked(&self) -> u64 {
        self.acked
    }

    /// How many bytes the receiver must have returned in all before a
    /// message of `len` bytes fits ([`SendRing::reserve`]).
    pub fn needed_for(&self, len: usize) -> u64 {
        let len = (len as u64).min(self.cap);
        let pos = self.head % self.cap.max(1);
        if len <= self.cap - pos {
            (self.head + len).saturating_sub(self.cap)
        } else {
            // It wraps to 0 and must not reach the oldest unreturned byte:
            // at most `pos - len` may be in flight, nothing when `len > pos`.
            (self.head + len).saturating_sub(pos).min(self.head)
        }
    }

    /// Forgets everything: the peer advertised its buffer afresh.
    pub fn reset(&mut self, cap: usize) {
        *self = SendRing::new(cap);
    }
}

/// Where a receiver's ring wraps for one sender: at the end of the ring, or
/// sooner when the sender says it uses less of it (`ring_use`, its staging
/// size; 0 from legacy peers, which never wrap). A sender cannot make it
/// larger than the ring.
pub fn wrap_point(ring_len: usize, ring_use: u32) -> usize {
    match ring_use as usize {
        0 => ring_len,
        n => n.min(ring_len),
    }
}

/// Receiver side: checks where messages land and counts what is consumed.
/// A message's bytes count as consumed (reportable to the sender, who may
/// then write them again) only once nobody looks at them any more: from
/// [`RecvRing::accept`] until [`RecvRing::release`] they are read out of
/// the ring, and a credit sent meanwhile by another thread (one riding
/// with a message) must not report them.
#[derive(Debug, Clone, Default)]
pub struct RecvRing {
    cap: u64,
    /// Bytes accepted so far, skipped tails and gaps included: where the
    /// next message must start.
    accepted: u64,
    /// Bytes consumed: accepted, and no longer looked at.
    consumed: u64,
    /// What the last credit told the sender.
    reported: u64,
    /// Messages accepted and not yet released.
    open: u32,
}

impl RecvRing {
    pub fn new(cap: usize) -> RecvRing {
        RecvRing {
            cap: cap as u64,
            ..RecvRing::default()
        }
    }

    /// Where the ring wraps for its sender: the most it can have in flight.
    pub fn capacity(&self) -> usize {
        self.cap as usize
    }

    /// Accounts for a message of `len` bytes at `offset`, which must start at
    /// the current position or (after a skipped tail) at 0, and end inside
    /// the ring. Returns false for a message that breaks those rules. An
    /// accepted message is released ([`RecvRing::release`]) once its bytes
    /// have been read.
    pub fn accept(&mut self, offset: usize, len: usize) -> bool {
        let (offset, len) = (offset as u64, len as u64);
        if len == 0 || offset.checked_add(len).is_none_or(|end| end > self.cap) {
            return false;
        }
        let pos = self.accepted % self.cap;
        let skip = if offset == pos {
            0
        } else if offset == 0 {
            self.cap - pos
        } else {
            return false;
        };
        self.accepted += skip + len;
        self.open += 1;
        true
    }

    /// An accepted message's bytes have been read: once every accepted
    /// message has been, all of them count as consumed. (Deliveries of
    /// one connection take turns, so that is after each message, but for
    /// one delivered inside another's callback.)
    pub fn release(&mut self) {
        self.open = self.open.saturating_sub(1);
        if self.open == 0 {
            self.consumed = self.accepted;
        }
    }

    /// Bytes consumed so far, skipped tails and gaps included.
    pub fn consumed(&self) -> u64 {
        self.consumed
    }

    /// Bytes consumed that the sender has not been told about.
    pub fn unreported(&self) -> u64 {
        self.consumed - self.reported
    }

    /// Marks everything consumed as reported; returns the cumulative count to
    /// put in the credit.
    pub fn take_report(&mut self) -> u64 {
        self.reported = self.consumed;
        self.consumed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message accepted and read at once.
    fn take(rx: &mut RecvRing, offset: usize, len: usize) -> bool {
        let ok = rx.accept(offset, len);
        if ok {
            rx.release();
        }
        ok
    }

    #[test]
    fn messages_wrap_and_credit_frees_room() {
        let mut tx = SendRing::new(100);
        let mut rx = RecvRing::new(100);
        assert_eq!(tx.reserve(40), Some(0));
        assert_eq!(tx.reserve(40), Some(40));
        assert_eq!(tx.reserve(40), None, "only 20 bytes left");
        assert!(take(&mut rx, 0, 40) && take(&mut rx, 40, 40));
        assert!(tx.ack(rx.take_report()));
        // 20 bytes remain before the end: a 30-byte message skips them.
        assert_eq!(tx.reserve(30), Some(0));
        assert!(take(&mut rx, 0, 30));
        assert_eq!(tx.in_flight(), 50);
        assert!(tx.ack(rx.take_report()));
        assert_eq!(tx.in_flight(), 0);
    }

    #[test]
    fn a_full_ring_refuses_until_credit_arrives() {
        let mut tx = SendRing::new(64);
        assert_eq!(tx.reserve(64), Some(0));
        assert_eq!(tx.reserve(1), None);
        assert!(tx.ack(64));
        assert_eq!(tx.reserve(1), Some(0));
    }

    #[test]
    fn impossible_sizes_and_acks_are_refused() {
        let mut tx = SendRing::new(64);
        assert_eq!(tx.reserve(0), None);
        assert_eq!(tx.reserve(65), None);
        tx.reserve(10);
        assert!(!tx.ack(11), "acking more than was sent");
        assert!(tx.ack(5));
        assert!(!tx.ack(4), "acks never go backwards");
        assert!(!tx.ack(5), "nor repeat");
        assert!(!tx.ack(u64::MAX));
        assert_eq!(tx.in_flight(), 5);
    }

    #[test]
    fn stale_reports_are_ignored_and_reports_beyond_what_was_sent_refused() {
        let mut tx = SendRing::new(64);
        tx.reserve(10);
        assert_eq!(tx.ack_at_least(5), Some(true));
        assert_eq!(tx.ack_at_least(5), Some(false), "a repeat");
        assert_eq!(tx.ack_at_least(3), Some(false), "an older one");
        assert_eq!(tx.ack_at_least(11), None);
        assert_eq!(tx.acked(), 5);
    }

    #[test]
    fn needed_for_is_exactly_what_makes_a_message_fit() {
        // Every head, ack and length of a small ring: the message fits once
        // the ack reaches `needed_for`, and not one byte before.
        for start in 0..40u64 {
            for len in 1..=16usize {
                let mut tx = SendRing::new(16);
                // Walk the head to `start` in steps that always fit.
                while tx.head() < start {
                    let step = (start - tx.head()).min(16 - tx.in_flight()).min(1) as usize;
                    tx.reserve(step).unwrap();
                    tx.ack(tx.head());
                }
                for inflight in 0..=16u64.min(tx.head()) {
                    let mut t = tx.clone();
                    t.acked = t.head - inflight;
                    let need = t.needed_for(len);
                    assert!(need <= t.head);
                    let fits = |acked: u64| {
                        let mut c = t.clone();
                        c.acked = acked;
                        c.reserve(len).is_some()
                    };
                    assert!(
                        fits(need.max(t.acked)),
                        "head {} len {len} need {need}",
                        t.head
                    );
                    if need > t.acked {
                        assert!(!fits(need - 1), "head {} len {len} need {need}", t.head);
                    }
                }
            }
        }
    }

    #[test]
    fn rings_as_large_as_memory_do_not_overflow() {
        let mut tx = SendRing::new(usize::MAX);
        assert_eq!(tx.reserve(usize::MAX - 1), Some(0));
        assert_eq!(tx.reserve(2), None, "one byte left");
        let mut rx = RecvRing::new(64);
        assert!(!take(&mut rx, usize::MAX, 2));
        assert!(!take(&mut rx, 2, usize::MAX));
        assert_eq!(rx.unreported(), 0);
    }

    #[test]
    fn the_receiver_refuses_messages_out_of_place() {
        let mut rx = RecvRing::new(64);
        assert!(
            !take(&mut rx, 10, 4),
            "must start at the current position or 0"
        );
        assert!(!take(&mut rx, 60, 8), "must end inside the ring");
        assert!(!take(&mut rx, 0, 0));
        assert!(take(&mut rx, 0, 60));
        assert!(take(&mut rx, 0, 8), "wrapped: skips 4 bytes");
        assert_eq!(rx.unreported(), 72);
    }

    #[test]
    fn a_sender_with_a_smaller_staging_buffer_wraps_both_sides_in_step() {
        assert_eq!(wrap_point(1000, 0), 1000, "legacy: the whole ring");
        assert_eq!(wrap_point(1000, u32::MAX), 1000, "never past the ring");
        let cap = wrap_point(1000, 300);
        assert_eq!(cap, 300);
        // The sender's ring is its staging size; the receiver agrees.
        let mut tx = SendRing::new(300);
        let mut rx = RecvRing::new(cap);
        for len in [200, 150, 120, 290] {
            let off = tx.reserve(len).unwrap_or_else(|| {
                assert!(tx.ack(rx.take_report()));
                tx.reserve(len).unwrap()
            });
            assert!(take(&mut rx, off, len));
        }
        assert!(tx.ack(rx.take_report()), "credit matches what was sent");
        assert_eq!(tx.in_flight(), 0);
    }

    #[test]
    fn many_laps_stay_in_step() {
        let mut tx = SendRing::new(1000);
        let mut rx = RecvRing::new(1000);
        let mut sent = 0u64;
        for i in 0..10_000usize {
            let len = 1 + (i * 7919) % 997;
            let off = match tx.reserve(len) {
                Some(o) => o,
                None => {
                    assert!(tx.ack(rx.take_report()));
                    tx.reserve(len).expect("room after credit")
                }
            };
            assert!(take(&mut rx, off, len), "message {i} at {off}+{len}");
            sent += len as u64;
        }
        assert!(tx.ack(rx.take_report()));
        assert_eq!(tx.in_flight(), 0);
        assert!(sent > 100 * 1000);
    }

    #[test]
    fn bytes_still_being_read_are_never_reported() {
        let mut rx = RecvRing::new(100);
        assert!(rx.accept(0, 40));
        // Another thread's credit, while the message is read.
        assert_eq!(rx.unreported(), 0);
        assert_eq!(rx.take_report(), 0);
        // One delivered inside the first's callback.
        assert!(rx.accept(40, 10));
        rx.release();
        assert_eq!(rx.unreported(), 0, "the first is still being read");
        rx.release();
        assert_eq!(rx.take_report(), 50);
        assert!(!rx.accept(10, 10), "accepted bytes set the next position");
    }
}
