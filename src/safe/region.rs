//! Typed memory regions and the segments lent out of them.
//!
//! A region's memory is registered for local access and memory-window binds
//! only: a peer reaches it solely through an [`Offer`](super::Offer), which
//! holds the offered segment. So a segment the program holds is touched by
//! nobody else, and reading it as a slice is sound: read-only segments may
//! overlap, a read-write one overlaps nothing, and a posted operation owns
//! its segments until its completion arrives.

use std::mem::ManuallyDrop;
use std::ops::{Bound, Range, RangeBounds};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

use bytemuck::Pod;

use super::error::{Error, Result};
use super::segments::{HoldId, SegmentError, SegmentSet};
use crate::verbs::{self, AccessFlags, Sge};

/// A protection domain of the safe layer: regions, completion queues and
/// queue pairs are made from it. Cheap to clone.
#[derive(Clone)]
pub struct ProtectionDomain {
    pd: verbs::ProtectionDomain,
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.pd.context().name())
            .finish()
    }
}

/// The alignment an allocated region's memory (an anonymous mapping) is
/// sure to have: the smallest page.
const PAGE_ALIGN: usize = 4096;

/// The remote rights an offer may grant.
const REMOTE: AccessFlags = AccessFlags::REMOTE_READ
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_ATOMIC);

impl ProtectionDomain {
    /// Opens a device (by name, or the default one: `SNOWRDMA_DEVICE`, else
    /// the first) and allocates a protection domain on it. It serves both
    /// manual connections and RDMA CM ([`Listener`](super::Listener),
    /// [`connect`](super::connect)) on that device.
    pub fn open(device: Option<&str>) -> Result<ProtectionDomain> {
        Self::new(&verbs::Context::open_with_cm(device)?)
    }

    /// A protection domain on an open device (for RDMA CM, one from
    /// [`verbs::Context::open_with_cm`]).
    pub fn new(ctx: &verbs::Context) -> Result<ProtectionDomain> {
        Ok(ProtectionDomain {
            pd: ctx.alloc_pd()?,
        })
    }

    /// The verbs-layer protection domain: the escape hatch.
    pub fn verbs(&self) -> &verbs::ProtectionDomain {
        &self.pd
    }

    /// Allocates `n` zeroed elements of `T`. `remote` says what peers may
    /// be offered (any of REMOTE_READ, REMOTE_WRITE, REMOTE_ATOMIC; empty:
    /// the region stays local). `T` is plain old data; anything that owns
    /// memory or has invalid bit patterns does not compile:
    ///
    /// ```compile_fail
    /// # fn f(pd: &snowrdma::safe::ProtectionDomain) {
    /// let _ = pd.allocate::<String>(4, snowrdma::safe::AccessFlags::empty());
    /// # }
    /// ```
    pub fn allocate<T: Pod + Send + Sync>(
        &self,
        n: usize,
        remote: AccessFlags,
    ) -> Result<MemoryRegion<T>> {
        let bytes = n
            .checked_mul(std::mem::size_of::<T>())
            .filter(|&b| b > 0)
            .ok_or_else(|| Error::invalid(format!("cannot allocate {n} elements")))?;
        // The memory is mapped: aligned to a page, and no more.
        if std::mem::align_of::<T>() > PAGE_ALIGN {
            return Err(Error::invalid(format!(
                "{} is aligned to {} bytes; allocated regions are aligned to {PAGE_ALIGN}",
                std::any::type_name::<T>(),
                std::mem::align_of::<T>()
            )));
        }
        check_remote(remote)?;
        let mr = self.pd.allocate(bytes, local_access())?;
        Ok(MemoryRegion::new(mr, None, n, remote))
    }

    /// Registers memory the program owns; [`MemoryRegion::into_inner`] gives
    /// it back once no segment is left.
    pub fn register<T: Pod + Send + Sync>(
        &self,
        data: impl Into<Box<[T]>>,
        remote: AccessFlags,
    ) -> Result<MemoryRegion<T>> {
        check_remote(remote)?;
        let data: Box<[T]> = data.into();
        let n = data.len();
        if n == 0 || std::mem::size_of::<T>() == 0 {
            return Err(Error::invalid("cannot register an empty buffer"));
        }
        let raw = NonNull::from(Box::leak(data));
        // SAFETY: the memory is leaked into the region, which frees it only
        // after deregistering (RegionInner::drop, MemoryRegion::into_inner).
        let mr = unsafe {
            self.pd.register_raw(
                raw.as_ptr().cast(),
                std::mem::size_of_val(raw.as_ref()),
                local_access(),
            )
        };
        match mr {
            Ok(mr) => Ok(MemoryRegion::new(mr, Some(raw), n, remote)),
            Err(e) => {
                // SAFETY: leaked above and not registered.
                drop(unsafe { Box::from_raw(raw.as_ptr()) });
                Err(e.into())
            }
        }
    }
}

