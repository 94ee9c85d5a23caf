//! Memory registration: regions of memory the device may read and write.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Bound, RangeBounds};
use std::ptr::NonNull;

use bitflags::bitflags;
use rdma_sys as sys;

use super::error::{Error, Result};
use super::pd::ProtectionDomain;
use crate::mapping::Mapping;

bitflags! {
    /// What the device (and remote peers) may do with a memory region, as
    /// `ibv_access_flags`. Remote write and remote atomic need local write.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct AccessFlags: u32 {
        const LOCAL_WRITE = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        const REMOTE_WRITE = sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        const REMOTE_READ = sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        const REMOTE_ATOMIC = sys::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
        /// Memory windows may be bound to the region (see
        /// [`MemoryWindow`](super::MemoryWindow)).
        const MW_BIND = sys::ibv_access_flags::IBV_ACCESS_MW_BIND.0;
    }
}

const PAGE: usize = 4096;

/// Page-aligned, zeroed memory owned by a region.
enum OwnedBuf {
    /// An anonymous mapping: the kernel hands its pages out zeroed as the
    /// device pins them, so nothing writes them first (zeroing by hand was
    /// much of setting up a connection under emulation).
    Mapped(Mapping),
    /// Zeroed here: for regions the device may not write, since pinning
    /// untouched memory read-only could pin the kernel's shared zero page,
    /// which the program's later writes would not reach.
    Heap { ptr: NonNull<u8>, layout: Layout },
}

impl OwnedBuf {
    fn new(len: usize, device_writes: bool) -> Result<OwnedBuf> {
        let failed = |source| Error::Verb {
            verb: "alloc",
            source,
        };
        if device_writes {
            return Mapping::new(len, false)
                .map(OwnedBuf::Mapped)
                .map_err(failed);
        }
        let layout = Layout::from_size_align(len, PAGE)
            .map_err(|_| Error::invalid(format!("{len} bytes is too large to allocate")))?;
        // SAFETY: layout has non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
            .ok_or_else(|| failed(std::io::Error::from_raw_os_error(libc::ENOMEM)))?;
        Ok(OwnedBuf::Heap { ptr, layout })
    }

    fn ptr(&self) -> *mut u8 {
        match self {
            OwnedBuf::Mapped(map) => map.as_ptr(),
            OwnedBuf::Heap { ptr, .. } => ptr.as_ptr(),
        }
    }
}

impl Drop for OwnedBuf {
    fn drop(&mut self) {
        if let OwnedBuf::Heap { ptr, layout } = self {
            // SAFETY: allocated with this layout in `OwnedBuf::new`.
            unsafe { alloc::dealloc(ptr.as_ptr(), *layout) };
        }
    }
}

/// A registered memory region. Holds its protection domain; deregisters on
/// drop, and then frees the memory when it owns it.
pub struct MemoryRegion {
    mr: NonNull<sys::ibv_mr>,
    addr: *mut u8,
    len: usize,
    // Field order matters: the MR is deregistered in Drop before `owned`
    // frees the memory and `_pd` releases the PD.
    owned: Option<OwnedBuf>,
    pd: ProtectionDomain,
}

// SAFETY: the region is plain memory plus a verbs handle usable from any
// thread; `&mut` access goes through `&mut self`.
unsafe impl Send for MemoryRegion {}
unsafe impl Sync for MemoryRegion {}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &self.addr)
            .field("len", &self.len)
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered once.
        let rc = unsafe { sys::ibv_dereg_mr(self.mr.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "ibv_dereg_mr failed: {}",
                std::io::Error::from_raw_os_error(rc)
            );
        }
    }
}

