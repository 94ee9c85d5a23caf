//! Loopback self-tests of the posted operations: two QPs on one device,
//! connected through RDMA CM or manually, and a check per operation that the
//! bytes (or the atomic's old value and the remote word) arrive as sent. The
//! probe program runs them to show what a device can do; the device tests
//! run them on Soft-RoCE.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use super::{
    AccessFlags, CmEventKind, CmId, CompletionQueue, ConnParam, Context, Error, MemoryRegion,
    ProtectionDomain, QpCaps, QpOptions, QueuePair, RemoteRegion, Result, SendOp, SendRequest,
    WcOpcode, REMOTE_REGION_WIRE_LEN,
};

/// How the two QPs of a pair are connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectMode {
    /// Through RDMA CM (address and route resolution, connect, accept).
    RdmaCm,
    /// Manually: QP info exchanged, INIT -> RTR -> RTS by hand.
    Manual,
}

impl fmt::Display for ConnectMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            ConnectMode::RdmaCm => "RDMA CM",
            ConnectMode::Manual => "manual",
        })
    }
}

/// The operations a self-test can check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Send,
    SendWithImm,
    Write,
    WriteWithImm,
    Read,
    CompareSwap,
    FetchAdd,
}

impl Op {
    pub const ALL: [Op; 7] = [
        Op::Send,
        Op::SendWithImm,
        Op::Write,
        Op::WriteWithImm,
        Op::Read,
        Op::CompareSwap,
        Op::FetchAdd,
    ];

    /// Whether the operation is a 64-bit atomic (its size is always 8 bytes).
    pub fn is_atomic(self) -> bool {
        matches!(self, Op::CompareSwap | Op::FetchAdd)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Op::Send => "SEND",
            Op::SendWithImm => "SEND WITH IMM",
            Op::Write => "RDMA WRITE",
            Op::WriteWithImm => "WRITE WITH IMM",
            Op::Read => "RDMA READ",
            Op::CompareSwap => "ATOMIC CAS",
            Op::FetchAdd => "ATOMIC FETCH-ADD",
        })
    }
}

/// One side of a pair: its own PD, CQs (on one completion channel), QP and a
/// buffer registered for everything.
pub struct Endpoint {
    pub qp: QueuePair,
    pub mr: MemoryRegion,
    pub send_cq: CompletionQueue,
    pub recv_cq: CompletionQueue,
    pub pd: ProtectionDomain,
}

/// An endpoint's PD, send and receive CQs (sharing one completion channel)
/// and a buffer registered with every access right.
type Resources = (
    ProtectionDomain,
    CompletionQueue,
    CompletionQueue,
    MemoryRegion,
);

fn endpoint_resources(ctx: &Context, buf_len: usize) -> Result<Resources> {
    let pd = ctx.alloc_pd()?;
    let channel = ctx.create_comp_channel()?;
    let send_cq = ctx.create_cq(256, Some(&channel))?;
    let recv_cq = ctx.create_cq(256, Some(&channel))?;
    let mr = pd.allocate(buf_len, AccessFlags::all())?;
    Ok((pd, send_cq, recv_cq, mr))
}

/// Two connected RC QPs on the same device: `a` initiates, `b` is the target.
pub struct LoopbackPair {
    pub a: Endpoint,
    pub b: Endpoint,
    pub mode: ConnectMode,
    /// Bound on every wait.
    pub timeout: Duration,
}

impl LoopbackPair {
    /// Connects two QPs on `ctx` (port 1), each with a `buf_len`-byte buffer.
    pub fn connect(
        ctx: &Context,
        mode: ConnectMode,
        buf_len: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let (a, b) = match mode {
            ConnectMode::Manual => connect_manual(ctx, buf_len)?,
            ConnectMode::RdmaCm => connect_cm(ctx, buf_len, timeout)?,
        };
        Ok(LoopbackPair {
            a,
            b,
            mode,
            timeout,
        })
    }

    /// The next completion of a's send CQ (or b's receive CQ); when none
    /// comes in time, both QPs are stopped, so the device starts nothing
    /// more on either buffer once the caller has the error.
    fn wait_or_stop(&self, receive: bool) -> Result<super::Completion> {
        let cq = if receive {
            &self.b.recv_cq
        } else {
            &self.a.send_cq
        };
        cq.wait_one(self.timeout).inspect_err(|_| {
            let _ = self.a.qp.to_error();
            let _ = self.b.qp.to_error();
        })
    }

