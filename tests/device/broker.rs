//! The RC message broker on a real device: the full mesh in both connection
//! modes and any start order, all-to-all messages with every byte checked,
//! immediates, replies from the callback, a full ring, WRITE and READ,
//! doorbell counting, a peer that dies, and a C callback that destroys its
//! broker.

use std::cell::Cell;
use std::ffi::{c_int, c_void, CString};
use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use snowrdma::broker::{Broker, BrokerError, Config, ConnectMode, EventKind, Local, Remote};
use snowrdma::ffi::broker::{
    snowrdma_broker, snowrdma_broker_config, snowrdma_broker_create, snowrdma_broker_destroy,
    snowrdma_broker_event, snowrdma_broker_flush, snowrdma_broker_init, snowrdma_broker_mode,
    snowrdma_broker_poll_rq, snowrdma_broker_poll_sq, snowrdma_broker_post_send,
    snowrdma_broker_send_buf, snowrdma_broker_status,
};
use snowrdma::verbs::CmId;

use crate::device_ip;

const INIT: Duration = Duration::from_secs(60);
const WAIT: Duration = Duration::from_secs(30);

fn config(servers: usize, me: usize, thread: u16, base_port: u16, mode: ConnectMode) -> Config {
    Config {
        hosts: (0..servers)
            .map(|i| SocketAddr::new(IpAddr::V4(device_ip()), base_port + 10 * i as u16))
            .collect(),
        server_id: me,
        thread_id: thread,
        slots: 16,
        slot_size: 256,
        doorbell_batch: 4,
        data_len: 1 << 16,
        mode,
        device: None,
    }
}

/// What a callback saw, for the test to check.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    kind: EventKind,
    peer: usize,
    wr_id: u64,
    buf: Vec<u8>,
    imm: Option<u32>,
}

type Log = Arc<Mutex<Vec<Seen>>>;

fn recorder() -> (
    Log,
    impl FnMut(&Broker, &snowrdma::broker::Event<'_>) + Send + 'static,
) {
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let s = seen.clone();
    (seen, move |_: &Broker, ev: &snowrdma::broker::Event<'_>| {
        s.lock().unwrap().push(Seen {
            kind: ev.kind,
            peer: ev.peer,
            wr_id: ev.wr_id,
            buf: ev.buf.to_vec(),
            imm: ev.imm,
        })
    })
}

/// Polls both sides until `done` holds, failing after WAIT.
fn poll_until(b: &Broker, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        b.poll_rq(None).unwrap();
        b.poll_sq(None).unwrap();
        assert!(start.elapsed() < WAIT, "timed out polling");
    }
}

fn message(from: usize, to: usize, thread: u16, seq: u32) -> Vec<u8> {
    let len = 8 + (seq as usize * 37 + from * 11 + to) % 200;
    (0..len)
        .map(|i| (from * 31 + to * 7 + thread as usize * 3 + seq as usize + i) as u8)
        .collect()
}

