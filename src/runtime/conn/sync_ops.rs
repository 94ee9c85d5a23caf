//! The synchronous one-sided operations a connection has in flight, by id.
//! Ids are handed out in order (`State::next_op`) and one send queue
//! completes them in order, so they live in a window indexed by id rather
//! than a hash map: a lookup is a subtraction, not a hash, on every sync
//! READ and WRITE (insert, settle, check, remove).

use std::collections::VecDeque;

/// What became of an operation: `None` while in flight, else its result
/// (`Err` with the reason it failed).
pub(super) type Outcome = Option<Result<(), String>>;

pub(super) struct SyncOps {
    /// The room it is made with, and shrinks back to once empty.
    room: usize,
    /// The id of `slots[0]`.
    first: u64,
    /// `None`: removed, kept only while one before it is not.
    slots: VecDeque<Option<Outcome>>,
}

impl SyncOps {
    /// Room for `n` operations at once before the window grows.
    pub(super) fn with_capacity(n: usize) -> Self {
        SyncOps {
            room: n,
            first: 0,
            slots: VecDeque::with_capacity(n),
        }
    }

    /// Tracks `id`, in flight. Ids come in increasing order; one skipped
    /// is never tracked.
    pub(super) fn insert(&mut self, id: u64) {
        if self.slots.is_empty() {
            self.first = id;
        }
        let end = self.first + self.slots.len() as u64;
        debug_assert!(id >= end, "sync op ids come in order");
        for _ in end..id {
            self.slots.push_back(None);
        }
        self.slots.push_back(Some(None));
    }

    fn index(&self, id: u64) -> Option<usize> {
        let i = usize::try_from(id.checked_sub(self.first)?).ok()?;
        (i < self.slots.len()).then_some(i)
    }

    pub(super) fn get(&self, id: u64) -> Option<&Outcome> {
        self.slots.get(self.index(id)?)?.as_ref()
    }

    pub(super) fn get_mut(&mut self, id: u64) -> Option<&mut Outcome> {
        let i = self.index(id)?;
        self.slots.get_mut(i)?.as_mut()
    }

    /// Stops tracking `id`; false when it was not tracked.
    pub(super) fn remove(&mut self, id: u64) -> bool {
        let Some(slot) = self.index(id).and_then(|i| self.slots.get_mut(i)) else {
            return false;
        };
        if slot.take().is_none() {
            return false;
        }
        while self.slots.front().is_some_and(Option::is_none) {
            self.slots.pop_front();
            self.first += 1;
        }
        if self.slots.is_empty() && self.slots.capacity() > self.room {
            // Grown while an early operation's waiter held its place
            // (`PendingReads`) and others came and went: given back.
            self.slots.shrink_to(self.room);
        }
        true
    }

    /// Every tracked operation's outcome.
    pub(super) fn outcomes_mut(&mut self) -> impl Iterator<Item = &mut Outcome> {
        self.slots.iter_mut().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[test]
    fn settled_out_of_order_and_removed_the_window_shrinks() {
        let mut ops = SyncOps::with_capacity(4);
        for id in 5..9 {
            ops.insert(id);
        }
        *ops.get_mut(7).unwrap() = Some(Ok(()));
        assert!(ops.remove(7));
        assert!(!ops.remove(7), "gone");
        assert_eq!(ops.get(7), None);
        assert_eq!(ops.get(6), Some(&None));
        assert!(ops.remove(5) && ops.remove(6));
        assert_eq!((ops.first, ops.slots.len()), (8, 1));
        assert!(ops.remove(8));
        assert!(ops.slots.is_empty());
        ops.insert(20);
        assert_eq!(ops.get(20), Some(&None));
        assert_eq!((ops.get(19), ops.get(21), ops.get(0)), (None, None, None));
    }

    #[test]
    fn a_window_grown_behind_a_held_operation_is_given_back() {
        let mut ops = SyncOps::with_capacity(4);
        ops.insert(1);
        for id in 2..1000 {
            ops.insert(id);
            assert!(ops.remove(id));
        }
        assert!(ops.slots.capacity() >= 999, "held open by op 1");
        assert!(ops.remove(1));
        assert!(ops.slots.capacity() < 999);
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Insert the next id after skipping this many.
        Insert(u8),
        Settle(u8, bool),
        Remove(u8),
        FailAll,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..3).prop_map(Op::Insert),
            (any::<u8>(), any::<bool>()).prop_map(|(i, ok)| Op::Settle(i, ok)),
            any::<u8>().prop_map(Op::Remove),
            Just(Op::FailAll),
        ]
    }

    proptest! {
        /// Against a map: the same ids tracked, with the same outcomes.
        #[test]
        fn the_window_matches_a_map(script in prop::collection::vec(op(), 1..200)) {
            let mut ops = SyncOps::with_capacity(2);
            let mut model: BTreeMap<u64, Outcome> = BTreeMap::new();
            let mut next = 1u64;
            // Ids near the ones handed out: the `u8` picks among them.
            let pick = |i: u8, next: u64| next.saturating_sub(1 + u64::from(i) % 8);
            for step in script {
                match step {
                    Op::Insert(skip) => {
                        next += u64::from(skip);
                        ops.insert(next);
                        model.insert(next, None);
                        next += 1;
                    }
                    Op::Settle(i, ok) => {
                        let id = pick(i, next);
                        let outcome = Some(if ok { Ok(()) } else { Err("failed".to_string()) });
                        if let Some(slot) = ops.get_mut(id) {
                            *slot = outcome.clone();
                        }
                        if let Some(slot) = model.get_mut(&id) {
                            *slot = outcome;
                        }
                    }
                    Op::Remove(i) => {
                        let id = pick(i, next);
                        prop_assert_eq!(ops.remove(id), model.remove(&id).is_some());
                    }
                    Op::FailAll => {
                        for slot in ops.outcomes_mut() {
                            slot.get_or_insert_with(|| Err("closed".into()));
                        }
                        for slot in model.values_mut() {
                            slot.get_or_insert_with(|| Err("closed".into()));
                        }
                    }
                }
                for id in next.saturating_sub(12)..next + 2 {
                    prop_assert_eq!(ops.get(id), model.get(&id));
                }
                prop_assert_eq!(ops.outcomes_mut().count(), model.len());
            }
        }
    }
}