    /// Runs `op` with `size` bytes (atomics: 8) and checks what arrived;
    /// returns the time from post to the initiator's completion.
    pub fn verify(&mut self, op: Op, size: usize) -> Result<Duration> {
        let size = if op.is_atomic() { 8 } else { size };
        if size == 0 || size > self.a.mr.len() || size > self.b.mr.len() {
            return Err(Error::invalid(format!(
                "size {size} does not fit the pair's buffers"
            )));
        }
        let seed = (op as u64 + 1) * 0x9e37_79b9 + size as u64;
        self.a.mr.as_mut_slice()[..size].fill(0);
        self.b.mr.as_mut_slice()[..size].fill(0);
        match op {
            Op::Send | Op::SendWithImm | Op::Write | Op::WriteWithImm => {
                fill_pattern(&mut self.a.mr.as_mut_slice()[..size], seed)
            }
            Op::Read => fill_pattern(&mut self.b.mr.as_mut_slice()[..size], seed),
            Op::CompareSwap | Op::FetchAdd => {
                self.b.mr.as_mut_slice()[..8].copy_from_slice(&seed.to_ne_bytes())
            }
        }
        let imm = (seed as u32) ^ 0xa5a5_0000;
        let remote = self.b.mr.remote().at(0);
        let (send_op, expect_opcode) = match op {
            Op::Send => (SendOp::Send, WcOpcode::SEND),
            Op::SendWithImm => (SendOp::SendWithImm(imm), WcOpcode::SEND),
            Op::Write => (SendOp::Write(remote), WcOpcode::RDMA_WRITE),
            Op::WriteWithImm => (SendOp::WriteWithImm(remote, imm), WcOpcode::RDMA_WRITE),
            Op::Read => (SendOp::Read(remote), WcOpcode::RDMA_READ),
            Op::CompareSwap => (
                SendOp::CompareSwap {
                    remote,
                    compare: seed,
                    swap: !seed,
                },
                WcOpcode::COMP_SWAP,
            ),
            Op::FetchAdd => (
                SendOp::FetchAdd {
                    remote,
                    add: 0x1234_5678,
                },
                WcOpcode::FETCH_ADD,
            ),
        };
        let two_sided = matches!(op, Op::Send | Op::SendWithImm | Op::WriteWithImm);
        if two_sided {
            let sge = self.b.mr.sge(..size);
            // A WRITE WITH IMM lands by its remote address; its receive needs
            // no buffer.
            let sges = if op == Op::WriteWithImm {
                &[][..]
            } else {
                std::slice::from_ref(&sge)
            };
            // SAFETY: b's buffer is only read again after this receive completes.
            unsafe { self.b.qp.post_recv(7, sges)? };
        }
        let sge = self.a.mr.sge(..size);
        let start = Instant::now();
        // SAFETY: a's buffer is only touched again after the completion below.
        unsafe {
            self.a
                .qp
                .post_send(&[SendRequest::new(42, send_op, std::slice::from_ref(&sge))])?
        };
        let wc = self.wait_or_stop(false)?;
        let elapsed = start.elapsed();
        expect(wc.wr_id() == 42, || {
            format!("send completion has wr_id {}", wc.wr_id())
        })?;
        expect(wc.opcode() == expect_opcode, || {
            format!(
                "send completion opcode {}, expected {expect_opcode}",
                wc.opcode()
            )
        })?;
        if two_sided {
            let rc = self.wait_or_stop(true)?;
            let want = if op == Op::WriteWithImm {
                WcOpcode::RECV_RDMA_WITH_IMM
            } else {
                WcOpcode::RECV
            };
            expect(rc.wr_id() == 7 && rc.opcode() == want, || {
                format!("receive completion {rc:?}, expected wr_id 7 and {want}")
            })?;
            expect(rc.byte_len() as usize == size, || {
                format!("receive of {} bytes, expected {size}", rc.byte_len())
            })?;
            let want_imm = matches!(op, Op::SendWithImm | Op::WriteWithImm).then_some(imm);
            expect(rc.imm() == want_imm, || {
                format!("immediate {:?}, expected {want_imm:?}", rc.imm())
            })?;
        }
        let a = &self.a.mr.as_slice()[..size];
        let b = &self.b.mr.as_slice()[..size];
        match op {
            Op::CompareSwap | Op::FetchAdd => {
                let old = u64::from_ne_bytes(a.try_into().expect("8 bytes"));
                let now = u64::from_ne_bytes(b.try_into().expect("8 bytes"));
                let want_now = if op == Op::CompareSwap {
                    !seed
                } else {
                    seed.wrapping_add(0x1234_5678)
                };
                expect(old == seed, || {
                    format!("{op} returned old value {old:#x}, expected {seed:#x}")
                })?;
                expect(now == want_now, || {
                    format!("{op} left {now:#x} remotely, expected {want_now:#x}")
                })?;
            }
            _ => {
                if let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) {
                    return Err(Error::Verification(format!(
                        "{op} of {size} bytes: first difference at byte {i} ({:#04x} vs {:#04x})",
                        a[i], b[i]
                    )));
                }
            }
        }
        Ok(elapsed)
    }
}

fn expect(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::Verification(what()))
    }
}

/// Fills `buf` with a reproducible pseudo-random pattern (xorshift64).
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