fn mesh(mode: ConnectMode, base_port: u16) {
    const SERVERS: usize = 4;
    const THREADS: u16 = 2;
    const MSGS: u32 = 12;
    let mut handles = Vec::new();
    // A start order that differs between runs and modes.
    let mut order: Vec<(usize, u16)> = (0..SERVERS)
        .flat_map(|s| (0..THREADS).map(move |t| (s, t)))
        .collect();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as usize;
    let n = order.len();
    order.rotate_left(seed % n);
    order.reverse();
    for (k, (me, thread)) in order.into_iter().enumerate() {
        handles.push(std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(40 * k as u64));
            let (seen, cb) = recorder();
            let b = Broker::new(config(SERVERS, me, thread, base_port, mode), cb).unwrap();
            b.init(INIT)
                .unwrap_or_else(|e| panic!("server {me} thread {thread}: {e}"));
            assert_eq!(b.peers().count(), SERVERS - 1);
            for seq in 0..MSGS {
                for to in (0..SERVERS).filter(|&s| s != me) {
                    let m = message(me, to, thread, seq);
                    let mut buf = b.send_buf_wait(to, WAIT).unwrap();
                    buf.as_mut_slice()[..m.len()].copy_from_slice(&m);
                    buf.send(m.len() as u32, seq + 1).unwrap();
                }
            }
            b.flush_all().unwrap();
            let want = (SERVERS as u32 - 1) * MSGS;
            poll_until(&b, || {
                let s = seen.lock().unwrap();
                s.iter().filter(|e| e.kind == EventKind::Recv).count() as u32 == want
                    && s.iter().filter(|e| e.kind == EventKind::SendDone).count() as u32 == want
            });
            let s = seen.lock().unwrap();
            for e in s.iter().filter(|e| e.kind == EventKind::Recv) {
                let seq = e.imm.expect("sent with an immediate") - 1;
                assert_eq!(
                    e.buf,
                    message(e.peer, me, thread, seq),
                    "from {} seq {seq}",
                    e.peer
                );
            }
            assert!(s.iter().all(|e| e.kind != EventKind::Failed));
            // Keep the QPs until every broker is done receiving.
            std::thread::sleep(Duration::from_secs(2));
            b.stats()
        }));
    }
    for h in handles {
        let stats = h.join().unwrap();
        assert!(
            stats.doorbells < stats.sends,
            "sends were batched: {stats:?}"
        );
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_full_mesh_over_rdma_cm() {
    mesh(ConnectMode::Cm, 19100);
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_full_mesh_over_sockets() {
    mesh(ConnectMode::Socket, 19200);
}

/// Two brokers on two threads; `other` runs on its own thread with `cb`.
fn two(base_port: u16, tweak: impl Fn(&mut Config)) -> (Broker, Log, Broker, Log) {
    let (tx, rx) = mpsc::channel();
    let mut c1 = config(2, 1, 0, base_port, ConnectMode::Cm);
    tweak(&mut c1);
    let other = std::thread::spawn(move || {
        let (seen, cb) = recorder();
        let b = Broker::new(c1, cb).unwrap();
        b.init(INIT).unwrap();
        tx.send(()).unwrap();
        (b, seen)
    });
    let (seen0, cb) = recorder();
    let mut c0 = config(2, 0, 0, base_port, ConnectMode::Cm);
    tweak(&mut c0);
    let b0 = Broker::new(c0, cb).unwrap();
    b0.init(INIT).unwrap();
    rx.recv_timeout(WAIT).unwrap();
    let (mut b1, seen1) = other.join().unwrap();
    // The test drives both from this thread: it owns them now.
    b1.take_ownership();
    (b0, seen0, b1, seen1)
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_ping_pong_with_replies_from_the_callback() {
    let (tx, rx) = mpsc::channel::<(usize, u32)>();
    let (seen0, cb0) = recorder();
    let echo = move |b: &Broker, ev: &snowrdma::broker::Event<'_>| {
        if ev.kind == EventKind::Recv {
            let _ = tx.send((ev.buf.len(), ev.imm.unwrap_or(0)));
            // The reply goes out in this same poll.
            let mut buf = b.send_buf(ev.peer).unwrap();
            buf.as_mut_slice()[..ev.buf.len()].copy_from_slice(ev.buf);
            buf.send(ev.buf.len() as u32, ev.imm.unwrap_or(0) + 1)
                .unwrap();
        }
    };
    let port = 19300;
    let server = std::thread::spawn(move || {
        let b = Broker::new(config(2, 1, 0, port, ConnectMode::Cm), echo).unwrap();
        b.init(INIT).unwrap();
        let start = Instant::now();
        let mut handled = 0;
        while handled < 10 && start.elapsed() < WAIT {
            handled += b.poll_rq(None).unwrap();
            b.poll_sq(None).unwrap();
        }
        std::thread::sleep(Duration::from_millis(500));
        handled
    });
    let b = Broker::new(config(2, 0, 0, port, ConnectMode::Cm), cb0).unwrap();
    b.init(INIT).unwrap();
    for round in 0..10u32 {
        let mut buf = b.send_buf_wait(1, WAIT).unwrap();
        buf.as_mut_slice()[..5].copy_from_slice(b"ping!");
        buf.send(5, 100 * round + 1).unwrap();
        b.flush(1).unwrap();
        poll_until(&b, || {
            seen0
                .lock()
                .unwrap()
                .iter()
                .any(|e| e.kind == EventKind::Recv && e.imm == Some(100 * round + 2))
        });
        assert_eq!(rx.recv_timeout(WAIT).unwrap(), (5, 100 * round + 1));
    }
    assert!(seen0
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.kind == EventKind::Recv)
        .all(|e| e.buf == b"ping!"));
    assert_eq!(server.join().unwrap(), 10);
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_one_sided_ring_full_and_doorbells() {
    let (b0, seen0, b1, seen1) = two(19400, |c| c.doorbell_batch = 4);
    // WRITE by offset, READ back by address.
    let mut buf = b0.send_buf(1).unwrap();
    buf.as_mut_slice()[..6].copy_from_slice(b"remote");
    let w = buf.write(6, Remote::Offset(100), 0).unwrap();
    b0.flush(1).unwrap();
    poll_until(&b0, || {
        seen0
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.kind == EventKind::WriteDone && e.wr_id == w)
    });
    let mut got = [0u8; 6];
    b1.read_data(100, &mut got).unwrap();
    assert_eq!(&got, b"remote");
    let region = b0.peer_region(1).unwrap();
    b0.write_data(0, &[0; 16]).unwrap();
    let r = b0
        .post_read(1, Local::Data(0), 6, Remote::Addr(region.addr + 100))
        .unwrap();
    b0.flush(1).unwrap();
    poll_until(&b0, || {
        seen0
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.kind == EventKind::ReadDone && e.wr_id == r)
    });
    b0.read_data(0, &mut got).unwrap();
    assert_eq!(&got, b"remote");
    assert!(matches!(
        b0.post_read(1, Local::Data(0), 8, Remote::Offset(region.len - 4)),
        Err(BrokerError::InvalidArgument(_))
    ));
    // WRITE WITH IMM: the peer gets the immediate.
    b1.write_data(200, b"0123").unwrap();
    b1.post_write(0, Local::Data(200), 4, Remote::Offset(300), 9)
        .unwrap();
    b1.flush(0).unwrap();
    poll_until(&b0, || {
        seen0
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.kind == EventKind::Recv && e.imm == Some(9))
    });
    poll_until(&b1, || {
        seen1
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.kind == EventKind::WriteDone)
    });
    b0.read_data(300, &mut got[..4]).unwrap();
    assert_eq!(&got[..4], b"0123");

    // Doorbells: 10 sends at batch 4 ring twice by themselves; the flush
    // posts the partial third.
    b0.poll_sq(None).unwrap();
    let before = b0.stats().doorbells;
    for i in 0..10u32 {
        b0.send_buf(1).unwrap().send(1, i + 1).unwrap();
    }
    assert_eq!(b0.stats().doorbells - before, 2);
    b0.flush(1).unwrap();
    assert_eq!(b0.stats().doorbells - before, 3);
    poll_until(&b1, || {
        seen1
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.kind == EventKind::Recv)
            .count()
            == 10
    });

    // The ring: 16 slots; with nothing reaped, slot 17 is refused.
    let mut held = Vec::new();
    let err = loop {
        match b0.send_buf(1) {
            Ok(buf) => {
                held.push(buf.slot());
                buf.send(1, 0).unwrap();
            }
            Err(e) => break e,
        }
        assert!(held.len() <= 16, "a slot was handed out twice");
    };
    assert!(matches!(err, BrokerError::Full(1)), "{err}");
    let mut unique = held.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), held.len(), "no slot handed out twice");
    b0.flush(1).unwrap();
    poll_until(&b0, || b0.send_buf(1).is_ok());
    drop(b1);
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_a_dead_peer_fails_only_its_own_operations() {
    dead_peer(ConnectMode::Cm, 19500);
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_a_dead_peer_is_noticed_over_sockets_too() {
    dead_peer(ConnectMode::Socket, 19600);
}

/// Three servers; server 2 dies once every init is done; server 0 keeps
/// talking to 1.
fn dead_peer(mode: ConnectMode, port: u16) {
    let (tx, rx) = mpsc::channel();
    // Server 2 dies only once the mesh is complete on every side: dying as
    // soon as its own init returned, it could leave while server 0 still
    // waited for server 1, and server 0 then waited for it again until its
    // init timed out.
    let (die_tx, die_rx) = mpsc::channel::<()>();
    let mut die_rx = Some(die_rx);
    let mut others = Vec::new();
    for me in 1..3 {
        let tx = tx.clone();
        let die = if me == 2 { die_rx.take() } else { None };
        others.push(std::thread::spawn(move || {
            let (seen, cb) = recorder();
            let b = Broker::new(config(3, me, 0, port, mode), cb).unwrap();
            b.init(INIT).unwrap();
            tx.send(me).unwrap();
            if let Some(die) = die {
                die.recv_timeout(WAIT).unwrap();
                return; // dies: its queue pairs are destroyed
            }
            poll_until(&b, || {
                seen.lock()
                    .unwrap()
                    .iter()
                    .filter(|e| e.kind == EventKind::Recv)
                    .count()
                    == 3
            });
        }));
    }
    let (seen, cb) = recorder();
    let b = Broker::new(config(3, 0, 0, port, mode), cb).unwrap();
    b.init(INIT).unwrap();
    for _ in 0..2 {
        rx.recv_timeout(WAIT).unwrap();
    }
    die_tx.send(()).unwrap();
    others.remove(1).join().unwrap();
    let start = Instant::now();
    loop {
        match b.send_buf(2) {
            Ok(buf) => {
                buf.send(1, 0).unwrap();
                b.flush(2).unwrap();
            }
            Err(BrokerError::PeerFailed(2)) => break,
            Err(BrokerError::Full(2)) => {}
            Err(e) => panic!("{e}"),
        }
        b.poll_sq(None).unwrap();
        b.poll_rq(None).unwrap();
        assert!(
            start.elapsed() < WAIT * 2,
            "the dead peer was never noticed"
        );
    }
    // The death may be noticed through the connection (its socket closing,
    // a CM event) before any operation failed; the operations still posted
    // to it then fail as its queue pair is flushed, in a later poll.
    poll_until(&b, || {
        seen.lock()
            .unwrap()
            .iter()
            .any(|e| e.kind == EventKind::Failed && e.peer == 2)
    });
    for i in 0..3u32 {
        b.send_buf(1).unwrap().send(1, i + 1).unwrap();
    }
    b.flush(1).unwrap();
    others.remove(0).join().unwrap();
    assert!(seen
        .lock()
        .unwrap()
        .iter()
        .all(|e| e.kind != EventKind::Failed || e.peer == 2));
}

/// A server reaches another but gives up on server 1 and goes; the other,
/// still waiting for server 1, must forget it, take it again when it comes
/// back, and end up with a live connection to it. Server 2 leaving server
/// 0 leaves a peer that was accepted; server 0 leaving server 2, one that
/// was connected to.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_a_peer_that_leaves_during_setup_is_taken_again() {
    let mut port = 19700;
    for mode in [ConnectMode::Cm, ConnectMode::Socket] {
        for (leaver, stayer) in [(2, 0), (0, 2)] {
            leaves_during_setup(mode, port, leaver, stayer);
            port += 50;
        }
    }
}

