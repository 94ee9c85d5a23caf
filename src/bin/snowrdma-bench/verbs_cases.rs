//! The verbs-layer cases: each operation as its perftest program does it,
//! the two ends in two processes as perftest runs them. The far end is
//! `snowrdma-bench peer <role>` ([`serve_peer`]), connected through RDMA CM
//! with each side's buffer in the private data.

use std::time::{Duration, Instant};

use snowrdma::verbs::selftest::Endpoint;
use snowrdma::verbs::{
    CmId, Completion, CompletionQueue, RemoteAddr, RemoteRegion, SendOp, SendRequest,
};

use super::{device_addr, measured, us, PeerRole};

const WAIT: Duration = Duration::from_secs(30);

/// Waits for one completion on `cq`, spinning; None after `patience`.
fn spin_for(cq: &CompletionQueue, patience: Duration) -> Option<Completion> {
    let mut wc = [Completion::default()];
    let deadline = Instant::now() + patience;
    loop {
        if cq.poll(&mut wc).expect("poll") == 1 {
            let [wc] = wc;
            return Some(wc.into_result().expect("completion"));
        }
        if Instant::now() >= deadline {
            return None;
        }
    }
}

fn spin_one(cq: &CompletionQueue) -> Completion {
    spin_for(cq, Duration::from_secs(10)).expect("a completion was lost")
}

/// Spins until the byte at `addr` is `want`; false after `patience`.
fn await_byte(addr: u64, want: u8, patience: Duration) -> bool {
    let deadline = Instant::now() + patience;
    // SAFETY: a byte of a registered buffer that lives as long as the
    // caller's endpoint; the peer writes it, we only read it.
    while unsafe { std::ptr::read_volatile(addr as *const u8) } != want {
        if Instant::now() >= deadline {
            return false;
        }
    }
    true
}

/// The value the `i`th WRITE of a ping-pong carries in its last byte.
fn iteration_mark(i: usize) -> u8 {
    (i % 255 + 1) as u8
}

/// Receives each side of the WRITE WITH IMM and SEND ping-pongs keeps posted.
const RECVS: usize = 16;
/// Every this many writes of the WRITE WITH IMM ping-pong, one asks for a
/// completion.
const IMM_SIGNAL_EVERY: usize = 32;

fn post_recvs(ep: &Endpoint, sge: Option<snowrdma::verbs::Sge>) -> snowrdma::verbs::Result<()> {
    for i in 0..RECVS {
        // SAFETY: the scatter list (if any) is the endpoint's own receive
        // area, which only the peer's messages write.
        unsafe { ep.qp.post_recv(i as u64, sge.as_slice())? };
    }
    Ok(())
}

/// One write of `size` bytes with immediate `i` to `peer`; the signaled ones
/// are waited for here.
fn imm_turn(side: &Endpoint, peer: RemoteAddr, size: usize, i: usize) {
    let sges = [side.mr.sge(size..2 * size)];
    let mut req = SendRequest::new(i as u64, SendOp::WriteWithImm(peer, i as u32), &sges);
    let signaled = i % IMM_SIGNAL_EVERY == IMM_SIGNAL_EVERY - 1;
    if !signaled {
        req = req.unsignaled();
    }
    // SAFETY: our send area; nothing rewrites it.
    unsafe { side.qp.post_send(&[req]).expect("post") };
    if signaled {
        spin_one(&side.send_cq);
    }
}

/// Serves one client as the far end `role` (a verbs one) of a case with
/// `size`-byte messages, on the device at `port`, until the client goes
/// quiet for a while or the process is killed.
pub(crate) fn serve_peer(role: PeerRole, port: u16, size: usize) -> snowrdma::verbs::Result<()> {
    let addr = device_addr(port);
    let listener = CmId::listen_on(addr, 1)?;
    println!("listening on {addr}");
    let idle = Duration::from_secs(20);
    match role {
        PeerRole::Target => {
            let _lent = Endpoint::accept_from(&listener, size.max(8), WAIT, |_| Ok(()))?;
            std::thread::sleep(Duration::from_secs(300));
        }
        PeerRole::WritePong => {
            let (ep, peer) = Endpoint::accept_from(&listener, 2 * size, WAIT, |_| Ok(()))?;
            let peer = peer.expect("the client advertises its buffer").at(0);
            let (flag, out) = (
                ep.mr.addr() + size as u64 - 1,
                ep.mr.addr() + 2 * size as u64 - 1,
            );
            let sge = ep.mr.sge(size..2 * size);
            for i in 0.. {
                let want = iteration_mark(i);
                if !await_byte(flag, want, idle) {
                    break;
                }
                // SAFETY: our send area; the previous WRITE from it completed.
                unsafe {
                    std::ptr::write_volatile(out as *mut u8, want);
                    ep.qp
                        .post_send(&[SendRequest::new(i as u64, SendOp::Write(peer), &[sge])])?;
                }
                spin_one(&ep.send_cq);
            }
        }
        PeerRole::ImmPong => {
            let (ep, peer) =
                Endpoint::accept_from(&listener, 2 * size, WAIT, |ep| post_recvs(ep, None))?;
            let peer = peer.expect("the client advertises its buffer").at(0);
            for i in 0.. {
                if spin_for(&ep.recv_cq, idle).is_none() {
                    break;
                }
                // SAFETY: no scatter list: the data lands by the write.
                unsafe { ep.qp.post_recv(i as u64, &[])? };
                imm_turn(&ep, peer, size, i);
            }
        }
        PeerRole::SendPong => {
            let mut inbox = None;
            let (ep, _) = Endpoint::accept_from(&listener, 2 * size, WAIT, |ep| {
                inbox = Some(ep.mr.sge(..size));
                post_recvs(ep, inbox)
            })?;
            let sge = ep.mr.sge(size..2 * size);
            for i in 0.. {
                if spin_for(&ep.recv_cq, idle).is_none() {
                    break;
                }
                // SAFETY: our receive area, which only the peer's SENDs write;
                // our send area, which nothing rewrites.
                unsafe {
                    ep.qp.post_recv(i as u64, inbox.as_slice())?;
                    ep.qp
                        .post_send(&[SendRequest::new(i as u64, SendOp::Send, &[sge])])?;
                }
                spin_one(&ep.send_cq);
            }
        }
        PeerRole::BrokerSink | PeerRole::BrokerEcho | PeerRole::BrokerMesh => {
            unreachable!("a broker's role, served by serve_broker")
        }
    }
    Ok(())
}

