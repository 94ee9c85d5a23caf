//! A peer that speaks only the legacy protocol (version 0), on raw verbs:
//! what a program built on the legacy library looks like from the wire. It
//! advertises its ring with version 0, never returns credit, and writes each
//! message at a byte offset that only grows, so it can send as much as the
//! receiver's ring holds in its whole life. Tests and `make bench` use it to
//! hold the runtime to the legacy contract; it is not a general endpoint.
//!
//! It can also break the protocol on purpose (the hostile-peer tests): claim
//! version 1, send any 32 bytes as a command, write anywhere with any
//! immediate.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::verbs::{
    AccessFlags, CmEventKind, CmId, Completion, CompletionQueue, ConnParam, MemoryRegion,
    ProtectionDomain, QpCaps, QueuePair, RemoteRegion, SendOp, SendRequest, WcOpcode,
};

use super::proto::{Cmd, CreditWords, Opcode, CMD_LEN, CREDIT_SLOT_LEN};
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
    pd: ProtectionDomain,
    /// The credit slot we told the other side of, as a version-2 peer.
    credit_slot: Option<MemoryRegion>,
    peer_ring: Option<RemoteRegion>,
    /// Where the next message goes in the peer's ring; only grows.
    tx_offset: usize,
    unsignaled: u64,
    /// The version our REG_LOCAL_ADDR claims (0 unless a test says).
    version: u8,
    /// Signaled sends completed so far.
    sends_done: u64,
    /// Polls its CQ while it waits instead of sleeping on the channel.
    spins: bool,
    /// A received message, copied out of the ring (kept between messages).
    scratch: Vec<u8>,
    /// Receives are posted again once taken ([`LegacyPeer::stop_reposting`]).
    reposts: bool,
}

impl LegacyPeer {
    /// Connects to a SnowRDMA server and exchanges rings.
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<LegacyPeer> {
        LegacyPeer::connect_claiming(addr, timeout, 0)
    }

    /// Connects like [`LegacyPeer::connect`], but advertises its ring with
    /// `version` (and, from version 1, its receive depth), so the other
    /// side expects what that version may send; it still never returns
    /// credit.
    pub fn connect_claiming(
        addr: SocketAddr,
        timeout: Duration,
        version: u8,
    ) -> Result<LegacyPeer> {
        let id = CmId::resolve(addr, None, timeout)?;
        let mut peer = LegacyPeer::build(id, None)?;
        peer.version = version;
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
        LegacyPeer::accept_claiming(addr, timeout, 0, ready)
    }

    /// Accepts like [`LegacyPeer::accept`], advertising its ring with
    /// `version`, as [`LegacyPeer::connect_claiming`] does.
    pub fn accept_claiming(
        addr: SocketAddr,
        timeout: Duration,
        version: u8,
        ready: impl FnOnce(SocketAddr),
    ) -> Result<LegacyPeer> {
        let listener = CmId::listen_on(addr, 8)?;
        ready(listener.local_addr().unwrap_or(addr));
        let (id, _) = listener.get_request(timeout)?;
        let mut peer = LegacyPeer::build(id, Some(listener))?;
        peer.version = version;
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
        let ring = pd.allocate(
            DEFAULT_RECV_BUF_LEN,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )?;
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
            pd,
            credit_slot: None,
            peer_ring: None,
            tx_offset: 0,
            unsignaled: 0,
            version: 0,
            sends_done: 0,
            spins: false,
            scratch: Vec::new(),
            reposts: true,
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
        reg.version = self.version;
        if self.version >= 1 {
            reg.recv_depth = RECV_DEPTH;
        }
        self.send_command(&reg.encode())?;
        let deadline = Instant::now() + timeout;
        while self.peer_ring.is_none() {
            if self.poll(deadline, &mut |_| Ok(()))?.is_none() {
                return Err(Error::Timeout("waiting for the peer's ring".into()));
            }
        }
        Ok(())
    }

    /// Sends `bytes` as a command (SEND into the peer's command slots) and
    /// waits for it to complete.
    pub fn send_command(&mut self, bytes: &[u8; CMD_LEN]) -> Result<()> {
        let at = RECV_DEPTH as usize * CMD_LEN;
        self.cmds.as_mut_slice()[at..at + CMD_LEN].copy_from_slice(bytes);
        let sge = [self.cmds.sge(at..at + CMD_LEN)];
        // SAFETY: the command slot stays untouched until this send
        // completes, which is waited for below.
        unsafe {
            self.qp
                .post_send(&[SendRequest::new(SEND_WR, SendOp::Send, &sge)])?
        };
        self.wait_sent()
    }

