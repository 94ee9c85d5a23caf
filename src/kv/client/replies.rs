//! Matching replies to requests: the waiting callers by request id, ids
//! given up on (whose late replies release what they hold), and the handler
//! that files each reply.

use rustc_hash::{FxHashMap, FxHashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::kv::proto::{Reply, Request, COMPACT_REPLY_LEN, RELEASED_AT_MOST};
use crate::runtime::{ConnHandler, Connection, InRing};

/// By request id. FxHash, not SipHash: ids are ours (sequential), so
/// nobody can pick colliding ones, and SipHash on both sides of every
/// reply is a cost each request pays on its critical path.
pub(super) type ById<T> = FxHashMap<u64, T>;

/// Replies by request id, filled by whichever thread polls the connection
/// (a waiting caller, or the completion thread).
#[derive(Default)]
pub(super) struct Replies {
    pub(super) inbox: Mutex<Inbox>,
    pub(super) arrived: AtomicU64,
    pub(super) dead: AtomicBool,
    /// Whether `abandoned` may hold ids: spares the sending path the lock.
    pub(super) any_abandoned: AtomicBool,
    awaited: Awaited,
}

/// The request ids sent and not yet answered, counted in [`AWAITED_SLOTS`]
/// slots (an id counts in slot `id % AWAITED_SLOTS`): a reply to an id
/// whose slot counts none is the server's invention (or a second reply to
/// one request), which would otherwise be filed for nobody and kept, with
/// its payload, for good. Counts, not bits: ids that share a slot (one
/// request outstanding while thousands of others come and go) only let a
/// reply through unchecked, never refuse one. Two uncontended atomic
/// operations per request, no lock, no allocation.
struct Awaited(Box<[AtomicU32]>);

/// Slots of [`Awaited`]: 16 KiB per client.
const AWAITED_SLOTS: u64 = 4096;

impl Default for Awaited {
    fn default() -> Awaited {
        Awaited((0..AWAITED_SLOTS).map(|_| AtomicU32::new(0)).collect())
    }
}

impl Awaited {
    fn slot(&self, id: u64) -> &AtomicU32 {
        &self.0[(id % AWAITED_SLOTS) as usize]
    }

    fn sent(&self, id: u64) {
        self.slot(id).fetch_add(1, Ordering::AcqRel);
    }

    fn is_awaited(&self, id: u64) -> bool {
        self.slot(id).load(Ordering::Acquire) > 0
    }

    /// Whether `id` was awaited; it counts once less.
    fn answered(&self, id: u64) -> bool {
        self.slot(id)
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
    }
}

pub(super) struct Inbox {
    pub(super) ready: ById<(Reply, Vec<u8>)>,
    /// Requests whose callers gave up waiting: their replies, if they
    /// come, are dropped, and what they hold on the server is released.
    pub(super) abandoned: FxHashSet<u64>,
    /// Payload buffers callers handed back, for the next replies: a steady
    /// stream of inline replies allocates nothing.
    spare: Vec<Vec<u8>>,
    /// Callers' buffers that replies' payloads are copied straight into
    /// (`get_into`), by request id; written only under this lock, and only
    /// while the entry is here.
    landings: ById<Landing>,
}

impl Default for Inbox {
    fn default() -> Inbox {
        Inbox {
            // Twice the replies a batch's window can have waiting: a table
            // at most half full is rehashed in place when its deleted
            // entries use up its room, where a fuller one is grown (a new
            // table allocated, the old freed: `kv_get_bw`'s 0.06 to 0.19
            // allocations per batch in some runs).
            ready: ById::with_capacity_and_hasher(2 * super::BATCH_WINDOW, Default::default()),
            abandoned: FxHashSet::default(),
            spare: Vec::new(),
            landings: ById::default(),
        }
    }
}

/// A caller's buffer for a reply's payload, and how much landed in it.
struct Landing {
    at: usize,
    cap: usize,
    landed: Option<usize>,
}

/// Spare payload buffers kept, and the largest kept.
const SPARES: usize = 16;
const SPARE_UP_TO: usize = 64 << 10;

impl Replies {
    /// Gives up on request `id`: returns its reply if it came after all.
    pub(super) fn abandon(&self, id: u64) -> Option<(Reply, Vec<u8>)> {
        let mut inbox = self.inbox.lock().expect("reply lock");
        let reply = inbox.ready.remove(&id);
        if reply.is_none() {
            inbox.abandoned.insert(id);
            self.any_abandoned.store(true, Ordering::Release);
        }
        reply
    }

    /// Takes back a reply's payload buffer for a later reply.
    pub(super) fn recycle(&self, payload: Vec<u8>) {
        if payload.capacity() <= SPARE_UP_TO {
            let mut inbox = self.inbox.lock().expect("reply lock");
            if inbox.spare.len() < SPARES {
                inbox.spare.push(payload);
            }
        }
    }

    /// Has the payload of the reply to `id` copied straight into `buf` (if
    /// it fits) rather than into a buffer of the inbox; until
    /// [`Replies::unland`].
    ///
    /// # Safety
    /// `buf` must stay valid, and untouched by the caller, until
    /// [`Replies::unland`] for `id` has returned.
    pub(super) unsafe fn land(&self, id: u64, buf: &mut [u8]) {
        let landing = Landing {
            at: buf.as_mut_ptr() as usize,
            cap: buf.len(),
            landed: None,
        };
        self.inbox
            .lock()
            .expect("reply lock")
            .landings
            .insert(id, landing);
    }

    /// Ends the landing for `id`: how many bytes of payload landed, if the
    /// reply came and fit. No write reaches the buffer after this returns.
    pub(super) fn unland(&self, id: u64) -> Option<usize> {
        let mut inbox = self.inbox.lock().expect("reply lock");
        inbox.landings.remove(&id).and_then(|l| l.landed)
    }

    /// A request `id` is about to be sent: its reply is awaited.
    pub(super) fn sent(&self, id: u64) {
        self.awaited.sent(id);
    }

    /// Ids wrap: a request taking the id of one whose reply never came
    /// must not have its own reply dropped.
    pub(super) fn reuse(&self, id: u64) {
        if self.any_abandoned.load(Ordering::Acquire) {
            let mut inbox = self.inbox.lock().expect("reply lock");
            inbox.abandoned.remove(&id);
            if inbox.abandoned.is_empty() {
                self.any_abandoned.store(false, Ordering::Release);
            }
        }
    }
}

pub(super) struct ReplyHandler(pub(super) Arc<Replies>);

impl ConnHandler for ReplyHandler {
    /// A compact reply (status OK, a small inline value or none): a value
    /// for a caller waiting with its buffer (`get_into`) goes from the ring
    /// straight into the buffer, its one copy on this side; a reply with no
    /// value is filed from its header alone. Anything else goes to `recv`.
    fn recv_in_ring(&self, _conn: &Connection, msg: &InRing<'_>) -> bool {
        let mut head = [0u8; COMPACT_REPLY_LEN];
        if !msg.read(0, &mut head) {
            return false;
        }
        let payload_len = msg.len() - COMPACT_REPLY_LEN;
        let Some(reply) = Reply::decode_compact(&head, payload_len) else {
            return false;
        };
        // Not awaited: `recv`'s to refuse.
        if !self.0.awaited.is_awaited(reply.req_id) {
            return false;
        }
        let mut inbox = self.0.inbox.lock().expect("reply lock");
        // A reply its caller gave up on is `recv`'s to drop.
        if inbox.abandoned.contains(&reply.req_id) {
            return false;
        }
        match inbox.landings.get_mut(&reply.req_id) {
            Some(l) if l.landed.is_none() && payload_len <= l.cap => {
                // SAFETY: the caller keeps the buffer for us until it ends
                // the landing, which takes this lock (Replies::land).
                let dst = unsafe { std::slice::from_raw_parts_mut(l.at as *mut u8, payload_len) };
                if !msg.read_payload(COMPACT_REPLY_LEN, dst) {
                    return false;
                }
                l.landed = Some(payload_len);
            }
            _ if payload_len == 0 => {}
            _ => return false,
        }
        self.0.awaited.answered(reply.req_id);
        inbox.ready.insert(reply.req_id, (reply, Vec::new()));
        drop(inbox);
        self.0.arrived.fetch_add(1, Ordering::Release);
        true
    }

    fn recv(&self, conn: &Connection, data: &[u8], _imm: Option<u32>) {
        // A server that breaks the protocol is not believed again: its
        // callers fail now rather than at their timeouts.
        // Failed, not closed: a close would wait on this thread for
        // queued releases to drain, which such a server may never let.
        let broken = |why: &str| {
            self.0.dead.store(true, Ordering::Release);
            conn.fail(why);
        };
        let Ok((reply, payload)) = Reply::decode(data) else {
            return broken("the server sent a malformed reply");
        };
        if !self.0.awaited.answered(reply.req_id) {
            return broken("the server answered a request nobody awaits");
        }
        let mut inbox = self.0.inbox.lock().expect("reply lock");
        if inbox.abandoned.remove(&reply.req_id) {
            drop(inbox);
            // A lease or write target nobody will use: ended now, rather
            // than held until we disconnect (and counted against our
            // limit of targets meanwhile).
            // On this connection's polling thread the send never waits: a
            // full ring queues it.
            if reply.status == 0 && reply.lease != 0 {
                send_releases(conn, &[reply.lease]);
            }
            return;
        }
        if let Some(l) = inbox.landings.get_mut(&reply.req_id) {
            if l.landed.is_none() && payload.len() <= l.cap {
                // SAFETY: the caller keeps the buffer for us until it ends
                // the landing, which takes this lock (Replies::land).
                let dst = unsafe { std::slice::from_raw_parts_mut(l.at as *mut u8, payload.len()) };
                crate::copy::copy(dst, payload);
                l.landed = Some(payload.len());
                inbox.ready.insert(reply.req_id, (reply, Vec::new()));
                drop(inbox);
                self.0.arrived.fetch_add(1, Ordering::Release);
                return;
            }
        }
        let mut copy = match payload.is_empty() {
            true => Vec::new(),
            false => inbox.spare.pop().unwrap_or_default(),
        };
        copy.clear();
        crate::copy::extend(&mut copy, payload);
        inbox.ready.insert(reply.req_id, (reply, copy));
        drop(inbox);
        self.0.arrived.fetch_add(1, Ordering::Release);
    }

    fn disconnected(&self, _conn: &Connection) {
        self.0.dead.store(true, Ordering::Release);
    }
}

/// Ends leases or write targets, up to [`RELEASED_AT_MOST`] in one
/// message (a batch's leases in one, not one per value). Releases get no reply, so they take no request id; losing one
/// only keeps the memory a little longer (until we disconnect).
pub(super) fn send_releases(conn: &Connection, leases: &[u64]) {
    for part in leases.chunks(RELEASED_AT_MOST) {
        let mut words = [0u8; (RELEASED_AT_MOST - 1) * 8];
        let (release, more) = Request::release(part, &mut words);
        let header = release.header(more.len(), 0);
        let _ = conn.send_parts(&[header.as_slice(), more]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(id: u64) -> (Reply, Vec<u8>) {
        let r = Reply {
            req_id: id,
            ..Reply::default()
        };
        (r, b"late".to_vec())
    }

    #[test]
    fn only_ids_sent_and_not_yet_answered_are_awaited() {
        let a = Awaited::default();
        assert!(!a.is_awaited(7), "never sent");
        a.sent(7);
        a.sent(8);
        assert!(a.is_awaited(7) && a.is_awaited(8));
        assert!(a.answered(7));
        assert!(!a.answered(7), "a second reply to one request");
        assert!(a.is_awaited(8), "another request's count is kept");
        // Ids past the 32-bit wrap land on their own slots again.
        a.sent(u64::from(u32::MAX));
        assert!(a.answered(u64::from(u32::MAX)));
        assert!(!a.is_awaited(0));
    }

    #[test]
    fn ids_sharing_a_slot_never_refuse_a_reply() {
        let a = Awaited::default();
        let (old, new) = (5, 5 + AWAITED_SLOTS);
        a.sent(old); // outstanding a long time
        a.sent(new);
        assert!(a.answered(new));
        assert!(a.answered(old), "the old request's reply still counts");
        assert!(!a.answered(old));
    }

    #[test]
    fn an_abandoned_id_is_remembered_until_reused() {
        let replies = Replies::default();
        // A reply that came at the last moment is still taken.
        replies.inbox.lock().unwrap().ready.insert(1, reply(1));
        assert_eq!(replies.abandon(1).unwrap().1, b"late");
        assert!(!replies.any_abandoned.load(Ordering::Acquire));
        // One that has not come is remembered, so its reply is dropped.
        assert!(replies.abandon(2).is_none());
        assert!(replies.inbox.lock().unwrap().abandoned.contains(&2));
        replies.reuse(3);
        assert!(replies.inbox.lock().unwrap().abandoned.contains(&2));
        // Until a new request takes its id after the ids wrap.
        replies.reuse(2);
        assert!(replies.inbox.lock().unwrap().abandoned.is_empty());
        assert!(!replies.any_abandoned.load(Ordering::Acquire));
    }
}
