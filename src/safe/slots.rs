//! The table of a completion queue's operations in flight: a slot per
//! posted operation, named by its work request ids, holding its result,
//! its waker and, once its future is dropped, its memory.

use std::task::Waker;

use super::region::RawHold;
use crate::verbs::Completion;

/// Bit 63 of a work request id: the request that completes its operation
/// (the only one of a batch that is signaled).
const TAIL: u64 = 1 << 63;

fn encode(idx: u32, gen: u32, tail: bool) -> u64 {
    u64::from(idx) | (u64::from(gen & 0x7fff_ffff) << 32) | if tail { TAIL } else { 0 }
}

pub(super) fn decode(wr_id: u64) -> (u32, u32, bool) {
    (
        wr_id as u32,
        ((wr_id >> 32) as u32) & 0x7fff_ffff,
        wr_id & TAIL != 0,
    )
}

/// A slot of a posted operation: its index and generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket {
    pub(super) idx: u32,
    pub(super) gen: u32,
}

impl Ticket {
    /// The work request id of one of the operation's requests.
    pub(crate) fn wr_id(self, tail: bool) -> u64 {
        encode(self.idx, self.gen, tail)
    }
}

#[derive(Default)]
pub(super) struct Slots {
    pub(super) all: Vec<Slot>,
    pub(super) free: Vec<u32>,
    /// Work requests posted whose completions are not reaped yet: each may
    /// still put one in the CQ (a batch's unsignaled ones when flushed),
    /// and a CQ that overflows loses completions.
    pub(super) in_flight: usize,
}

#[derive(Default)]
pub(super) struct Slot {
    pub(super) gen: u32,
    pub(super) busy: bool,
    /// The queue pair whose work queue holds the operation (with
    /// [`SRQ_TAG`](super::cq::SRQ_TAG): a shared receive queue's).
    pub(super) qp: u32,
    /// Its work requests, counted in [`Slots::in_flight`] until its
    /// completion is reaped.
    pub(super) wrs: usize,
    /// The operation's result: its tail's completion, or its first failure.
    pub(super) done: Option<Completion>,
    pub(super) failed: Option<Completion>,
    pub(super) waker: Option<Waker>,
    /// The future was dropped: the completion only releases `parked`.
    pub(super) abandoned: bool,
    /// A batch posted in part: no tail will complete it
    /// ([`CqShared::disown`](super::cq::CqShared::disown)).
    pub(super) tailless: bool,
    /// A receive whose shared receive queue was destroyed: it will never
    /// complete, and the device no longer touches its memory.
    pub(super) gone: bool,
    /// Segments of an operation whose future was dropped.
    pub(super) parked: Vec<RawHold>,
}

impl Slots {
    /// A slot for an operation of `wrs` work requests on queue pair `qp`,
    /// its requests counted in flight.
    pub(super) fn open(&mut self, qp: u32, wrs: usize) -> Ticket {
        self.in_flight += wrs;
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.all.push(Slot::default());
                (self.all.len() - 1) as u32
            }
        };
        let slot = &mut self.all[idx as usize];
        slot.gen = slot.gen.wrapping_add(1) & 0x7fff_ffff;
        slot.busy = true;
        slot.qp = qp;
        slot.wrs = wrs;
        Ticket { idx, gen: slot.gen }
    }

    /// The operation's completion is out of the CQ: its room is free.
    pub(super) fn reaped(&mut self, idx: u32) {
        let slot = &mut self.all[idx as usize];
        self.in_flight -= std::mem::take(&mut slot.wrs);
    }

    /// Operations of queue pair `qp` not completed yet (a batch without
    /// its tail never completes).
    pub(super) fn pending_of(&self, qp: u32) -> usize {
        self.all
            .iter()
            .filter(|s| s.busy && s.qp == qp && s.done.is_none() && !s.tailless)
            .count()
    }

    pub(super) fn close(&mut self, idx: u32) {
        let slot = &mut self.all[idx as usize];
        slot.busy = false;
        slot.done = None;
        slot.failed = None;
        slot.waker = None;
        slot.abandoned = false;
        slot.tailless = false;
        slot.gone = false;
        debug_assert!(slot.parked.is_empty());
        self.free.push(idx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_request_ids_round_trip() {
        for (idx, gen, tail) in [(0, 1, true), (u32::MAX, 0x7fff_ffff, false), (7, 3, false)] {
            assert_eq!(decode(encode(idx, gen, tail)), (idx, gen, tail));
        }
    }
}
