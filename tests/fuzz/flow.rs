//! Flow control as a state machine: a sender's [`SendRing`] and a
//! receiver's [`RecvRing`] joined by an in-order wire (RC delivers in
//! order), fed random sequences of sends, deliveries, credits and forged
//! input, and checked against a simple model of the ring: what is placed
//! fits and never overlaps what the receiver still holds, what a forger
//! sends is refused without changing anything, and honest traffic never
//! deadlocks (once everything is delivered and credited, any message that
//! fits the ring goes).

use std::collections::VecDeque;

use proptest::prelude::*;
use snowrdma::runtime::ring::{wrap_point, RecvRing, SendRing};

use crate::corpus;

#[derive(Debug, Clone, Copy)]
enum Step {
    /// The sender reserves room for a message and posts it.
    Send(usize),
    /// The oldest posted message reaches the receiver.
    Deliver,
    /// The receiver returns what it consumed (when it has something new).
    Report,
    /// The oldest credit reaches the sender.
    Credit,
    /// A forged credit reaches the sender.
    Forged(Forgery),
    /// A forged sender's message lands out of place.
    Stray { offset: usize, len: usize },
}

#[derive(Debug, Clone, Copy)]
enum Forgery {
    /// More than was ever sent.
    Beyond(u64),
    /// Less than already returned.
    Backwards(u64),
    /// The last credit again.
    Repeated,
    Max,
}

#[derive(Debug, Clone)]
struct Sim {
    cap: usize,
    tx: SendRing,
    rx: RecvRing,
    /// Bytes the sender used, skipped tails included (the model's head).
    sent: u64,
    /// What the sender has been given back.
    acked: u64,
    /// Messages whose room has not come back: (cumulative end, offset, len).
    live: VecDeque<(u64, usize, usize)>,
    /// Posted, not yet delivered.
    wire: VecDeque<(usize, usize)>,
    /// Bytes the receiver consumed, skipped tails included.
    received: u64,
    reported: u64,
    credits: VecDeque<u64>,
}

impl Sim {
    /// A sender with `staging` bytes of staging buffer talking to a
    /// receiver with a ring of `ring_len`: both must wrap at one place.
    fn new(ring_len: usize, staging: usize) -> Sim {
        let cap = ring_len.min(staging);
        let ring_use = u32::try_from(staging).expect("test staging sizes fit the command");
        assert_eq!(wrap_point(ring_len, ring_use), cap);
        Sim {
            cap,
            tx: SendRing::new(cap),
            rx: RecvRing::new(wrap_point(ring_len, ring_use)),
            sent: 0,
            acked: 0,
            live: VecDeque::new(),
            wire: VecDeque::new(),
            received: 0,
            reported: 0,
            credits: VecDeque::new(),
        }
    }

    fn in_flight(&self) -> u64 {
        self.sent - self.acked
    }

    fn check(&self) {
        // In flight may pass the ring's size by a skipped tail: what
        // matters is that no two live messages overlap (see `send`).
        assert_eq!(self.tx.in_flight(), self.in_flight());
        assert_eq!(self.rx.unreported(), self.received - self.reported);
        assert!(self.received <= self.sent);
    }

    fn step(&mut self, step: Step) {
        match step {
            Step::Send(len) => self.send(len),
            Step::Deliver => self.deliver(),
            Step::Report => self.report(),
            Step::Credit => {
                if let Some(c) = self.credits.pop_front() {
                    assert!(self.tx.ack(c), "an honest credit of {c}");
                    self.acked = c;
                    let acked = self.acked;
                    self.live.retain(|&(end, ..)| end > acked);
                }
            }
            Step::Forged(f) => {
                let forged = match f {
                    Forgery::Beyond(d) => self.sent.saturating_add(1).saturating_add(d),
                    Forgery::Backwards(_) if self.acked == 0 => return,
                    Forgery::Backwards(d) => self.acked - 1 - d % self.acked,
                    Forgery::Repeated => self.acked,
                    Forgery::Max => u64::MAX,
                };
                assert!(!self.tx.ack(forged), "{f:?}: {forged} was taken");
            }
            Step::Stray { offset, len } => {
                if placed(self.cap, self.received, offset, len).is_some() {
                    return; // indistinguishable from the next honest message
                }
                assert!(!self.rx.accept(offset, len), "{len} bytes at {offset}");
            }
        }
        self.check();
    }

    fn send(&mut self, len: usize) {
        let Some(offset) = self.tx.reserve(len) else {
            let valid = len > 0 && len <= self.cap;
            assert!(
                !valid || self.in_flight() > 0,
                "an empty ring refused {len} bytes"
            );
            if valid {
                // Refused for now, not for ever.
                let mut later = self.clone();
                later.drain();
                assert!(later.tx.reserve(len).is_some(), "{len} bytes after a drain");
            }
            return;
        };
        let start = placed(self.cap, self.sent, offset, len)
            .unwrap_or_else(|| panic!("{len} bytes placed at {offset}, stream at {}", self.sent));
        for &(_, o, l) in &self.live {
            assert!(
                offset + len <= o || o + l <= offset,
                "{len} bytes at {offset} overwrite {l} bytes at {o} not yet returned"
            );
        }
        self.sent = start + len as u64;
        self.live.push_back((self.sent, offset, len));
        self.wire.push_back((offset, len));
    }

