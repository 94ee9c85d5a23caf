//! The queue of messages waiting for room, against a model: order, the
//! byte bound, what the peer's ring will take, the counts and the episodes
//! of refusals, over pushes, pops, put-backs and drops in any order.

use std::collections::VecDeque;

use proptest::prelude::*;
use snowrdma::runtime::proto::{ExtKind, EXT_HEADER_LEN};
use snowrdma::runtime::send_queue::{Episode, Push, SendQueue, MESSAGE_OVERHEAD};

use crate::corpus;

#[derive(Debug, Clone)]
enum Op {
    Push(usize, Option<ExtKind>),
    Pop,
    /// Popped, could not be posted, put back.
    PopAndPutBack,
    DropAll,
    EndEpisode,
}

fn op() -> impl Strategy<Value = Op> {
    let ext = proptest::option::of(prop_oneof![
        any::<u32>().prop_map(ExtKind::WithImm),
        Just(ExtKind::Silent),
    ]);
    prop_oneof![
        6 => (prop_oneof![0usize..200, 0usize..3000], ext).prop_map(|(len, ext)| Op::Push(len, ext)),
        3 => Just(Op::Pop),
        1 => Just(Op::PopAndPutBack),
        1 => Just(Op::DropAll),
        2 => Just(Op::EndEpisode),
    ]
}

fn ring_len(m: &(Vec<u8>, Option<ExtKind>)) -> usize {
    m.0.len() + if m.1.is_some() { EXT_HEADER_LEN } else { 0 }
}

proptest! {
    #![proptest_config(corpus::config(2000))]

    #[test]
    fn the_send_queue_matches_its_model(
        limit in prop_oneof![0usize..100, 100usize..5000],
        ops in prop::collection::vec(op(), 1..200),
    ) {
        let mut q = SendQueue::new(limit);
        let mut model: VecDeque<(Vec<u8>, Option<ExtKind>)> = VecDeque::new();
        let mut episode: Option<Episode> = None;
        let (mut queued, mut refused, mut dropped, mut peak) = (0u64, 0u64, 0u64, 0usize);
        for (i, op) in ops.into_iter().enumerate() {
            let charged: usize = model.iter().map(|m| m.0.len() + MESSAGE_OVERHEAD).sum();
            match op {
                Op::Push(len, ext) => {
                    let data = vec![i as u8; len];
                    if charged + len + MESSAGE_OVERHEAD <= limit {
                        prop_assert_eq!(q.push(&data, ext), Push::Queued);
                        model.push_back((data, ext));
                        queued += 1;
                        peak = peak.max(charged + len + MESSAGE_OVERHEAD);
                    } else {
                        let first = episode.is_none();
                        prop_assert_eq!(q.push(&data, ext), Push::Refused { first });
                        let ep = episode.get_or_insert_with(Episode::default);
                        ep.refused += 1;
                        ep.refused_bytes += len as u64;
                        refused += 1;
                    }
                }
                Op::Pop => {
                    let m = q.pop().map(|m| (m.data, m.ext));
                    prop_assert_eq!(m, model.pop_front());
                }
                Op::PopAndPutBack => {
                    if let Some(m) = q.pop() {
                        q.unpop(m);
                    }
                }
                Op::DropAll => {
                    let bytes = model.iter().map(|m| m.0.len()).sum();
                    prop_assert_eq!(q.drop_all(), (model.len() as u64, bytes));
                    dropped += model.len() as u64;
                    model.clear();
                }
                Op::EndEpisode => {
                    let ended = if model.is_empty() { episode.take() } else { None };
                    prop_assert_eq!(q.end_episode(), ended);
                }
            }
            prop_assert_eq!(q.len(), model.len());
            prop_assert_eq!(q.is_empty(), model.is_empty());
            prop_assert_eq!(q.payload_bytes(), model.iter().map(ring_len).sum::<usize>());
            let s = q.stats();
            prop_assert_eq!((s.queued, s.refused, s.dropped, s.peak_bytes), (queued, refused, dropped, peak));
        }
    }
}
