//! Answering requests: GET (inline or leased), PUT (inline, staged or
//! into a write target), CAS, DELETE, ALLOC, RELEASE and HELLO.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use smallvec::SmallVec;

use crate::kv::proto::{
    is_inline, Header, Op, Reply, Request, ServerInfo, Source, BLOCK_HEADER_LEN, RELEASED_AT_MOST,
};
use crate::kv::store::{Block, Target};
use crate::kv::{check_key, KvError, Result, MAX_KEY_LEN};
use crate::runtime::{Connection, Window};
use crate::verbs::AccessFlags;

use super::targets::{NoRoom, MAX_TARGETS};
use super::{bump, ClientState, Shared, MAX_LEASES};

/// A reply, and what its header is followed by on the wire.
pub(super) struct Answer {
    reply: Reply,
    payload: Payload,
}

enum Payload {
    Empty,
    /// An inline GET's value, sent from its block as it is (the block is
    /// held until then).
    Value(Arc<Block>, usize),
    /// HELLO's server information.
    Info(Vec<u8>),
}

impl Answer {
    pub(super) fn plain(reply: Reply) -> Answer {
        Answer {
            reply,
            payload: Payload::Empty,
        }
    }

    /// The reply's header, and the payload that follows it.
    fn parts(&self) -> (Header, &[u8]) {
        let payload = match &self.payload {
            Payload::Empty => &[][..],
            Payload::Value(block, key_len) => block.value(*key_len),
            Payload::Info(info) => info,
        };
        (self.reply.header(payload), payload)
    }

    /// Sends the reply on `conn`: its header and payload gathered straight
    /// into the connection's ring.
    pub(super) fn send(&self, conn: &Connection) -> crate::runtime::Result<usize> {
        let (header, payload) = self.parts();
        conn.send_parts(&[header.as_slice(), payload])
    }
}

/// Replies sent with one doorbell: as many as one round of completions
/// delivers requests.
pub(super) const REPLIES_PER_DOORBELL: usize = 32;

impl Shared {
    /// Sends `answers` on `conn`, up to [`REPLIES_PER_DOORBELL`] with one
    /// doorbell; those that find no room go one by one, as [`Shared::reply`]
    /// sends any reply.
    pub(super) fn reply_all(&self, conn: &Connection, client: &ClientState, answers: &[Answer]) {
        if let [one] = answers {
            return self.reply(conn, client, one);
        }
        for chunk in answers.chunks(REPLIES_PER_DOORBELL) {
            let parts: SmallVec<[(Header, &[u8]); REPLIES_PER_DOORBELL]> =
                chunk.iter().map(Answer::parts).collect();
            let pieces: SmallVec<[[&[u8]; 2]; REPLIES_PER_DOORBELL]> = parts
                .iter()
                .map(|(header, payload)| [header.as_slice(), *payload])
                .collect();
            let msgs: SmallVec<[&[&[u8]]; REPLIES_PER_DOORBELL]> =
                pieces.iter().map(|p| &p[..]).collect();
            let posted = match conn.send_batch(&msgs) {
                Ok(n) => n,
                Err(e) => return self.reply_failed(conn, client, &e),
            };
            for answer in &chunk[posted..] {
                if client.gone.load(Ordering::Acquire) {
                    // A reply found the connection ended: no more.
                    return;
                }
                self.reply(conn, client, answer);
            }
        }
    }
}

