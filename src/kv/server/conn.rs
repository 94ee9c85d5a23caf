//! One client's connection on the server: its requests come in on the
//! completion thread (small PUTs stored straight from the ring, heavy
//! requests handed to a worker), and the answers of one round of
//! completions go out together at its end.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crate::kv::proto::{Op, Request, Source, COMPACT_REQUEST_LEN};
use crate::kv::{check_key, KvError};
use crate::runtime::{self, ConnHandler, Connection, InRing};
use crate::verbs::AccessFlags;

use super::answer::Answer;
use super::{ClientState, Job, Shared};

pub(super) struct ServerConn {
    shared: Arc<Shared>,
    client: Arc<ClientState>,
    /// Answers to the requests of the round of completions being
    /// delivered, sent together at its end (`round_done`).
    held: Mutex<Vec<Answer>>,
}

impl ServerConn {
    pub(super) fn new(shared: Arc<Shared>, client: Arc<ClientState>) -> ServerConn {
        ServerConn {
            shared,
            client,
            held: Mutex::new(Vec::new()),
        }
    }

    /// Holds `answer` until the round's end.
    fn hold(&self, answer: Answer) {
        self.held.lock().expect("held lock").push(answer);
    }
}

impl ConnHandler for ServerConn {
    fn recv(&self, conn: &Connection, data: &[u8], _imm: Option<u32>) {
        let client = &self.client;
        if client.gone.load(Ordering::Acquire) {
            return; // Being closed: nothing more is answered.
        }
        // Parsed once here; only requests handed to a worker are parsed
        // again there (they are copied out of the ring anyway).
        let parts = match Request::decode(data) {
            Ok(parts) => parts,
            Err(why) => return self.shared.drop_malformed(conn, client, why),
        };
        let req = &parts.0;
        let heavy = req.op == Op::Alloc || (req.op == Op::Write && req.source != Source::Inline);
        let queued = client.queued.load(Ordering::Acquire);
        let full = queued >= self.shared.limit(|l| l.client_jobs);
        // For a worker: heavy, or behind the client's requests already there.
        let for_worker = heavy || queued > 0;
        if full && req.op != Op::Release && for_worker {
            return self.shared.refuse_busy(conn, client, req.req_id, queued);
        }
        // Room for its target is reserved now, not when a worker comes to
        // it: see `targets`. One with a bad key is refused before `alloc`,
        // which gives the room back, so it reserves none.
        if req.op == Op::Alloc
            && check_key(parts.1).is_ok()
            && !self.shared.reserve_target(client, req)
        {
            let refusal = self.shared.error_reply(req.req_id, KvError::NoMemory);
            return self.hold(Answer::plain(refusal));
        }
        // A release is always taken: behind the client's queued requests
        // while there is room, at once beyond (one for a lease a queued
        // request has yet to give then ends nothing, and that lease
        // expires), so a stream of releases cannot grow the queue.
        if for_worker && !full {
            let tx = {
                let jobs = self.shared.jobs.lock().expect("jobs lock");
                jobs.get(client.worker % jobs.len().max(1)).cloned()
            };
            if let Some(tx) = tx {
                client.queued.fetch_add(1, Ordering::AcqRel);
                let job = Job {
                    conn: conn.clone(),
                    client: client.clone(),
                    msg: self.shared.job_message(data),
                };
                if self.shared.queue_job(&tx, job) {
                    return self.shared.targets_leaving(client, req, parts.1);
                }
                client.queued.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let (req, key, inline) = parts;
        if let Some(answer) = self.shared.answer(conn, client, &req, key, inline) {
            self.hold(answer);
        }
    }

    fn round_done(&self, conn: &Connection) {
        let mut held = {
            let mut slot = self.held.lock().expect("held lock");
            if slot.is_empty() {
                return;
            }
            std::mem::take(&mut *slot)
        };
        self.shared.reply_all(conn, &self.client, &held);
        held.clear();
        // Back with its room, unless a callback that waited (and so
        // delivered a round of its own meanwhile) held more.
        let mut slot = self.held.lock().expect("held lock");
        if slot.is_empty() {
            *slot = held;
        }
    }

    /// A plain small PUT (a compact request, its value inline) is stored
    /// from the ring: its key and value go straight into their new block,
    /// their one copy on this side. Anything else, and anything that must
    /// wait behind this client's queued requests, goes to `recv`.
    fn recv_in_ring(&self, _conn: &Connection, msg: &InRing<'_>) -> bool {
        let client = &self.client;
        if client.gone.load(Ordering::Acquire) || client.queued.load(Ordering::Acquire) > 0 {
            return false;
        }
        let mut head = [0u8; COMPACT_REQUEST_LEN];
        if !msg.read(0, &mut head) {
            return false;
        }
        let Some((id, key_len)) = Request::compact_put(&head, msg.len()) else {
            return false;
        };
        let value_len = msg.len() - COMPACT_REQUEST_LEN - key_len;
        let answer = self.shared.put_filled(id, key_len, value_len, |block| {
            msg.read_payload(COMPACT_REQUEST_LEN, block)
        });
        self.hold(answer);
        true
    }

    fn connected(&self, conn: &Connection) {
        // Bound now that the QP can send: before the client's first request
        // (RC keeps its advertisement ahead of it), and only its QP can use it.
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND;
        let window = conn
            .pd()
            .allocate(self.shared.cfg.request_buf_len, access)
            .map_err(runtime::Error::from)
            .and_then(|mr| conn.expose(mr, AccessFlags::REMOTE_WRITE));
        match window {
            Ok(w) => {
                let _ = self.client.request_buf.set(w);
            }
            Err(e) => {
                log::warn!("dropping {:?}: no request buffer: {e}", conn.peer_addr());
                // Not a close, which waits (up to a second) for its goodbye
                // to complete, on the thread that serves every client, and a
                // client that posts no receives holds the goodbye back.
                conn.drop_peer("no request buffer");
                self.shared.forget(&self.client);
            }
        }
    }

    fn disconnected(&self, _conn: &Connection) {
        self.shared.forget(&self.client);
        // Answers to messages delivered as the peer left: nobody to send
        // them to, and inline GETs' blocks are held until they go.
        self.held.lock().expect("held lock").clear();
    }

    fn retired(&self, _conn: &Connection) {
        self.shared.forget(&self.client);
        self.held.lock().expect("held lock").clear();
    }
}
