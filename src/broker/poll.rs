//! Polling: reaping send and receive completions into the callback,
//! reposting receives, and noticing peers that are gone.

use std::cell::RefMut;
use std::time::{Duration, Instant};

use super::peer::{self, Peer, Posted, Slot};
use super::{
    Broker, BrokerError, Callback, Event, EventKind, PollRoom, Result, CM_CHECK, POLL_BATCH,
};
use crate::verbs::{self, WcOpcode, WcStatus};

impl Broker {
    /// A peer that disconnected (RDMA CM) or closed its socket has failed: its QP is moved to
    /// the error state, so its operations flush. Looked at every CM_CHECK.
    fn check_cm(&self) {
        if self.last_cm_check.get().elapsed() < CM_CHECK {
            return;
        }
        self.last_cm_check.set(Instant::now());
        let by_id = |id: verbs::CmIdRef| {
            self.all()
                .iter()
                .flatten()
                .find(|p| p.cm_id.as_ref().is_some_and(|c| c.id_ref() == id))
        };
        for p in self.all().iter().flatten() {
            if let Some(why) = p.socket_end() {
                p.fail(&why);
            }
        }
        // Peers may share a channel: each is drained once, where it first
        // appears. Walked in place, not gathered: this runs every
        // CM_CHECK, and a steady broker allocates nothing.
        let peer_channels = || {
            self.all()
                .iter()
                .flatten()
                .filter_map(|p| p.cm_id.as_ref().map(|c| c.channel()))
        };
        let channels = peer_channels().enumerate().filter(|&(i, ch)| {
            !peer_channels()
                .take(i)
                .any(|earlier| earlier.fd() == ch.fd())
        });
        let listener = self
            .listener()
            .map(|l| l.channel())
            .filter(|l| !peer_channels().any(|ch| ch.fd() == l.fd()));
        for ch in channels.map(|(_, ch)| ch).chain(listener) {
            while let Ok(ev) = ch.get_event(Duration::ZERO) {
                if ev.kind == verbs::CmEventKind::CONNECT_REQUEST {
                    // The mesh is complete; a late request is refused.
                    let mut ev = ev;
                    if let Some(id) = ev.take_new_id() {
                        let _ = id.reject(&[]);
                    }
                } else if let Some(p) = by_id(ev.id) {
                    p.fail(&format!("RDMA CM reported {}", ev.kind));
                }
            }
        }
    }

    fn targets(&self, server: Option<usize>) -> Result<impl Iterator<Item = &Peer>> {
        self.check_owner()?;
        self.check_cm();
        let all = self.all();
        let range = match server {
            Some(s) => {
                all.get(s)
                    .and_then(Option::as_ref)
                    .ok_or(BrokerError::NoSuchPeer(s))?;
                s..s + 1
            }
            None => 0..all.len(),
        };
        Ok(all[range].iter().flatten())
    }