    fn deliver(&mut self) {
        let Some((offset, len)) = self.wire.pop_front() else {
            return;
        };
        let start = placed(self.cap, self.received, offset, len).expect("in step");
        assert!(self.rx.accept(offset, len), "{len} bytes at {offset}");
        // Read at once: nothing else looks at the bytes.
        self.rx.release();
        self.received = start + len as u64;
    }

    fn report(&mut self) {
        if self.rx.unreported() == 0 {
            return;
        }
        let c = self.rx.take_report();
        assert_eq!(c, self.received);
        self.reported = c;
        self.credits.push_back(c);
    }

    /// Everything delivered and credited, as an honest receiver does.
    fn drain(&mut self) {
        while !self.wire.is_empty() {
            self.step(Step::Deliver);
        }
        self.step(Step::Report);
        while !self.credits.is_empty() {
            self.step(Step::Credit);
        }
        assert_eq!(self.in_flight(), 0);
        assert_eq!(self.received, self.sent);
    }
}

/// Where a message at `offset` starts in the cumulative count of a ring of
/// `cap` bytes, after a stream at `count` (`None`: it may not go there).
fn placed(cap: usize, count: u64, offset: usize, len: usize) -> Option<u64> {
    let end = offset.checked_add(len)?;
    if len == 0 || end > cap {
        return None;
    }
    let pos = count % cap as u64;
    if offset as u64 == pos {
        Some(count)
    } else if offset == 0 {
        Some(count + (cap as u64 - pos))
    } else {
        None
    }
}

fn forgery() -> impl Strategy<Value = Forgery> {
    prop_oneof![
        prop_oneof![0u64..4, any::<u64>()].prop_map(Forgery::Beyond),
        prop_oneof![0u64..4, any::<u64>()].prop_map(Forgery::Backwards),
        Just(Forgery::Repeated),
        Just(Forgery::Max),
    ]
}

/// Sizes around the ring's: empty, small, up to all of it, past it.
fn length(cap: usize) -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 1..=cap.min(64),
        4 => 1..=cap,
        1 => Just(0),
        1 => cap..=cap.saturating_add(2),
        1 => Just(usize::MAX),
    ]
}

fn step(cap: usize) -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => length(cap).prop_map(Step::Send),
        5 => Just(Step::Deliver),
        2 => Just(Step::Report),
        3 => Just(Step::Credit),
        1 => forgery().prop_map(Step::Forged),
        1 => (prop_oneof![0..=cap, any::<usize>()], length(cap))
            .prop_map(|(offset, len)| Step::Stray { offset, len }),
    ]
}

/// A receiver's ring and a sender's staging size, small or very large
/// (still small enough for the cumulative counts of a run to fit 64 bits).
fn sizes() -> impl Strategy<Value = (usize, usize)> {
    prop_oneof![
        4 => (1usize..600, 1usize..800),
        1 => (1usize..1 << 16, 1usize..1 << 16),
        1 => (Just(1usize << 44), prop_oneof![Just(u32::MAX as usize), 1usize..=u32::MAX as usize]),
    ]
}

proptest! {
    #![proptest_config(corpus::config(2000))]

    #[test]
    fn credit_and_placement_match_the_model(
        (ring_len, staging, steps) in sizes().prop_flat_map(|(ring_len, staging)| {
            let cap = ring_len.min(staging);
            (Just(ring_len), Just(staging), prop::collection::vec(step(cap), 1..300))
        })
    ) {
        let mut sim = Sim::new(ring_len, staging);
        for s in steps {
            sim.step(s);
        }
        sim.drain();
        // Space comes back: any size up to the ring fits an empty ring.
        for len in [1, sim.cap / 2 + 1, sim.cap] {
            sim.step(Step::Send(len));
            prop_assert_eq!(sim.wire.len(), 1, "{} bytes went", len);
            sim.drain();
        }
    }

    /// The receiver alone, against arbitrary placements: it takes exactly
    /// the messages the model allows and counts them.
    #[test]
    fn the_receiver_takes_only_messages_in_place(
        cap in prop_oneof![1usize..300, Just(1usize << 44)],
        ops in prop::collection::vec(
            (0u8..4, prop_oneof![0usize..320, any::<usize>()], prop_oneof![0usize..320, any::<usize>()]),
            1..300,
        ),
    ) {
        let mut rx = RecvRing::new(cap);
        let (mut consumed, mut reported) = (0u64, 0u64);
        for (kind, at, len) in ops {
            let offset = match kind {
                0 => (consumed % cap as u64) as usize,
                1 => 0,
                2 => at,
                _ => {
                    reported = rx.take_report();
                    prop_assert_eq!(reported, consumed);
                    continue;
                }
            };
            let expect = placed(cap, consumed, offset, len);
            prop_assert_eq!(rx.accept(offset, len), expect.is_some(), "{} at {}", len, offset);
            if let Some(start) = expect {
                // Until it is released, none of its bytes is reportable.
                prop_assert_eq!(rx.unreported(), consumed - reported);
                rx.release();
                consumed = start + len as u64;
            }
            prop_assert_eq!(rx.unreported(), consumed - reported);
        }
    }

    #[test]
    fn the_wrap_point_is_inside_the_ring(ring_len in any::<usize>(), ring_use in any::<u32>()) {
        let w = wrap_point(ring_len, ring_use);
        prop_assert!(w <= ring_len);
        let expect = if ring_use == 0 { ring_len } else { ring_len.min(ring_use as usize) };
        prop_assert_eq!(w, expect);
    }
}
