//! The bounce buffer: one registered buffer large values pass through, taken
//! in turns, and the transfers in and out of it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, MutexGuard, PoisonError};

use crate::kv::{KvError, Result};
use crate::runtime::{thread_token, Connection, WriteAhead};
use crate::verbs::{AccessFlags, MemoryRegion, RemoteAddr};

use super::{Client, KEEP_BOUNCE};

/// Registered memory large values pass through.
pub(super) struct Bounce {
    pub(super) mr: Arc<MemoryRegion>,
    pub(super) addr: u64,
    pub(super) len: usize,
    pub(super) lkey: u32,
}

impl Bounce {
    pub(super) fn bytes(&mut self, len: usize) -> &mut [u8] {
        self.at(0, len)
    }

    /// `len` bytes from `offset` (cut short at the buffer's end).
    pub(super) fn at(&mut self, offset: usize, len: usize) -> &mut [u8] {
        let offset = offset.min(self.len);
        // SAFETY: registered memory of `self.len` bytes owned by the
        // connection; the bounce lock makes us its only user.
        unsafe {
            std::slice::from_raw_parts_mut(
                (self.addr as *mut u8).add(offset),
                len.min(self.len - offset),
            )
        }
    }

    /// `value` as the RDMA WRITE to `remote`: from where it lies when it is
    /// in memory registered on the client (`registered`: its lkey), else
    /// copied to `offset` of this buffer first.
    pub(super) fn stage(
        &mut self,
        offset: usize,
        value: &[u8],
        registered: Option<u32>,
        remote: RemoteAddr,
    ) -> WriteAhead {
        match registered {
            Some(lkey) => WriteAhead {
                local_addr: value.as_ptr() as u64,
                lkey,
                remote,
                len: value.len() as u32,
            },
            None => {
                crate::copy::copy(self.at(offset, value.len()), value);
                WriteAhead {
                    local_addr: self.addr + offset as u64,
                    lkey: self.lkey,
                    remote,
                    len: value.len() as u32,
                }
            }
        }
    }
}

/// The locked bounce buffer; a buffer over [`KEEP_BOUNCE`] is freed when
/// the guard goes.
pub(super) struct BounceGuard<'c> {
    pub(super) slot: MutexGuard<'c, Option<Bounce>>,
    pub(super) conn: &'c Connection,
    pub(super) holder: &'c AtomicUsize,
}

impl std::ops::Deref for BounceGuard<'_> {
    type Target = Bounce;
    fn deref(&self) -> &Bounce {
        self.slot.as_ref().expect("bounce buffer")
    }
}

impl std::ops::DerefMut for BounceGuard<'_> {
    fn deref_mut(&mut self) -> &mut Bounce {
        self.slot.as_mut().expect("bounce buffer")
    }
}

impl Drop for BounceGuard<'_> {
    fn drop(&mut self) {
        self.holder.store(0, Ordering::Release);
        if self.slot.as_ref().is_some_and(|b| b.len > KEEP_BOUNCE) {
            if let Some(big) = self.slot.take() {
                self.conn.deregister(&big.mr);
            }
        }
    }
}

/// The size of a bounce buffer for `len` bytes: at least 1 MiB, rounded up
/// to a power of two so that it seldom grows again; `None` past the largest
/// power of two (a length from a server's reply can be anything).
fn bounce_size(len: usize) -> Option<usize> {
    len.checked_next_power_of_two()
        .map(|size| size.max(1 << 20))
}

impl Client {
    /// The bounce buffer, grown to at least `len` bytes, locked until the
    /// guard is dropped.
    pub(super) fn lock_bounce(&self, len: usize) -> Result<BounceGuard<'_>> {
        let me = thread_token();
        if self.bounce_holder.load(Ordering::Acquire) == me {
            return Err(KvError::InvalidArgument(
                "a callback lent a value called back into the same client".into(),
            ));
        }
        // Poisoned only by a panic in a user's callback lent a value; the
        // buffer is scratch space and still whole.
        let mut slot = self.bounce.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.as_ref().is_none_or(|b| b.len < len) {
            // Sized first: a size that cannot be had keeps the old buffer.
            let size = bounce_size(len).ok_or(KvError::NoMemory)?;
            if let Some(old) = slot.take() {
                self.conn.deregister(&old.mr);
            }
            // Only our own READs and WRITEs use it: no remote access.
            let mr = self
                .conn
                .register_with(size, AccessFlags::LOCAL_WRITE)
                .map_err(|_| KvError::NoMemory)?;
            *slot = Some(Bounce {
                addr: mr.addr(),
                lkey: mr.lkey(),
                len: size,
                mr,
            });
        }
        self.bounce_holder.store(me, Ordering::Release);
        Ok(BounceGuard {
            slot,
            conn: &self.conn,
            holder: &self.bounce_holder,
        })
    }

    /// Runs `f` with the bounce buffer grown to at least `len` bytes.
    pub(super) fn with_bounce<T>(
        &self,
        len: usize,
        f: impl FnOnce(&mut Bounce) -> Result<T>,
    ) -> Result<T> {
        let mut bounce = self.lock_bounce(len)?;
        f(&mut bounce)
    }

    /// Moves `len` bytes between the bounce buffer (from `local`) and the
    /// server, in pieces, waiting for each.
    pub(super) fn transfer(
        &self,
        read: bool,
        bounce: &Bounce,
        local: usize,
        remote: RemoteAddr,
        len: usize,
    ) -> Result<()> {
        self.transfer_at(read, bounce.addr + local as u64, bounce.lkey, remote, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bounce_buffer_past_the_largest_power_of_two_is_refused_not_a_panic() {
        assert_eq!(bounce_size(1), Some(1 << 20));
        assert_eq!(bounce_size((1 << 20) + 1), Some(2 << 20));
        let top = usize::MAX / 2 + 1;
        assert_eq!(bounce_size(top), Some(top));
        assert_eq!(bounce_size(top + 1), None);
        assert_eq!(bounce_size(usize::MAX), None);
    }
}
