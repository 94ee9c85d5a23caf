//! The broker's memory manager: a slab allocator over memory the program
//! gives it (typically part of the registered region peers READ and WRITE).
//!
//! The seed's layout by default: 64 size classes from 1,200 bytes, each
//! twice the one before (capped at the slab size); memory cut into slabs;
//! a slab is given to a class when it first needs one; partitions chosen by
//! `key % partitions`, each with its own slabs and locks. Unlike the seed,
//! a free of memory that is not an allocated item of that class is refused
//! (double frees included), and exhaustion is `None`, not an abort.

use std::collections::HashSet;
use std::sync::Mutex;

/// Number of size classes.
pub const SIZE_CLASSES: usize = 64;
/// The smallest class's item size.
pub const FIRST_CLASS_SIZE: u64 = 1200;

/// Why an item could not be freed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FreeError {
    #[error("{addr:#x} is not an item of size class {class}")]
    NotAnItem { addr: usize, class: u32 },
    #[error("{addr:#x} is already free")]
    DoubleFree { addr: usize },
    #[error("size class {0} does not exist")]
    NoSuchClass(u32),
}

/// A slab allocator over `[base, base + len)`. Thread-safe.
pub struct MemManager {
    base: usize,
    partitions: Vec<Mutex<Partition>>,
    slab_size: u64,
    class_sizes: [u64; SIZE_CLASSES],
}

struct Partition {
    /// The next slab not yet given to a class, and where the partition's
    /// last whole slab ends: slabs are counted out, not listed up front, as
    /// a manager may cover more address space than the process could list.
    next_slab: usize,
    slabs_end: usize,
    classes: Vec<Class>,
}

#[derive(Default)]
struct Class {
    /// (start, next unused byte) of each slab of the class.
    slabs: Vec<(usize, usize)>,
    free: Vec<usize>,
    /// Everything handed out and not freed: refuses double and wild frees.
    live: HashSet<usize>,
}

impl MemManager {
    /// Manages `len` bytes at address `base` (not dereferenced: the manager
    /// only hands out addresses), in `partitions` partitions of slabs of
    /// `slab_size` bytes. `None` when a slab is smaller than the first class,
    /// a partition would hold no slab (its state is made up front: a huge
    /// count would abort the process), or `base + len` passes the end of the address
    /// space.
    pub fn new(base: usize, len: u64, partitions: u32, slab_size: u64) -> Option<MemManager> {
        let end = u64::try_from(base).ok()?.checked_add(len)?;
        if partitions == 0
            || slab_size < FIRST_CLASS_SIZE
            || u64::from(partitions) > len / slab_size
            || usize::try_from(end).is_err()
        {
            return None;
        }
        let mut class_sizes = [0; SIZE_CLASSES];
        let mut size = FIRST_CLASS_SIZE;
        for c in &mut class_sizes {
            *c = size;
            size = size.saturating_mul(2).min(slab_size);
        }
        // Every figure below is at most `end`, which fits in a usize.
        let part_len = len / u64::from(partitions);
        let whole = part_len / slab_size * slab_size;
        let parts = (0..u64::from(partitions))
            .map(|p| {
                let start = base as u64 + p * part_len;
                Mutex::new(Partition {
                    next_slab: start as usize,
                    slabs_end: (start + whole) as usize,
                    classes: (0..SIZE_CLASSES).map(|_| Class::default()).collect(),
                })
            })
            .collect();
        Some(MemManager {
            base,
            partitions: parts,
            slab_size,
            class_sizes,
        })
    }

    /// The smallest class whose items hold `size` bytes; `None` for 0 or more
    /// than a slab. (`key` picks the partition, as in the seed; all
    /// partitions have the same classes.)
    pub fn class_of(&self, _key: u64, size: u64) -> Option<u32> {
        if size == 0 || size > self.slab_size {
            return None;
        }
        self.class_sizes
            .iter()
            .position(|&c| size <= c)
            .map(|c| c as u32)
    }

    /// The item size of a class.
    pub fn class_size(&self, class: u32) -> Option<u64> {
        self.class_sizes.get(class as usize).copied()
    }

    /// An item of `class` from the partition of `key`; `None` when the
    /// partition has no room left for it.
    pub fn alloc(&self, key: u64, class: u32) -> Option<usize> {
        let size = *self.class_sizes.get(class as usize)? as usize;
        let mut part = self.partition(key);
        let part = &mut *part;
        let c = &mut part.classes[class as usize];
        let item = match c.free.pop() {
            Some(item) => item,
            None => {
                // A slab's end fits in a usize (`new` checked the manager's).
                let fits = |&(start, next): &(usize, usize)| {
                    size <= start + self.slab_size as usize - next
                };
                if !c.slabs.last().is_some_and(fits) {
                    let slab = part.next_slab;
                    if slab == part.slabs_end {
                        return None;
                    }
                    part.next_slab += self.slab_size as usize;
                    c.slabs.push((slab, slab));
                }
                let last = c.slabs.last_mut().expect("pushed above");
                let item = last.1;
                last.1 += size;
                item
            }
        };
        c.live.insert(item);
        Some(item)
    }

