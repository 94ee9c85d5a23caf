//! The SnowRDMA runtime (Rust API) on a real device.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use snowrdma::costs::{self, Counter};
use snowrdma::runtime::proto::EXT_HEADER_LEN;
use snowrdma::runtime::{
    CommMode, ConnHandler, ConnState, Connection, Listener, Options, CHOSEN_INLINE_DATA,
};
use snowrdma::verbs::selftest::fill_pattern;

use crate::{device_ip, TIMEOUT};

/// Echoes every message back, in blocking mode (queued when the ring is full).
pub struct Echo;
impl ConnHandler for Echo {
    fn recv(&self, conn: &Connection, data: &[u8], imm: Option<u32>) {
        let sent = match imm {
            Some(v) => conn.send_with_imm(v, data),
            None => conn.send(data),
        };
        assert_eq!(sent.unwrap(), data.len(), "echo");
    }
}

/// Collects what arrives.
#[derive(Default)]
pub struct Collect {
    got: Mutex<(Vec<u8>, Vec<Option<u32>>, usize)>,
    cond: Condvar,
}
impl ConnHandler for Collect {
    fn recv(&self, _conn: &Connection, data: &[u8], imm: Option<u32>) {
        let mut g = self.got.lock().unwrap();
        g.0.extend_from_slice(data);
        g.1.push(imm);
        self.cond.notify_all();
    }
    fn disconnected(&self, _conn: &Connection) {
        self.got.lock().unwrap().2 += 1;
        self.cond.notify_all();
    }
}

impl Collect {
    /// Waits until `disconnected` has fired.
    pub fn wait_disconnected(&self, timeout: Duration) {
        assert!(
            self.ended_within(timeout),
            "no disconnected callback within {timeout:?}"
        );
    }

    /// Whether `disconnected` fires within `timeout`.
    pub fn ended_within(&self, timeout: Duration) -> bool {
        let g = self.got.lock().unwrap();
        let (g, _) = self
            .cond
            .wait_timeout_while(g, timeout, |g| g.2 == 0)
            .unwrap();
        g.2 > 0
    }

    pub fn wait_bytes(&self, n: usize, timeout: Duration) -> Vec<u8> {
        let deadline = Instant::now() + timeout;
        let mut g = self.got.lock().unwrap();
        while g.0.len() < n {
            let now = Instant::now();
            assert!(now < deadline, "only {} of {n} bytes arrived", g.0.len());
            g = self.cond.wait_timeout(g, deadline - now).unwrap().0;
        }
        g.0.clone()
    }
}

/// A started listener on the device whose connections share `handler`.
pub fn serve(opts: &Options, handler: Arc<dyn ConnHandler>) -> (Listener, SocketAddr) {
    let l = Listener::bind(
        SocketAddr::new(IpAddr::V4(device_ip()), 0),
        opts,
        Box::new(move |_| Some(handler.clone())),
    )
    .unwrap();
    l.start().unwrap();
    let addr = l.local_addr().unwrap();
    (l, addr)
}

pub fn echo_server(opts: &Options) -> (Listener, SocketAddr) {
    serve(opts, Arc::new(Echo))
}