fn leaves_during_setup(mode: ConnectMode, port: u16, leaver: usize, stayer: usize) {
    let (seen_s, cb_s) = recorder();
    let (ready_tx, ready_rx) = mpsc::channel();
    let stays = std::thread::spawn(move || {
        let b = Broker::new(config(3, stayer, 0, port, mode), cb_s).unwrap();
        ready_tx.send(()).unwrap();
        b.init(INIT).unwrap();
        b
    });
    ready_rx.recv_timeout(WAIT).unwrap();
    // Server 1 is not there yet: the leaver reaches only the stayer, and
    // gives up in time.
    {
        let (_seen, cb) = recorder();
        let early = Broker::new(config(3, leaver, 0, port, mode), cb).unwrap();
        match early.init(Duration::from_secs(8)) {
            Err(BrokerError::InitTimeout { missing, why }) => {
                assert_eq!(missing, [1], "{mode:?}");
                // What it last heard of server 1: its own attempts' refusal
                // (it connects to lower ids), or nothing (higher ids
                // connect to it).
                assert_eq!(why.len(), 1);
                let nothing = why[0].contains("never heard from");
                assert_eq!(nothing, leaver < 1, "{mode:?}: {}", why[0]);
            }
            other => panic!("server {leaver} without server 1: {other:?}"),
        }
    }
    let (seen_l, cb_l) = recorder();
    let comes_back = std::thread::spawn(move || {
        let b = Broker::new(config(3, leaver, 0, port, mode), cb_l).unwrap();
        b.init(INIT).map(|()| b)
    });
    let one = std::thread::spawn(move || {
        let (_seen, cb) = recorder();
        let b = Broker::new(config(3, 1, 0, port, mode), cb).unwrap();
        b.init(INIT).unwrap();
        b
    });
    let mut bl = comes_back
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("{mode:?}: server {leaver} came back: {e}"));
    let mut bs = stays.join().unwrap();
    let _b1 = one.join().unwrap();
    bs.take_ownership();
    bl.take_ownership();
    bs.send_buf_wait(leaver, WAIT).unwrap().send(3, 7).unwrap();
    bs.flush(leaver).unwrap();
    bl.send_buf_wait(stayer, WAIT).unwrap().send(3, 8).unwrap();
    bl.flush(stayer).unwrap();
    let got = |seen: &Log, imm: u32| {
        seen.lock()
            .unwrap()
            .iter()
            .any(|e| e.kind == EventKind::Recv && e.imm == Some(imm))
    };
    let start = Instant::now();
    while !(got(&seen_l, 7) && got(&seen_s, 8)) {
        for b in [&bs, &bl] {
            b.poll_rq(None).unwrap();
            b.poll_sq(None).unwrap();
        }
        assert!(
            start.elapsed() < WAIT,
            "{mode:?}: servers {stayer} and {leaver} did not exchange messages"
        );
    }
    for seen in [&seen_s, &seen_l] {
        assert!(seen
            .lock()
            .unwrap()
            .iter()
            .all(|e| e.kind != EventKind::Failed));
    }
}