/// This side of a two-process case: connected to the peer at `port`.
fn connect(
    port: u16,
    buf_len: usize,
    prepare: impl FnOnce(&Endpoint) -> snowrdma::verbs::Result<()>,
) -> (Endpoint, RemoteRegion) {
    Endpoint::connect_to(device_addr(port), buf_len, WAIT, prepare).expect("connect to the peer")
}

/// The one-sided operations [`verbs_op_lat`] measures.
pub(crate) enum VerbsOp {
    Read,
    /// Atomic compare-and-swap (8 bytes whatever the size).
    CompareSwap,
    /// One signaled WRITE.
    Write,
}

/// Post-to-completion latency of one operation on the buffer of a `target`
/// peer at `port`, spinning on the CQ, as ib_read_lat / ib_atomic_lat do.
pub(crate) fn verbs_op_lat(op: VerbsOp, iters: usize, size: usize, port: u16) -> f64 {
    let len = if matches!(op, VerbsOp::CompareSwap) {
        8
    } else {
        size
    };
    let (ep, peer) = connect(port, len, |_| Ok(()));
    let remote = peer.at(0);
    let sge = ep.mr.sge(..len);
    measured(iters, |i| {
        let send_op = match op {
            VerbsOp::Read => SendOp::Read(remote),
            VerbsOp::CompareSwap => SendOp::CompareSwap {
                remote,
                compare: i as u64,
                swap: i as u64 + 1,
            },
            VerbsOp::Write => SendOp::Write(remote),
        };
        let t = Instant::now();
        // SAFETY: our buffer is touched by nothing else until the completion.
        unsafe {
            ep.qp
                .post_send(&[SendRequest::new(i as u64, send_op, &[sge])])
                .expect("post")
        };
        spin_one(&ep.send_cq);
        us(t.elapsed())
    })
}

/// RDMA WRITE ping-pong with a `write-pong` peer at `port`, as ib_write_lat
/// does it: each side writes the iteration number into the other's buffer
/// and spins on its own. Each buffer: [0, size) receives the peer's writes,
/// [size, 2 size) is sent.
pub(crate) fn verbs_write_lat(iters: usize, size: usize, port: u16) -> f64 {
    let (ep, peer) = connect(port, 2 * size, |_| Ok(()));
    let peer = peer.at(0);
    let (flag, out) = (
        ep.mr.addr() + size as u64 - 1,
        ep.mr.addr() + 2 * size as u64 - 1,
    );
    let sge = ep.mr.sge(size..2 * size);
    measured(iters, |i| {
        let want = iteration_mark(i);
        let t = Instant::now();
        // SAFETY: our send area; the previous write from it completed.
        unsafe {
            std::ptr::write_volatile(out as *mut u8, want);
            ep.qp
                .post_send(&[SendRequest::new(i as u64, SendOp::Write(peer), &[sge])])
                .expect("post");
        }
        spin_one(&ep.send_cq);
        assert!(await_byte(flag, want, WAIT), "the pong was lost");
        us(t.elapsed()) / 2.0
    })
}

/// WRITE WITH IMM ping-pong with an `imm-pong` peer at `port`: each side
/// writes `size` bytes and an immediate into the other's buffer and spins
/// on its receive CQ, with a receive reposted for each one taken and every
/// 32nd write signaled, as the runtime does it.
pub(crate) fn verbs_imm_lat(iters: usize, size: usize, port: u16) -> f64 {
    let (ep, peer) = connect(port, 2 * size, |ep| post_recvs(ep, None));
    let peer = peer.at(0);
    measured(iters, |i| {
        let t = Instant::now();
        imm_turn(&ep, peer, size, i);
        spin_one(&ep.recv_cq);
        let half_rtt = us(t.elapsed()) / 2.0;
        // SAFETY: no scatter list: the data lands by the write.
        unsafe { ep.qp.post_recv(i as u64, &[]).expect("post recv") };
        half_rtt
    })
}
