//! Zero-copy values: memory registered on the client's connection, which
//! the NIC reads a PUT's value from and writes a GET's value into, with no
//! copy through the bounce buffer. [`Client::put`] and [`Client::get_into`]
//! take this path by themselves when the value or the buffer lies in such
//! memory and the value is too large to travel inside a message.

use std::sync::Arc;

use crate::kv::proto::{verify_leased_parts, Reply, BLOCK_HEADER_LEN};
use crate::kv::{KvError, Result};
use crate::runtime::Connection;
use crate::verbs::{MemoryRegion, RemoteAddr};

use super::{failed_verification, Client, MAX_TRANSFER};

/// Memory registered on one client's connection, for values the NIC moves
/// without a copy ([`Client::register`]). Deregistered when dropped.
pub struct KvMemory {
    mr: Arc<MemoryRegion>,
    conn: Connection,
}

impl KvMemory {
    pub fn len(&self) -> usize {
        self.mr.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mr.is_empty()
    }

    pub fn as_slice(&self) -> &[u8] {
        self.mr.as_slice()
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: this handle is the only way to the bytes (the connection
        // keeps the registration only to look its lkey up), and `&mut self`
        // makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.mr.addr() as *mut u8, self.mr.len()) }
    }
}

impl Drop for KvMemory {
    fn drop(&mut self) {
        self.conn.deregister(&self.mr);
    }
}

impl Client {
    /// `len` zeroed bytes registered on this client's connection. A value
    /// [`Client::put`] from this memory, or fetched by [`Client::get_into`]
    /// into it, moves between it and the server's memory by RDMA alone (for
    /// values too large to go inline in a message): no copy in user space.
    pub fn register(&self, len: usize) -> Result<KvMemory> {
        if len == 0 {
            return Err(KvError::InvalidArgument("registering 0 bytes".into()));
        }
        let mr = self
            .conn
            .register_with(len, crate::verbs::AccessFlags::LOCAL_WRITE)?;
        Ok(KvMemory {
            mr,
            conn: self.conn.clone(),
        })
    }

    /// The lkey of the registered memory `bytes` lies in, if it does.
    pub(super) fn registered(&self, bytes: &[u8]) -> Option<u32> {
        if bytes.is_empty() {
            return None;
        }
        self.conn
            .registered_lkey(bytes.as_ptr() as u64, bytes.len())
    }

    /// Moves `len` bytes between local registered memory at `local`
    /// (`lkey`) and the server, in pieces, waiting for each.
    pub(super) fn transfer_at(
        &self,
        read: bool,
        local: u64,
        lkey: u32,
        remote: RemoteAddr,
        len: usize,
    ) -> Result<()> {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(MAX_TRANSFER);
            let at = RemoteAddr {
                addr: remote.addr + done as u64,
                rkey: remote.rkey,
            };
            let laddr = local + done as u64;
            if read {
                self.conn.read_sync(laddr, lkey, at, n as u32)?;
            } else {
                self.conn.write_sync(laddr, lkey, at, n as u32)?;
            }
            done += n;
        }
        Ok(())
    }

    /// READs a leased block's value straight into `dst` (registered:
    /// `lkey`) and its header and key into the bounce buffer, checks the
    /// block, the value's checksum included (the lease may have ended
    /// before the READ landed, and the block been reused), and ends the
    /// lease: the value's length and version.
    pub(super) fn fetch_registered(
        &self,
        key: &[u8],
        reply: &Reply,
        dst: &mut [u8],
        lkey: u32,
    ) -> Result<(usize, u64)> {
        let n = reply.value_len as usize;
        let head_len = BLOCK_HEADER_LEN + key.len();
        let result = self.with_bounce(head_len, |b| {
            let block = RemoteAddr {
                addr: reply.addr,
                rkey: reply.rkey,
            };
            self.transfer_at(true, b.addr, b.lkey, block, head_len)?;
            // The server's address: one near the end of the address space
            // is its mistake, not a reason to panic.
            let value_at = RemoteAddr {
                addr: reply.addr.checked_add(head_len as u64).ok_or_else(|| {
                    KvError::Internal("the server's reply points past the address space".into())
                })?,
                rkey: reply.rkey,
            };
            self.transfer_at(true, dst.as_ptr() as u64, lkey, value_at, n)?;
            verify_leased_parts(b.bytes(head_len), key, &dst[..n]).ok_or_else(failed_verification)
        });
        self.release(reply.lease);
        result.map(|version| (n, version))
    }
}