/// Inside a callback nothing can be polled: a wait for a send slot with a
/// full ring says so at once instead of spinning out its timeout; and a
/// slot whose post failed is free again once its `SendBuf` is dropped.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_a_callback_never_waits_for_a_slot_and_a_failed_post_keeps_none() {
    let (tx, rx) = mpsc::channel::<(bool, Duration, bool, bool)>();
    let on_recv = move |b: &Broker, ev: &snowrdma::broker::Event<'_>| {
        if ev.kind != EventKind::Recv {
            return;
        }
        let mut taken = Vec::new();
        while let Ok(buf) = b.send_buf(ev.peer) {
            taken.push(buf);
        }
        let start = Instant::now();
        let full = matches!(
            b.send_buf_wait(ev.peer, Duration::from_secs(5)),
            Err(BrokerError::Full(_))
        );
        let waited = start.elapsed();
        // Longer than a slot: refused, and the slot is not lost. The first
        // taken, as slots are handed out in ring order: it is next.
        let refused = taken.remove(0).send(4096, 0).is_err();
        let again = b.send_buf(ev.peer).is_ok();
        let _ = tx.send((b.in_callback() && full, waited, refused, again));
    };
    let port = 19340;
    let server = std::thread::spawn(move || {
        let b = Broker::new(config(2, 1, 0, port, ConnectMode::Cm), on_recv).unwrap();
        b.init(INIT).unwrap();
        assert!(!b.in_callback());
        let start = Instant::now();
        while b.poll_rq(None).unwrap() == 0 && start.elapsed() < WAIT {}
        std::thread::sleep(Duration::from_millis(500));
    });
    let (_, cb) = recorder();
    let b = Broker::new(config(2, 0, 0, port, ConnectMode::Cm), cb).unwrap();
    b.init(INIT).unwrap();
    let mut buf = b.send_buf_wait(1, WAIT).unwrap();
    buf.as_mut_slice()[..4].copy_from_slice(b"fill");
    buf.send(4, 0).unwrap();
    b.flush(1).unwrap();
    let (full_at_once, waited, refused, again) = rx.recv_timeout(WAIT).unwrap();
    assert!(full_at_once, "a full ring inside the callback: Full");
    assert!(
        waited < Duration::from_secs(1),
        "not waited for: {waited:?}"
    );
    assert!(refused, "a post longer than a slot is refused");
    assert!(again, "... and its slot is handed out again");
    server.join().unwrap();
}