fn connect_manual(ctx: &Context, buf_len: usize) -> Result<(Endpoint, Endpoint)> {
    let opts = QpOptions::default();
    let mut halves = Vec::new();
    for _ in 0..2 {
        let (pd, send_cq, recv_cq, mr) = endpoint_resources(ctx, buf_len)?;
        let qp = pd.create_rc_qp(&send_cq, &recv_cq, &opts)?;
        halves.push((pd, send_cq, recv_cq, mr, qp));
    }
    let infos = [halves[0].4.local_info()?, halves[1].4.local_info()?];
    let mut eps = halves.into_iter().zip(infos.iter().rev()).map(
        |((pd, send_cq, recv_cq, mr, qp), remote)| {
            Ok(Endpoint {
                qp: qp.connect(remote)?,
                mr,
                send_cq,
                recv_cq,
                pd,
            })
        },
    );
    let a = eps.next().expect("two endpoints")?;
    let b = eps.next().expect("two endpoints")?;
    Ok((a, b))
}

fn connect_cm(ctx: &Context, buf_len: usize, timeout: Duration) -> Result<(Endpoint, Endpoint)> {
    let ip = ctx
        .ipv4_address(1)?
        .ok_or_else(|| Error::invalid(format!("{} has no IPv4 address for RDMA CM", ctx.name())))?;
    let listener = CmId::listen_on(SocketAddr::new(IpAddr::V4(ip), 0), 8)?;
    let addr = listener
        .local_addr()
        .ok_or_else(|| Error::invalid("listener has no local address"))?;
    let client_id = CmId::resolve(addr, None, timeout)?;
    let client = cm_endpoint(&client_id, buf_len)?;
    client_id.connect(&ConnParam::default())?;

    let (server_id, _) = listener.get_request(timeout)?;
    let server = cm_endpoint(&server_id, buf_len)?;
    server_id.accept(&ConnParam::default())?;
    client_id.expect_event(CmEventKind::ESTABLISHED, timeout)?;
    server_id.expect_event(CmEventKind::ESTABLISHED, timeout)?;
    Ok((client, server))
}

impl Endpoint {
    /// Takes one connect request on `listener` within `timeout` from a peer
    /// in another process: returns this side (its buffer `buf_len` bytes,
    /// `prepare`d before the connection is accepted, so that receives it
    /// posts are there for the peer's first message) and the peer's buffer
    /// if it advertised one (as [`Endpoint::connect_to`] does).
    pub fn accept_from(
        listener: &CmId,
        buf_len: usize,
        timeout: Duration,
        prepare: impl FnOnce(&Endpoint) -> Result<()>,
    ) -> Result<(Endpoint, Option<RemoteRegion>)> {
        let (id, ev) = listener.get_request(timeout)?;
        let advertised = ev.private_data.iter().any(|&b| b != 0);
        let peer = advertised
            .then(|| peer_region(&ev.private_data))
            .transpose()?;
        let ep = cm_endpoint(&id, buf_len)?;
        prepare(&ep)?;
        id.accept(&advertising(&ep))?;
        id.expect_event(CmEventKind::ESTABLISHED, timeout)?;
        Ok((ep, peer))
    }

    /// Connects to a peer in another process that waits in
    /// [`Endpoint::accept_from`] at `addr`, as that one does.
    pub fn connect_to(
        addr: SocketAddr,
        buf_len: usize,
        timeout: Duration,
        prepare: impl FnOnce(&Endpoint) -> Result<()>,
    ) -> Result<(Endpoint, RemoteRegion)> {
        let id = CmId::resolve(addr, None, timeout)?;
        let ep = cm_endpoint(&id, buf_len)?;
        prepare(&ep)?;
        id.connect(&advertising(&ep))?;
        let ev = id.expect_event(CmEventKind::ESTABLISHED, timeout)?;
        Ok((ep, peer_region(&ev.private_data)?))
    }
}

/// Connection parameters that tell the peer `ep`'s buffer.
fn advertising(ep: &Endpoint) -> ConnParam {
    ConnParam {
        private_data: ep.mr.remote().to_bytes().to_vec(),
        ..ConnParam::default()
    }
}

/// The buffer a peer advertised in its private data (which RDMA CM pads
/// with zeros).
fn peer_region(private_data: &[u8]) -> Result<RemoteRegion> {
    let bytes = private_data
        .get(..REMOTE_REGION_WIRE_LEN)
        .ok_or_else(|| Error::invalid("the peer did not advertise its buffer"))?;
    RemoteRegion::from_bytes(bytes)
}

fn cm_endpoint(id: &CmId, buf_len: usize) -> Result<Endpoint> {
    let ctx = id
        .context()
        .ok_or_else(|| Error::invalid("CM id without a device"))?;
    let (pd, send_cq, recv_cq, mr) = endpoint_resources(&ctx, buf_len)?;
    let qp = id.create_qp(&pd, &send_cq, &recv_cq, &QpCaps::default())?;
    Ok(Endpoint {
        qp,
        mr,
        send_cq,
        recv_cq,
        pd,
    })
}
