//! Posting staged messages: one (`send`), or several with one doorbell (a
//! batch of requests, a kv batch's GETs or PUTs, leaves in one
//! `ibv_post_send`, not one per message), each after its write if it has
//! one, with the credit owed to the peer in front.

use std::sync::MutexGuard;

use smallvec::SmallVec;

use crate::runtime::Result;
use crate::verbs::{RemoteAddr, SendOp, SendRequest, Sge};

use crate::runtime::proto::EXT_HEADER_LEN;

use super::send::{gather_sges, Parts, StagedMessage, INLINE_PARTS};
use super::{wr_id, Connection, State, K_DATA};

/// Work requests one doorbell chains at most, as many as the verbs layer
/// chains on the stack (a kv batch's 64 requests, or 32 PUTs with their
/// writes). A credit command and a READ of the peer's credit may take two
/// of them.
const CHAIN: usize = 129;

/// Messages one doorbell posts at most (each with no write ahead of it).
pub const MESSAGES_PER_DOORBELL: usize = CHAIN - 2;

/// An RDMA WRITE from a buffer registered on the connection that goes
/// ahead of a message, as [`Connection::write_then_send`] makes it.
#[derive(Debug, Clone, Copy)]
pub struct WriteAhead {
    pub local_addr: u64,
    pub lkey: u32,
    pub remote: RemoteAddr,
    pub len: u32,
}