/// What a C callback that destroys its broker saw, for the test to read
/// between polls.
#[derive(Default)]
struct Destroyer {
    /// What `snowrdma_broker_destroy` returned inside the callback.
    destroyed: Cell<Option<c_int>>,
    /// What a second destroy, and a flush, with the same handle returned
    /// right after it, still inside the callback.
    again: Cell<c_int>,
    flush_after: Cell<c_int>,
    /// Callbacks that ran after the destroy.
    late: Cell<u32>,
}

/// Destroys its broker on the first FAILED event, as a C program that
/// gives up on a failure does.
unsafe extern "C" fn destroy_on_failure(
    user: *mut c_void,
    b: *mut snowrdma_broker,
    ev: *const snowrdma_broker_event,
) {
    // SAFETY: `user` is the test's `Destroyer`, which outlives the broker;
    // `ev` is valid during the callback.
    let (d, kind) = unsafe { (&*user.cast::<Destroyer>(), (*ev).kind) };
    if d.destroyed.get().is_some() {
        d.late.set(d.late.get() + 1);
    } else if kind == EventKind::Failed {
        d.destroyed.set(Some(snowrdma_broker_destroy(b)));
        d.again.set(snowrdma_broker_destroy(b));
        d.flush_after.set(snowrdma_broker_flush(b, -1));
    }
}

