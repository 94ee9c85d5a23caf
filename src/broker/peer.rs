//! One peer of a broker: its queue pair and completion queues, its ring of
//! send slots and its receive ring, the requests waiting for a doorbell and
//! those waiting for their signaled completion.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

use smallvec::SmallVec;

use super::mesh::Hello;
use super::{OpKind, Result, Shared};
use crate::verbs::{
    CmId, Completion, CompletionQueue, PreparedQp, QpCaps, QpInfo, QpOptions, QueuePair,
    RemoteRegion, SendOp, SendRequest, Sge,
};

/// Where a send slot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    Free,
    /// Given to the program by `send_buf`, not posted yet.
    Handed,
    /// Posted; free again when its signaled completion arrives.
    Posted,
}

/// A request waiting for the doorbell.
pub(crate) struct Pending {
    pub seq: u64,
    pub op: SendOp,
    pub sge: Sge,
    pub kind: OpKind,
    pub slot: Option<u32>,
}

/// A posted request waiting for a signaled completion at or after it.
pub(crate) struct Posted {
    pub seq: u64,
    pub kind: OpKind,
    pub slot: Option<u32>,
}

pub(crate) struct SendSide {
    pub slots: Vec<Slot>,
    /// The next slot to hand out, in ring order.
    pub next: u32,
    pub pending: Vec<Pending>,
    pub posted: VecDeque<Posted>,
    /// Requests in the send queue: posted and not yet completed.
    pub in_queue: usize,
    pub seq: u64,
}

pub(crate) struct Peer {
    pub server: usize,
    pub remote: RemoteRegion,
    // Field order: the QP goes before its CQs.
    pub qp: QueuePair,
    pub send_cq: CompletionQueue,
    pub recv_cq: CompletionQueue,
    pub send: RefCell<SendSide>,
    pub failed: Cell<bool>,
    /// The RDMA CM id (CM mode), to recognise its events.
    pub cm_id: Option<CmId>,
    /// The handshake's socket (socket mode), kept open: its end of file says
    /// the peer is gone.
    pub tcp: Option<std::net::TcpStream>,
}

impl Peer {
    /// Why the handshake's socket (socket mode) says the peer is gone, if
    /// it does: its end, an error, or bytes it may not send after the
    /// handshake. Does not block.
    pub(crate) fn socket_end(&self) -> Option<String> {
        use std::io::Read;
        let mut tcp = self.tcp.as_ref()?;
        match tcp.read(&mut [0u8; 1]) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
            Ok(0) => Some("its socket closed".into()),
            Ok(_) => Some("it sent bytes after the handshake".into()),
            Err(e) => Some(format!("its socket: {e}")),
        }
    }
}

/// A manually connected peer's QP before the handshake ends.
pub(crate) struct ManualPeer {
    qp: PreparedQp,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
}

fn caps(shared: &Shared) -> QpCaps {
    QpCaps {
        max_send_wr: shared.max_send_wr(),
        max_recv_wr: shared.config.slots,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    }
}

fn cqs(shared: &Shared) -> Result<(CompletionQueue, CompletionQueue)> {
    let ctx = shared.pd.context();
    Ok((
        ctx.create_cq(shared.max_send_wr() + 1, None)?,
        ctx.create_cq(shared.config.slots + 1, None)?,
    ))
}

impl Peer {
    fn new(
        shared: &Shared,
        hello: Hello,
        qp: QueuePair,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue,
    ) -> Peer {
        let slots = shared.config.slots as usize;
        // Sized for the most that can wait or be in flight: a steady
        // broker allocates nothing, not even when a burst sets a record.
        let most = shared.max_send_wr() as usize;
        Peer {
            server: hello.server_id as usize,
            remote: hello.region,
            qp,
            send_cq,
            recv_cq,
            send: RefCell::new(SendSide {
                slots: vec![Slot::Free; slots],
                next: 0,
                pending: Vec::with_capacity(most),
                posted: VecDeque::with_capacity(most),
                in_queue: 0,
                seq: 0,
            }),
            failed: Cell::new(false),
            cm_id: None,
            tcp: None,
        }
    }

    /// A peer on an RDMA CM id, its receives posted.
    pub(crate) fn on_cm(shared: &Shared, id: &CmId, hello: Hello) -> Result<Peer> {
        let (send_cq, recv_cq) = cqs(shared)?;
        let qp = id.create_qp(&shared.pd, &send_cq, &recv_cq, &caps(shared))?;
        let mut peer = Peer::new(shared, hello, qp, send_cq, recv_cq);
        peer.cm_id = Some(id.clone());
        post_recvs(
            shared,
            &peer.qp,
            hello.server_id as usize,
            0..shared.config.slots,
        )?;
        Ok(peer)
    }

    /// A QP for a socket handshake, its receives posted, and its endpoint.
    pub(crate) fn manual(shared: &Shared) -> Result<(ManualPeer, QpInfo)> {
        let (send_cq, recv_cq) = cqs(shared)?;
        let opts = QpOptions {
            caps: caps(shared),
            rnr_retry: 7,
            ..QpOptions::default()
        };
        let qp = shared.pd.create_rc_qp(&send_cq, &recv_cq, &opts)?;
        let info = qp.local_info()?;
        Ok((
            ManualPeer {
                qp,
                send_cq,
                recv_cq,
            },
            info,
        ))
    }

