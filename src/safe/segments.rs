//! Which parts of a region are lent out, and how: the bookkeeping behind
//! [`MemoryRegion::ro`](super::MemoryRegion::ro) and
//! [`MemoryRegion::rw`](super::MemoryRegion::rw). Pure logic, tested on the
//! host against a brute-force model.
//!
//! Read-only holds may overlap each other; a read-write hold overlaps
//! nothing. A hold is released the moment its segment drops, so a range is
//! reusable at once (the legacy SafeVerbs never gave a range back).

use std::fmt;
use std::ops::Range;

/// Why a segment could not be taken. Ranges are in elements of the region.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SegmentError {
    /// The range is empty or reaches past the region's end.
    #[error("segment {wanted:?} is not inside a region of {len} elements")]
    OutOfBounds { wanted: Range<usize>, len: usize },
    /// The range overlaps a segment that is still held.
    #[error("segment {wanted:?} ({}) overlaps {held:?} ({}), which is still held", mode(*.wanted_rw), mode(*.held_rw))]
    Overlap {
        wanted: Range<usize>,
        wanted_rw: bool,
        held: Range<usize>,
        held_rw: bool,
    },
}

fn mode(rw: bool) -> &'static str {
    if rw {
        "read-write"
    } else {
        "read-only"
    }
}

/// The holds on one region. Linear in the number of holds, which is about
/// the number of operations in flight on the region.
#[derive(Default)]
pub(crate) struct SegmentSet {
    holds: Vec<Hold>,
    next_id: u64,
}

#[derive(Clone)]
struct Hold {
    id: u64,
    range: Range<usize>,
    rw: bool,
}

/// Identifies one hold, to release it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HoldId(u64);

impl HoldId {
    /// Stands for no hold, for things kept alive that are not segments.
    pub(crate) const NONE: HoldId = HoldId(u64::MAX);
}

impl fmt::Debug for SegmentSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.holds.iter().map(|h| (&h.range, mode(h.rw))))
            .finish()
    }
}

impl SegmentSet {
    /// Takes `range` of a region of `len` elements, read-write or read-only.
    pub(crate) fn take(
        &mut self,
        range: Range<usize>,
        rw: bool,
        len: usize,
    ) -> Result<HoldId, SegmentError> {
        if range.start >= range.end || range.end > len {
            return Err(SegmentError::OutOfBounds { wanted: range, len });
        }
        let clash = self
            .holds
            .iter()
            .find(|h| (rw || h.rw) && h.range.start < range.end && range.start < h.range.end);
        if let Some(h) = clash {
            return Err(SegmentError::Overlap {
                wanted: range,
                wanted_rw: rw,
                held: h.range.clone(),
                held_rw: h.rw,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        self.holds.push(Hold { id, range, rw });
        Ok(HoldId(id))
    }

    /// Turns a read-write hold into a read-only one (it can only get less
    /// exclusive, so this cannot fail).
    pub(crate) fn freeze(&mut self, id: HoldId) {
        if let Some(h) = self.holds.iter_mut().find(|h| h.id == id.0) {
            h.rw = false;
        }
    }

    /// Ends a hold; its range is free at once.
    pub(crate) fn release(&mut self, id: HoldId) {
        if let Some(i) = self.holds.iter().position(|h| h.id == id.0) {
            self.holds.swap_remove(i);
        }
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.holds.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The model: a counter per element, of readers and of writers.
    #[derive(Default)]
    struct Model {
        readers: Vec<u32>,
        writers: Vec<u32>,
    }

    impl Model {
        fn can_take(&self, r: &Range<usize>, rw: bool) -> bool {
            r.start < r.end
                && r.end <= self.readers.len()
                && r.clone()
                    .all(|i| self.writers[i] == 0 && (!rw || self.readers[i] == 0))
        }
        fn add(&mut self, r: &Range<usize>, rw: bool, by: i32) {
            for i in r.clone() {
                let c = if rw {
                    &mut self.writers[i]
                } else {
                    &mut self.readers[i]
                };
                *c = c.checked_add_signed(by).unwrap();
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Step {
        Take { start: usize, len: usize, rw: bool },
        Drop(usize),
        Freeze(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (0..70usize, 0..20usize, any::<bool>()).prop_map(|(start, len, rw)| Step::Take {
                start,
                len,
                rw
            }),
            (0..16usize).prop_map(Step::Drop),
            (0..16usize).prop_map(Step::Freeze),
        ]
    }

    proptest! {
        #[test]
        fn takes_and_drops_agree_with_the_model(steps in proptest::collection::vec(step(), 1..200)) {
            const LEN: usize = 64;
            let mut set = SegmentSet::default();
            let mut model = Model { readers: vec![0; LEN], writers: vec![0; LEN] };
            let mut held: Vec<(HoldId, Range<usize>, bool)> = Vec::new();
            for s in steps {
                match s {
                    Step::Take { start, len, rw } => {
                        let r = start..start + len;
                        let expect = model.can_take(&r, rw);
                        match set.take(r.clone(), rw, LEN) {
                            Ok(id) => {
                                prop_assert!(expect, "took {r:?} rw={rw} against the model");
                                model.add(&r, rw, 1);
                                held.push((id, r, rw));
                            }
                            Err(SegmentError::Overlap { held: other, held_rw, .. }) => {
                                prop_assert!(!expect, "refused {r:?} rw={rw}");
                                // The named range is really held and really clashes.
                                prop_assert!(held.iter().any(|(_, h, hrw)| *h == other && *hrw == held_rw));
                                prop_assert!(other.start < r.end && r.start < other.end);
                            }
                            Err(SegmentError::OutOfBounds { .. }) => {
                                prop_assert!(r.is_empty() || r.end > LEN);
                            }
                        }
                    }
                    Step::Drop(i) if i < held.len() => {
                        let (id, r, rw) = held.swap_remove(i);
                        set.release(id);
                        model.add(&r, rw, -1);
                    }
                    Step::Freeze(i) if i < held.len() => {
                        let (id, r, rw) = held[i].clone();
                        if rw {
                            set.freeze(id);
                            model.add(&r, true, -1);
                            model.add(&r, false, 1);
                            held[i].2 = false;
                        }
                    }
                    _ => {}
                }
            }
            for (id, ..) in held {
                set.release(id);
            }
            prop_assert!(set.is_empty());
        }
    }

    #[test]
    fn an_overlap_names_both_ranges() {
        let mut set = SegmentSet::default();
        set.take(0..10, true, 100).unwrap();
        let e = set.take(5..20, false, 100).unwrap_err();
        assert_eq!(
            e.to_string(),
            "segment 5..20 (read-only) overlaps 0..10 (read-write), which is still held"
        );
    }
}
