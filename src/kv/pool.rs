//! Server memory: anonymous mappings (huge pages on request) and the slab
//! pool values up to [`SLAB_PAGE`] live in.
//!
//! The pool is one mapping registered once per device. It is cut into
//! [`SLAB_PAGE`] pages, each given to one size class (powers of two from
//! [`MIN_CLASS`]) and carved into chunks; allocation and free are O(1).
//! A freed chunk is first invalidated (its block magic cleared) and then
//! waits out [`QUARANTINE`] before reuse, so a client that read its index
//! slot just before the free still finds the old bytes; a reader that loses
//! that race anyway sees a checksum mismatch (see `proto::verify_block`).

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Slab page, and the largest size class.
pub const SLAB_PAGE: usize = 2 << 20;
pub const MIN_CLASS: usize = 64;
/// How long a freed chunk rests before it is handed out again (unless the
/// pool has nothing else).
pub const QUARANTINE: Duration = Duration::from_secs(1);
const HUGE_PAGE: usize = 2 << 20;

/// An anonymous private mapping, unmapped on drop.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    huge: bool,
}

// SAFETY: the mapping is plain memory; who may touch which bytes is decided
// by its owners (the pool's lock, the store's shard locks).
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` zeroed bytes; with `huge`, from 2 MiB huge pages, falling
    /// back to normal pages (with a warning) when none are available.
    pub fn new(len: usize, huge: bool) -> std::io::Result<Mapping> {
        let len = len.max(1);
        if huge {
            let rounded = len.div_ceil(HUGE_PAGE) * HUGE_PAGE;
            match Self::map(rounded, libc::MAP_HUGETLB) {
                Ok(ptr) => {
                    return Ok(Mapping {
                        ptr,
                        len: rounded,
                        huge: true,
                    })
                }
                Err(e) => log::warn!(
                    "no huge pages for {} MiB ({e}); using normal pages (reserve some in \
                     /proc/sys/vm/nr_hugepages)",
                    rounded >> 20
                ),
            }
        }
        let ptr = Self::map(len, 0)?;
        Ok(Mapping {
            ptr,
            len,
            huge: false,
        })
    }

    fn map(len: usize, extra: i32) -> std::io::Result<NonNull<u8>> {
        // SAFETY: an anonymous private mapping touches no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | extra,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(NonNull::new(p.cast()).expect("mmap returned NULL"))
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_huge(&self) -> bool {
        self.huge
    }

    /// The bytes `[offset, offset+len)`.
    ///
    /// # Safety
    /// No other thread may access the range meanwhile (the device may read
    /// it: readers verify checksums).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        assert!(offset + len <= self.len, "range outside the mapping");
        std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we own the mapping; registrations of it are gone first
        // (they are dropped before the mapping by their owners).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

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
        let len = len.div_ceil(SLAB_PAGE).max(1) * SLAB_PAGE;
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
        while let Some(&(at, off)) = c.quarantine.front() {
            if now.duration_since(at) < QUARANTINE {
                break;
            }
            c.quarantine.pop_front();
            c.free.push(off);
        }
        let offset = match c.free.pop() {
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

    /// Returns a chunk: its block is invalidated at once, its memory reused
    /// after the quarantine.
    pub fn free(&self, chunk: Chunk) {
        // SAFETY: the chunk was ours and nobody else writes it now.
        unsafe { self.mem.bytes_mut(chunk.offset, 4) }.fill(0);
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
}
