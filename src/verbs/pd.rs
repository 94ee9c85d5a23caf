//! Protection domains.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as sys;

use super::device::Context;
use super::error::{Error, Result};
use super::mr::{AccessFlags, MemoryRegion};

pub(crate) struct PdInner {
    pub(crate) pd: NonNull<sys::ibv_pd>,
    pub(crate) ctx: Context,
}

// SAFETY: protection domains may be used from any thread.
unsafe impl Send for PdInner {}
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR and QP holds an Arc to this PD, so none is alive.
        let rc = unsafe { sys::ibv_dealloc_pd(self.pd.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "ibv_dealloc_pd failed: {}",
                std::io::Error::from_raw_os_error(rc)
            );
        }
    }
}

/// A protection domain: memory regions and queue pairs in the same PD may
/// work together. Cheap to clone.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl ProtectionDomain {
    pub(crate) fn new(ctx: &Context) -> Result<ProtectionDomain> {
        // SAFETY: the context is alive.
        let pd = unsafe { sys::ibv_alloc_pd(ctx.as_raw()) };
        let pd = NonNull::new(pd).ok_or_else(|| Error::last_os("ibv_alloc_pd"))?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                pd,
                ctx: ctx.clone(),
            }),
        })
    }

    /// The device this PD belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// The raw `ibv_pd`.
    pub fn as_raw(&self) -> *mut sys::ibv_pd {
        self.inner.pd.as_ptr()
    }

    /// Allocates `len` zeroed, page-aligned bytes and registers them with
    /// `access`. The region owns the memory.
    pub fn allocate(&self, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        MemoryRegion::allocate(self, len, access)
    }

    /// Registers memory the caller owns.
    ///
    /// # Safety
    /// `addr..addr+len` must stay valid, and must not be freed, for as long as
    /// the returned region lives; the device may read or write it whenever a
    /// posted operation or a peer holding the rkey says so.
    pub unsafe fn register_raw(
        &self,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
    ) -> Result<MemoryRegion> {
        MemoryRegion::register_raw(self, addr, len, access)
    }
}