impl MemoryRegion {
    pub(crate) fn allocate(pd: &ProtectionDomain, len: usize, access: AccessFlags) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid("a memory region cannot be empty"));
        }
        let owned = OwnedBuf::new(len, access.contains(AccessFlags::LOCAL_WRITE))?;
        // SAFETY: the memory lives as long as the region, which owns it.
        let mut mr = unsafe { Self::register_raw(pd, owned.ptr(), len, access)? };
        mr.owned = Some(owned);
        Ok(mr)
    }

    /// # Safety
    /// See [`ProtectionDomain::register_raw`].
    pub(crate) unsafe fn register_raw(
        pd: &ProtectionDomain,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<Self> {
        if addr.is_null() || len == 0 {
            return Err(Error::invalid("cannot register a NULL or empty buffer"));
        }
        let needs_local_write = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
        if access.intersects(needs_local_write) && !access.contains(AccessFlags::LOCAL_WRITE) {
            return Err(Error::invalid(
                "remote write and remote atomic access require LOCAL_WRITE",
            ));
        }
        let mr = sys::ibv_reg_mr(pd.as_raw(), addr.cast(), len, access.bits() as i32);
        let mr = NonNull::new(mr).ok_or_else(|| Error::last_os("ibv_reg_mr"))?;
        Ok(MemoryRegion {
            mr,
            addr,
            len,
            owned: None,
            pd: pd.clone(),
        })
    }

    /// The raw `ibv_mr`.
    pub fn as_raw(&self) -> *mut sys::ibv_mr {
        self.mr.as_ptr()
    }

    /// The protection domain the region is registered in.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// Start address of the region.
    pub fn addr(&self) -> u64 {
        self.addr as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region has no bytes (never true: empty regions are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Local key, for scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is alive.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    /// Remote key, for peers' RDMA READ, WRITE and atomics.
    pub fn rkey(&self) -> u32 {
        // SAFETY: the MR is alive.
        unsafe { (*self.mr.as_ptr()).rkey }
    }

    /// The bytes of the region. Reading while a posted operation writes here
    /// sees partial data: wait for its completion first.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: addr..addr+len is valid for the region's life.
        unsafe { std::slice::from_raw_parts(self.addr, self.len) }
    }

    /// Appends `range` of the region to `dst`, without forming a Rust
    /// reference to memory a peer may be writing right now: the one read of
    /// bytes that arrived remotely, after which they are ours. Returns false
    /// (and copies nothing) when the range is outside the region.
    pub fn copy_out(&self, range: std::ops::Range<usize>, dst: &mut Vec<u8>) -> bool {
        if range.start > range.end || range.end > self.len {
            return false;
        }
        let n = range.end - range.start;
        dst.reserve(n);
        // SAFETY: the destination has `n` bytes of spare capacity, which
        // the copy fills before they count as the vector's.
        unsafe {
            let copied = self.read_raw(range.start, n, dst.as_mut_ptr().add(dst.len()));
            debug_assert!(copied);
            dst.set_len(dst.len() + n);
        }
        true
    }

    /// Copies `dst.len()` bytes from offset `at` of the region into `dst`,
    /// as [`MemoryRegion::copy_out`] does; false (nothing copied) when they
    /// are not all inside the region.
    pub fn copy_out_to(&self, at: usize, dst: &mut [u8]) -> bool {
        // SAFETY: `dst` is ours and `dst.len()` long.
        unsafe { self.read_raw(at, dst.len(), dst.as_mut_ptr()) }
    }

    /// Copies `n` bytes at `at` of the region to `dst` if they are all
    /// inside it (else false, nothing copied), without forming a Rust
    /// reference to memory a peer may be writing: a racing remote write can
    /// change which bytes are copied, never where they go.
    ///
    /// # Safety
    /// `dst` must be valid for `n` bytes of writes.
    unsafe fn read_raw(&self, at: usize, n: usize, dst: *mut u8) -> bool {
        match at.checked_add(n) {
            Some(end) if end <= self.len => {
                std::ptr::copy_nonoverlapping(self.addr.add(at), dst, n);
                true
            }
            _ => false,
        }
    }

    /// The bytes of the region, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` excludes other Rust borrows.
        unsafe { std::slice::from_raw_parts_mut(self.addr, self.len) }
    }

    /// A scatter/gather entry for `range` of this region.
    ///
    /// # Panics
    /// When the range is out of bounds or longer than 4 GiB, as slicing does.
    pub fn sge(&self, range: impl RangeBounds<usize>) -> Sge {
        let (start, end) = bounds(range, self.len);
        let length = u32::try_from(end - start).expect("one SGE covers at most 4 GiB - 1");
        Sge {
            addr: self.addr() + start as u64,
            length,
            lkey: self.lkey(),
        }
    }

    /// What a peer needs to READ, WRITE or run atomics on this region.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.addr(),
            len: self.len as u64,
            rkey: self.rkey(),
        }
    }
}

fn bounds(range: impl RangeBounds<usize>, len: usize) -> (usize, usize) {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s + 1,
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e + 1,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    assert!(
        start <= end && end <= len,
        "range {start}..{end} out of bounds of a {len}-byte region"
    );
    (start, end)
}

/// A scatter/gather entry, laid out exactly as `struct ibv_sge`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

impl Sge {
    /// Fills the unused places of arrays of SGEs; never posted.
    pub const EMPTY: Sge = Sge {
        addr: 0,
        length: 0,
        lkey: 0,
    };
}

/// Size of [`RemoteRegion::to_bytes`].
pub const REMOTE_REGION_WIRE_LEN: usize = 20;

/// A peer's registered memory, as it was advertised to us.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteRegion {
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
}

impl RemoteRegion {
    /// The remote address `offset` bytes into the region.
    ///
    /// # Panics
    /// When `offset` is beyond the region.
    pub fn at(&self, offset: u64) -> RemoteAddr {
        assert!(
            offset <= self.len,
            "offset {offset} beyond a {}-byte remote region",
            self.len
        );
        RemoteAddr {
            addr: self.addr + offset,
            rkey: self.rkey,
        }
    }

    /// Big-endian encoding, for exchange with a peer.
    pub fn to_bytes(&self) -> [u8; REMOTE_REGION_WIRE_LEN] {
        let mut b = [0; REMOTE_REGION_WIRE_LEN];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..16].copy_from_slice(&self.len.to_be_bytes());
        b[16..].copy_from_slice(&self.rkey.to_be_bytes());
        b
    }

    /// Decodes [`RemoteRegion::to_bytes`].
    pub fn from_bytes(b: &[u8]) -> Result<RemoteRegion> {
        if b.len() != REMOTE_REGION_WIRE_LEN {
            return Err(Error::invalid(format!(
                "a remote region is {} bytes, got {}",
                REMOTE_REGION_WIRE_LEN,
                b.len()
            )));
        }
        Ok(RemoteRegion {
            addr: u64::from_be_bytes(b[..8].try_into().expect("8 bytes")),
            len: u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")),
            rkey: u32::from_be_bytes(b[16..].try_into().expect("4 bytes")),
        })
    }
}

/// One remote address with the key that grants access to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteAddr {
    pub addr: u64,
    pub rkey: u32,
}
