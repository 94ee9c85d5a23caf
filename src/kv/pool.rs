//! The slab pool values up to [`SLAB_PAGE`] live in.
//!
//! The pool is one mapping registered once per device. It is cut into
//! [`SLAB_PAGE`] pages, each given to one size class (powers of two from
//! [`MIN_CLASS`]) and carved into chunks; allocation and free are O(1).
//! A freed chunk is first invalidated (its block magic cleared) and then
//! waits out [`QUARANTINE`] before reuse, so a client that read its index
//! slot just before the free still finds the old bytes; a reader that loses
//! that race anyway sees a checksum mismatch (see `proto::verify_block`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use crate::mapping::Mapping;

/// Slab page, and the largest size class.
pub const SLAB_PAGE: usize = 2 << 20;
pub const MIN_CLASS: usize = 64;
/// How long a freed chunk rests before it is handed out again (unless the
/// pool has nothing else).
pub const QUARANTINE: Duration = Duration::from_secs(1);

/// A chunk of the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub offset: usize,
    pub class: usize,
}

struct Class {
    size: usize,
    free: Vec<usize>,
    quarantine: VecDeque<(Instant, usize)>,
}

struct Slabs {
    next_page: usize,
    classes: Vec<Class>,
}

/// The slab pool.
pub struct Pool {
    mem: Mapping,
    slabs: Mutex<Slabs>,
    used: AtomicU64,
}

impl Pool {
    /// A pool of `len` bytes (rounded up to whole slab pages, at least one).
    pub fn new(len: usize, huge: bool) -> std::io::Result<Pool> {
        let len = len
            .div_ceil(SLAB_PAGE)
            .max(1)
            .checked_mul(SLAB_PAGE)
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("a pool of {len} bytes passes the address space"),
                )
            })?;
        let mem = Mapping::new(len, huge)?;
        let mut classes = Vec::new();
        let mut size = MIN_CLASS;
        while size <= SLAB_PAGE {
            classes.push(Class {
                size,
                free: Vec::new(),
                quarantine: VecDeque::new(),
            });
            size *= 2;
        }
        Ok(Pool {
            mem,
            slabs: Mutex::new(Slabs {
                next_page: 0,
                classes,
            }),
            used: AtomicU64::new(0),
        })
    }

    pub fn mapping(&self) -> &Mapping {
        &self.mem
    }

    /// Bytes handed out (by class size).
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    pub fn class_size(&self, class: usize) -> usize {
        MIN_CLASS << class
    }

    /// A chunk of at least `len` bytes, or `None` when `len` exceeds the
    /// largest class or the pool is exhausted.
    pub fn alloc(&self, len: usize) -> Option<Chunk> {
        if len > SLAB_PAGE {
            return None;
        }
        let class = len.max(MIN_CLASS).next_power_of_two().trailing_zeros() as usize
            - MIN_CLASS.trailing_zeros() as usize;
        let mut slabs = self.slabs.lock().expect("pool lock");
        let now = Instant::now();
        let c = &mut slabs.classes[class];
        // A chunk whose rest is over is taken straight from the quarantine,
        // not moved to the free list first: that list then grows only when
        // a page is carved, never in the steady state of a stream of PUTs.
        let rested = c
            .quarantine
            .front()
            .is_some_and(|&(at, _)| now.duration_since(at) >= QUARANTINE);
        let taken = match rested {
            true => c.quarantine.pop_front().map(|(_, off)| off),
            false => c.free.pop(),
        };
        let offset = match taken {
            Some(off) => off,
            None if slabs.next_page + SLAB_PAGE <= self.mem.len() => {
                let page = slabs.next_page;
                slabs.next_page += SLAB_PAGE;
                let c = &mut slabs.classes[class];
                c.free
                    .extend((page..page + SLAB_PAGE).step_by(c.size).skip(1).rev());
                page
            }
            // Out of fresh memory: reuse a chunk still resting rather than
            // fail; readers detect the reuse by checksum.
            None => slabs.classes[class].quarantine.pop_front()?.1,
        };
        self.used
            .fetch_add(self.class_size(class) as u64, Ordering::Relaxed);
        Some(Chunk { offset, class })
    }

    /// Returns a chunk: its block is invalidated and its key and value
    /// cleared at once (every client may READ the pool, and a deleted value
    /// must not stay readable), its memory reused after the quarantine.
    pub fn free(&self, chunk: Chunk) {
        // SAFETY: the chunk was ours and nobody else writes it now.
        unsafe {
            self.mem
                .bytes_mut(chunk.offset, self.class_size(chunk.class))
        }
        .fill(0);
        self.used
            .fetch_sub(self.class_size(chunk.class) as u64, Ordering::Relaxed);
        self.slabs.lock().expect("pool lock").classes[chunk.class]
            .quarantine
            .push_back((Instant::now(), chunk.offset));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_distinct_and_sized() {
        let pool = Pool::new(4 * SLAB_PAGE, false).unwrap();
        let a = pool.alloc(100).unwrap();
        let b = pool.alloc(100).unwrap();
        assert_eq!(pool.class_size(a.class), 128);
        assert_ne!(a.offset, b.offset);
        assert!(a.offset.abs_diff(b.offset) >= 128);
        let big = pool.alloc(SLAB_PAGE).unwrap();
        assert_eq!(big.offset % SLAB_PAGE, 0);
        assert!(pool.alloc(SLAB_PAGE + 1).is_none());
    }

    #[test]
    fn freed_chunks_rest_before_reuse_unless_memory_runs_out() {
        let pool = Pool::new(SLAB_PAGE, false).unwrap();
        let whole = pool.alloc(SLAB_PAGE).unwrap();
        pool.free(whole);
        // The only page rests in quarantine, but nothing else is left.
        assert_eq!(pool.alloc(SLAB_PAGE), Some(whole));
        assert!(pool.alloc(64).is_none());
    }

    #[test]
    fn rested_chunks_are_reused_without_growing_the_free_list() {
        let pool = Pool::new(SLAB_PAGE, false).unwrap();
        // A page carved into 8: 7 go to the free list, and all 8 are out.
        let all: Vec<Chunk> = (0..8).map(|_| pool.alloc(SLAB_PAGE / 8).unwrap()).collect();
        let class = all[0].class;
        let capacity = pool.slabs.lock().unwrap().classes[class].free.capacity();
        for c in &all {
            pool.free(*c);
        }
        std::thread::sleep(QUARANTINE);
        // All 8 rested: an alloc takes the first freed, and leaves the other
        // 7 where they are rather than move them to a list of room for 7.
        assert_eq!(pool.alloc(SLAB_PAGE / 8), Some(all[0]));
        let slabs = pool.slabs.lock().unwrap();
        assert_eq!(slabs.classes[class].free.len(), 0);
        assert_eq!(slabs.classes[class].free.capacity(), capacity);
        assert_eq!(slabs.classes[class].quarantine.len(), 7);
    }

    #[test]
    fn a_freed_chunk_is_cleared_whole() {
        let pool = Pool::new(SLAB_PAGE, false).unwrap();
        let c = pool.alloc(200).unwrap();
        let size = pool.class_size(c.class);
        // SAFETY: the chunk is ours.
        unsafe { pool.mem.bytes_mut(c.offset, size) }.fill(0xab);
        pool.free(c);
        // SAFETY: nobody else uses the pool.
        let after = unsafe { pool.mem.bytes_mut(c.offset, size) };
        assert!(after.iter().all(|&b| b == 0), "stale bytes after free");
    }
}
