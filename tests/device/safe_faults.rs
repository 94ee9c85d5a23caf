//! The safe API when things go wrong around an operation: a queue pair
//! dropped with work on it, a completion queue with no room left, a
//! completion channel that fails under the background reaper, and a batch
//! the send queue takes only in part.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;

use snowrdma::safe::{AccessFlags, Progress, ProtectionDomain, Rc, WcStatus};

use crate::safe::{block_on, pair, pair_sized, Pair};

/// Dropping a queue pair flushes its work, and the drop reaps the flushed
/// completions before the QP is destroyed: a pending receive resolves to
/// its flush error, and a dropped one's memory is released by the time the
/// drop returns (a destroyed QP's work never completes, and its memory
/// stayed parked until someone happened to poll the CQ, if ever).
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn safe_a_dropped_queue_pair_flushes_its_work_before_it_goes() {
    let Pair { pd, a, b, cq_b, .. } = pair::<Rc>(Progress::Poll);
    let kept = pd.allocate::<u8>(4096, AccessFlags::empty()).unwrap();
    let pending = b.recv(kept.rw(..).unwrap()).unwrap();
    let parked = pd.allocate::<u8>(4096, AccessFlags::empty()).unwrap();
    let weak = parked.downgrade();
    drop(b.recv(parked.rw(..).unwrap()).unwrap());
    drop(parked);
    assert!(weak.is_alive(), "the device may still write it");
    drop(b);
    assert!(!weak.is_alive(), "released when the drop returned");
    assert_eq!(cq_b.stats().cancelled, 1);
    let err = block_on(pending).expect_err("a flushed receive");
    assert_eq!(err.status(), Some(WcStatus::WR_FLUSH_ERR), "{err}");
    assert!(
        kept.rw(..).is_ok(),
        "the pending receive's segment is free again"
    );
    drop(a);
}

/// A CQ takes no more operations than it has room for completions: past
/// that, posting is refused (an overflowed CQ loses completions, and their
/// futures waited for good), and room comes back as completions are reaped.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn safe_a_full_completion_queue_refuses_more_work() {
    let Pair { pd, a, b, .. } = pair_sized::<Rc>(Progress::Poll, 4);
    let mem = pd.allocate::<u8>(64 * 1024, AccessFlags::empty()).unwrap();
    let mut recvs = Vec::new();
    let refused = loop {
        let n = recvs.len();
        assert!(n < 1024, "never refused");
        match b.recv(mem.rw(n * 64..(n + 1) * 64).unwrap()) {
            Ok(op) => recvs.push(op),
            Err(e) => break e,
        }
    };
    assert!(refused.to_string().contains("room"), "{refused}");
    assert!(!recvs.is_empty());
    let src = pd.allocate::<u8>(64, AccessFlags::empty()).unwrap();
    for _ in 0..recvs.len() {
        block_on(a.send(src.ro(..).unwrap()).unwrap()).unwrap();
    }
    let n = recvs.len();
    for op in recvs {
        assert_eq!(block_on(op).unwrap().byte_len(), 64);
    }
    // Their completions reaped, the room is back.
    drop(b.recv(mem.rw(n * 64..(n + 1) * 64).unwrap()).unwrap());
}

/// The background reaper of [`Progress::Thread`] outlives a completion
/// channel that fails: it polls the CQ at every tick instead, and the
/// futures still resolve (it used to end at its first error, and every
/// future of that CQ then waited for good).
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn safe_the_background_reaper_outlives_a_failing_channel() {
    let Pair { pd, a, b, cq_b, .. } = pair::<Rc>(Progress::Thread);
    // The channel's descriptor becomes one that cannot be read: every
    // wait on it fails (EBADF), as on a channel whose device went away.
    let unreadable = OpenOptions::new().write(true).open("/dev/null").unwrap();
    let channel = cq_b.as_fd().expect("a channel").as_raw_fd();
    // SAFETY: both descriptors are open; the channel closes its own
    // (now the duplicate) when it goes.
    assert!(unsafe { libc::dup2(unreadable.as_raw_fd(), channel) } >= 0);
    let src = pd.allocate::<u8>(64, AccessFlags::empty()).unwrap();
    let dst = pd.allocate::<u8>(128, AccessFlags::empty()).unwrap();
    for half in [0, 64] {
        let recv = b.recv(dst.rw(half..half + 64).unwrap()).unwrap();
        block_on(a.send(src.ro(..).unwrap()).unwrap()).unwrap();
        assert_eq!(block_on(recv).unwrap().byte_len(), 64);
    }
    drop((a, b));
}