/// A message of [`Connection::write_then_send_batch`]: its parts, and the
/// write that goes ahead of it, if any.
pub type BatchMessage<'a> = (&'a [&'a [u8]], Option<WriteAhead>);

/// A message staged for posting, with the pieces it is posted from (its
/// parts where it goes inline, else its place in the staging buffer) and
/// the write ahead of it.
pub(super) struct Ready {
    msg: StagedMessage,
    sges: [Sge; INLINE_PARTS],
    n: usize,
    write: Option<([Sge; 1], RemoteAddr)>,
}

impl Connection {
    /// Stages a message at `offset` (reserved in the peer's ring) for
    /// [`Connection::post_ready`]: inline from its pieces (`ext_header`,
    /// which must stay where it is until the post, then `data`) when it
    /// fits, else copied into the staging buffer.
    pub(super) fn stage_ready(
        &self,
        st: &mut State,
        offset: usize,
        data: Parts<'_>,
        ext_header: Option<&[u8; EXT_HEADER_LEN]>,
        write: Option<(Sge, RemoteAddr)>,
    ) -> Result<Ready> {
        let mut sges = [Sge::EMPTY; INLINE_PARTS];
        let header = ext_header.map(|h| h.as_slice());
        let in_place = match self.fits_inline(data.len() + header.map_or(0, <[u8]>::len)) {
            true => gather_sges(
                header.into_iter().chain(data.pieces().iter().copied()),
                &mut sges,
            )
            .map(<[Sge]>::len),
            false => None,
        };
        let msg = self.stage_message(
            st,
            offset,
            data,
            ext_header.copied(),
            write.is_some(),
            in_place.is_none(),
        )?;
        let n = in_place.unwrap_or_else(|| {
            sges[0] = msg.sge;
            1
        });
        Ok(Ready {
            msg,
            sges,
            n,
            write: write.map(|(sge, remote)| ([sge], remote)),
        })
    }

    /// Posts staged messages, in order, each after its write, with the
    /// credit owed to the peer in front (no doorbell of its own), all with
    /// one doorbell, letting go of the state lock for the post. The caller
    /// fails the connection if this fails.
    pub(super) fn post_ready(&self, mut st: MutexGuard<'_, State>, ready: &[Ready]) -> Result<()> {
        let credit = self.credit_to_carry(&mut st)?;
        if credit.is_some() {
            // The command's send-queue place (its slot is taken): both stay
            // taken whatever the post returns, as a failed post may have
            // posted part of the chain, the command with it.
            st.sq_used += 1;
        }
        let credit_sge = credit.map(|(_, sge)| [sge]);
        // Behind the messages, a READ of what the peer consumed, when due.
        let read = self.credit_read(&mut st);
        let mut chain: SmallVec<[SendRequest<'_>; CHAIN]> = SmallVec::new();
        if let (Some((slot, _)), Some(sge)) = (credit, &credit_sge) {
            chain.push(self.cmd_request(slot, sge));
        }
        for r in ready {
            if let Some((local, remote)) = &r.write {
                chain.push(
                    SendRequest::new(wr_id(K_DATA, 0), SendOp::Write(*remote), local).unsignaled(),
                );
            }
            // Inline, the provider copies the parts into the work request
            // at the post, so they may change as soon as it returns.
            chain.push(r.msg.request(&r.sges[..r.n]));
        }
        if let Some(read) = &read {
            chain.push(read.request());
        }
        // SAFETY: inline parts are read at the post; written ranges stay
        // unchanged until the peer has their messages (the callers'
        // promise); staging ranges stay reserved until the peer returns
        // them, after the messages have landed; the command slot stays
        // untouched until its send completes. The chain points at none of
        // the state.
        unsafe { self.post_unlocked(st, &chain) }
    }

    /// Sends `msgs` in order, each as [`Connection::send_parts`] would, up
    /// to [`MESSAGES_PER_DOORBELL`] with one doorbell, as long as each finds
    /// room now. Returns how many were posted: the first of the rest found
    /// no room (or messages queued before it, or is empty or too large),
    /// and the caller sends it and those after it one by one with
    /// `send_parts`, which waits, queues or reports the error as it does
    /// for any message. An error means the connection failed. Another
    /// thread's messages may go between two doorbells of one batch.
    pub fn send_batch(&self, msgs: &[&[&[u8]]]) -> Result<usize> {
        // SAFETY: no writes.
        unsafe { self.post_batch(msgs.len(), |i| (msgs[i], None)) }
    }

    /// [`Connection::send_batch`], each message after its write, if it has
    /// one (a write and its message are two of a doorbell's work
    /// requests). The first message not posted, with its write, is the
    /// caller's to send with [`Connection::write_then_send`] (which also
    /// reports a write outside the registered buffers).
    ///
    /// # Safety
    /// As [`Connection::write_then_send`], for every write posted.
    pub unsafe fn write_then_send_batch(&self, msgs: &[BatchMessage<'_>]) -> Result<usize> {
        self.post_batch(msgs.len(), |i| msgs[i])
    }

    /// Posts messages `0..count` (`msg(i)`: its parts and its write) as
    /// [`Connection::write_then_send_batch`] describes.
    ///
    /// # Safety
    /// As [`Connection::write_then_send_batch`].
    unsafe fn post_batch<'m>(
        &self,
        count: usize,
        msg: impl Fn(usize) -> (&'m [&'m [u8]], Option<WriteAhead>),
    ) -> Result<usize> {
        // The writes' buffers are checked before the state lock is taken
        // (the registrations have a lock of their own); the batch ends
        // before the first that fails the check.
        let mut writes: SmallVec<[Option<(Sge, RemoteAddr)>; CHAIN]> = SmallVec::new();
        for i in 0..count {
            let Some(w) = msg(i).1 else {
                writes.push(None);
                continue;
            };
            match self.check_local(w.local_addr, w.lkey, w.len) {
                Ok(sge) if w.len > 0 => writes.push(Some((sge, w.remote))),
                _ => break,
            }
        }
        let count = writes.len();
        self.reap_credit_read();
        let mut posted = 0;
        while posted < count {
            let mut st = self.lock();
            let mut staged: SmallVec<[Ready; MESSAGES_PER_DOORBELL]> = SmallVec::new();
            // The places of a credit command and a credit READ are kept.
            let mut wrs = 2;
            for (i, &write) in writes.iter().enumerate().skip(posted) {
                let data = Parts::new(msg(i).0);
                wrs += 1 + usize::from(write.is_some());
                if wrs > CHAIN
                    || data.len() == 0
                    || !st.queue.is_empty()
                    || self.check_sendable(&st, data.len(), None).is_err()
                {
                    break;
                }
                let Some(offset) = Self::reserve(&mut st, data.len(), None, write.is_some()) else {
                    break;
                };
                match self.stage_ready(&mut st, offset, data, None, write) {
                    Ok(ready) => staged.push(ready),
                    Err(e) => {
                        // Ring places were taken that will never be filled.
                        drop(st);
                        self.fail(&format!("staging a batch of messages: {e}"));
                        return Err(e);
                    }
                }
            }
            if staged.is_empty() {
                break;
            }
            if let Err(e) = self.post_ready(st, &staged) {
                self.fail(&format!("posting a batch of messages: {e}"));
                return Err(e);
            }
            let stopped_early = posted + staged.len() < count && wrs <= CHAIN;
            posted += staged.len();
            if stopped_early {
                break;
            }
        }
        Ok(posted)
    }
}
