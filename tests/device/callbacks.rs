//! What callbacks may do and where they run: sync operations and sends
//! from inside `recv` and `write_done`, `write_done` never inside the
//! caller's own call, and the order of write callbacks and `disconnected`
//! on a caller-polled connection.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use snowrdma::runtime::{ConnHandler, Connection, Listener, Options};
use snowrdma::verbs::{MemoryRegion, RemoteAddr};

use crate::runtime::{blocking, echo_server};
use crate::TIMEOUT;

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn callbacks_can_run_sync_operations_and_send_without_deadlock() {
    // On the first message, the client's callback reads the server's buffer
    // synchronously (the completion thread must drive its own CQ) and sends.
    struct ReadInCallback {
        result: Mutex<Option<Vec<u8>>>,
        cond: Condvar,
    }
    impl ConnHandler for ReadInCallback {
        fn recv(&self, conn: &Connection, data: &[u8], _imm: Option<u32>) {
            if data != b"first" {
                return;
            }
            let mr = conn.register(64).unwrap();
            let (addr, lkey) = (mr.addr(), mr.lkey());
            let peer = conn.peer_buffer().unwrap();
            let n = conn.read_sync(addr, lkey, peer.at(0), 5).unwrap();
            let got = unsafe { std::slice::from_raw_parts(addr as *const u8, n) }.to_vec();
            assert_eq!(conn.send(b"second").unwrap(), 6);
            conn.deregister(&mr);
            *self.result.lock().unwrap() = Some(got);
            self.cond.notify_all();
        }
    }
    let (server, addr) = echo_server(&blocking());
    let h = Arc::new(ReadInCallback {
        result: Mutex::new(None),
        cond: Condvar::new(),
    });
    let conn = Connection::connect(addr, &Options::default(), h.clone()).unwrap();
    conn.send(b"first").unwrap();
    let g = h
        .cond
        .wait_timeout_while(h.result.lock().unwrap(), TIMEOUT, |r| r.is_none())
        .unwrap()
        .0;
    // The server's ring starts with the bytes we sent it.
    assert_eq!(g.as_deref(), Some(&b"first"[..]));
    drop(g);
    conn.close();
    server.release();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_write_callback_can_run_sync_operations_and_send_without_deadlock() {
    // The completion of an async WRITE runs `write_done` on the completion
    // thread, which then reads synchronously (driving the send CQ itself)
    // and sends, as a legacy program may from its write callback.
    #[derive(Default)]
    struct ReadAfterWrite {
        mr: Mutex<Option<(u64, u32)>>,
        result: Mutex<Option<Vec<u8>>>,
        cond: Condvar,
    }
    impl ConnHandler for ReadAfterWrite {
        fn write_done(&self, conn: &Connection, len: usize) {
            let (addr, lkey) = self.mr.lock().unwrap().unwrap();
            let peer = conn.peer_buffer().unwrap();
            let n = conn.read_sync(addr + 64, lkey, peer.at(0), len as u32);
            let got = n.map(|n| {
                unsafe { std::slice::from_raw_parts((addr + 64) as *const u8, n) }.to_vec()
            });
            let sent = conn.send(b"after the write");
            *self.result.lock().unwrap() = Some(match (got, sent) {
                (Ok(got), Ok(15)) => got,
                (got, sent) => format!("{got:?} {sent:?}").into_bytes(),
            });
            self.cond.notify_all();
        }
    }
    let (server, addr) = echo_server(&blocking());
    let h = Arc::new(ReadAfterWrite::default());
    let conn = Connection::connect(addr, &Options::default(), h.clone()).unwrap();
    let mr = conn.register(128).unwrap();
    *h.mr.lock().unwrap() = Some((mr.addr(), mr.lkey()));
    unsafe { std::slice::from_raw_parts_mut(mr.addr() as *mut u8, 16).fill(0x3e) };
    let remote = conn.peer_buffer().unwrap().at(0);
    assert_eq!(
        unsafe { conn.write(mr.addr(), mr.lkey(), remote, 16) }.unwrap(),
        16
    );
    let g = h
        .cond
        .wait_timeout_while(h.result.lock().unwrap(), TIMEOUT, |r| r.is_none())
        .unwrap()
        .0;
    assert_eq!(
        g.as_deref(),
        Some(&[0x3e; 16][..]),
        "the callback read back the write"
    );
    drop(g);
    conn.close();
    server.release();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_silent_write_calls_write_done_later_on_the_completion_thread() {
    // The caller holds the lock `write_done` takes around its write: a
    // callback run inside the call would deadlock here.
    #[derive(Default)]
    struct Seen {
        calls: Mutex<Vec<(usize, std::thread::ThreadId)>>,
        cond: Condvar,
    }
    impl ConnHandler for Seen {
        fn write_done(&self, _conn: &Connection, len: usize) {
            self.calls
                .lock()
                .unwrap()
                .push((len, std::thread::current().id()));
            self.cond.notify_all();
        }
    }
    let (server, addr) = echo_server(&blocking());
    let h = Arc::new(Seen::default());
    let conn = Connection::connect(addr, &Options::default(), h.clone()).unwrap();
    let held = h.calls.lock().unwrap();
    assert_eq!(conn.write_silent(b"written").unwrap(), 7);
    assert_eq!(conn.write_silent(b"again").unwrap(), 5);
    let calls = h
        .cond
        .wait_timeout_while(held, TIMEOUT, |c| c.len() < 2)
        .unwrap()
        .0;
    let me = std::thread::current().id();
    assert_eq!(calls.iter().map(|c| c.0).collect::<Vec<_>>(), [7, 5]);
    assert!(
        calls.iter().all(|c| c.1 != me),
        "not on the caller's thread"
    );
    drop(calls);
    // A message after the writes still goes.
    conn.send(b"after").unwrap();
    conn.close();
    server.release();
}

/// A caller-polled connection to an echo server, a registered buffer, and
/// the peer's buffer under a wrong rkey (a READ of it fails the connection).
fn caller_polled_with_a_wrong_rkey(
    h: Arc<dyn ConnHandler>,
) -> (Listener, Connection, Arc<MemoryRegion>, RemoteAddr) {
    let (server, addr) = echo_server(&blocking());
    let opts = Options {
        caller_polls: true,
        ..Options::default()
    };
    let conn = Connection::connect(addr, &opts, h).unwrap();
    let mr = conn.register(64).unwrap();
    let mut bad = conn.peer_buffer().unwrap().at(0);
    bad.rkey ^= 0x77;
    (server, conn, mr, bad)
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_disconnected_handler_that_waits_on_its_connection_does_not_deadlock() {
    // The caller polls its own connection: the failed READ is found by its
    // poll of the send CQ, and `disconnected` waits on the connection,
    // which polls that CQ again.
    #[derive(Default)]
    struct WaitsWhenDisconnected(Mutex<bool>);
    impl ConnHandler for WaitsWhenDisconnected {
        fn disconnected(&self, conn: &Connection) {
            conn.wait_for(Instant::now() + Duration::from_millis(50), || false);
            *self.0.lock().unwrap() = true;
        }
    }
    let h = Arc::new(WaitsWhenDisconnected::default());
    let (server, conn, mr, bad) = caller_polled_with_a_wrong_rkey(h.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = conn.clone();
    let (addr_l, lkey) = (mr.addr(), mr.lkey());
    std::thread::spawn(move || {
        let _ = tx.send(reader.read_sync(addr_l, lkey, bad, 64).is_err());
    });
    assert_eq!(
        rx.recv_timeout(TIMEOUT),
        Ok(true),
        "the READ failed, in time"
    );
    // The completion thread may have found the failure and be running
    // `disconnected` still.
    let deadline = Instant::now() + TIMEOUT;
    while !*h.0.lock().unwrap() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(*h.0.lock().unwrap(), "disconnected ran to its end");
    conn.close();
    server.release();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_caller_polled_connection_runs_its_write_callbacks_before_disconnected() {
    // The caller's own failing READ ends the connection, on its thread:
    // the write callbacks its earlier writes owe run first, none is lost.
    #[derive(Default)]
    struct Order(Mutex<Vec<&'static str>>);
    impl ConnHandler for Order {
        fn write_done(&self, _conn: &Connection, _len: usize) {
            self.0.lock().unwrap().push("write");
        }
        fn disconnected(&self, _conn: &Connection) {
            self.0.lock().unwrap().push("disconnected");
        }
    }
    let h = Arc::new(Order::default());
    let (server, conn, mr, bad) = caller_polled_with_a_wrong_rkey(h.clone());
    for _ in 0..3 {
        assert_eq!(conn.write_silent(b"abc").unwrap(), 3);
    }
    assert!(conn.read_sync(mr.addr(), mr.lkey(), bad, 64).is_err());
    let deadline = Instant::now() + TIMEOUT;
    while !h.0.lock().unwrap().contains(&"disconnected") && Instant::now() < deadline {
        conn.wait_for(Instant::now() + Duration::from_millis(10), || false);
    }
    assert_eq!(
        *h.0.lock().unwrap(),
        ["write", "write", "write", "disconnected"]
    );
    conn.close();
    server.release();
}