impl Shared {
    /// The reply to a request (`None`: it takes none).
    pub(super) fn answer(
        &self,
        conn: &Connection,
        client: &ClientState,
        req: &Request,
        key: &[u8],
        inline: &[u8],
    ) -> Option<Answer> {
        let id = req.req_id;
        if req.op == Op::Release {
            // Leases and write targets are numbered from one counter, so a
            // number names one or the other. What they hold is let go once
            // the locks are: unmapping a large value takes long, and the
            // completion thread takes these locks for the client's next
            // requests meanwhile (every client waits on that thread).
            let mut values: SmallVec<[Arc<Block>; RELEASED_AT_MOST]> = SmallVec::new();
            let mut targets: SmallVec<[Target; MAX_TARGETS]> = SmallVec::new();
            {
                let mut leased = client.leases.lock().expect("lease lock");
                let mut targeted = client.targets.lock().expect("target lock");
                for n in req.released(key) {
                    match leased.remove(n) {
                        Some(value) => values.push(value),
                        None => targets.extend(targeted.take(n)),
                    }
                }
            }
            // A lease ends here, at once. Unregistering and unmapping a
            // write target (which a client asks for without writing a
            // byte) goes to the housekeeping thread.
            drop(values);
            if !targets.is_empty() {
                self.discard(targets);
            }
            return None;
        }
        if req.op == Op::Hello {
            return Some(self.hello(client, id));
        }
        // Taken before anything is checked, so a PUT naming a target ends
        // it whether it is stored or refused: the target stopped counting
        // against the client's share when the PUT was queued (`targets`).
        let target = self.target_named(client, req);
        if let Err(e) = check_key(key) {
            bump(&self.counters.errors);
            return Some(Answer::plain(Reply::error(id, e)));
        }
        let result = match req.op {
            Op::Get => return Some(self.get(client, id, key)),
            Op::Write => {
                let stored = self.write(client, req, key, inline, target);
                return Some(self.written(id, stored));
            }
            Op::Alloc => self.alloc(conn, client, req, key),
            Op::Delete => {
                bump(&self.counters.deletes);
                self.store.delete(key).map(|()| Reply::default())
            }
            Op::Hello | Op::Release => unreachable!("handled above"),
        };
        let reply = match result {
            Ok(mut r) => {
                r.req_id = id;
                r
            }
            Err(e) => self.error_reply(id, e),
        };
        Some(Answer::plain(reply))
    }

    /// The answer to a write of request `id` that stored `result`.
    pub(super) fn written(&self, id: u64, result: Result<u64>) -> Answer {
        Answer::plain(match result {
            Ok(version) => Reply {
                req_id: id,
                version,
                ..Reply::default()
            },
            Err(e) => self.error_reply(id, e),
        })
    }

    /// Stores a plain PUT (request `id`) whose key and value `fill` writes
    /// straight into their block; its answer.
    pub(super) fn put_filled(
        &self,
        id: u64,
        key_len: usize,
        value_len: usize,
        fill: impl FnOnce(&mut [u8]) -> bool,
    ) -> Answer {
        let result = self.store.put_filled(key_len, value_len, fill, None, None);
        if result.is_ok() {
            bump(&self.counters.puts);
        }
        self.written(id, result)
    }

    pub(super) fn error_reply(&self, id: u64, e: KvError) -> Reply {
        let mut r = Reply::error(id, e.clone());
        match e {
            KvError::CasFailed { current } => {
                bump(&self.counters.cas_failed);
                r.version = current;
            }
            KvError::ValueTooLong { max } => r.value_len = max,
            KvError::NotFound => {}
            other => {
                bump(&self.counters.errors);
                log::debug!("request {id} failed: {other}");
            }
        }
        r
    }

    pub(super) fn hello(&self, client: &ClientState, id: u64) -> Answer {
        let Some(dev) = self.store.device() else {
            return Answer::plain(Reply::error(id, KvError::Internal("no device".into())));
        };
        let Some(request_buf) = client.request_buf.get().map(Window::remote) else {
            return Answer::plain(Reply::error(
                id,
                KvError::Internal("no request buffer".into()),
            ));
        };
        let info = ServerInfo {
            request_buf: request_buf.addr,
            request_buf_len: request_buf.len,
            request_buf_rkey: request_buf.rkey,
            index_addr: dev.index_mr.addr(),
            index_rkey: dev.index_mr.rkey(),
            buckets: self.store.index().buckets() as u64,
            pool_rkey: dev.pool_mr.rkey(),
            max_key: MAX_KEY_LEN as u32,
            max_value: self.store.max_value,
        };
        Answer {
            reply: Reply {
                req_id: id,
                ..Reply::default()
            },
            payload: Payload::Info(info.encode()),
        }
    }