    /// Returns an item to its class.
    pub fn free(&self, key: u64, addr: usize, class: u32) -> Result<(), FreeError> {
        if class as usize >= SIZE_CLASSES {
            return Err(FreeError::NoSuchClass(class));
        }
        let mut part = self.partition(key);
        let c = &mut part.classes[class as usize];
        if c.live.remove(&addr) {
            c.free.push(addr);
            Ok(())
        } else if c.free.contains(&addr) {
            Err(FreeError::DoubleFree { addr })
        } else {
            Err(FreeError::NotAnItem { addr, class })
        }
    }

    /// The first managed address.
    pub fn base(&self) -> usize {
        self.base
    }

    fn partition(&self, key: u64) -> std::sync::MutexGuard<'_, Partition> {
        let i = (key % self.partitions.len() as u64) as usize;
        // A partition is consistent after every call.
        self.partitions[i].lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MB: u64 = 1 << 20;

    #[test]
    fn the_seed_layout_of_classes() {
        let m = MemManager::new(0x1000_0000, 8 * MB, 1, MB).unwrap();
        assert_eq!(m.class_size(0), Some(1200));
        assert_eq!(m.class_size(1), Some(2400));
        assert_eq!(m.class_of(0, 40), Some(0));
        assert_eq!(m.class_of(0, 1201), Some(1));
        assert_eq!(m.class_of(0, MB), Some(10), "capped at the slab size");
        assert_eq!(m.class_of(0, MB + 1), None);
        assert_eq!(m.class_of(0, 0), None);
    }

    #[test]
    fn exhaustion_is_none_and_frees_are_checked() {
        let m = MemManager::new(0x1000, 2 * MB, 2, MB).unwrap();
        let c = m.class_of(0, MB).unwrap();
        let a = m.alloc(0, c).unwrap();
        assert_eq!(m.alloc(0, c), None, "partition 0 has one slab");
        let b = m.alloc(1, c).unwrap();
        assert_ne!(a, b);
        assert_eq!(
            m.free(0, a + 1, c),
            Err(FreeError::NotAnItem {
                addr: a + 1,
                class: c
            })
        );
        m.free(0, a, c).unwrap();
        assert_eq!(m.free(0, a, c), Err(FreeError::DoubleFree { addr: a }));
        assert_eq!(m.alloc(0, c), Some(a), "a freed item is reused");
    }

    #[test]
    fn a_manager_of_more_than_the_address_space_is_refused_and_a_huge_one_costs_nothing() {
        assert!(MemManager::new(0x1000, u64::MAX, 1, MB).is_none());
        assert!(MemManager::new(usize::MAX - MB as usize, 2 * MB, 1, MB).is_none());
        assert!(MemManager::new(0x1000, 4 * MB, 1, u64::MAX).is_none());
        // 2^62 bytes of slabs: counted out, not listed (a list would not fit
        // in memory and abort the process).
        let m = MemManager::new(0x1000, 1 << 62, 3, FIRST_CLASS_SIZE).unwrap();
        let c = m.class_of(0, 1).unwrap();
        assert_eq!(m.alloc(0, c), Some(0x1000));
        assert_eq!(m.alloc(1, c), Some(0x1000 + (1usize << 62) / 3));
    }

    #[test]
    fn more_partitions_than_slabs_are_refused_before_anything_is_made() {
        assert!(MemManager::new(0x1000, 4 * MB, 5, MB).is_none());
        assert!(MemManager::new(0x1000, 1 << 30, u32::MAX, MB).is_none());
        assert!(MemManager::new(0x1000, 4 * MB, 4, MB).is_some());
    }

    #[test]
    fn a_slab_size_near_the_top_of_u64_keeps_classes_capped() {
        let m = MemManager::new(0x1000, u64::MAX / 2, 1, u64::MAX / 4).unwrap();
        assert_eq!(m.class_size(63), Some(u64::MAX / 4));
    }

    proptest! {
        #[test]
        fn items_never_overlap_and_stay_inside(ops in proptest::collection::vec((0u64..4, 0u64..6000, any::<bool>()), 1..300)) {
            let base = 0x10_0000usize;
            let len = 4 * 64 * 1024u64;
            let m = MemManager::new(base, len, 2, 64 * 1024).unwrap();
            let mut live: Vec<(u64, usize, u32)> = Vec::new();
            for (key, size, free) in ops {
                if free && !live.is_empty() {
                    let (k, a, c) = live.swap_remove((size as usize) % live.len());
                    prop_assert!(m.free(k, a, c).is_ok());
                    continue;
                }
                let Some(c) = m.class_of(key, size) else { continue };
                if let Some(a) = m.alloc(key, c) {
                    let sz = m.class_size(c).unwrap() as usize;
                    prop_assert!(a >= base && a + sz <= base + len as usize);
                    for &(_, b, bc) in &live {
                        let bsz = m.class_size(bc).unwrap() as usize;
                        prop_assert!(a + sz <= b || b + bsz <= a, "{a:#x} overlaps {b:#x}");
                    }
                    live.push((key, a, c));
                }
            }
        }
    }
}
