//! Echo under load, the way legacy programs echo: from the receive callback,
//! ignoring what the send returns. Nothing a sender was told it sent may be
//! lost, whatever the mode, however full the rings are.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use snowrdma::runtime::legacy_peer::LegacyPeer;
use snowrdma::runtime::{
    CommMode, ConnHandler, Connection, Options, SendQueueStats, DEFAULT_RECV_BUF_LEN,
};

use crate::c_programs::{program, Proc};
use crate::{device_ip, TIMEOUT};

/// A prime, so streams of different seeds do not line up.
const PATTERN_LEN: usize = 1_000_003;

fn pattern() -> &'static [u8] {
    static P: OnceLock<Vec<u8>> = OnceLock::new();
    P.get_or_init(|| {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        (0..PATTERN_LEN)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    })
}

/// The bytes of stream `seed` from position `pos`, into `out`.
fn stream_bytes(seed: u64, pos: u64, out: &mut [u8]) {
    let p = pattern();
    let mut at = ((seed.wrapping_mul(7919) + pos) % PATTERN_LEN as u64) as usize;
    let mut done = 0;
    while done < out.len() {
        let n = (out.len() - done).min(PATTERN_LEN - at);
        out[done..done + n].copy_from_slice(&p[at..at + n]);
        done += n;
        at = 0;
    }
}

fn stream_matches(seed: u64, pos: u64, data: &[u8]) -> bool {
    let p = pattern();
    let mut at = ((seed.wrapping_mul(7919) + pos) % PATTERN_LEN as u64) as usize;
    let mut done = 0;
    while done < data.len() {
        let n = (data.len() - done).min(PATTERN_LEN - at);
        if data[done..done + n] != p[at..at + n] {
            return false;
        }
        done += n;
        at = 0;
    }
    true
}

/// Random sizes from a seed (xorshift), in `1..=max`.
struct Sizes(u64);
impl Sizes {
    fn next(&mut self, max: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        1 + (self.0 % max as u64) as usize
    }
}

#[derive(Default)]
struct Received {
    /// Sizes of the messages sent and not yet echoed, in order.
    expected: VecDeque<usize>,
    /// Stream position of the next echoed byte.
    pos: u64,
    error: Option<String>,
    gone: bool,
}

/// Checks that echoes come back whole, in order, byte for byte.
struct EchoCheck {
    seed: u64,
    got: Mutex<Received>,
    cond: Condvar,
}

impl ConnHandler for EchoCheck {
    fn recv(&self, _conn: &Connection, data: &[u8], _imm: Option<u32>) {
        let mut g = self.got.lock().unwrap();
        if g.error.is_none() {
            match g.expected.pop_front() {
                Some(n) if n == data.len() && stream_matches(self.seed, g.pos, data) => {
                    g.pos += n as u64;
                }
                Some(n) => {
                    g.error = Some(format!(
                        "at byte {}: an echo of {} bytes, expected {n} bytes of the stream",
                        g.pos,
                        data.len()
                    ))
                }
                None => g.error = Some(format!("{} bytes nobody sent", data.len())),
            }
        }
        self.cond.notify_all();
    }

    fn disconnected(&self, _conn: &Connection) {
        self.got.lock().unwrap().gone = true;
        self.cond.notify_all();
    }
}

impl EchoCheck {
    fn new(seed: u64) -> Arc<EchoCheck> {
        Arc::new(EchoCheck {
            seed,
            got: Mutex::new(Received::default()),
            cond: Condvar::new(),
        })
    }

    /// Waits until `ok` holds; an error if an echo was wrong, the server
    /// left, or nothing moved for `stall`.
    fn wait(&self, stall: Duration, ok: impl Fn(&Received) -> bool) -> Result<(), String> {
        let mut g = self.got.lock().unwrap();
        let mut last = (g.pos, Instant::now());
        loop {
            if let Some(e) = &g.error {
                return Err(e.clone());
            }
            if ok(&g) {
                return Ok(());
            }
            if g.gone {
                return Err(format!("the server left at byte {}", g.pos));
            }
            if g.pos != last.0 {
                last = (g.pos, Instant::now());
            } else if last.1.elapsed() > stall {
                return Err(format!(
                    "no echo for {stall:?}: stuck at byte {} with {} messages outstanding",
                    g.pos,
                    g.expected.len()
                ));
            }
            g = self
                .cond
                .wait_timeout(g, Duration::from_millis(100))
                .unwrap()
                .0;
        }
    }
}

