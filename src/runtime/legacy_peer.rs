//! A peer that speaks only the legacy protocol (version 0), on raw verbs:
//! what a program built on the legacy library looks like from the wire. It
//! advertises its ring with version 0, never returns credit, and writes each
//! message at a byte offset that only grows, so it can send as much as the
//! receiver's ring holds in its whole life. Tests and `make bench` use it to
//! hold the runtime to the legacy contract; it is not a general endpoint.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::verbs::{
    AccessFlags, CmEventKind, CmId, Completion, CompletionQueue, ConnParam, MemoryRegion, QpCaps,
    QueuePair, RemoteRegion, SendOp, SendRequest, WcOpcode,
};

use super::proto::{Cmd, Opcode, CMD_LEN};
use super::{Error, Result, DEFAULT_RECV_BUF_LEN};

/// Receives posted, as the legacy library's `rdmaRecvDepth` default.
const RECV_DEPTH: u32 = 1024;
/// Send-queue depth (`RDMA_MAX_SGE`).
const SEND_DEPTH: u32 = 1024;
/// One signaled send per this many, so the send queue never fills.
const SIGNAL_EVERY: u64 = 64;
/// Work request id of sends; receives use their command slot.
const SEND_WR: u64 = u64::MAX;

/// One version-0 connection; see the module docs.
pub struct LegacyPeer {
    id: CmId,
    /// The listening id of an accepted connection, kept while it lives.
    _listener: Option<CmId>,
    cq: CompletionQueue,
    qp: QueuePair,
    ring: MemoryRegion,
    staging: MemoryRegion,
    cmds: MemoryRegion,
    peer_ring: Option<RemoteRegion>,
    /// Where the next message goes in the peer's ring; only grows.
    tx_offset: usize,
    unsignaled: u64,
}

