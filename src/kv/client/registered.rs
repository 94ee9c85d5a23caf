//! Zero-copy values: memory registered on the client's connection, which
//! the NIC reads a PUT's value from and writes a GET's value into, with no
//! copy through the bounce buffer. [`Client::put`] and [`Client::get_into`]
//! take this path by themselves when the value or the buffer lies in such
//! memory and the value is too large to travel inside a message.

use std::sync::Arc;

use crate::kv::proto::{u32_at, u64_at, Reply, BLOCK_HEADER_LEN, BLOCK_MAGIC, SUPERSEDED_MAGIC};
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
    /// `lkey`) and its header and key into the bounce buffer, checks those,
    /// and ends the lease: the value's length and version.
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
            let value_at = RemoteAddr {
                addr: reply.addr + head_len as u64,
                rkey: reply.rkey,
            };
            self.transfer_at(true, dst.as_ptr() as u64, lkey, value_at, n)?;
            verify_leased_head(b.bytes(head_len), key, n).ok_or_else(failed_verification)
        });
        self.release(reply.lease);
        result.map(|version| (n, version))
    }
}

/// Checks a leased block's header and key (read apart from its value, of
/// `value_len` bytes): its version. As for every leased block, the value
/// itself is not hashed: the server neither frees nor writes a block while
/// it is leased.
fn verify_leased_head(head: &[u8], key: &[u8], value_len: usize) -> Option<u64> {
    if head.len() != BLOCK_HEADER_LEN + key.len() {
        return None;
    }
    let magic = u32_at(head, 0);
    let whole = magic == BLOCK_MAGIC || magic == SUPERSEDED_MAGIC;
    let lens = u32_at(head, 4) as usize == key.len()
        && usize::try_from(u64_at(head, 8)).ok() == Some(value_len);
    (whole && lens && &head[BLOCK_HEADER_LEN..] == key).then(|| u64_at(head, 16))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::proto::BLOCK_HEADER_LEN;

    fn head(magic: u32, key: &[u8], value_len: u64, version: u64) -> Vec<u8> {
        let mut h = vec![0u8; BLOCK_HEADER_LEN];
        h[..4].copy_from_slice(&magic.to_le_bytes());
        h[4..8].copy_from_slice(&(key.len() as u32).to_le_bytes());
        h[8..16].copy_from_slice(&value_len.to_le_bytes());
        h[16..24].copy_from_slice(&version.to_le_bytes());
        h.extend_from_slice(key);
        h
    }

    #[test]
    fn a_leased_head_is_checked_for_magic_lengths_and_key() {
        let ok = head(BLOCK_MAGIC, b"key", 100, 7);
        assert_eq!(verify_leased_head(&ok, b"key", 100), Some(7));
        let superseded = head(SUPERSEDED_MAGIC, b"key", 100, 7);
        assert_eq!(verify_leased_head(&superseded, b"key", 100), Some(7));
        assert_eq!(verify_leased_head(&ok, b"kez", 100), None);
        assert_eq!(verify_leased_head(&ok, b"key", 99), None);
        assert_eq!(
            verify_leased_head(&head(0xdead, b"key", 100, 7), b"key", 100),
            None
        );
        assert_eq!(verify_leased_head(&ok[..ok.len() - 1], b"key", 100), None);
    }
}
