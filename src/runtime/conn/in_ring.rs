//! A received message still in the receive ring, for handlers that take
//! parts of it straight to where they belong (one copy) instead of from a
//! copy of the whole message (two).

use crate::verbs::MemoryRegion;

/// A message in the receive ring, lent to
/// [`ConnHandler::recv_in_ring`](crate::runtime::ConnHandler::recv_in_ring)
/// for the call only. The peer
/// can write the ring while it is looked at, so the bytes are reached only
/// by copying them out: read each byte once, and decide only on the copy.
pub struct InRing<'a> {
    ring: &'a MemoryRegion,
    start: usize,
    len: usize,
}

impl<'a> InRing<'a> {
    /// `len` bytes at `start` of `ring`, which the caller checked are inside it.
    pub(super) fn new(ring: &'a MemoryRegion, start: usize, len: usize) -> InRing<'a> {
        debug_assert!(start + len <= ring.len());
        InRing { ring, start, len }
    }

    /// The message's length.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies the message's bytes from `at` into the whole of `dst`; false
    /// (nothing copied) when they are not all inside the message. Not
    /// counted as a payload copy: a handler that copies payload says so
    /// ([`InRing::read_payload`]).
    pub fn read(&self, at: usize, dst: &mut [u8]) -> bool {
        match at.checked_add(dst.len()) {
            Some(end) if end <= self.len => self.ring.copy_out_to(self.start + at, dst),
            _ => false,
        }
    }

    /// [`InRing::read`] of payload: counted as one user-space copy of it
    /// (none when `dst` is empty).
    pub fn read_payload(&self, at: usize, dst: &mut [u8]) -> bool {
        let read = self.read(at, dst);
        if read {
            crate::costs::copied_if_any(dst.len());
        }
        read
    }
}
