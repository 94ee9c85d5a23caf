//! Batches: many keys' requests in flight at once, their replies collected
//! together, and the READs of large values started before the first is
//! copied out.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use crate::copy;
use crate::kv::proto::{block_len, is_inline, value_checksum, Op, Reply, Request, Source};
use crate::kv::{check_key, KvError, Result};
use crate::runtime::PendingReads;
use crate::verbs::RemoteAddr;

use super::bounce::BounceGuard;
use super::one_sided::verify_leased;
use super::replies::send_releases;
use super::{
    collect_batch, failed_verification, status, Client, Each, GetResult, Sent, BATCH_WINDOW,
    GROUP_BYTES, SLOT_ALIGN,
};

/// A batch's leased blocks being READ side by side into the bounce buffer,
/// each as soon as its reply is in, so the server answers the batch's later
/// requests while the earlier values move.
pub(super) struct BlockReads<'c> {
    pub(super) client: &'c Client,
    /// Key index, offset in the bounce buffer, block length, and the READ
    /// (declared before `bounce`: dropped, so waited for, first).
    pub(super) pending: Vec<(usize, usize, usize, PendingReads<'c>)>,
    pub(super) leases: Vec<u64>,
    pub(super) used: usize,
    pub(super) bounce: BounceGuard<'c>,
}

impl BlockReads<'_> {
    /// Starts the READ of `keys[i]`'s block, after finishing the earlier
    /// ones when the buffer is full. Its answer goes to `each`, now if
    /// posting fails, otherwise at [`BlockReads::finish`].
    pub(super) fn start(&mut self, keys: &[&[u8]], i: usize, reply: &Reply, each: &mut Each<'_>) {
        let len = block_len(keys[i].len(), reply.value_len as usize);
        if self.used + len > self.bounce.len {
            self.finish(keys, each);
        }
        self.leases.push(reply.lease);
        let remote = RemoteAddr {
            addr: reply.addr,
            rkey: reply.rkey,
        };
        let local = self.bounce.addr + self.used as u64;
        // SAFETY: the range is looked at only after `finish` has waited for
        // its READ, and the guard is dropped before the bounce lock is let go
        // (field order).
        let read = unsafe {
            self.client
                .conn
                .start_reads(self.bounce.lkey, &[(local, remote, len as u32)])
        };
        match read {
            Ok(read) => {
                self.pending.push((i, self.used, len, read));
                self.used += len;
            }
            Err(e) => each(i, Err(e.into())),
        }
    }

    /// Waits for the READs in order, hands each verified value to `each`
    /// (the later READs still in flight), and ends the leases.
    pub(super) fn finish(&mut self, keys: &[&[u8]], each: &mut Each<'_>) {
        for (i, at, len, mut read) in self.pending.drain(..) {
            let answer = match read.wait_through(0) {
                Err(e) => Err(e.into()),
                Ok(()) => verify_leased(self.bounce.at(at, len), keys[i])
                    .map(|(version, value)| (value, version))
                    .ok_or_else(failed_verification),
            };
            each(i, answer);
        }
        send_releases(&self.client.conn, &self.leases);
        self.leases.clear();
        self.used = 0;
    }
}

/// A batch's sends: once one has waited out its time for room in the
/// server's ring (a server that stopped taking requests), the rest fail
/// with that error at once instead of each waiting as long again.
#[derive(Default)]
pub(super) struct BatchSends {
    pub(super) stuck: Option<KvError>,
}

impl BatchSends {
    pub(super) fn send(&mut self, send: impl FnOnce() -> Result<Sent>) -> Result<Sent> {
        if let Some(e) = &self.stuck {
            return Err(e.clone());
        }
        let sent = send();
        if let Err(e @ KvError::Timeout(_)) = &sent {
            self.stuck = Some(e.clone());
        }
        sent
    }
}

