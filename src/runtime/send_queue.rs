//! Messages that found no room in the peer's ring (or its receive queue, or
//! our send queue) and wait, in order, to be posted as room returns. The
//! legacy library never refused a send before its buffer ran out for good,
//! so legacy programs send from callbacks and ignore what the send returns:
//! a message that cannot go now must wait here rather than be lost.
//!
//! The queue is bounded in bytes; each message is charged its length plus
//! [`MESSAGE_OVERHEAD`], so a flood of tiny messages is bounded too. Once
//! full it refuses messages; a run of refusals (an episode) is reported once
//! when it starts and once, with its count, when the queue has drained.

use std::collections::VecDeque;

use super::proto::ExtKind;

/// Bytes each queued message is charged besides its payload (its slot and
/// allocation).
pub const MESSAGE_OVERHEAD: usize = 64;

/// One message waiting to be posted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Queued {
    pub data: Vec<u8>,
    pub ext: Option<ExtKind>,
}

/// What became of a message offered to the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Push {
    Queued,
    /// The queue is full; `first` when this refusal starts an episode.
    Refused {
        first: bool,
    },
}

/// Counts over a connection's life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SendQueueStats {
    /// Messages that waited in the queue.
    pub queued: u64,
    /// Messages refused because the queue was full (the send returned 0).
    pub refused: u64,
    /// Messages still queued when the connection ended, never sent.
    pub dropped: u64,
    /// The most bytes (as charged) the queue held at once.
    pub peak_bytes: usize,
}

/// A run of refusals, reported when the queue has drained.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Episode {
    pub refused: u64,
    pub refused_bytes: u64,
}

#[derive(Debug, Default)]
pub struct SendQueue {
    msgs: VecDeque<Queued>,
    /// Bytes charged for what is queued.
    charged: usize,
    /// Payload bytes queued (ring bytes, extension headers included).
    payload: usize,
    limit: usize,
    episode: Option<Episode>,
    stats: SendQueueStats,
}

fn charge(q: &Queued) -> usize {
    q.data.len() + MESSAGE_OVERHEAD
}

/// Bytes a message takes in the peer's ring.
fn ring_len(q: &Queued) -> usize {
    q.data.len()
        + if q.ext.is_some() {
            super::proto::EXT_HEADER_LEN
        } else {
            0
        }
}