fn check_remote(remote: AccessFlags) -> Result<()> {
    if REMOTE.contains(remote) {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{remote:?}: only remote rights can be given, local write is always on"
        )))
    }
}

/// Local write for the device, window binds for offers; no remote rights on
/// the region itself.
fn local_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND
}

pub(crate) struct RegionInner<T> {
    mr: Option<verbs::MemoryRegion>,
    /// Registered program memory, freed after `mr` is deregistered.
    boxed: Option<NonNull<[T]>>,
    segs: Mutex<SegmentSet>,
    len: usize,
    remote: AccessFlags,
}

// SAFETY: the memory is only reached through segments, whose holds the
// mutex serialises; `T: Send + Sync`.
unsafe impl<T: Send + Sync> Send for RegionInner<T> {}
unsafe impl<T: Send + Sync> Sync for RegionInner<T> {}

impl<T> Drop for RegionInner<T> {
    fn drop(&mut self) {
        drop(self.mr.take());
        if let Some(b) = self.boxed.take() {
            // SAFETY: leaked in `register`, deregistered just above.
            drop(unsafe { Box::from_raw(b.as_ptr()) });
        }
    }
}

impl<T> RegionInner<T> {
    fn segs(&self) -> MutexGuard<'_, SegmentSet> {
        // The set is consistent after every call, so a panic elsewhere does
        // not spoil it.
        self.segs.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn mr(&self) -> &verbs::MemoryRegion {
        self.mr.as_ref().expect("registered while the region lives")
    }
}

/// Releases one hold of any region, whatever its element type: what a batch
/// or a cancelled operation keeps until the device is done.
pub trait Holder: Send + Sync {
    fn release(&self, id: HoldId);
}

impl<T: Send + Sync> Holder for RegionInner<T> {
    fn release(&self, id: HoldId) {
        self.segs().release(id);
    }
}

/// A hold of any region (or anything else that must outlive an operation),
/// released on drop.
pub struct RawHold {
    owner: Arc<dyn Holder>,
    id: HoldId,
}

impl RawHold {
    /// Keeps a shared object alive until the hold drops.
    pub(crate) fn shared(owner: Arc<dyn Holder>) -> RawHold {
        RawHold {
            owner,
            id: HoldId::NONE,
        }
    }

    /// Keeps `thing` alive until the hold drops.
    pub(crate) fn keep<K: Send + Sync + 'static>(thing: K) -> RawHold {
        struct Keep<K>(K);
        impl<K: Send + Sync> Holder for Keep<K> {
            fn release(&self, _: HoldId) {}
        }
        RawHold {
            owner: Arc::new(Keep(thing)),
            id: HoldId::NONE,
        }
    }
}

impl Drop for RawHold {
    fn drop(&mut self) {
        self.owner.release(self.id);
    }
}

/// A registered region of `n` elements of `T`. Cheap to clone; the memory
/// lives while a clone or a segment does.
pub struct MemoryRegion<T> {
    inner: Arc<RegionInner<T>>,
}

impl<T> Clone for MemoryRegion<T> {
    fn clone(&self) -> Self {
        MemoryRegion {
            inner: self.inner.clone(),
        }
    }
}

impl<T> std::fmt::Debug for MemoryRegion<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("len", &self.inner.len)
            .field("segments", &*self.inner.segs())
            .finish()
    }
}

