//! Single-key operations: GET (copied, lent or into the caller's buffer),
//! PUT, compare-and-swap and DELETE.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use crate::copy;
use crate::kv::proto::{block_len, is_inline, value_checksum, Op, Reply, Request, Source};
use crate::kv::{check_key, KvError, Result};
use crate::verbs::RemoteAddr;

use super::one_sided::verify_leased;
use super::replies::send_releases;
use super::{copy_into, failed_verification, Client};

/// A GET's answer before its value is fetched.
pub(super) enum Found {
    Inline(Vec<u8>, u64),
    Remote(Reply),
}

impl Client {
    pub(super) fn check_value(&self, value: &[u8]) -> Result<()> {
        if value.len() as u64 > self.info.max_value {
            return Err(KvError::ValueTooLong {
                max: self.info.max_value,
            });
        }
        Ok(())
    }

    /// Asks the server for `key`.
    pub(super) fn lookup(&self, key: &[u8]) -> Result<Found> {
        check_key(key)?;
        let (reply, payload) = self.call(Request::new(Op::Get, 0), key, &[], 0)?;
        Ok(if reply.remote {
            Found::Remote(reply)
        } else {
            Found::Inline(payload, reply.version)
        })
    }

    /// READs a block the server leased us, verifies it, hands the value and
    /// its version to `take`, and ends the lease.
    pub(super) fn fetch<T>(
        &self,
        key: &[u8],
        reply: &Reply,
        take: impl FnOnce(&[u8], u64) -> T,
    ) -> Result<T> {
        if reply.value_len > self.info.max_value {
            self.release(reply.lease);
            return Err(KvError::Internal(format!(
                "the server leased a {}-byte value, beyond its own limit of {}",
                reply.value_len, self.info.max_value
            )));
        }
        // Saturated, not truncated, where usize is narrower: the bounce
        // buffer then refuses it.
        let value_len = usize::try_from(reply.value_len).unwrap_or(usize::MAX);
        let total = block_len(key.len(), value_len);
        let result = self.with_bounce(total, |b| {
            self.transfer(
                true,
                b,
                0,
                RemoteAddr {
                    addr: reply.addr,
                    rkey: reply.rkey,
                },
                total,
            )?;
            let block = b.bytes(total);
            let (version, value) = verify_leased(block, key).ok_or_else(failed_verification)?;
            // A panicking `take` still lets the lease go first.
            Ok(catch_unwind(AssertUnwindSafe(|| take(value, version))))
        });
        self.release(reply.lease);
        result.map(|taken| taken.unwrap_or_else(|payload| resume_unwind(payload)))
    }

    pub(super) fn release(&self, lease: u64) {
        send_releases(&self.conn, &[lease]);
    }

    /// The value and version of `key`.
    pub fn get(&self, key: &[u8]) -> Result<(Vec<u8>, u64)> {
        match self.lookup(key)? {
            // Already the caller's own copy.
            Found::Inline(v, version) => Ok((v, version)),
            Found::Remote(reply) => {
                self.fetch(key, &reply, |v, version| (copy::to_vec(v), version))
            }
        }
    }

    /// Lends the value of `key` to `take` (for the call only; no copy is
    /// made first) and returns what it made, with the version. `take` runs
    /// on the calling thread while the client's transfer buffer may be
    /// lent to it: a large-value call on the same client from inside it
    /// fails with [`KvError::InvalidArgument`] (rather than deadlocking).
    pub fn get_with<T>(&self, key: &[u8], take: impl FnOnce(&[u8]) -> T) -> Result<(T, u64)> {
        match self.lookup(key)? {
            Found::Inline(v, version) => Ok((take(&v), version)),
            Found::Remote(reply) => self.fetch(key, &reply, |v, version| (take(v), version)),
        }
    }