/// One client: sends `total` bytes in messages of random sizes up to `max`,
/// keeping at most `window` bytes unechoed, and checks every echo.
fn echo_client(addr: SocketAddr, seed: u64, load: Load) -> Result<(), String> {
    let Load {
        window,
        max,
        total,
        ring,
    } = load;
    let _ = env_logger::Builder::from_env(env_logger::Env::new().filter("SNOWRDMA_LOG"))
        .is_test(true)
        .try_init();
    let check = EchoCheck::new(seed);
    let opts = Options {
        comm_mode: CommMode::Blocking,
        recv_buf_len: ring,
        ..Options::default()
    };
    let conn = Connection::connect(addr, &opts, check.clone()).map_err(|e| e.to_string())?;
    let mut sizes = Sizes(seed | 1);
    let mut buf = vec![0u8; max];
    let mut sent = 0u64;
    let result = (|| {
        while sent < total {
            let n = sizes.next(max).min((total - sent) as usize);
            check.wait(TIMEOUT, |g| sent + n as u64 - g.pos <= window)?;
            stream_bytes(seed, sent, &mut buf[..n]);
            // Expected before it is sent: the echo may beat the return.
            check.got.lock().unwrap().expected.push_back(n);
            let deadline = Instant::now() + TIMEOUT;
            loop {
                match conn.send(&buf[..n]) {
                    Ok(k) if k == n => break,
                    Ok(0) if Instant::now() < deadline => continue,
                    other => return Err(format!("send at byte {sent}: {other:?}")),
                }
            }
            sent += n as u64;
        }
        check.wait(TIMEOUT, |g| g.pos == total)
    })();
    conn.close();
    result
}

/// What one echo client does: `total` bytes in messages of random sizes up
/// to `max`, at most `window` bytes unechoed, into a receive ring of `ring`
/// bytes.
#[derive(Debug, Clone, Copy)]
struct Load {
    window: u64,
    max: usize,
    total: u64,
    ring: usize,
}

/// Runs `clients` echo clients at once against `addr`; every error, with
/// the client it happened on.
fn echo_clients(addr: SocketAddr, clients: u64, load: Load) {
    let started = Instant::now();
    let total = load.total;
    let handles: Vec<_> = (0..clients)
        .map(|c| thread::spawn(move || echo_client(addr, 1000 + c, load)))
        .collect();
    let errors: Vec<String> = handles
        .into_iter()
        .enumerate()
        .filter_map(|(c, h)| h.join().unwrap().err().map(|e| format!("client {c}: {e}")))
        .collect();
    assert!(errors.is_empty(), "{errors:#?}");
    println!(
        "{clients} clients echoed {} MiB each in {:?}",
        total >> 20,
        started.elapsed()
    );
}