impl Client {
    /// GETs several keys with up to 64 requests in flight; one result per
    /// key, in order. A value the server leases is READ as soon as its
    /// reply is in, while the later replies are still coming; up to the
    /// bounce buffer's size of them are in flight, and a value larger than
    /// `GROUP_BYTES` is read alone at the end of its chunk.
    pub fn batch_get(&self, keys: &[&[u8]]) -> Vec<GetResult> {
        collect_batch(keys.len(), |each| self.batch_get_with(keys, each))
    }

    /// [`Client::batch_get`], lending each value to `each` (with the key's
    /// index and the version, or the error) instead of copying it out of
    /// the transfer buffer first: `each` runs once per key, in no
    /// particular order, on the calling thread, under the same rule as
    /// [`Client::get_with`]'s `take`.
    ///
    /// Should `each` panic, the batch is still finished without it (every
    /// reply taken, every value the server lent us given back), and then
    /// the panic goes on.
    pub fn batch_get_with(
        &self,
        keys: &[&[u8]],
        mut each: impl FnMut(usize, Result<(&[u8], u64)>),
    ) {
        let mut panic = None;
        self.batch_get_each(keys, &mut |i, r| {
            if panic.is_none() {
                panic = catch_unwind(AssertUnwindSafe(|| each(i, r))).err();
            }
        });
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
    }

    pub(super) fn batch_get_each(&self, keys: &[&[u8]], each: &mut Each<'_>) {
        let mut sends = BatchSends::default();
        // A chunk at a time, so the server holds at most a chunk's leases
        // for us.
        for (n, chunk) in keys.chunks(BATCH_WINDOW).enumerate() {
            let base = n * BATCH_WINDOW;
            let ids: Vec<Result<Sent>> = chunk
                .iter()
                .map(|key| {
                    check_key(key)?;
                    sends.send(|| self.send(Request::new(Op::Get, 0), key, &[]))
                })
                .collect();
            let mut answer = |i: usize, r: Result<(&[u8], u64)>| each(base + i, r);
            let mut reads: Option<BlockReads> = None;
            let mut alone = Vec::new();
            for (i, id) in ids.iter().enumerate() {
                let reply = self.collect(i, id, &mut |_, reply, payload| Ok((reply, payload)));
                let reply = match reply {
                    Ok((reply, payload)) if !reply.remote => {
                        answer(i, Ok((&payload, reply.version)));
                        continue;
                    }
                    Ok((reply, _)) => reply,
                    Err(e) => {
                        answer(i, Err(e));
                        continue;
                    }
                };
                if block_len(chunk[i].len(), reply.value_len as usize) > GROUP_BYTES {
                    alone.push((i, reply));
                    continue;
                }
                if reads.is_none() {
                    match self.lock_bounce(GROUP_BYTES) {
                        Ok(bounce) => {
                            reads = Some(BlockReads {
                                client: self,
                                pending: Vec::new(),
                                leases: Vec::new(),
                                used: 0,
                                bounce,
                            })
                        }
                        Err(e) => {
                            answer(i, Err(e));
                            self.release(reply.lease);
                            continue;
                        }
                    }
                }
                if let Some(r) = reads.as_mut() {
                    r.start(chunk, i, &reply, &mut answer);
                }
            }
            if let Some(mut r) = reads {
                r.finish(chunk, &mut answer);
            }
            for (i, reply) in alone {
                let fetched = self.fetch(chunk[i], &reply, |v, version| {
                    answer(i, Ok((v, version)));
                });
                if let Err(e) = fetched {
                    answer(i, Err(e));
                }
            }
        }
    }

    /// PUTs several pairs; one result (the new version) per pair, in order.
    /// Values up to the size of our request buffer on the server are
    /// pipelined, up to 64 requests in flight; a larger value is put alone,
    /// in its place, so a key written twice in a batch ends with its last
    /// value.
    pub fn batch_put(&self, pairs: &[(&[u8], &[u8])]) -> Vec<Result<u64>> {
        let mut results = Vec::with_capacity(pairs.len());
        let mut rest = pairs;
        while let Some(((key, value), after)) = rest.split_first() {
            let run = rest
                .iter()
                .take_while(|(_, v)| v.len() as u64 <= self.info.request_buf_len)
                .count();
            if run == 0 {
                results.push(self.put(key, value));
                rest = after;
            } else {
                results.extend(self.put_pipelined(&rest[..run]));
                rest = &rest[run..];
            }
        }
        results
    }