pub fn blocking() -> Options {
    Options {
        comm_mode: CommMode::Blocking,
        ..Options::default()
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn echo_of_messages_that_wrap_the_ring_many_times() {
    let opts = Options {
        recv_buf_len: 64 << 10,
        ..blocking()
    };
    let (server, addr) = echo_server(&opts);
    let sink = Arc::new(Collect::default());
    let conn = Connection::connect(addr, &opts, sink.clone()).unwrap();
    assert_eq!(conn.state(), ConnState::MrReady);
    let mut sent = Vec::new();
    let mut seed = 1u64;
    while sent.len() < 4 << 20 {
        seed += 1;
        let len = 1 + (seed as usize * 7919) % (16 << 10);
        let mut msg = vec![0u8; len];
        fill_pattern(&mut msg, seed);
        assert_eq!(conn.send(&msg).unwrap(), len);
        sent.extend_from_slice(&msg);
    }
    let got = sink.wait_bytes(sent.len(), TIMEOUT * 6);
    assert!(got == sent, "echoed bytes differ");
    conn.close();
    server.release();
}

/// Reads each message where it lies in the ring, slowly, and checks it is
/// the next one sent (message `k`: `fill_pattern` with seed `k`).
#[derive(Default)]
struct SlowReader {
    /// Reads started.
    started: std::sync::atomic::AtomicU64,
    /// Messages read, and those whose bytes differed.
    seen: Mutex<(u64, u64)>,
}
impl ConnHandler for SlowReader {
    fn recv_in_ring(&self, _conn: &Connection, msg: &snowrdma::runtime::InRing<'_>) -> bool {
        self.started
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // The test sends meanwhile; its message carries credit for what
        // this side has taken off the completion queue.
        std::thread::sleep(Duration::from_millis(10));
        let mut got = vec![0u8; msg.len()];
        assert!(msg.read(0, &mut got));
        let mut seen = self.seen.lock().unwrap();
        let mut want = vec![0u8; got.len()];
        fill_pattern(&mut want, seen.0);
        seen.0 += 1;
        seen.1 += u64::from(got != want);
        true
    }
    fn recv(&self, _conn: &Connection, _data: &[u8], _imm: Option<u32>) {
        unreachable!("every message is taken in the ring");
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_slow_reader_in_the_ring_gets_every_echo_intact_while_its_side_sends() {
    // Rings of about 20 messages on both sides; the echo server has more
    // to send than fits while each message is read, and every 4th read
    // this thread sends (its message may carry credit) while a message is
    // still being read: the bytes being read must not be handed back.
    // (Written after CI saw an echo whose bytes differed; on the VM this
    // arrangement did not reproduce that race before the fix, so it
    // guards the rule rather than replays the failure.)
    let opts = Options {
        recv_buf_len: 64 << 10,
        ..blocking()
    };
    let (server, addr) = echo_server(&opts);
    let reader = Arc::new(SlowReader::default());
    let conn = Connection::connect(addr, &opts, reader.clone()).unwrap();
    let send = |k: u64| {
        let mut msg = vec![0u8; 3000];
        fill_pattern(&mut msg, k);
        assert_eq!(conn.send(&msg).unwrap(), msg.len());
    };
    const AHEAD: u64 = 60;
    const MESSAGES: u64 = 75;
    (0..AHEAD).for_each(send);
    let deadline = Instant::now() + TIMEOUT * 3;
    for k in AHEAD..MESSAGES {
        // During read number 4 * (k - AHEAD + 1).
        while reader.started.load(std::sync::atomic::Ordering::SeqCst) < 4 * (k - AHEAD + 1) {
            assert!(Instant::now() < deadline, "the reads stalled");
            std::thread::sleep(Duration::from_millis(1));
        }
        send(k);
    }
    while reader.seen.lock().unwrap().0 < MESSAGES {
        assert!(Instant::now() < deadline, "not every echo came back");
        std::thread::sleep(Duration::from_millis(10));
    }
    let (read, differed) = *reader.seen.lock().unwrap();
    assert_eq!(
        (read, differed),
        (MESSAGES, 0),
        "messages read, and with other bytes than sent"
    );
    conn.close();
    server.release();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_batch_posts_what_it_can_and_hands_back_the_rest() {
    use snowrdma::costs::{self, Counter};
    use snowrdma::runtime::WriteAhead;
    let (server, addr) = echo_server(&blocking());
    let sink = Arc::new(Collect::default());
    let conn = Connection::connect(addr, &blocking(), sink.clone()).unwrap();
    // Three messages with one doorbell (a credit may ride in front).
    let before = costs::this_thread();
    assert_eq!(
        conn.send_batch(&[&[b"one "], &[b"two", b" "], &[b"three "]])
            .unwrap(),
        3
    );
    let d = costs::this_thread().since(&before);
    assert_eq!(d.get(Counter::SendDoorbells), 1, "{d:?}");
    // An empty message stops the batch: it and what follows are the
    // caller's to send one by one, and the send reports the error.
    assert_eq!(
        conn.send_batch(&[&[b"four "], &[], &[b"never"]]).unwrap(),
        1
    );
    assert!(conn.send(b"").is_err());
    // A write from memory not registered on the connection stops it too.
    let target = conn.peer_buffer().expect("the peer's ring").at(0);
    let bogus = WriteAhead {
        local_addr: 0x1000,
        lkey: 0xdead,
        remote: target,
        len: 8,
    };
    // SAFETY: nothing is posted: the write fails its check first.
    let posted = unsafe { conn.write_then_send_batch(&[(&[b"five"], Some(bogus))]) };
    assert_eq!(posted.unwrap(), 0);
    // SAFETY: as above.
    let refused = unsafe { conn.write_then_send(0x1000, 0xdead, target, 8, &[b"five"]) };
    assert!(refused.is_err(), "an unregistered write is refused");
    assert_eq!(&sink.wait_bytes(19, TIMEOUT), b"one two three four ");
    assert_eq!(conn.state(), ConnState::MrReady, "refusals are not fatal");
    conn.close();
    server.release();
}

/// Echoes each round's messages together at its end, as the kv server
/// answers: nothing is sent from `recv`.
#[derive(Default)]
struct RoundEcho {
    held: Mutex<Vec<Vec<u8>>>,
    rounds: Mutex<usize>,
}
impl ConnHandler for RoundEcho {
    fn recv(&self, _conn: &Connection, data: &[u8], _imm: Option<u32>) {
        self.held.lock().unwrap().push(data.to_vec());
    }
    fn round_done(&self, conn: &Connection) {
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        *self.rounds.lock().unwrap() += 1;
        let parts: Vec<[&[u8]; 1]> = held.iter().map(|m| [&m[..]]).collect();
        let msgs: Vec<&[&[u8]]> = parts.iter().map(|p| &p[..]).collect();
        let mut sent = 0;
        while sent < msgs.len() {
            let chunk = &msgs[sent..msgs.len().min(sent + 100)];
            sent += conn.send_batch(chunk).unwrap();
            if sent < msgs.len() {
                assert!(conn.send(&held[sent]).unwrap() > 0, "echo");
                sent += 1;
            }
        }
    }
}

/// A handler that answers only at the end of each round of completions
/// gets that call after every round, whichever way the messages came (one
/// by one or many to a doorbell): every echo arrives, in order.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_handler_that_answers_at_the_end_of_each_round_answers_everything() {
    let echo = Arc::new(RoundEcho::default());
    let (server, addr) = serve(&blocking(), echo.clone());
    let sink = Arc::new(Collect::default());
    let conn = Connection::connect(addr, &blocking(), sink.clone()).unwrap();
    let msgs: Vec<[u8; 8]> = (0..600u64).map(u64::to_le_bytes).collect();
    let mut expected = Vec::new();
    for (i, group) in msgs.chunks(40).enumerate() {
        if i % 2 == 0 {
            // Many to a doorbell, arriving together.
            let parts: Vec<[&[u8]; 1]> = group.iter().map(|m| [&m[..]]).collect();
            let batch: Vec<&[&[u8]]> = parts.iter().map(|p| &p[..]).collect();
            let posted = conn.send_batch(&batch).unwrap();
            for m in &group[posted..] {
                assert_eq!(conn.send(m).unwrap(), 8);
            }
        } else {
            for m in group {
                assert_eq!(conn.send(m).unwrap(), 8);
            }
        }
        expected.extend(group.iter().flatten());
    }
    assert_eq!(sink.wait_bytes(expected.len(), TIMEOUT), expected);
    let rounds = *echo.rounds.lock().unwrap();
    assert!((1..=msgs.len()).contains(&rounds), "{rounds} rounds");
    conn.close();
    server.release();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn immediates_arrive_with_their_message() {
    let (server, addr) = echo_server(&blocking());
    let sink = Arc::new(Collect::default());
    let conn = Connection::connect(addr, &blocking(), sink.clone()).unwrap();
    conn.send_with_imm(0xfeed_0001, b"with imm").unwrap();
    conn.send(b"plain").unwrap();
    let got = sink.wait_bytes(13, TIMEOUT);
    assert_eq!(&got, b"with immplain");
    assert_eq!(sink.got.lock().unwrap().1, [Some(0xfeed_0001), None]);
    conn.close();
    server.release();
}

/// With `max_inline_data` left at 0, as the legacy library's default, a
/// small message still goes inline (the sender copies none of it; the
/// provider takes it with the work request) and arrives intact, at every
/// size around the runtime's choice, with and without an immediate (whose
/// header counts against it).
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn small_messages_go_inline_when_the_caller_left_it_to_the_runtime() {
    let (server, addr) = echo_server(&blocking());
    let sink = Arc::new(Collect::default());
    let conn = Connection::connect(addr, &blocking(), sink.clone()).unwrap();
    let limit = CHOSEN_INLINE_DATA as usize;
    let mut sent = Vec::new();
    let mut imms = Vec::new();
    for len in 1..=limit + 8 {
        for imm in [None, Some(len as u32)] {
            let mut msg = vec![0u8; len];
            fill_pattern(&mut msg, sent.len() as u64);
            let header = if imm.is_some() { EXT_HEADER_LEN } else { 0 };
            let before = costs::this_thread();
            let n = match imm {
                Some(v) => conn.send_with_imm(v, &msg),
                None => conn.send(&msg),
            };
            assert_eq!(n.unwrap(), len);
            let copied = costs::this_thread()
                .since(&before)
                .get(Counter::CopiedBytes);
            let inline = len + header <= limit;
            assert_eq!(
                copied,
                if inline { 0 } else { len as u64 },
                "{len} bytes with {imm:?}"
            );
            sent.extend_from_slice(&msg);
            imms.push(imm);
        }
    }
    let got = sink.wait_bytes(sent.len(), TIMEOUT);
    assert!(got == sent, "echoed bytes differ");
    assert_eq!(sink.got.lock().unwrap().1, imms);
    conn.close();
    server.release();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_full_ring_and_send_queue_make_a_non_blocking_send_return_zero() {
    // The server never consumes: its callback parks until released.
    let gate = Arc::new((Mutex::new(false), Condvar::new()));
    struct Park(Arc<(Mutex<bool>, Condvar)>);
    impl ConnHandler for Park {
        fn recv(&self, _c: &Connection, _d: &[u8], _i: Option<u32>) {
            let (m, c) = &*self.0;
            let mut open = m.lock().unwrap();
            while !*open {
                open = c.wait(open).unwrap();
            }
        }
    }
    // Opens the gate however the test ends: a parked callback would hold
    // the completion thread every later test needs.
    struct OpenOnDrop(Arc<(Mutex<bool>, Condvar)>);
    impl Drop for OpenOnDrop {
        fn drop(&mut self) {
            *self.0 .0.lock().unwrap() = true;
            self.0 .1.notify_all();
        }
    }
    let opener = OpenOnDrop(gate.clone());
    let opts = Options {
        recv_buf_len: 16 << 10,
        send_queue_bytes: 64 << 10,
        ..Options::default()
    };
    let g = gate.clone();
    let server = Listener::bind(
        SocketAddr::new(IpAddr::V4(device_ip()), 0),
        &opts,
        Box::new(move |_| Some(Arc::new(Park(g.clone())) as Arc<dyn ConnHandler>)),
    )
    .unwrap();
    server.start().unwrap();
    let conn = Connection::connect(
        server.local_addr().unwrap(),
        &opts,
        Arc::new(Collect::default()),
    )
    .unwrap();
    let mut accepted = 0;
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let n = conn.send(&[7u8; 1000]).unwrap();
        if n == 0 {
            break;
        }
        accepted += n;
        assert!(Instant::now() < deadline);
    }
    // The ring's share, then the send queue's: 61 messages of 1000 bytes
    // (each charged 64 more) fit in 64 KiB.
    let queued = 61 * 1000;
    assert!(
        (8 << 10) + queued <= accepted && accepted <= (16 << 10) + queued,
        "accepted {accepted}"
    );
    let stats = conn.send_queue_stats();
    assert_eq!((stats.queued, stats.refused), (61, 1), "{stats:?}");
    let too_big = vec![0u8; (16 << 10) + 1];
    assert!(conn.send(&too_big).is_err());
    assert!(conn.send(&[]).is_err());
    drop(opener);
    conn.close();
    server.release();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn connecting_to_a_closed_port_fails_within_the_timeout() {
    let opts = Options {
        timeout: Duration::from_millis(1000),
        ..Options::default()
    };
    let start = Instant::now();
    let err = Connection::connect(
        SocketAddr::new(IpAddr::V4(device_ip()), 9),
        &opts,
        Arc::new(Collect::default()),
    )
    .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "took {:?}: {err}",
        start.elapsed()
    );
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn sync_read_and_write_move_the_bytes_and_a_wrong_rkey_fails() {
    let (server, addr) = echo_server(&Options::default());
    let conn =
        Connection::connect(addr, &Options::default(), Arc::new(Collect::default())).unwrap();
    let mr = conn.register(8192).unwrap();
    let (addr_l, lkey, len) = (mr.addr(), mr.lkey(), mr.len());
    assert_eq!(len, 8192);
    // The pick runs outside the connection's locks: it may call it.
    let found = conn.find_registered(|r| conn.registered_lkey(r.addr(), 1) == Some(lkey));
    assert_eq!(found.map(|r| r.lkey()), Some(lkey));
    // The peer's ring is remote memory we may read and write.
    let remote = conn.peer_buffer().unwrap();
    unsafe { std::slice::from_raw_parts_mut(addr_l as *mut u8, 4096).fill(0x5c) };
    assert_eq!(
        conn.write_sync(addr_l, lkey, remote.at(0), 4096).unwrap(),
        4096
    );
    assert_eq!(
        conn.read_sync(addr_l + 4096, lkey, remote.at(0), 4096)
            .unwrap(),
        4096
    );
    let back = unsafe { std::slice::from_raw_parts((addr_l + 4096) as *const u8, 4096) };
    assert!(back.iter().all(|&b| b == 0x5c));
    // Unregistered local memory is refused before anything is posted.
    assert!(conn
        .read_sync(addr_l, lkey ^ 0xffff, remote.at(0), 16)
        .is_err());
    assert!(conn
        .read_sync(addr_l + 8000, lkey, remote.at(0), 4096)
        .is_err());
    assert_eq!(conn.state(), ConnState::MrReady);
    // READs started together are waited for one by one, in order; the
    // guard waits for the rest when dropped.
    for (i, byte) in [0xa1u8, 0xa2, 0xa3].into_iter().enumerate() {
        let piece = addr_l + i as u64 * 1024;
        unsafe { std::slice::from_raw_parts_mut(piece as *mut u8, 1024).fill(byte) };
        conn.write_sync(piece, lkey, remote.at(i as u64 * 1024), 1024)
            .unwrap();
    }
    let local = |i: u64| unsafe {
        std::slice::from_raw_parts((addr_l + 4096 + i * 1024) as *const u8, 1024)
    };
    let ops: Vec<_> = (0..3u64)
        .map(|i| (addr_l + 4096 + i * 1024, remote.at(i * 1024), 1024))
        .collect();
    let mut reads = unsafe { conn.start_reads(lkey, &ops) }.unwrap();
    reads.wait_through(0).unwrap();
    assert!(local(0).iter().all(|&b| b == 0xa1));
    reads.wait_through(1).unwrap();
    assert!(local(1).iter().all(|&b| b == 0xa2));
    drop(reads);
    assert!(local(2).iter().all(|&b| b == 0xa3));
    // A wrong rkey fails its operation (and, as RDMA does, the connection);
    // the READ before it still counts.
    let mut bad = remote.at(0);
    bad.rkey ^= 0x77;
    let ops = [(addr_l + 4096, remote.at(0), 64), (addr_l, bad, 64)];
    let mut reads = unsafe { conn.start_reads(lkey, &ops) }.unwrap();
    assert!(reads.wait_through(0).is_ok());
    assert!(reads.wait_through(1).is_err());
    // Whoever has the failure finds the connection ended, its QP stopped.
    assert_eq!(conn.state(), ConnState::Error);
    assert_eq!(conn.qp_state().unwrap(), snowrdma::verbs::QpState::ERR);
    drop(reads);
    assert!(conn.read_sync(addr_l, lkey, remote.at(0), 64).is_err());
    assert!(conn.send(b"x").is_err());
    assert!(conn.deregister(&mr));
    assert!(!conn.deregister(&mr));
    conn.close();
    conn.close();
    server.release();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn stopping_a_server_leaves_other_connections_running() {
    let (a, a_addr) = echo_server(&blocking());
    let (b, b_addr) = echo_server(&blocking());
    let sink = Arc::new(Collect::default());
    let to_b = Connection::connect(b_addr, &blocking(), sink.clone()).unwrap();
    let to_a = Connection::connect(a_addr, &blocking(), Arc::new(Collect::default())).unwrap();
    a.stop();
    a.release();
    assert!(
        Connection::connect(
            a_addr,
            &Options {
                timeout: Duration::from_millis(500),
                ..blocking()
            },
            Arc::new(Collect::default())
        )
        .is_err(),
        "a released server accepts nothing"
    );
    to_b.send(b"still here").unwrap();
    assert_eq!(sink.wait_bytes(10, TIMEOUT), b"still here");
    to_a.close();
    to_b.close();
    b.release();
}

/// A peer that speaks the legacy protocol (version 0), built on raw verbs:
/// it must get the legacy wire format and no extension.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_legacy_peer_gets_the_legacy_protocol_and_no_extension() {
    use snowrdma::runtime::legacy_peer::LegacyPeer;

    struct EchoAndTryImm(Mutex<Option<String>>);
    impl ConnHandler for EchoAndTryImm {
        fn recv(&self, conn: &Connection, data: &[u8], _imm: Option<u32>) {
            conn.send(data).unwrap();
            let refused = conn.send_with_imm(7, data).unwrap_err().to_string();
            *self.0.lock().unwrap() = Some(refused);
        }
    }
    let seen = Arc::new(EchoAndTryImm(Mutex::new(None)));
    let (server, addr) = serve(&blocking(), seen.clone());

    // Advertises its ring with version 0, reads each message where its
    // immediate (the offset, no extension bit) says, and fails on any
    // command the legacy library did not know, CREDIT among them.
    let mut peer = LegacyPeer::connect(addr, TIMEOUT).unwrap();
    assert_eq!(peer.send(b"hello legacy").unwrap(), 12);
    let mut echoed = Vec::new();
    let came = peer
        .recv(Instant::now() + TIMEOUT, &mut |b| {
            echoed.extend_from_slice(b)
        })
        .unwrap();
    assert!(came, "the echo came back in the legacy format");
    assert_eq!(echoed, b"hello legacy");
    let more = peer
        .recv(Instant::now() + Duration::from_millis(700), &mut |b| {
            panic!("{} more bytes", b.len())
        })
        .unwrap();
    assert!(!more, "nothing else, and no CREDIT");
    let refused = seen
        .0
        .lock()
        .unwrap()
        .clone()
        .expect("the server tried an immediate");
    assert!(refused.contains("legacy"), "{refused}");
    drop(peer);
    server.release();
}

/// Sends a greeting from `connected`, the first moment data may flow, and
/// collects what arrives.
#[derive(Default)]
struct Greeter {
    got: Collect,
}
impl ConnHandler for Greeter {
    fn connected(&self, conn: &Connection) {
        conn.send(b"hello").unwrap();
    }
    fn recv(&self, conn: &Connection, data: &[u8], imm: Option<u32>) {
        self.got.recv(conn, data, imm)
    }
    fn disconnected(&self, conn: &Connection) {
        self.got.disconnected(conn)
    }
}

/// The peer's advertisement can be handled before this side's CM thread has
/// seen ESTABLISHED, or before a client posted its own: a greeting sent from
/// `connected` then must still follow this side's advertisement on the
/// wire, or the peer is right to cut the connection off. Many clients at
/// once keep the server's CM thread busy while their advertisements arrive.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_greeting_from_connected_follows_the_advertisement_on_both_sides() {
    const CLIENTS: usize = 16;
    let server_side = Arc::new(Greeter::default());
    let (server, addr) = serve(&blocking(), server_side.clone());
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            std::thread::spawn(move || {
                let greeter = Arc::new(Greeter::default());
                let conn = Connection::connect(addr, &blocking(), greeter.clone()).unwrap();
                (conn, greeter)
            })
        })
        .collect();
    let clients: Vec<_> = clients.into_iter().map(|t| t.join().unwrap()).collect();
    for (i, (_conn, greeter)) in clients.iter().enumerate() {
        assert_eq!(greeter.got.wait_bytes(5, TIMEOUT), b"hello", "client {i}");
    }
    let all = server_side.got.wait_bytes(5 * CLIENTS, TIMEOUT);
    assert_eq!(all, b"hello".repeat(CLIENTS));
    for (i, (conn, greeter)) in clients.iter().enumerate() {
        assert!(
            !greeter.got.ended_within(Duration::ZERO),
            "client {i} was cut off"
        );
        assert_eq!(conn.state(), ConnState::MrReady, "client {i}");
    }
    assert!(
        !server_side.got.ended_within(Duration::ZERO),
        "the server cut a client off"
    );
    for (conn, _) in clients {
        conn.close();
    }
    server.release();
}