    /// Copies the value of `key` into `buf`; returns its length and version.
    /// A value longer than `buf` is not copied at all:
    /// [`KvError::BufferTooSmall`] reports its length.
    pub fn get_into(&self, key: &[u8], buf: &mut [u8]) -> Result<(usize, u64)> {
        check_key(key)?;
        // A small value's payload lands in `buf` straight from the receive
        // ring (one copy on this side).
        let (reply, landed, payload) = self.call_into(Request::new(Op::Get, 0), key, buf)?;
        let found = match (reply.remote, landed) {
            (false, Some(n)) => return Ok((n, reply.version)),
            (false, None) => Found::Inline(payload, reply.version),
            (true, _) => Found::Remote(reply),
        };
        match found {
            Found::Inline(v, version) => {
                let copied = copy_into(buf, &v);
                self.replies.recycle(v);
                Ok((copied?, version))
            }
            Found::Remote(reply) => {
                if reply.value_len > buf.len() as u64 {
                    self.release(reply.lease);
                    return Err(KvError::BufferTooSmall {
                        needed: reply.value_len,
                    });
                }
                let n = reply.value_len as usize;
                if let Some(lkey) = self.registered(&buf[..n]) {
                    return self.fetch_registered(key, &reply, &mut buf[..n], lkey);
                }
                self.fetch(key, &reply, |v, version| {
                    copy::copy(&mut buf[..n], v);
                    (n, version)
                })
            }
        }
    }

    /// Stores `value` under `key`; returns the new version.
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<u64> {
        self.write(key, value, None)
    }

    /// Stores `value` only if the key's version is `expected` (0: only if the
    /// key is absent). Fails with [`KvError::CasFailed`] carrying the current
    /// version otherwise.
    pub fn cas(&self, key: &[u8], expected: u64, value: &[u8]) -> Result<u64> {
        self.write(key, value, Some(expected))
    }

    pub(super) fn write(&self, key: &[u8], value: &[u8], cas: Option<u64>) -> Result<u64> {
        check_key(key)?;
        self.check_value(value)?;
        let mut req = Request::new(Op::Write, 0);
        req.value_len = value.len() as u64;
        req.cas = cas;
        if is_inline(key.len(), value.len()) {
            return self.call(req, key, value, 0).map(|(r, _)| r.version);
        }
        if value.len() as u64 <= self.info.request_buf_len {
            // One round trip: the value goes by RDMA WRITE into our request
            // buffer, the request right behind it on the same QP (so the
            // value has landed when the server reads the request). From
            // registered memory, the WRITE reads the caller's bytes; the
            // bounce lock is held either way, as it guards that buffer.
            let zero_copy = self.registered(value);
            let len = if zero_copy.is_some() { 0 } else { value.len() };
            return self.with_bounce(len, |b| {
                let remote = RemoteAddr {
                    addr: self.info.request_buf,
                    rkey: self.info.request_buf_rkey,
                };
                req.source = Source::Staged {
                    offset: 0,
                    checksum: value_checksum(value),
                };
                let staged = Some(b.stage(0, value, zero_copy, remote));
                self.call_after(req, key, &[], staged, value.len())
                    .map(|(r, _)| r.version)
            });
        }
        // Larger than the request buffer: the server makes a target first.
        let mut alloc = Request::new(Op::Alloc, 0);
        alloc.value_len = value.len() as u64;
        // The server maps and registers memory for it first: time in
        // proportion to its size.
        let (target, _) = self.call(alloc, key, &[], value.len())?;
        let remote = RemoteAddr {
            addr: target.addr,
            rkey: target.rkey,
        };
        req.source = Source::Allocated {
            token: target.lease,
        };
        let put = match self.registered(value) {
            Some(lkey) => self
                .transfer_at(false, value.as_ptr() as u64, lkey, remote, value.len())
                .and_then(|()| self.call(req, key, &[], value.len()))
                .map(|(r, _)| r.version),
            None => self.with_bounce(value.len(), |b| {
                copy::copy(b.bytes(value.len()), value);
                self.transfer(false, b, 0, remote, value.len())?;
                self.call(req, key, &[], value.len())
                    .map(|(r, _)| r.version)
            }),
        };
        if put.is_err() {
            // The server takes our requests in order: a release behind a
            // commit it has not seen yet finds the target already used.
            self.release(target.lease);
        }
        put
    }

    /// Deletes `key`.
    pub fn delete(&self, key: &[u8]) -> Result<()> {
        check_key(key)?;
        self.call(Request::new(Op::Delete, 0), key, &[], 0)
            .map(|_| ())
    }
}