/// A batch that the send queue takes only in part: what went out stays on
/// the device with no signaled tail, so its memory stays parked until the
/// queue pair is stopped, and is released by the queue pair's drop (it
/// stayed parked for good). A batch refused whole gives its memory back at
/// once.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn safe_a_partly_posted_batch_gives_its_memory_back_when_its_queue_pair_goes() {
    let pd = ProtectionDomain::open(None).expect("an RDMA device");
    let (cq_a, cq_b) = (
        pd.create_cq(256, Progress::Poll).unwrap(),
        pd.create_cq(256, Progress::Poll).unwrap(),
    );
    let a = pd.qp::<Rc>(&cq_a, &cq_a).max_send_wr(4).build().unwrap();
    let b = pd.qp::<Rc>(&cq_b, &cq_b).build().unwrap();
    let (ea, eb) = (a.endpoint().unwrap(), b.endpoint().unwrap());
    let (mut a, _b) = (a.connect(&eb).unwrap(), b.connect(&ea).unwrap());
    // `b` posts no receive: the sends that went out wait in RNR retries.
    let mem = pd.allocate::<u8>(64 * 64, AccessFlags::empty()).unwrap();
    let weak = mem.downgrade();
    let mut batch = a.batch();
    for i in 0..64 {
        batch.send(mem.ro(i * 64..(i + 1) * 64).unwrap());
    }
    drop(mem);
    let Err(err) = batch.post() else {
        panic!("more requests than the send queue holds were taken");
    };
    assert!(
        weak.is_alive(),
        "part of the batch is on the device ({err})"
    );
    drop(a);
    assert!(!weak.is_alive(), "released once its queue pair was stopped");
}

/// Receives still posted when their shared receive queue is destroyed never
/// complete (no queue pair flushes them): a pending one resolves to an
/// error, and its memory, like a dropped one's, is released (both waited,
/// and stayed parked, for good). Two queues on one CQ are told apart.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn safe_receives_of_a_destroyed_shared_receive_queue_resolve() {
    let pd = ProtectionDomain::open(None).unwrap();
    let cq = pd.create_cq(64, Progress::Poll).unwrap();
    let (srq, other) = (
        pd.create_srq(&cq, 16, 1).unwrap(),
        pd.create_srq(&cq, 16, 1).unwrap(),
    );
    let (kept, dropped, stays) = (
        pd.allocate::<u8>(64, AccessFlags::empty()).unwrap(),
        pd.allocate::<u8>(64, AccessFlags::empty()).unwrap(),
        pd.allocate::<u8>(64, AccessFlags::empty()).unwrap(),
    );
    let (kept_weak, dropped_weak, stays_weak) =
        (kept.downgrade(), dropped.downgrade(), stays.downgrade());
    let pending = srq.recv(kept.rw(..).unwrap()).unwrap();
    drop(srq.recv(dropped.rw(..).unwrap()).unwrap());
    let _other_pending = other.recv(stays.rw(..).unwrap()).unwrap();
    drop((kept, dropped, stays));
    assert!(dropped_weak.is_alive(), "the device may still write it");
    drop(srq);
    assert!(
        !dropped_weak.is_alive(),
        "released once its queue was destroyed"
    );
    let err = block_on(pending).expect_err("a receive of a destroyed queue");
    assert!(err.to_string().contains("destroyed"), "{err}");
    assert!(
        !kept_weak.is_alive(),
        "the pending one's memory is released"
    );
    assert!(
        stays_weak.is_alive(),
        "the other queue's receive is untouched"
    );
}
