//! Anonymous private mappings: memory the kernel hands out zeroed (page by
//! page, as it is first touched or pinned), optionally from huge pages.

use std::ptr::NonNull;

const HUGE_PAGE: usize = 2 << 20;

/// An anonymous private mapping, unmapped on drop.
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    huge: bool,
}

// SAFETY: the mapping is plain memory; who may touch which bytes is decided
// by its owners (a memory region, the kv pool's lock, the store's shard
// locks).
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