    /// Tells the other side, as a version-2 peer does, where to READ what
    /// we consumed, and makes it say `words`, true or not.
    pub fn offer_credit_slot(&mut self, words: CreditWords) -> Result<()> {
        self.offer_slot(words, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
    }

    /// As [`LegacyPeer::offer_credit_slot`], with the key of memory that
    /// may not be read remotely: the other side's READs of it fail.
    pub fn offer_unreadable_credit_slot(&mut self) -> Result<()> {
        self.offer_slot(CreditWords::default(), AccessFlags::LOCAL_WRITE)
    }

    fn offer_slot(&mut self, words: CreditWords, access: AccessFlags) -> Result<()> {
        let mut slot = self.pd.allocate(CREDIT_SLOT_LEN, access)?;
        slot.as_mut_slice().copy_from_slice(&words.encode());
        let cmd = Cmd::new(
            Opcode::CreditSlot,
            slot.addr(),
            CREDIT_SLOT_LEN as u32,
            slot.rkey(),
        );
        self.credit_slot = Some(slot);
        self.send_command(&cmd.encode())
    }

    /// Posts no receive again once taken: when those posted are used up,
    /// the other side's sends wait in RNR retries (at the RDMA CM's
    /// minimum RNR timer, 655 ms each), and so does whatever it queued
    /// behind them, as with a peer that stopped taking messages.
    pub fn stop_reposting(&mut self) {
        self.reposts = false;
    }

    /// Writes `data` at byte `at` of the peer's ring with immediate `imm`,
    /// whatever the protocol says, and waits for the write to complete.
    pub fn write_with_imm(&mut self, at: u64, imm: u32, data: &[u8]) -> Result<()> {
        let peer = self.peer_ring.ok_or(Error::NotConnected)?;
        let staged = data.len().min(self.staging.len());
        self.staging.as_mut_slice()[..staged].copy_from_slice(&data[..staged]);
        let sge = [self.staging.sge(..staged)];
        let req = SendRequest::new(SEND_WR, SendOp::WriteWithImm(peer.at(at), imm), &sge);
        // SAFETY: staging is not touched until the write completes, which is
        // waited for below.
        unsafe { self.qp.post_send(&[req])? };
        self.wait_sent()
    }

    /// Waits for the signaled send just posted, handling what arrives
    /// meanwhile; an error completion (the peer cut us off) is an error.
    fn wait_sent(&mut self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        let before = self.sends_done;
        while self.sends_done == before {
            if self.poll(deadline, &mut |_| Ok(()))?.is_none() {
                // The send may still read the staging buffer the next one
                // fills: stopped, the device reads it no more.
                let _ = self.qp.to_error();
                return Err(Error::Timeout("waiting for a send to complete".into()));
            }
        }
        Ok(())
    }

    /// Whether the other side has ended the connection, waiting up to
    /// `deadline` for a sign of it (an error completion, a goodbye, or the
    /// RDMA CM's DISCONNECTED).
    pub fn cut_off(&mut self, deadline: Instant) -> bool {
        loop {
            if self
                .id
                .expect_event(CmEventKind::DISCONNECTED, Duration::ZERO)
                .is_ok()
            {
                return true;
            }
            let soon = (Instant::now() + Duration::from_millis(20)).min(deadline);
            match self.poll(soon, &mut |_| Ok(())) {
                Err(_) => return true,
                Ok(_) if Instant::now() >= deadline => return false,
                Ok(_) => {}
            }
        }
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

    /// Makes the peer poll its CQ while it waits, as our runtime's spinning
    /// completion thread does, instead of sleeping on the channel as the
    /// legacy library does: a benchmark then compares the protocols, not a
    /// sleeping peer with a spinning one.
    pub fn spin_while_waiting(&mut self) {
        self.spins = true;
    }

    /// Takes one completion, sleeping on the completion channel while there
    /// is none (the legacy library never spins; see
    /// [`LegacyPeer::spin_while_waiting`]); a data message goes to `got`.
    /// `None` when nothing came by `deadline`.
    fn poll(
        &mut self,
        deadline: Instant,
        got: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<Option<()>> {
        let mut wc = [Completion::default()];
        if self.spins {
            while self.cq.poll(&mut wc)? == 0 {
                if Instant::now() >= deadline {
                    return Ok(None);
                }
                std::hint::spin_loop();
            }
        } else {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.cq.wait(&mut wc, left) {
                Ok(_) => {}
                Err(e) if e.is_timeout() => return Ok(None),
                Err(e) => return Err(e.into()),
            }
        }
        let wc = &wc[0];
        if !wc.is_ok() {
            return Err(Error::Disconnected);
        }
        if wc.wr_id() == SEND_WR {
            self.sends_done += 1;
            return Ok(Some(()));
        }
        let slot = wc.wr_id();
        match wc.opcode() {
            WcOpcode::RECV => {
                // Copied out of its slot first: the peer may be writing
                // the others.
                let mut bytes = [0u8; CMD_LEN];
                if !self.cmds.copy_out_to(slot as usize * CMD_LEN, &mut bytes) {
                    return Err(Error::OperationFailed(format!("no command slot {slot}")));
                }
                let cmd = Cmd::decode(&bytes)
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
                    // Told to a peer claiming version 2, which may ignore
                    // it: the other side then returns credit as commands
                    // when asked (it never is here) or runs short.
                    Opcode::CreditSlot if self.version >= 2 => {}
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
                // The one read of the bytes, into a buffer kept between
                // messages: the peer may be writing the ring meanwhile.
                let mut bytes = std::mem::take(&mut self.scratch);
                bytes.clear();
                if !self.ring.copy_out(offset..offset + len, &mut bytes) {
                    return Err(Error::OperationFailed(format!(
                        "{len} bytes at {offset}: outside the ring"
                    )));
                }
                let handled = got(&bytes);
                self.scratch = bytes;
                handled?;
            }
            other => log::warn!("legacy peer: unexpected completion {other}"),
        }
        if self.reposts {
            self.post_recv(slot)?;
        }
        Ok(Some(()))
    }
}

impl Drop for LegacyPeer {
    fn drop(&mut self) {
        let _ = self.id.disconnect();
    }
}
