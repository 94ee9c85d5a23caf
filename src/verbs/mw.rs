//! Memory windows (type 2): remote access to part of a memory region that
//! only one queue pair can use. A region registered without remote access
//! (but with [`AccessFlags::MW_BIND`]) is exposed to one peer by binding a
//! window to that peer's QP; another QP in the same protection domain that
//! presents the window's rkey gets a remote access error from the NIC.

use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as sys;

use super::error::{check_code, Error, Result};
use super::mr::{AccessFlags, MemoryRegion, RemoteRegion};
use super::pd::{PdInner, ProtectionDomain};
use super::qp::QueuePair;

/// A type-2 memory window. Unbound when allocated; [`QueuePair::post_bind`]
/// binds it. Dropping it invalidates whatever it exposed.
pub struct MemoryWindow {
    mw: NonNull<sys::ibv_mw>,
    _pd: Arc<PdInner>,
}

// SAFETY: the window is a kernel/provider object usable from any thread;
// binding goes through a QP's send queue, which serialises it.
unsafe impl Send for MemoryWindow {}
unsafe impl Sync for MemoryWindow {}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: ours, deallocated once.
        let rc = unsafe { sys::ibv_dealloc_mw(self.mw.as_ptr()) };
        if rc != 0 {
            log::warn!(
                "ibv_dealloc_mw failed: {}",
                std::io::Error::from_raw_os_error(rc)
            );
        }
    }
}

impl ProtectionDomain {
    /// Allocates a type-2 memory window in this PD.
    pub fn alloc_mw(&self) -> Result<MemoryWindow> {
        // SAFETY: the PD is alive.
        let mw = unsafe { sys::ibv_alloc_mw(self.as_raw(), sys::ibv_mw_type::IBV_MW_TYPE_2) };
        let mw = mw
            .and_then(NonNull::new)
            .ok_or_else(|| Error::last_os("ibv_alloc_mw"))?;
        Ok(MemoryWindow {
            mw,
            _pd: self.inner.clone(),
        })
    }
}

/// The rkey a window gets at its next bind: the same index with the
/// low byte (the key the consumer chooses) moved on, so an rkey of an
/// earlier binding no longer works.
fn next_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
}

impl QueuePair {
    /// Posts a signaled bind of `mw` to `len` bytes of `mr` from `offset`,
    /// with `access` (remote read and/or write), usable through this QP only.
    /// Returns what the peer needs; it is valid once the bind's completion
    /// (`wr_id`) arrives, and operations posted after the bind on this QP see
    /// it already.
    ///
    /// The region must have been registered with [`AccessFlags::MW_BIND`].
    ///
    /// # Safety
    /// `mw` and `mr` must outlive the bind's completion, and `mr` must outlive
    /// the binding (drop the window first).
    pub unsafe fn post_bind(
        &self,
        wr_id: u64,
        mw: &MemoryWindow,
        mr: &MemoryRegion,
        offset: usize,
        len: usize,
        access: AccessFlags,
    ) -> Result<RemoteRegion> {
        if offset.checked_add(len).is_none_or(|end| end > mr.len()) {
            return Err(Error::invalid(format!(
                "a window of {len} bytes at {offset} does not fit a region of {}",
                mr.len()
            )));
        }
        let rkey = next_rkey((*mw.mw.as_ptr()).rkey);
        let addr = mr.addr() + offset as u64;
        // SAFETY: all-zero is a valid ibv_send_wr.
        let mut wr: sys::ibv_send_wr = std::mem::zeroed();
        wr.wr_id = wr_id;
        wr.opcode = sys::ibv_wr_opcode::IBV_WR_BIND_MW;
        wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.bind_mw_tso_union.bind_mw = sys::bind_mw_t {
            mw: mw.mw.as_ptr(),
            rkey,
            bind_info: sys::ibv_mw_bind_info {
                mr: mr.as_raw(),
                addr,
                length: len as u64,
                mw_access_flags: access.bits(),
            },
        };
        let mut bad = std::ptr::null_mut();
        crate::costs::post_send(&wr);
        check_code(
            "ibv_post_send(BIND_MW)",
            sys::ibv_post_send(self.as_raw(), &mut wr, &mut bad),
        )?;
        // The provider leaves a type-2 window's rkey to the consumer.
        (*mw.mw.as_ptr()).rkey = rkey;
        Ok(RemoteRegion {
            addr,
            len: len as u64,
            rkey,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::next_rkey;

    #[test]
    fn a_new_binding_moves_only_the_key_byte_on() {
        assert_eq!(next_rkey(0x1234_56ff), 0x1234_5600);
        assert_eq!(next_rkey(0x1234_5601), 0x1234_5602);
        assert_eq!(next_rkey(u32::MAX), 0xffff_ff00);
    }
}
