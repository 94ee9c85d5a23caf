//! Batches: many keys' requests in flight at once, their replies collected
//! together, and the READs of a chunk's large values posted together
//! (one doorbell each for the requests and the READs).

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use smallvec::SmallVec;

use crate::kv::proto::{block_len, is_inline, value_checksum, Op, Reply, Request, Source};
use crate::kv::{check_key, KvError, Result};
use crate::verbs::RemoteAddr;

use super::one_sided::verify_leased;
use super::replies::send_releases;
use super::{
    collect_batch, failed_verification, status, Client, Each, GetResult, Outgoing, Sent,
    BATCH_WINDOW, GROUP_BYTES, SLOT_ALIGN,
};

/// The leased blocks of a batch's values: (key index, the reply).
type Leased = SmallVec<[(usize, Reply); BATCH_WINDOW]>;

impl Client {
    /// READs the leased blocks of a chunk's keys side by side into the
    /// bounce buffer, as many as it holds with one doorbell, hands each
    /// verified value to `each`, and ends the leases (one message).
    fn read_leased(&self, keys: &[&[u8]], leased: &[(usize, Reply)], each: &mut Each<'_>) {
        let mut bounce = match self.lock_bounce(GROUP_BYTES) {
            Ok(bounce) => bounce,
            Err(e) => {
                for &(i, _) in leased {
                    each(i, Err(e.clone()));
                }
                self.end_leases(leased);
                return;
            }
        };
        let mut rest = leased;
        while !rest.is_empty() {
            // As many as the bounce buffer holds (each is at most
            // GROUP_BYTES: larger ones are read alone).
            let mut used = 0;
            let mut reads: SmallVec<[(u64, RemoteAddr, u32); BATCH_WINDOW]> = SmallVec::new();
            for (i, reply) in rest {
                let len = block_len(keys[*i].len(), reply.value_len as usize);
                if used + len > bounce.len {
                    break;
                }
                let remote = RemoteAddr {
                    addr: reply.addr,
                    rkey: reply.rkey,
                };
                reads.push((bounce.addr + used as u64, remote, len as u32));
                used += len;
            }
            let (group, after) = rest.split_at(reads.len().max(1));
            rest = after;
            // SAFETY: every range is looked at only after its READ has been
            // waited for, and the guard (which waits for all of them when
            // dropped) goes before the bounce lock is let go.
            match unsafe { self.conn.start_reads(bounce.lkey, &reads) } {
                Ok(mut pending) => {
                    for (j, ((i, _), (local, _, len))) in group.iter().zip(&reads).enumerate() {
                        let answer = match pending.wait_through(j) {
                            Err(e) => Err(e.into()),
                            Ok(()) => {
                                let at = (local - bounce.addr) as usize;
                                verify_leased(bounce.at(at, *len as usize), keys[*i])
                                    .map(|(version, value)| (value, version))
                                    .ok_or_else(failed_verification)
                            }
                        };
                        each(*i, answer);
                    }
                }
                Err(e) => {
                    let e = KvError::from(e);
                    for (i, _) in group {
                        each(*i, Err(e.clone()));
                    }
                }
            }
            self.end_leases(group);
        }
    }