impl LegacyPeer {
    /// Connects to a SnowRDMA server and exchanges rings.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<LegacyPeer> {
        let id = CmId::resolve(addr, None, timeout)?;
        let mut peer = LegacyPeer::build(id, None)?;
        peer.id.connect(&ConnParam::default())?;
        peer.id.expect_event(CmEventKind::ESTABLISHED, timeout)?;
        peer.start(timeout)?;
        Ok(peer)
    }

    /// Listens on `addr` and accepts one SnowRDMA client; `ready` is called
    /// once the listener is bound (with its address).
    pub fn accept(
        addr: SocketAddr,
        timeout: Duration,
        ready: impl FnOnce(SocketAddr),
    ) -> Result<LegacyPeer> {
        let listener = CmId::listen_on(addr, 8)?;
        ready(listener.local_addr().unwrap_or(addr));
        let (id, _) = listener.get_request(timeout)?;
        let mut peer = LegacyPeer::build(id, Some(listener))?;
        peer.id.accept(&ConnParam::default())?;
        peer.id.expect_event(CmEventKind::ESTABLISHED, timeout)?;
        peer.start(timeout)?;
        Ok(peer)
    }

    fn build(id: CmId, listener: Option<CmId>) -> Result<LegacyPeer> {
        let ctx = id
            .context()
            .ok_or_else(|| Error::InvalidArgument("the RDMA CM id has no device".into()))?;
        let pd = ctx.alloc_pd()?;
        // Event-driven, as the legacy library's completion thread is: idle,
        // it sleeps on the channel.
        let channel = ctx.create_comp_channel()?;
        let cq = ctx.create_cq(RECV_DEPTH + SEND_DEPTH, Some(&channel))?;
        let caps = QpCaps {
            max_send_wr: SEND_DEPTH,
            max_recv_wr: RECV_DEPTH,
            ..QpCaps::default()
        };
        let qp = id.create_qp(&pd, &cq, &cq, &caps)?;
        let ring = pd.allocate(DEFAULT_RECV_BUF_LEN, AccessFlags::all())?;
        let staging = pd.allocate(DEFAULT_RECV_BUF_LEN, AccessFlags::LOCAL_WRITE)?;
        let cmds = pd.allocate(
            (RECV_DEPTH as usize + 1) * CMD_LEN,
            AccessFlags::LOCAL_WRITE,
        )?;
        let peer = LegacyPeer {
            id,
            _listener: listener,
            cq,
            qp,
            ring,
            staging,
            cmds,
            peer_ring: None,
            tx_offset: 0,
            unsignaled: 0,
        };
        for slot in 0..RECV_DEPTH as u64 {
            peer.post_recv(slot)?;
        }
        Ok(peer)
    }

    fn post_recv(&self, slot: u64) -> Result<()> {
        let at = slot as usize * CMD_LEN;
        // SAFETY: the slot is read only after its receive completed, and
        // reposted only after that; the buffer lives as long as the QP.
        unsafe {
            self.qp
                .post_recv(slot, &[self.cmds.sge(at..at + CMD_LEN)])?
        };
        Ok(())
    }

    /// Advertises our ring as the legacy library does (version 0) and waits
    /// for the peer's.
    fn start(&mut self, timeout: Duration) -> Result<()> {
        let mut reg = Cmd::new(
            Opcode::RegLocalAddr,
            self.ring.addr(),
            self.ring.len() as u32,
            self.ring.rkey(),
        );
        reg.version = 0;
        let at = RECV_DEPTH as usize * CMD_LEN;
        self.cmds.as_mut_slice()[at..at + CMD_LEN].copy_from_slice(&reg.encode());
        let sge = [self.cmds.sge(at..at + CMD_LEN)];
        // SAFETY: the command slot stays untouched until this send completes,
        // which `wait_peer_ring` reaps.
        unsafe {
            self.qp
                .post_send(&[SendRequest::new(SEND_WR, SendOp::Send, &sge)])?
        };
        let deadline = Instant::now() + timeout;
        while self.peer_ring.is_none() {
            if self.poll(deadline, &mut |_| Ok(()))?.is_none() {
                return Err(Error::Timeout("waiting for the peer's ring".into()));
            }
        }
        Ok(())
    }

    /// Sends one message the legacy way: copied to staging, RDMA WRITE WITH
    /// IMM at the current offset, the immediate being that offset. Returns
    /// 0, as the legacy library did, once the peer's ring is used up.
    pub fn send(&mut self, data: &[u8]) -> Result<usize> {
        let peer = self.peer_ring.ok_or(Error::NotConnected)?;
        let room = (peer.len as usize).min(self.staging.len());
        if data.is_empty() || self.tx_offset + data.len() > room {
            return Ok(0);
        }
        let at = self.tx_offset;
        self.staging.as_mut_slice()[at..at + data.len()].copy_from_slice(data);
        self.unsignaled += 1;
        let sge = [self.staging.sge(at..at + data.len())];
        let mut req = SendRequest::new(
            SEND_WR,
            SendOp::WriteWithImm(peer.at(at as u64), at as u32),
            &sge,
        );
        if self.unsignaled < SIGNAL_EVERY {
            req = req.unsignaled();
        } else {
            self.unsignaled = 0;
        }
        // SAFETY: staging bytes are never rewritten (the offset only grows).
        unsafe { self.qp.post_send(&[req])? };
        self.tx_offset += data.len();
        Ok(data.len())
    }

    /// Waits for the next message, up to `deadline`, and hands it to `got`;
    /// false when none came in time.
    pub fn recv(&mut self, deadline: Instant, got: &mut dyn FnMut(&[u8])) -> Result<bool> {
        let mut delivered = false;
        while !delivered {
            let r = self.poll(deadline, &mut |bytes| {
                got(bytes);
                delivered = true;
                Ok(())
            })?;
            if r.is_none() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Echoes every message back until the peer disconnects, `deadline`
    /// passes, or its ring is used up (an error: the legacy lifetime is
    /// over). Returns the bytes echoed.
    pub fn echo(&mut self, deadline: Instant) -> Result<u64> {
        let mut echoed = 0u64;
        loop {
            let mut msg = Vec::new();
            match self.recv(deadline, &mut |b| msg.extend_from_slice(b)) {
                Ok(true) => {}
                Ok(false) => return Ok(echoed),
                Err(Error::Disconnected) => return Ok(echoed),
                Err(e) => return Err(e),
            }
            if self.send(&msg)? == 0 {
                return Err(Error::OperationFailed(
                    "the legacy ring's lifetime is used up".into(),
                ));
            }
            echoed += msg.len() as u64;
        }
    }

    /// Takes one completion, sleeping on the completion channel while there
    /// is none (the legacy library never spins); a data message goes to
    /// `got`. `None` when nothing came by `deadline`.
    fn poll(
        &mut self,
        deadline: Instant,
        got: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<Option<()>> {
        let mut wc = [Completion::default()];
        let left = deadline.saturating_duration_since(Instant::now());
        match self.cq.wait(&mut wc, left) {
            Ok(_) => {}
            Err(e) if e.is_timeout() => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        let wc = &wc[0];
        if !wc.is_ok() {
            return Err(Error::Disconnected);
        }
        if wc.wr_id() == SEND_WR {
            return Ok(Some(()));
        }
        let slot = wc.wr_id();
        match wc.opcode() {
            WcOpcode::RECV => {
                let at = slot as usize * CMD_LEN;
                let cmd = Cmd::decode(&self.cmds.as_slice()[at..at + CMD_LEN])
                    .map_err(|e| Error::OperationFailed(format!("bad command: {e}")))?;
                match cmd.opcode {
                    Opcode::RegLocalAddr => {
                        self.peer_ring = Some(RemoteRegion {
                            addr: cmd.addr,
                            len: u64::from(cmd.length),
                            rkey: cmd.key,
                        });
                        self.tx_offset = 0;
                    }
                    // The peer is leaving: nothing follows.
                    Opcode::ConnGoodbye => return Err(Error::Disconnected),
                    // The legacy library treats any other command as fatal.
                    other => {
                        return Err(Error::OperationFailed(format!(
                            "a legacy peer was sent {other:?}"
                        )))
                    }
                }
            }
            WcOpcode::RECV_RDMA_WITH_IMM => {
                let offset = wc.imm().unwrap_or(0) as usize;
                let len = wc.byte_len() as usize;
                let bytes = self
                    .ring
                    .as_slice()
                    .get(offset..offset + len)
                    .ok_or_else(|| {
                        Error::OperationFailed(format!("{len} bytes at {offset}: outside the ring"))
                    })?;
                got(bytes)?;
            }
            other => log::warn!("legacy peer: unexpected completion {other}"),
        }
        self.post_recv(slot)?;
        Ok(Some(()))
    }
}

impl Drop for LegacyPeer {
    fn drop(&mut self) {
        let _ = self.id.disconnect();
    }
}