impl<T: Pod + Send + Sync> MemoryRegion<T> {
    fn new(
        mr: verbs::MemoryRegion,
        boxed: Option<NonNull<[T]>>,
        len: usize,
        remote: AccessFlags,
    ) -> Self {
        MemoryRegion {
            inner: Arc::new(RegionInner {
                mr: Some(mr),
                boxed,
                segs: Mutex::default(),
                len,
                remote,
            }),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The remote rights offers of this region may grant.
    pub fn remote_access(&self) -> AccessFlags {
        self.inner.remote
    }

    /// A read-only segment: it may overlap other read-only ones, not a
    /// read-write one.
    pub fn ro(&self, range: impl RangeBounds<usize>) -> Result<RoSegment<T>, SegmentError> {
        self.take(range, false).map(|raw| RoSegment { raw })
    }

    /// A read-write segment: it overlaps no other segment.
    pub fn rw(&self, range: impl RangeBounds<usize>) -> Result<RwSegment<T>, SegmentError> {
        self.take(range, true).map(|raw| RwSegment { raw })
    }

    fn take(&self, range: impl RangeBounds<usize>, rw: bool) -> Result<Seg<T>, SegmentError> {
        let range = to_range(range, self.inner.len);
        let id = self.inner.segs().take(range.clone(), rw, self.inner.len)?;
        Ok(Seg {
            region: self.inner.clone(),
            id,
            range,
        })
    }

    /// The memory of a region made by [`ProtectionDomain::register`], once
    /// no segment and no other clone is left; else the region comes back.
    pub fn into_inner(self) -> std::result::Result<Box<[T]>, MemoryRegion<T>> {
        match Arc::try_unwrap(self.inner) {
            Ok(mut inner) if inner.boxed.is_some() => {
                drop(inner.mr.take());
                let b = inner.boxed.take().expect("checked above");
                // SAFETY: leaked in `register`; deregistered just above.
                Ok(unsafe { Box::from_raw(b.as_ptr()) })
            }
            Ok(inner) => Err(MemoryRegion {
                inner: Arc::new(inner),
            }),
            Err(inner) => Err(MemoryRegion { inner }),
        }
    }

    /// Whether the region's memory is still alive somewhere (in a segment, an
    /// operation in flight or a clone) once this handle is dropped: for
    /// tests that watch a cancelled operation release its memory.
    pub fn downgrade(&self) -> WeakRegion {
        WeakRegion(Arc::downgrade(&self.inner) as std::sync::Weak<dyn Holder>)
    }
}

/// A weak reference to a region: [`WeakRegion::is_alive`] says whether its
/// memory still exists.
pub struct WeakRegion(std::sync::Weak<dyn Holder>);

impl WeakRegion {
    pub fn is_alive(&self) -> bool {
        self.0.strong_count() > 0
    }
}

fn to_range(range: impl RangeBounds<usize>, len: usize) -> Range<usize> {
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    start..end
}

/// One hold with its region; releases the hold on drop.
struct Seg<T: Send + Sync> {
    region: Arc<RegionInner<T>>,
    id: HoldId,
    range: Range<usize>,
}

impl<T: Send + Sync> Drop for Seg<T> {
    fn drop(&mut self) {
        self.region.release(self.id);
    }
}

impl<T: Pod + Send + Sync> Seg<T> {
    fn ptr(&self) -> *mut T {
        let base = self.region.mr().addr() as usize as *mut T;
        // SAFETY: the range is inside the region (checked by the set).
        unsafe { base.add(self.range.start) }
    }

    fn bytes(&self) -> usize {
        self.range.len() * std::mem::size_of::<T>()
    }

    fn sge(&self) -> Sge {
        Sge {
            addr: self.ptr() as u64,
            length: u32::try_from(self.bytes()).unwrap_or(u32::MAX),
            lkey: self.region.mr().lkey(),
        }
    }

    fn into_hold(self) -> RawHold {
        let me = ManuallyDrop::new(self);
        // SAFETY: `me` is never dropped, so the Arc moves out exactly once;
        // the range needs no drop.
        let region = unsafe { std::ptr::read(&me.region) };
        RawHold {
            owner: region,
            id: me.id,
        }
    }
}

/// A read-only segment: the program and the device may read it, nobody
/// writes it while it lives. Clone it to read the same elements twice.
pub struct RoSegment<T: Send + Sync> {
    raw: Seg<T>,
}

/// A read-write segment: nothing else overlaps it while it lives.
pub struct RwSegment<T: Send + Sync> {
    raw: Seg<T>,
}

impl<T: Pod + Send + Sync> Clone for RoSegment<T> {
    fn clone(&self) -> Self {
        let r = &self.raw;
        let id = r
            .region
            .segs()
            .take(r.range.clone(), false, r.region.len)
            .expect("read-only holds of a held read-only range never clash");
        RoSegment {
            raw: Seg {
                region: r.region.clone(),
                id,
                range: r.range.clone(),
            },
        }
    }
}

impl<T: Pod + Send + Sync> RoSegment<T> {
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: the hold keeps writers (local and remote) off the range.
        unsafe { std::slice::from_raw_parts(self.raw.ptr(), self.raw.range.len()) }
    }

    /// The elements of the region this segment covers.
    pub fn range(&self) -> Range<usize> {
        self.raw.range.clone()
    }
}

impl<T: Pod + Send + Sync> RwSegment<T> {
    pub fn as_slice(&self) -> &[T] {
        // SAFETY: the hold keeps everyone else off the range.
        unsafe { std::slice::from_raw_parts(self.raw.ptr(), self.raw.range.len()) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, and `&mut self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.raw.ptr(), self.raw.range.len()) }
    }

    /// The elements of the region this segment covers.
    pub fn range(&self) -> Range<usize> {
        self.raw.range.clone()
    }

    /// The same range, read-only from now on (other read-only segments may
    /// then overlap it).
    pub fn freeze(self) -> RoSegment<T> {
        self.raw.region.segs().freeze(self.raw.id);
        RoSegment { raw: self.raw }
    }
}

/// Memory an operation may take: either kind of segment, or [`NoBuffer`].
///
/// Its methods are the library's: each takes a token, which
/// only this crate can make, so no program reaches through a segment to
/// its region's whole registration (`offer_parts` hands out the region
/// itself, whose bytes other segments may be writing):
///
/// ```compile_fail
/// use snowrdma::safe::Local;
/// fn whole_region<L: Local>(seg: &L) -> &[u8] {
///     seg.offer_parts().unwrap().0.as_slice()
/// }
/// ```
///
/// nor makes a token:
///
/// ```compile_fail
/// use snowrdma::safe::Local;
/// fn whole_region<L: Local>(seg: &L) -> &[u8] {
///     seg.offer_parts(Default::default()).unwrap().0.as_slice()
/// }
/// ```
pub trait Local: Send + Sync + 'static + sealed::Sealed {
    #[doc(hidden)]
    fn sge(&self, _: sealed::Token) -> Option<Sge>;
    /// Moves what keeps the memory alive (and off limits) into `into`.
    #[doc(hidden)]
    fn park(self, into: &mut Vec<RawHold>, _: sealed::Token);
    /// The region, byte range and the most remote rights an offer of this
    /// memory may grant.
    #[doc(hidden)]
    fn offer_parts(
        &self,
        _: sealed::Token,
    ) -> Option<(&verbs::MemoryRegion, Range<usize>, AccessFlags)>;
}

/// Memory the device may write: a read-write segment (or no memory at all,
/// for a receive that takes only an immediate).
pub trait Writable: Local {}

/// A segment of exactly one `u64`, the target of an atomic's old value.
pub trait AtomicTarget: Writable {}

/// No memory: a receive of a zero-length message or of a WRITE WITH IMM's
/// immediate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoBuffer;

pub(crate) use sealed::TOKEN;

pub(crate) mod sealed {
    pub trait Sealed {}

    /// Proof that a caller of [`super::Local`]'s methods is this crate.
    #[derive(Clone, Copy)]
    pub struct Token(());

    pub(crate) const TOKEN: Token = Token(());
}

impl sealed::Sealed for NoBuffer {}
impl<T: Pod + Send + Sync> sealed::Sealed for RoSegment<T> {}
impl<T: Pod + Send + Sync> sealed::Sealed for RwSegment<T> {}

impl Local for NoBuffer {
    fn sge(&self, _: sealed::Token) -> Option<Sge> {
        None
    }
    fn park(self, _: &mut Vec<RawHold>, _: sealed::Token) {}
    fn offer_parts(
        &self,
        _: sealed::Token,
    ) -> Option<(&verbs::MemoryRegion, Range<usize>, AccessFlags)> {
        None
    }
}

impl Writable for NoBuffer {}

impl<T: Pod + Send + Sync> Seg<T> {
    fn offer_parts(&self, rw: bool) -> (&verbs::MemoryRegion, Range<usize>, AccessFlags) {
        let size = std::mem::size_of::<T>();
        let bytes = self.range.start * size..self.range.end * size;
        let most = if rw {
            self.region.remote
        } else {
            self.region.remote & AccessFlags::REMOTE_READ
        };
        (self.region.mr(), bytes, most)
    }
}

impl<T: Pod + Send + Sync> Local for RoSegment<T> {
    fn sge(&self, _: sealed::Token) -> Option<Sge> {
        Some(self.raw.sge())
    }
    fn park(self, into: &mut Vec<RawHold>, _: sealed::Token) {
        into.push(self.raw.into_hold());
    }
    fn offer_parts(
        &self,
        _: sealed::Token,
    ) -> Option<(&verbs::MemoryRegion, Range<usize>, AccessFlags)> {
        Some(self.raw.offer_parts(false))
    }
}

impl<T: Pod + Send + Sync> Local for RwSegment<T> {
    fn sge(&self, _: sealed::Token) -> Option<Sge> {
        Some(self.raw.sge())
    }
    fn park(self, into: &mut Vec<RawHold>, _: sealed::Token) {
        into.push(self.raw.into_hold());
    }
    fn offer_parts(
        &self,
        _: sealed::Token,
    ) -> Option<(&verbs::MemoryRegion, Range<usize>, AccessFlags)> {
        Some(self.raw.offer_parts(true))
    }
}

impl<T: Pod + Send + Sync> Writable for RwSegment<T> {}
impl AtomicTarget for RwSegment<u64> {}

impl<T: Pod + Send + Sync> std::fmt::Debug for RoSegment<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RoSegment({:?})", self.raw.range)
    }
}

impl<T: Pod + Send + Sync> std::fmt::Debug for RwSegment<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RwSegment({:?})", self.raw.range)
    }
}