    pub(super) fn get(&self, client: &ClientState, id: u64, key: &[u8]) -> Answer {
        bump(&self.counters.gets);
        let (block, version) = match self.store.get(key) {
            Ok(found) => found,
            Err(e) => {
                if e == KvError::NotFound {
                    bump(&self.counters.get_misses);
                }
                return Answer::plain(self.error_reply(id, e));
            }
        };
        let value_len = block.len() - BLOCK_HEADER_LEN - key.len();
        let mut reply = Reply {
            req_id: id,
            version,
            value_len: value_len as u64,
            ..Reply::default()
        };
        if is_inline(key.len(), value_len) {
            return Answer {
                reply,
                payload: Payload::Value(block, key.len()),
            };
        }
        // The client READs the block; it stays allocated until it says it
        // is done (or goes away).
        let lease = client.next_token.fetch_add(1, Ordering::Relaxed);
        reply.remote = true;
        reply.addr = block.addr();
        reply.rkey = block.rkey();
        reply.lease = lease;
        let cap = self.limit(|l| l.lease_bytes);
        let ended = client
            .leases
            .lock()
            .expect("lease lock")
            .insert(lease, block, cap, MAX_LEASES);
        if ended > 0 {
            self.counters
                .leases_capped
                .fetch_add(ended, Ordering::Relaxed);
            self.episodes.leases.hit(|| {
                format!("a client holds leases of more than {cap} bytes: its oldest ones end")
            });
        }
        Answer::plain(reply)
    }

    /// Stores a PUT; `target` is the write target it names, taken from the
    /// client's list ([`Self::target_named`]).
    pub(super) fn write(
        &self,
        client: &ClientState,
        req: &Request,
        key: &[u8],
        inline: &[u8],
        target: Option<Target>,
    ) -> Result<u64> {
        self.store.check_value_len(req.value_len)?;
        let result = match req.source {
            Source::Inline => self.store.put(key, inline, req.cas),
            Source::Staged { offset, checksum } => {
                let buf = client
                    .request_buf
                    .get()
                    .ok_or_else(|| KvError::Internal("no request buffer".into()))?
                    .region();
                let range = usize::try_from(offset)
                    .ok()
                    .and_then(|start| Some(start..start.checked_add(req.value_len as usize)?))
                    .filter(|r| r.end <= buf.len())
                    .ok_or_else(|| {
                        KvError::InvalidArgument(
                            "the staged value is outside the request buffer".into(),
                        )
                    })?;
                // The client can write its buffer again at any moment: the
                // value is copied once, straight into its block, and the
                // copy is checked there before it is published.
                self.store.put_filled(
                    key.len(),
                    range.len(),
                    |block| {
                        let (k, v) = block.split_at_mut(key.len());
                        k.copy_from_slice(key);
                        let read = buf.copy_out_to(range.start, v);
                        if read {
                            crate::costs::copied_if_any(v.len());
                        }
                        read
                    },
                    Some(checksum),
                    req.cas,
                )
            }
            Source::Allocated { .. } => {
                let target = target
                    .ok_or_else(|| KvError::InvalidArgument("unknown write target".into()))?;
                if target.value_len() as u64 != req.value_len {
                    return Err(KvError::InvalidArgument(
                        "the length differs from the target's".into(),
                    ));
                }
                self.store.commit(key, target, req.cas)
            }
        };
        match (&result, req.cas) {
            (Ok(_), Some(_)) => bump(&self.counters.cas_ok),
            (Ok(_), None) => bump(&self.counters.puts),
            _ => {}
        }
        result
    }