    /// Ends the leases of `leased` (one message).
    fn end_leases(&self, leased: &[(usize, Reply)]) {
        let leases: SmallVec<[u64; BATCH_WINDOW]> = leased.iter().map(|(_, r)| r.lease).collect();
        send_releases(&self.conn, &leases);
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
            let ids = self.send_batch(
                chunk.len(),
                |i| {
                    check_key(chunk[i])?;
                    Ok(Outgoing::new(Request::new(Op::Get, 0), chunk[i], &[]))
                },
                &mut sends,
            );
            let mut answer = |i: usize, r: Result<(&[u8], u64)>| each(base + i, r);
            // Every reply first, so the chunk's READs go with one doorbell.
            let mut leased = Leased::new();
            let mut alone = Leased::new();
            for (i, id) in ids.iter().enumerate() {
                match self.collect(i, id, &mut |_, reply, payload| Ok((reply, payload))) {
                    Ok((reply, payload)) if !reply.remote => {
                        answer(i, Ok((&payload, reply.version)));
                        self.replies.recycle(payload);
                    }
                    Ok((reply, _)) => {
                        if block_len(chunk[i].len(), reply.value_len as usize) > GROUP_BYTES {
                            alone.push((i, reply));
                        } else {
                            leased.push((i, reply));
                        }
                    }
                    Err(e) => answer(i, Err(e)),
                }
            }
            if !leased.is_empty() {
                self.read_leased(chunk, &leased, &mut answer);
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
        self.batch_put_with(pairs, |_, r| results.push(r));
        results
    }

    /// [`Client::batch_put`], handing each pair's result to `each` (with
    /// the pair's index), in order, on the calling thread, instead of
    /// collecting them: allocates nothing.
    pub fn batch_put_with(
        &self,
        pairs: &[(&[u8], &[u8])],
        mut each: impl FnMut(usize, Result<u64>),
    ) {
        let mut base = 0;
        while base < pairs.len() {
            let run = pairs[base..]
                .iter()
                .take_while(|(_, v)| v.len() as u64 <= self.info.request_buf_len)
                .count();
            if run == 0 {
                let (key, value) = pairs[base];
                each(base, self.put(key, value));
                base += 1;
            } else {
                self.put_pipelined(&pairs[base..base + run], |i, r| each(base + i, r));
                base += run;
            }
        }
    }

    /// Pipelined PUTs of values that fit in a request or in the request
    /// buffer. A value that does not fit in a request is RDMA WRITTEN to a
    /// slot of the request buffer, from where it lies if that is memory
    /// registered on this client ([`Client::register`]: no copy), else
    /// from the same slot of the bounce buffer, staged there; a slot is
    /// reused only after the reply to the request that used it (the window
    /// is at most the number of slots).
    pub(super) fn put_pipelined(
        &self,
        pairs: &[(&[u8], &[u8])],
        mut each: impl FnMut(usize, Result<u64>),
    ) {
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
                    Ok(Outgoing::new(start_request(key, value)?, key, value))
                },
                version,
                each,
            );
        };
        let buf_len = usize::try_from(self.info.request_buf_len).unwrap_or(usize::MAX);
        let slots = (buf_len / slot).clamp(1, BATCH_WINDOW);
        let mut b = match self.lock_bounce(slots * slot) {
            Ok(b) => b,
            Err(e) => {
                // The bounce buffer could not be had: nothing is sent.
                for i in 0..pairs.len() {
                    each(i, Err(e.clone()));
                }
                return;
            }
        };
        let mut next_slot = 0;
        self.pipelined(
            pairs.len(),
            slots,
            |i| {
                let (key, value) = pairs[i];
                let mut req = start_request(key, value)?;
                if is_inline(key.len(), value.len()) {
                    return Ok(Outgoing::new(req, key, value));
                }
                let offset = next_slot % slots * slot;
                next_slot += 1;
                req.source = Source::Staged {
                    offset: offset as u64,
                    checksum: value_checksum(value),
                };
                let remote = RemoteAddr {
                    addr: self.info.request_buf + offset as u64,
                    rkey: self.info.request_buf_rkey,
                };
                let staged = b.stage(offset, value, self.registered(value), remote);
                Ok(Outgoing {
                    staged: Some(staged),
                    ..Outgoing::new(req, key, &[])
                })
            },
            version,
            each,
        );
    }

    /// Sends `count` requests (`prepare(i)`: the i-th, ready to go),
    /// keeping up to `window` (at most [`BATCH_WINDOW`]) in flight, turns
    /// each reply into a result with `finish` and hands it to `answer`, in
    /// order. Requests go in groups of half the window, one doorbell a
    /// group, so one group is on its way while the replies to the other
    /// come in; `prepare(i)` is called only once request `i - window` has
    /// been answered. Allocates nothing.
    pub(super) fn pipelined<'k, T>(
        &self,
        count: usize,
        window: usize,
        mut prepare: impl FnMut(usize) -> Result<Outgoing<'k>>,
        mut finish: impl FnMut(usize, Reply, Vec<u8>) -> Result<T>,
        mut answer: impl FnMut(usize, Result<T>),
    ) {
        let window = window.clamp(1, BATCH_WINDOW);
        let group = (window / 2).max(1);
        // Request i's outcome is at i % window while it is in flight.
        let mut in_flight: SmallVec<[Option<Result<Sent>>; BATCH_WINDOW]> =
            (0..window).map(|_| None).collect();
        let (mut sent, mut done) = (0, 0);
        let mut sends = BatchSends::default();
        while done < count {
            let room = window - (sent - done);
            if sent < count && room >= group.min(count - sent) {
                let n = room.min(count - sent);
                let first = sent;
                let outcomes = self.send_batch(n, |j| prepare(first + j), &mut sends);
                for outcome in outcomes {
                    in_flight[sent % window] = Some(outcome);
                    sent += 1;
                }
                continue;
            }
            let outcome = in_flight[done % window]
                .take()
                .unwrap_or_else(|| Err(KvError::Internal("a request went missing".into())));
            answer(done, self.collect(done, &outcome, &mut finish));
            done += 1;
        }
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