    /// Pipelined PUTs of values that fit in a request or in the request
    /// buffer. A value that does not fit in a request is staged in a slot of
    /// the bounce buffer and RDMA WRITTEN to the same slot of the request
    /// buffer; a slot is reused only after the reply to the request that
    /// used it (the window is at most the number of slots).
    pub(super) fn put_pipelined(&self, pairs: &[(&[u8], &[u8])]) -> Vec<Result<u64>> {
        let start_request = |key: &[u8], value: &[u8]| -> Result<Request> {
            check_key(key)?;
            self.check_value(value)?;
            let mut req = Request::new(Op::Write, 0);
            req.value_len = value.len() as u64;
            Ok(req)
        };
        let version = |_, reply: Reply, _| Ok(reply.version);
        let slot = pairs
            .iter()
            .filter(|(k, v)| !is_inline(k.len(), v.len()))
            .map(|(_, v)| v.len().next_multiple_of(SLOT_ALIGN))
            .max();
        let Some(slot) = slot else {
            return self.pipelined(
                pairs.len(),
                BATCH_WINDOW,
                |i| {
                    let (key, value) = pairs[i];
                    self.send(start_request(key, value)?, key, value)
                },
                version,
            );
        };
        let buf_len = usize::try_from(self.info.request_buf_len).unwrap_or(usize::MAX);
        let slots = (buf_len / slot).clamp(1, BATCH_WINDOW);
        let staged = self.with_bounce(slots * slot, |b| {
            let mut next_slot = 0;
            Ok(self.pipelined(
                pairs.len(),
                slots,
                |i| {
                    let (key, value) = pairs[i];
                    let mut req = start_request(key, value)?;
                    if is_inline(key.len(), value.len()) {
                        return self.send(req, key, value);
                    }
                    let offset = next_slot % slots * slot;
                    next_slot += 1;
                    copy::copy(b.at(offset, value.len()), value);
                    req.source = Source::Staged {
                        offset: offset as u64,
                        checksum: value_checksum(value),
                    };
                    let remote = RemoteAddr {
                        addr: self.info.request_buf + offset as u64,
                        rkey: self.info.request_buf_rkey,
                    };
                    self.send_after(req, key, &[], Some(b.staged(offset, remote, value.len())))
                },
                version,
            ))
        });
        staged.unwrap_or_else(|e| pairs.iter().map(|_| Err(e.clone())).collect())
    }

    /// Sends `count` requests with `start` (which returns the request id),
    /// keeping up to `window` in flight, and turns each reply into a result
    /// with `finish`.
    pub(super) fn pipelined<T>(
        &self,
        count: usize,
        window: usize,
        mut start: impl FnMut(usize) -> Result<Sent>,
        mut finish: impl FnMut(usize, Reply, Vec<u8>) -> Result<T>,
    ) -> Vec<Result<T>> {
        let mut ids: Vec<Result<Sent>> = Vec::with_capacity(count);
        let mut results: Vec<Result<T>> = Vec::with_capacity(count);
        let mut sends = BatchSends::default();
        for i in 0..count {
            ids.push(sends.send(|| start(i)));
            if ids.len() - results.len() >= window {
                let j = results.len();
                results.push(self.collect(j, &ids[j], &mut finish));
            }
        }
        while results.len() < count {
            let j = results.len();
            results.push(self.collect(j, &ids[j], &mut finish));
        }
        results
    }

    pub(super) fn collect<T>(
        &self,
        i: usize,
        sent: &Result<Sent>,
        finish: &mut impl FnMut(usize, Reply, Vec<u8>) -> Result<T>,
    ) -> Result<T> {
        let sent = sent.as_ref().map_err(Clone::clone)?;
        let (reply, payload) = self.wait(*sent, self.timeout)?;
        status(&reply)?;
        finish(i, reply, payload)
    }
}