/// `echo_server` as the legacy sample echoes (ignoring what the send
/// returns), in the default mode or blocking.
fn legacy_echo(port: u16, blocking: bool) -> (Proc, SocketAddr) {
    let mut cmd = std::process::Command::new(program("echo_server"));
    cmd.args([device_ip().to_string(), port.to_string()]);
    cmd.arg(if blocking {
        "legacy-blocking"
    } else {
        "legacy"
    });
    // Info: each connection's end says how much its send queue was used.
    cmd.env("SNOWRDMA_LOG", "info");
    let server = Proc::start(cmd);
    server.expect_line("listening on", Duration::from_secs(60));
    (server, SocketAddr::new(IpAddr::V4(device_ip()), port))
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn legacy_echo_from_the_callback_loses_nothing_under_load() {
    for (port, blocking) in [(7620, false), (7621, true)] {
        let (mut server, addr) = legacy_echo(port, blocking);
        let load = Load {
            window: 256 << 10,
            max: 64 << 10,
            total: 16 << 20,
            ring: DEFAULT_RECV_BUF_LEN,
        };
        echo_clients(addr, 8, load);
        // Flow control keeps up with a 256 KiB window: the queue is the
        // rare path (reported, not asserted: it depends on timing).
        for line in server.lines_containing(&["send queue"], Duration::from_secs(1)) {
            println!("256 KiB window: {line}");
        }
        // More in flight than the client's ring holds: the server's echoes
        // must wait in its send queue.
        let load = Load {
            window: 6 << 20,
            ring: 128 << 10,
            ..load
        };
        echo_clients(addr, 2, load);
        server.kill();
        let lines =
            server.lines_containing(&["refus", "lost", "drop", "fail", "send queue"], TIMEOUT);
        for line in &lines {
            println!("after a 6 MiB window: {line}");
        }
        let complaints: Vec<&String> = lines
            .iter()
            .filter(|l| !l.contains("0 were refused, 0 dropped"))
            .collect();
        assert!(complaints.is_empty(), "the server logged {complaints:#?}");
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn legacy_echo_serves_a_version_0_peer_its_whole_lifetime() {
    let (_server, addr) = legacy_echo(7622, false);
    let mut peer = LegacyPeer::connect(addr, TIMEOUT).unwrap();
    let seed = 77;
    let mut sizes = Sizes(seed);
    let (mut sent, mut echoed) = (0u64, 0u64);
    let mut buf = vec![0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(60);
    let lifetime = 512u64 << 10;
    while echoed < lifetime {
        // Keep up to 64 KiB in flight, as a legacy client does.
        while sent < lifetime && sent - echoed < 64 << 10 {
            let n = sizes.next(4096).min((lifetime - sent) as usize);
            stream_bytes(seed, sent, &mut buf[..n]);
            assert_eq!(peer.send(&buf[..n]).unwrap(), n, "at byte {sent}");
            sent += n as u64;
        }
        let mut ok = true;
        let got = peer
            .recv(deadline, &mut |b| {
                ok = stream_matches(seed, echoed, b);
                echoed += b.len() as u64;
            })
            .unwrap();
        assert!(got, "only {echoed} of {lifetime} bytes came back");
        assert!(ok, "the echo at byte {echoed} differs");
    }
    assert_eq!(echoed, lifetime);
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn our_client_is_echoed_whole_by_a_version_0_echo_server() {
    let (tx, rx) = std::sync::mpsc::channel();
    let server = thread::spawn(move || {
        let mut peer =
            LegacyPeer::accept(SocketAddr::new(IpAddr::V4(device_ip()), 0), TIMEOUT, |a| {
                tx.send(a).unwrap()
            })
            .unwrap();
        peer.echo(Instant::now() + Duration::from_secs(60)).unwrap()
    });
    let addr = rx.recv_timeout(TIMEOUT).unwrap();
    let started = Instant::now();
    let load = Load {
        window: 256 << 10,
        max: 4 << 10,
        total: 512 << 10,
        ring: DEFAULT_RECV_BUF_LEN,
    };
    echo_client(addr, 5, load).unwrap();
    println!(
        "512 KiB echoed by a version-0 server in {:?}",
        started.elapsed()
    );
    server.join().unwrap();
}

/// A receiver whose callback sleeps until the gate opens, keeping what
/// arrives.
#[derive(Default)]
struct SleepyReceiver {
    open: Mutex<bool>,
    gate: Condvar,
    got: Mutex<Vec<(Vec<u8>, Option<u32>)>>,
}

impl ConnHandler for SleepyReceiver {
    fn recv(&self, _conn: &Connection, data: &[u8], imm: Option<u32>) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut open = self.open.lock().unwrap();
        while !*open && Instant::now() < deadline {
            open = self
                .gate
                .wait_timeout(open, Duration::from_millis(50))
                .unwrap()
                .0;
        }
        drop(open);
        self.got.lock().unwrap().push((data.to_vec(), imm));
    }
}

impl SleepyReceiver {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.gate.notify_all();
    }

    /// Waits until `n` messages arrived, then a little longer for extras.
    fn wait_for(&self, n: usize) -> Vec<(Vec<u8>, Option<u32>)> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.got.lock().unwrap().len() < n && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        thread::sleep(Duration::from_millis(500));
        self.got.lock().unwrap().clone()
    }
}

/// Message `i` of the slow-receiver tests: 4 KiB, numbered.
fn numbered(i: u32) -> Vec<u8> {
    let mut m = vec![(i % 251) as u8; 4096];
    m[..4].copy_from_slice(&i.to_be_bytes());
    m
}

fn sleepy_pair(sender: Options) -> (snowrdma::runtime::Listener, Arc<SleepyReceiver>, Connection) {
    let receiver = Arc::new(SleepyReceiver::default());
    let r2 = receiver.clone();
    let l = snowrdma::runtime::Listener::bind(
        SocketAddr::new(IpAddr::V4(device_ip()), 0),
        &Options::default(),
        Box::new(move |_| Some(r2.clone() as Arc<dyn ConnHandler>)),
    )
    .unwrap();
    l.start().unwrap();
    let conn = Connection::connect(
        l.local_addr().unwrap(),
        &sender,
        Arc::new(crate::runtime::Collect::default()),
    )
    .unwrap();
    (l, receiver, conn)
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_sender_that_outruns_a_sleeping_receiver_queues_up_to_the_bound() {
    let bound = 2 << 20;
    let (listener, receiver, conn) = sleepy_pair(Options {
        send_queue_bytes: bound,
        ..Options::default()
    });
    // Non-blocking: never waits; accepted until ring and queue are full.
    let mut accepted = 0u32;
    while conn.send(&numbered(accepted)).unwrap() == 4096 {
        accepted += 1;
        assert!(accepted < 10_000, "the queue is not bounded");
    }
    for i in 0..5 {
        assert_eq!(conn.send(&numbered(accepted + i)).unwrap(), 0, "still full");
    }
    let stats = conn.send_queue_stats();
    println!("accepted {accepted} messages of 4 KiB; {stats:?}");
    assert!(stats.queued > 0 && stats.refused == 6, "{stats:?}");
    assert!(
        stats.peak_bytes <= bound && stats.peak_bytes > bound - 8192,
        "queued up to the bound: {stats:?}"
    );
    assert!(
        accepted as usize * 4096 > bound,
        "the ring took its share first"
    );
    receiver.open();
    let got = receiver.wait_for(accepted as usize);
    assert_eq!(
        got.len(),
        accepted as usize,
        "every accepted message, nothing else"
    );
    for (i, (m, _)) in got.iter().enumerate() {
        assert!(
            *m == numbered(i as u32),
            "message {i} out of order or changed"
        );
    }
    // Room is back: sends go again.
    assert_eq!(conn.send(&numbered(accepted)).unwrap(), 4096);
    assert_eq!(
        receiver.wait_for(accepted as usize + 1).len(),
        accepted as usize + 1
    );
    conn.close();
    listener.release();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn closing_with_queued_messages_sends_them_first() {
    let (listener, receiver, conn) = sleepy_pair(Options {
        timeout: Duration::from_secs(20),
        ..Options::default()
    });
    // Three rings' worth: most of it waits in the queue.
    let n = 3 * 256;
    for i in 0..n {
        assert_eq!(conn.send(&numbered(i)).unwrap(), 4096, "message {i}");
    }
    assert!(conn.send_queue_stats().queued > 0);
    let closer = thread::spawn(move || {
        let started = Instant::now();
        conn.close();
        (started.elapsed(), conn.send_queue_stats())
    });
    thread::sleep(Duration::from_millis(300));
    receiver.open();
    let got = receiver.wait_for(n as usize);
    let (took, stats) = closer.join().unwrap();
    println!("close took {took:?}; {stats:?}");
    assert_eq!(stats.dropped, 0);
    assert_eq!(got.len(), n as usize, "every message sent before the close");
    for (i, (m, _)) in got.iter().enumerate() {
        assert!(
            *m == numbered(i as u32),
            "message {i} out of order or changed"
        );
    }
    listener.release();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn immediates_and_silent_writes_wait_in_the_queue_in_order() {
    let (listener, receiver, conn) = sleepy_pair(Options {
        send_queue_bytes: 1 << 20,
        ..Options::default()
    });
    // In turn: a message, one with an immediate, bytes written silently
    // (`rdmaConnSend`, `rdmaConnSendWithImm`, `rdmaConnWrite`).
    let mut accepted = 0u32;
    loop {
        let m = numbered(accepted);
        let n = match accepted % 3 {
            0 => conn.send(&m),
            1 => conn.send_with_imm(accepted, &m),
            _ => conn.write_silent(&m),
        }
        .unwrap();
        if n == 0 {
            break;
        }
        assert_eq!(n, 4096);
        accepted += 1;
        assert!(accepted < 10_000, "the queue is not bounded");
    }
    let stats = conn.send_queue_stats();
    assert!(stats.queued > 100 && stats.refused == 1, "{stats:?}");
    receiver.open();
    let expected: Vec<(Vec<u8>, Option<u32>)> = (0..accepted)
        .filter(|i| i % 3 != 2)
        .map(|i| (numbered(i), (i % 3 == 1).then_some(i)))
        .collect();
    let got = receiver.wait_for(expected.len());
    assert_eq!(got.len(), expected.len(), "every message, nothing else");
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert!(
            g == e,
            "delivery {i} differs: imm {:?}, expected {:?}",
            g.1,
            e.1
        );
    }
    conn.close();
    listener.release();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_peer_that_leaves_frees_and_counts_what_was_queued_for_it() {
    let (listener, receiver, conn) = sleepy_pair(Options::default());
    let mut accepted = 0u32;
    while accepted < 600 {
        assert_eq!(conn.send(&numbered(accepted)).unwrap(), 4096);
        accepted += 1;
    }
    let queued = conn.send_queue_stats().queued;
    assert!(queued > 0);
    // The receiving side goes away while messages wait for its room.
    listener.release();
    receiver.open();
    let deadline = Instant::now() + TIMEOUT;
    while conn.state() == snowrdma::runtime::ConnState::MrReady {
        assert!(
            Instant::now() < deadline,
            "the peer's leaving was not noticed"
        );
        thread::sleep(Duration::from_millis(20));
    }
    let stats = conn.send_queue_stats();
    println!("{stats:?}");
    assert!(stats.dropped > 0 && stats.dropped <= queued, "{stats:?}");
    assert!(conn.send(&numbered(0)).is_err(), "the connection has ended");
    conn.close();
}

/// Sends `count` numbered messages from inside its first receive callback,
/// more than the peer's ring holds, then closes the connection there, as a
/// legacy program may.
struct SendThenClose {
    count: u32,
    closed: Mutex<Option<(Duration, SendQueueStats)>>,
    cond: Condvar,
}

impl ConnHandler for SendThenClose {
    fn recv(&self, conn: &Connection, _data: &[u8], _imm: Option<u32>) {
        if self.closed.lock().unwrap().is_some() {
            return;
        }
        for i in 0..self.count {
            assert_eq!(conn.send(&numbered(i)).unwrap(), 4096, "message {i}");
        }
        let started = Instant::now();
        conn.close();
        *self.closed.lock().unwrap() = Some((started.elapsed(), conn.send_queue_stats()));
        self.cond.notify_all();
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn closing_inside_a_callback_sends_what_is_queued_first() {
    let (mut server, addr) = legacy_echo(7623, false);
    let count = 3 * 256;
    let handler = Arc::new(SendThenClose {
        count,
        closed: Mutex::new(None),
        cond: Condvar::new(),
    });
    let conn = Connection::connect(addr, &Options::default(), handler.clone()).unwrap();
    // The echo of this starts the callback.
    assert_eq!(conn.send(b"go").unwrap(), 2);
    let mut closed = handler.closed.lock().unwrap();
    let deadline = Instant::now() + TIMEOUT;
    while closed.is_none() {
        assert!(Instant::now() < deadline, "the callback did not close");
        closed = handler.cond.wait_timeout(closed, TIMEOUT).unwrap().0;
    }
    let (took, stats) = closed.take().unwrap();
    drop(closed);
    println!("close inside the callback took {took:?}; {stats:?}");
    assert!(stats.queued > 0, "the ring filled, so messages waited");
    assert_eq!(stats.dropped, 0);
    // The server delivers every message the client sent before it left,
    // then reports the disconnect: only then is its count complete.
    server.expect_line("disconnected", Duration::from_secs(60));
    // SAFETY: plain kill(2) on our child.
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    let status = server.wait(TIMEOUT);
    let got = server.lines_containing(&["received"], TIMEOUT);
    println!("{status}: {got:?}");
    let expected = format!(
        "received {} bytes in {} messages",
        2 + u64::from(count) * 4096,
        count + 1
    );
    assert!(
        got.iter().any(|l| l.contains(&expected)),
        "the server reports {got:?}, expected {expected:?}"
    );
}
