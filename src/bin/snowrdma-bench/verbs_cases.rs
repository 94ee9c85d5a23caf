//! The verbs-layer cases: each operation as its perftest program does it.

use std::time::{Duration, Instant};

use snowrdma::verbs::selftest::{ConnectMode, Endpoint, LoopbackPair};
use snowrdma::verbs::{Completion, Context, RemoteAddr, SendOp, SendRequest};

use super::{median, us};

fn spin_one(cq: &snowrdma::verbs::CompletionQueue) -> Completion {
    let mut wc = [Completion::default()];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if cq.poll(&mut wc).expect("poll") == 1 {
            let [wc] = wc;
            return wc.into_result().expect("completion");
        }
        assert!(Instant::now() < deadline, "a completion was lost");
    }
}

/// The one-sided operations [`verbs_op_lat`] measures.
pub(crate) enum VerbsOp {
    Read,
    /// Atomic compare-and-swap (8 bytes whatever the size).
    CompareSwap,
    /// One signaled WRITE.
    Write,
}

/// Post-to-completion latency of one operation, spinning on the CQ, as
/// ib_read_lat / ib_atomic_lat do.
pub(crate) fn verbs_op_lat(op: VerbsOp, iters: usize, size: usize) -> f64 {
    let ctx = Context::open(None).expect("device");
    let mut pair = LoopbackPair::connect(
        &ctx,
        ConnectMode::RdmaCm,
        size.max(8),
        Duration::from_secs(10),
    )
    .expect("pair");
    let remote = pair.b.mr.remote().at(0);
    let sge = pair.a.mr.sge(
        ..if matches!(op, VerbsOp::CompareSwap) {
            8
        } else {
            size
        },
    );
    let mut lat = Vec::with_capacity(iters);
    for i in 0..iters {
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
        // SAFETY: a's buffer is touched by nothing else until the completion.
        unsafe {
            pair.a
                .qp
                .post_send(&[SendRequest::new(i as u64, send_op, &[sge])])
                .expect("post")
        };
        spin_one(&pair.a.send_cq);
        lat.push(us(t.elapsed()));
    }
    pair.b.mr.as_mut_slice()[0] = 0;
    median(&mut lat)
}

/// RDMA WRITE ping-pong as ib_write_lat does it: each side writes the
/// iteration number into the other's buffer and spins on its own buffer.
pub(crate) fn verbs_write_lat(iters: usize, size: usize) -> f64 {
    let ctx = Context::open(None).expect("device");
    // Each buffer: [0, size) receives the peer's writes, [size, 2 size) is sent.
    let pair = LoopbackPair::connect(&ctx, ConnectMode::RdmaCm, 2 * size, Duration::from_secs(10))
        .expect("pair");
    let LoopbackPair { a, b, .. } = pair;
    let (a_rem, b_rem) = (a.mr.remote().at(0), b.mr.remote().at(0));
    let last = size as u64 - 1;
    let pong = std::thread::spawn(move || {
        let flag = (b.mr.addr() + last) as *const u8;
        let out = (b.mr.addr() + size as u64 + last) as *mut u8;
        let sge = b.mr.sge(size..2 * size);
        for i in 0..iters {
            let want = (i % 255 + 1) as u8;
            // SAFETY: the peer writes this byte; we only read it.
            while unsafe { std::ptr::read_volatile(flag) } != want {}
            // SAFETY: our send area; the previous write from it completed.
            unsafe {
                std::ptr::write_volatile(out, want);
                b.qp.post_send(&[SendRequest::new(i as u64, SendOp::Write(a_rem), &[sge])])
                    .expect("post");
            }
            spin_one(&b.send_cq);
        }
    });
    let flag = (a.mr.addr() + last) as *const u8;
    let out = (a.mr.addr() + size as u64 + last) as *mut u8;
    let sge = a.mr.sge(size..2 * size);
    let mut lat = Vec::with_capacity(iters);
    for i in 0..iters {
        let want = (i % 255 + 1) as u8;
        let t = Instant::now();
        // SAFETY: as above.
        unsafe {
            std::ptr::write_volatile(out, want);
            a.qp.post_send(&[SendRequest::new(i as u64, SendOp::Write(b_rem), &[sge])])
                .expect("post");
        }
        spin_one(&a.send_cq);
        let deadline = Instant::now() + Duration::from_secs(10);
        while unsafe { std::ptr::read_volatile(flag) } != want {
            assert!(Instant::now() < deadline, "the pong was lost");
        }
        lat.push(us(t.elapsed()) / 2.0);
    }
    pong.join().expect("pong thread");
    median(&mut lat)
}

/// Receives each side of the WRITE WITH IMM ping-pong keeps posted.
const IMM_RECVS: usize = 16;
/// Every this many writes of the ping-pong, one asks for a completion.
const IMM_SIGNAL_EVERY: usize = 32;

/// WRITE WITH IMM ping-pong: each side writes `size` bytes and an
/// immediate into the other's buffer and spins on its receive CQ, with a
/// receive reposted for each one taken and every 32nd write signaled, as
/// the runtime does it.
pub(crate) fn verbs_imm_lat(iters: usize, size: usize) -> f64 {
    let ctx = Context::open(None).expect("device");
    let pair = LoopbackPair::connect(&ctx, ConnectMode::RdmaCm, 2 * size, Duration::from_secs(10))
        .expect("pair");
    let LoopbackPair { a, b, .. } = pair;
    for side in [&a, &b] {
        for i in 0..IMM_RECVS {
            // SAFETY: no scatter list: the data lands by the write.
            unsafe { side.qp.post_recv(i as u64, &[]).expect("post recv") };
        }
    }
    // One write to `peer`; the signaled ones are waited for here.
    fn turn(side: &Endpoint, peer: RemoteAddr, size: usize, i: usize) {
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
    let (a_rem, b_rem) = (a.mr.remote().at(0), b.mr.remote().at(0));
    let pong = std::thread::spawn(move || {
        for i in 0..iters {
            spin_one(&b.recv_cq);
            // SAFETY: as above.
            unsafe { b.qp.post_recv(i as u64, &[]).expect("post recv") };
            turn(&b, a_rem, size, i);
        }
    });
    let mut lat = Vec::with_capacity(iters);
    for i in 0..iters {
        let t = Instant::now();
        turn(&a, b_rem, size, i);
        spin_one(&a.recv_cq);
        lat.push(us(t.elapsed()) / 2.0);
        // SAFETY: as above.
        unsafe { a.qp.post_recv(i as u64, &[]).expect("post recv") };
    }
    pong.join().expect("pong thread");
    median(&mut lat)
}