impl SendQueue {
    /// A queue that holds up to `limit` bytes as charged.
    pub fn new(limit: usize) -> SendQueue {
        SendQueue {
            limit,
            ..SendQueue::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.msgs.is_empty()
    }

    pub fn len(&self) -> usize {
        self.msgs.len()
    }

    /// Ring bytes the queued messages will take.
    pub fn payload_bytes(&self) -> usize {
        self.payload
    }

    pub fn stats(&self) -> SendQueueStats {
        self.stats
    }

    /// Queues a copy of `data` at the back, unless that would pass the bound.
    pub fn push(&mut self, data: &[u8], ext: Option<ExtKind>) -> Push {
        self.push_parts(&[data], ext)
    }

    /// Queues the concatenation of `parts` as one message.
    pub fn push_parts(&mut self, parts: &[&[u8]], ext: Option<ExtKind>) -> Push {
        let mut joined = vec![0; parts.iter().map(|p| p.len()).sum()];
        crate::copy::gather(&mut joined, parts);
        let q = Queued { data: joined, ext };
        if self.charged + charge(&q) > self.limit {
            self.stats.refused += 1;
            let first = self.episode.is_none();
            let ep = self.episode.get_or_insert_with(Episode::default);
            ep.refused += 1;
            ep.refused_bytes += q.data.len() as u64;
            return Push::Refused { first };
        }
        self.stats.queued += 1;
        self.add(q, false);
        self.stats.peak_bytes = self.stats.peak_bytes.max(self.charged);
        Push::Queued
    }

    fn add(&mut self, q: Queued, front: bool) {
        self.charged += charge(&q);
        self.payload += ring_len(&q);
        if front {
            self.msgs.push_front(q);
        } else {
            self.msgs.push_back(q);
        }
    }

    /// Takes the oldest message to post it.
    pub fn pop(&mut self) -> Option<Queued> {
        let q = self.msgs.pop_front()?;
        self.charged -= charge(&q);
        self.payload -= ring_len(&q);
        Some(q)
    }

    /// Puts back a message [`SendQueue::pop`] gave that could not be posted.
    pub fn unpop(&mut self, q: Queued) {
        self.add(q, true);
    }

    /// The episode of refusals that ended, once the queue is empty again.
    pub fn end_episode(&mut self) -> Option<Episode> {
        if self.msgs.is_empty() {
            self.episode.take()
        } else {
            None
        }
    }

    /// Drops everything still queued (the connection ended); returns how
    /// many messages and payload bytes that was.
    pub fn drop_all(&mut self) -> (u64, usize) {
        let n = self.msgs.len() as u64;
        let bytes = self.msgs.iter().map(|q| q.data.len()).sum();
        self.msgs.clear();
        self.charged = 0;
        self.payload = 0;
        self.stats.dropped += n;
        (n, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn messages_leave_in_order_and_the_bound_holds() {
        let mut q = SendQueue::new(3 * (10 + MESSAGE_OVERHEAD));
        for i in 0..3u8 {
            assert_eq!(q.push(&[i; 10], None), Push::Queued);
        }
        assert_eq!(q.push(&[9; 1], None), Push::Refused { first: true });
        assert_eq!(q.push(&[9; 1], None), Push::Refused { first: false });
        assert_eq!(q.end_episode(), None, "not drained yet");
        let first = q.pop().unwrap();
        assert_eq!(first.data, vec![0; 10]);
        q.unpop(first);
        for i in 0..3u8 {
            assert_eq!(q.pop().unwrap().data, vec![i; 10]);
        }
        assert_eq!(
            q.end_episode(),
            Some(Episode {
                refused: 2,
                refused_bytes: 2
            })
        );
        assert_eq!(q.push(&[1], None), Push::Queued, "a new episode may start");
        let s = q.stats();
        assert_eq!((s.queued, s.refused, s.peak_bytes), (4, 2, 3 * 74));
    }

    #[test]
    fn tiny_messages_are_bounded_by_their_overhead() {
        let mut q = SendQueue::new(1 << 20);
        let mut n = 0;
        while q.push(&[0], None) == Push::Queued {
            n += 1;
        }
        assert_eq!(n, (1 << 20) / (1 + MESSAGE_OVERHEAD));
    }

    #[test]
    fn extended_messages_take_their_header_in_the_ring() {
        let mut q = SendQueue::new(1 << 20);
        q.push(&[0; 5], Some(ExtKind::WithImm(1)));
        q.push(&[0; 5], None);
        assert_eq!(q.payload_bytes(), 5 + 8 + 5);
        assert_eq!(q.drop_all(), (2, 10));
        assert_eq!(q.payload_bytes(), 0);
        assert_eq!(q.stats().dropped, 2);
    }

    proptest! {
        /// Against a plain model: what is accepted comes out in order, the
        /// bound is never passed, and the counts add up.
        #[test]
        fn the_queue_matches_a_model(ops in prop::collection::vec((any::<bool>(), 1usize..300), 1..300)) {
            let limit = 2000;
            let mut q = SendQueue::new(limit);
            let mut model = std::collections::VecDeque::new();
            let mut refused = 0u64;
            for (i, (push, len)) in ops.into_iter().enumerate() {
                if push {
                    let data = vec![i as u8; len];
                    let used: usize = model.iter().map(|d: &Vec<u8>| d.len() + MESSAGE_OVERHEAD).sum();
                    match q.push(&data, None) {
                        Push::Queued => {
                            prop_assert!(used + len + MESSAGE_OVERHEAD <= limit);
                            model.push_back(data);
                        }
                        Push::Refused { .. } => {
                            prop_assert!(used + len + MESSAGE_OVERHEAD > limit);
                            refused += 1;
                        }
                    }
                } else {
                    prop_assert_eq!(q.pop().map(|m| m.data), model.pop_front());
                }
                prop_assert_eq!(q.len(), model.len());
                prop_assert_eq!(q.payload_bytes(), model.iter().map(|d| d.len()).sum::<usize>());
            }
            prop_assert_eq!(q.stats().refused, refused);
        }
    }
}