    /// The write target a PUT names, taken from the client's list.
    fn target_named(&self, client: &ClientState, req: &Request) -> Option<Target> {
        let token = committed_token(req)?;
        client.targets.lock().expect("target lock").take(token)
    }

    /// A request queued for the worker that takes write targets (a PUT
    /// that commits one, a RELEASE): they no longer count against the
    /// client's share (`targets`). The worker takes them whatever it makes
    /// of the request ([`Self::target_named`], the RELEASE in
    /// [`Self::answer`]), before any target asked for after.
    pub(super) fn targets_leaving(&self, client: &ClientState, req: &Request, key: &[u8]) {
        let committed = committed_token(req);
        if committed.is_none() && req.op != Op::Release {
            return;
        }
        let mut targets = client.targets.lock().expect("target lock");
        match committed {
            Some(token) => targets.leaving(token),
            None => req.released(key).for_each(|n| targets.leaving(n)),
        }
    }

    /// Room for an ALLOC's target, reserved as it arrives (completion
    /// thread), before it waits for a worker (`targets`); false, and the
    /// refusal counted and logged, when there is none. Every ALLOC taken
    /// is answered by [`Self::alloc`], which gives the room back.
    pub(super) fn reserve_target(&self, client: &ClientState, req: &Request) -> bool {
        let cap = self.limit(|l| l.target_bytes);
        let Ok(len) = self.reservation(req.value_len) else {
            return true; // Too long: `alloc` says so, and reserves nothing.
        };
        let refused = client
            .targets
            .lock()
            .expect("target lock")
            .reserve(len, cap);
        match refused {
            Ok(()) => true,
            Err(NoRoom::Count) => false,
            Err(NoRoom::Bytes { has, cap }) => {
                bump(&self.counters.targets_capped);
                self.episodes.targets.hit(|| {
                    format!(
                        "refusing a client a {len}-byte write target: it holds or has asked for \
                         {has} bytes of them, and may have {cap}"
                    )
                });
                false
            }
        }
    }

    /// What an ALLOC of `value_len` bytes reserves; an error, and nothing
    /// reserved, for a value the server never takes, which [`Self::alloc`]
    /// refuses as such, whatever the client holds.
    fn reservation(&self, value_len: u64) -> Result<u64> {
        self.store.check_value_len(value_len).map(|()| value_len)
    }

    /// Makes the target an ALLOC reserved room for ([`Self::reserve_target`]).
    pub(super) fn alloc(
        &self,
        conn: &Connection,
        client: &ClientState,
        req: &Request,
        key: &[u8],
    ) -> Result<Reply> {
        let reserved = self.reservation(req.value_len)?;
        // Made without the lock: registering a large target takes long, and
        // the completion thread takes the lock when the client goes away.
        // Writable through a window on this client's QP only.
        let made = self.store.target(key.len(), req.value_len, |mr| {
            conn.expose(mr, AccessFlags::REMOTE_WRITE).map_err(|e| {
                log::warn!("exposing a write target: {e}");
                KvError::NoMemory
            })
        });
        let mut targets = client.targets.lock().expect("target lock");
        match made {
            Ok(target) if !client.gone.load(Ordering::Acquire) => {
                let token = client.next_token.fetch_add(1, Ordering::Relaxed);
                let reply = Reply {
                    addr: target.value_addr(),
                    rkey: target.rkey(),
                    value_len: req.value_len,
                    lease: token,
                    ..Reply::default()
                };
                targets.answered(reserved, Some((token, target)));
                Ok(reply)
            }
            // Gone meanwhile: its targets were ended, and this one ends
            // here, once the lock is let go (unregistering takes long).
            other => {
                targets.answered(reserved, None);
                drop(targets);
                other.and(Err(KvError::NoMemory))
            }
        }
    }
}

/// The write target a PUT commits, if it names one.
fn committed_token(req: &Request) -> Option<u64> {
    match (req.op, req.source) {
        (Op::Write, Source::Allocated { token }) => Some(token),
        _ => None,
    }
}