    /// The receive slot `slot` of this peer.
    pub(crate) fn recv_slot(&self, shared: &Shared, slot: u32) -> &[u8] {
        let (addr, len) = shared.recv_slot(self.server, slot);
        // SAFETY: the slot lies in the ring region, which the broker owns and
        // no peer can write (no remote access); the device wrote it before
        // the completion that led here, and it is reposted only after the
        // caller is done with this slice.
        unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
    }

    /// Posts the pending requests with one doorbell, all unsignaled but the
    /// last.
    pub(crate) fn flush(&self, shared: &Shared) -> Result<usize> {
        const CHAIN: usize = 64;
        let mut send = self.send.borrow_mut();
        let count = send.pending.len();
        if count == 0 {
            return Ok(0);
        }
        // Chained on the stack, CHAIN at a time (one doorbell each; a batch
        // is rarely longer), filled in place: only as many requests as
        // there are messages are built (a full array of CHAIN was ~4,000
        // instructions per flush of one message).
        for (c, chunk) in send.pending.chunks(CHAIN).enumerate() {
            let mut reqs: SmallVec<[SendRequest<'_>; CHAIN]> = SmallVec::new();
            reqs.extend(chunk.iter().enumerate().map(|(i, p)| {
                let r = SendRequest::new(p.seq, p.op, std::slice::from_ref(&p.sge));
                if c * CHAIN + i + 1 == count {
                    r
                } else {
                    r.unsignaled()
                }
            }));
            // SAFETY: every SGE is a send slot (handed to this request only)
            // or the data region, which the broker keeps registered until it
            // is dropped; the QP is flushed before that.
            let posted = unsafe { self.qp.post_send(&reqs) };
            shared.stats.doorbells.set(shared.stats.doorbells.get() + 1);
            if let Err(e) = posted {
                // Some may be on the wire without a signaled tail: the peer
                // is unusable from here on.
                self.fail(&format!("posting failed: {e}"));
                return Err(e.into());
            }
        }
        send.in_queue += count;
        let send = &mut *send;
        for p in send.pending.drain(..) {
            if let Some(s) = p.slot {
                send.slots[s as usize] = Slot::Posted;
            }
            send.posted.push_back(Posted {
                seq: p.seq,
                kind: p.kind,
                slot: p.slot,
            });
        }
        Ok(count)
    }
}

impl ManualPeer {
    /// Connects to `remote` and posts the receives.
    pub(crate) fn connect(self, shared: &Shared, hello: Hello, remote: &QpInfo) -> Result<Peer> {
        post_recvs(
            shared,
            self.qp.queue_pair(),
            hello.server_id as usize,
            0..shared.config.slots,
        )?;
        let qp = self.qp.connect(remote)?;
        Ok(Peer::new(shared, hello, qp, self.send_cq, self.recv_cq))
    }
}

/// Posts receives into `slots` of server `server`'s receive ring, chained
/// into one `ibv_post_recv`.
pub(crate) fn post_recvs(
    shared: &Shared,
    qp: &QueuePair,
    server: usize,
    slots: impl Iterator<Item = u32>,
) -> Result<()> {
    const CHAIN: usize = 64;
    let lkey = shared.rings.lkey();
    // Filled in place, as many as there are slots (a zeroed array of
    // CHAIN is 1.5 KiB to clear per poll).
    let mut recvs: SmallVec<[(u64, Sge); CHAIN]> = SmallVec::new();
    let post = |recvs: &[(u64, Sge)]| -> Result<()> {
        // SAFETY: the ring memory lives as long as the broker, which
        // outlives its QPs; each slot is reposted only after its message
        // was handled.
        unsafe { qp.post_recvs(recvs)? };
        shared
            .stats
            .recv_doorbells
            .set(shared.stats.recv_doorbells.get() + 1);
        Ok(())
    };
    for slot in slots {
        let (addr, len) = shared.recv_slot(server, slot);
        recvs.push((
            u64::from(slot),
            Sge {
                addr: addr as u64,
                length: len as u32,
                lkey,
            },
        ));
        if recvs.len() == CHAIN {
            post(&recvs)?;
            recvs.clear();
        }
    }
    if !recvs.is_empty() {
        post(&recvs)?;
    }
    Ok(())
}

impl Peer {
    /// Marks the peer failed and moves its QP to the error state, so what is
    /// in flight is flushed (and reported as failed by the next polls). The
    /// peer is told at once (a disconnect, or its socket shut down), rather
    /// than when its own next operation finds our QP gone: one waiting for
    /// our reply would otherwise wait for good.
    pub(crate) fn fail(&self, why: &str) {
        if !self.failed.get() {
            log::warn!("broker: server {} failed: {why}", self.server);
        }
        self.stop();
    }

    /// [`Peer::fail`] without a reason to log: the broker is going, or the
    /// failed completion that ends it was logged.
    pub(crate) fn stop(&self) {
        if self.failed.replace(true) {
            return;
        }
        if let Err(e) = self.qp.to_error() {
            log::debug!("broker: {e}");
        }
        if let Some(id) = &self.cm_id {
            let _ = id.disconnect();
        }
        if let Some(tcp) = &self.tcp {
            let _ = tcp.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Whether a completion failed; logs the first failure of a peer.
pub(crate) fn failed(peer: &Peer, wc: &Completion) -> bool {
    if wc.is_ok() {
        return false;
    }
    if !peer.failed.get() {
        log::warn!(
            "broker: server {} failed: work request {} completed with {}",
            peer.server,
            wc.wr_id(),
            wc.status()
        );
    }
    true
}