    /// The callback, for a poll to run; [`BrokerError::Reentrant`] while a
    /// callback runs (the poll that runs it holds it), so a poll from
    /// inside a callback is refused.
    fn borrow_callback(&self) -> Result<RefMut<'_, Callback>> {
        self.callback
            .try_borrow_mut()
            .map_err(|_| BrokerError::Reentrant)
    }

    /// Whether a callback of this broker is running (on its owner thread:
    /// the only one that polls).
    pub fn in_callback(&self) -> bool {
        self.borrow_callback().is_err()
    }

    /// Reaps send completions (of one server, or all): runs the callback for
    /// each finished operation and frees its slot. Returns how many
    /// operations finished.
    pub fn poll_sq(&self, server: Option<usize>) -> Result<u32> {
        let mut cb = self.borrow_callback()?;
        let peers = self.targets(server)?;
        // Kept between polls, and given back however the poll ends:
        // finishing operations allocates nothing.
        let mut done = self.finished.take();
        let mut room = self.take_room();
        let reaped = self.reap_sends(peers, &mut done, &mut room, &mut cb);
        self.finished.set(done);
        self.room.set(Some(room));
        reaped
    }

    /// [`Broker::poll_sq`]'s work on `peers`, with the kept lists.
    fn reap_sends<'a>(
        &'a self,
        peers: impl Iterator<Item = &'a Peer>,
        done: &mut Vec<Posted>,
        room: &mut PollRoom,
        cb: &mut Callback,
    ) -> Result<u32> {
        let mut n = 0;
        for peer in peers {
            for wc in room.poll(&peer.send_cq)? {
                let failed = peer::failed(peer, wc);
                {
                    let mut send = peer.send.borrow_mut();
                    while send
                        .posted
                        .front()
                        .is_some_and(|p| p.seq <= wc.wr_id() || failed)
                    {
                        let p = send.posted.pop_front().expect("checked");
                        send.in_queue -= 1;
                        if let Some(s) = p.slot {
                            send.slots[s as usize] = Slot::Free;
                        }
                        done.push(p);
                    }
                }
                if failed {
                    // Logged by `failed`. The QP is in the error state
                    // already; the peer is told now, not when its own next
                    // operation finds it.
                    peer.stop();
                }
                for p in done.drain(..) {
                    let bad = failed && p.seq >= wc.wr_id();
                    let ev = Event {
                        kind: if bad { EventKind::Failed } else { p.kind },
                        peer: peer.server,
                        wr_id: p.seq,
                        buf: &[],
                        imm: None,
                        status: if bad { wc.status() } else { WcStatus::SUCCESS },
                    };
                    if bad {
                        let c = &self.shared.stats.failed_ops;
                        c.set(c.get() + 1);
                    }
                    n += 1;
                    cb(self, &ev);
                }
            }
            if peer.failed.get() {
                self.report_down(peer, cb);
            }
        }
        Ok(n)
    }

    /// Reaps receives (of one server, or all): runs the callback on each
    /// message, reposts the slots, then posts every queued send, so replies
    /// made in the callback go out in the same poll. Returns how many
    /// messages arrived.
    pub fn poll_rq(&self, server: Option<usize>) -> Result<u32> {
        let mut cb = self.borrow_callback()?;
        let peers = self.targets(server)?;
        let mut room = self.take_room();
        let received = self.reap_recvs(peers, &mut room, &mut cb);
        drop(cb);
        self.room.set(Some(room));
        let n = received?;
        self.flush_all()?;
        Ok(n)
    }

    /// [`Broker::poll_rq`]'s work on `peers`, with the kept room.
    fn reap_recvs<'a>(
        &'a self,
        peers: impl Iterator<Item = &'a Peer>,
        room: &mut PollRoom,
        cb: &mut Callback,
    ) -> Result<u32> {
        let mut n = 0;
        for peer in peers {
            let wcs = room.poll(&peer.recv_cq)?;
            let mut repost = [0u32; POLL_BATCH];
            let mut reposts = 0;
            for wc in wcs {
                if peer::failed(peer, wc) {
                    peer.stop();
                    continue;
                }
                let slot = wc.wr_id() as u32;
                let buf = if wc.opcode() == WcOpcode::RECV_RDMA_WITH_IMM {
                    &[][..]
                } else {
                    &peer.recv_slot(&self.shared, slot)[..wc.byte_len() as usize]
                };
                let ev = Event {
                    kind: EventKind::Recv,
                    peer: peer.server,
                    wr_id: u64::from(slot),
                    buf,
                    imm: wc.imm(),
                    status: WcStatus::SUCCESS,
                };
                let c = &self.shared.stats.recvs;
                c.set(c.get() + 1);
                n += 1;
                cb(self, &ev);
                repost[reposts] = slot;
                reposts += 1;
            }
            if peer.failed.get() {
                self.report_down(peer, cb);
            } else if reposts > 0 {
                peer::post_recvs(
                    &self.shared,
                    &peer.qp,
                    peer.server,
                    repost[..reposts].iter().copied(),
                )?;
            }
        }
        Ok(n)
    }

    /// The room kept from the last poll, taken out of its cell while a
    /// poll uses it (a nested poll, refused before it gets here, would
    /// make a new one). A poll that failed leaves the room sound: its next
    /// poll clears all it offered.
    fn take_room(&self) -> Box<PollRoom> {
        self.room.take().unwrap_or_default()
    }

    fn report_down(&self, peer: &Peer, cb: &mut Callback) {
        let mut down = self.down_reported.borrow_mut();
        if std::mem::replace(&mut down[peer.server], true) {
            return;
        }
        drop(down);
        cb(
            self,
            &Event {
                kind: EventKind::PeerDown,
                peer: peer.server,
                wr_id: 0,
                buf: &[],
                imm: None,
                status: WcStatus::WR_FLUSH_ERR,
            },
        );
    }
}