/// A C callback destroys its broker when a send to a dead peer fails: the
/// destroy returns OK, the handle is dead at once (inside the callback and
/// after), no callback runs after it, the poll that ran it returns
/// normally, and the broker is freed when that poll returns (its RDMA CM
/// listener's address is free again).
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_a_c_callback_that_destroys_its_broker_on_a_failure_frees_it_after_the_poll() {
    const OK: c_int = snowrdma_broker_status::SNOWRDMA_BROKER_OK as c_int;
    const BAD_HANDLE: c_int = snowrdma_broker_status::SNOWRDMA_BROKER_INVALID_ARGUMENT as c_int;
    let port = 19360;
    let (tx, rx) = mpsc::channel();
    let peer = std::thread::spawn(move || {
        let (_seen, cb) = recorder();
        let b = Broker::new(config(2, 1, 0, port, ConnectMode::Cm), cb).unwrap();
        b.init(INIT).unwrap();
        tx.send(()).unwrap();
        // Dies here: its queue pair is destroyed.
    });
    let me = config(2, 0, 0, port, ConnectMode::Cm);
    let hosts: Vec<String> = me.hosts.iter().map(|h| h.to_string()).collect();
    let hosts = CString::new(hosts.join(",")).unwrap();
    let cfg = snowrdma_broker_config {
        hosts: hosts.as_ptr(),
        server_id: 0,
        thread_id: 0,
        slots_per_peer: me.slots,
        slot_size: me.slot_size,
        doorbell_batch: me.doorbell_batch,
        memory: std::ptr::null_mut(),
        memory_len: me.data_len as u64,
        mode: snowrdma_broker_mode::SNOWRDMA_BROKER_CM,
        device: std::ptr::null(),
    };
    let d = Destroyer::default();
    let user = &d as *const Destroyer as *mut c_void;
    // SAFETY: a valid config; the broker allocates its data region.
    let b = unsafe { snowrdma_broker_create(&cfg, Some(destroy_on_failure), user) };
    assert!(!b.is_null());
    assert_eq!(snowrdma_broker_init(b, INIT.as_millis() as u32), OK);
    rx.recv_timeout(WAIT).unwrap();
    peer.join().unwrap();
    let listen = me.hosts[0];
    assert!(
        CmId::listen_on(listen, 1).is_err(),
        "the live broker listens on {listen}"
    );

    let start = Instant::now();
    let polled = loop {
        for _ in 0..4 {
            let buf = snowrdma_broker_send_buf(b, 1);
            if !buf.is_null() {
                // Refused once the peer is found failed; the sends posted
                // before then fail, each a FAILED event.
                // SAFETY: NULL wr_id is allowed.
                let _ = unsafe { snowrdma_broker_post_send(b, buf, 1, 1, 0, std::ptr::null_mut()) };
            }
        }
        let _ = snowrdma_broker_flush(b, 1);
        let sq = snowrdma_broker_poll_sq(b, -1);
        if d.destroyed.get().is_some() {
            break sq;
        }
        assert!(sq >= 0, "poll_sq: {sq}");
        let rq = snowrdma_broker_poll_rq(b, -1);
        assert!(rq >= 0, "poll_rq: {rq}");
        assert!(
            start.elapsed() < WAIT * 2,
            "no send to the dead peer failed"
        );
    };
    assert_eq!(d.destroyed.get(), Some(OK), "destroy inside the callback");
    assert!(polled >= 1, "the poll that ran the callback: {polled}");
    assert_eq!(d.again.get(), BAD_HANDLE, "a second destroy inside it");
    assert_eq!(d.flush_after.get(), BAD_HANDLE, "a flush inside it");
    assert_eq!(d.late.get(), 0, "callbacks after the destroy");
    assert_eq!(snowrdma_broker_poll_sq(b, -1), -i64::from(BAD_HANDLE));
    assert_eq!(snowrdma_broker_destroy(b), BAD_HANDLE);
    assert!(snowrdma_broker_send_buf(b, 1).is_null());
    // Freed when the poll returned: its listener is gone.
    CmId::listen_on(listen, 1)
        .unwrap_or_else(|e| panic!("{listen} still taken after the poll: {e}"));
}
