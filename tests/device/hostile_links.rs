//! Peers that misuse how connections are set up: bytes on the socket after
//! socket mode's handshake, a client that connects and says nothing, and a
//! flood of setups that never finish.

use std::io::{ErrorKind, Read};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use snowrdma::broker::{Broker, BrokerError, Config, ConnectMode};
use snowrdma::runtime::{ConnHandler, Connection, Listener, Options};
use snowrdma::verbs::{CmEventKind, CmId, CompletionQueue, ConnParam, ProtectionDomain, QueuePair};

use crate::runtime::{blocking, Collect, Echo};
use crate::{device_ip, TIMEOUT};

/// The descriptor of this process's TCP socket whose peer is `peer`.
fn socket_to(peer: SocketAddr) -> libc::c_int {
    use std::os::fd::FromRawFd;
    for entry in std::fs::read_dir("/proc/self/fd").unwrap() {
        let Ok(fd) = entry
            .unwrap()
            .file_name()
            .to_string_lossy()
            .parse::<libc::c_int>()
        else {
            continue;
        };
        // SAFETY: borrowed, never closed (ManuallyDrop); `peer_addr` fails
        // harmlessly on a descriptor that is no connected socket.
        let borrowed = std::mem::ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd) });
        if borrowed.peer_addr().ok() == Some(peer) {
            return fd;
        }
    }
    panic!("no socket connected to {peer}");
}

/// Nothing is sent on the socket after the handshake: a byte there breaks
/// the protocol, and the listener ends that connection (which the client
/// hears as its end) and serves the others as before. A peer streaming
/// bytes once kept the CM thread reading them.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_socket_peer_that_sends_bytes_after_the_handshake_is_cut_off() {
    let opts = blocking();
    let (server, addr) = echo_listener(&opts, true);
    let rude = Arc::new(Collect::default());
    let rude_conn = Connection::connect_socket(addr, None, &opts, rude.clone()).unwrap();
    // Its socket, as the peer's program could write it: the only one of
    // this process whose peer is the listener, until the next connects.
    let fd = socket_to(addr);
    let polite = Arc::new(Collect::default());
    let polite_conn = Connection::connect_socket(addr, None, &opts, polite.clone()).unwrap();
    assert_eq!(polite_conn.send(b"before").unwrap(), 6);
    polite.wait_bytes(6, TIMEOUT);

    // SAFETY: one byte from a live buffer to a descriptor of ours.
    assert_eq!(unsafe { libc::write(fd, b"x".as_ptr().cast(), 1) }, 1);
    rude.wait_disconnected(TIMEOUT);

    assert_eq!(polite_conn.send(b"after").unwrap(), 5);
    assert_eq!(polite.wait_bytes(11, TIMEOUT), b"beforeafter");
    assert!(
        !polite.ended_within(Duration::ZERO),
        "the other connection ended too"
    );
    rude_conn.close();
    polite_conn.close();
    server.release();
}

/// A broker of two servers at `ips`, ports from `base_port`.
fn two_servers(ips: [IpAddr; 2], me: usize, base_port: u16, mode: ConnectMode) -> Config {
    Config {
        hosts: (0..2)
            .map(|i| SocketAddr::new(ips[i], base_port + 10 * i as u16))
            .collect(),
        server_id: me,
        thread_id: 0,
        slots: 16,
        slot_size: 256,
        doorbell_batch: 4,
        data_len: 1 << 16,
        mode,
        device: None,
    }
}

fn quiet(_: &Broker, _: &snowrdma::broker::Event<'_>) {}

/// Server 0 of two, told server 1 is at `server_1`, and a broker that
/// claims to be server 1 from the device's address: server 0 refuses it,
/// so neither finishes its init. Server 0 goes on waiting for the real one.
fn an_impostor_is_refused(
    mode: ConnectMode,
    base_port: u16,
    server_1: IpAddr,
    server_0_init: Duration,
) -> thread::JoinHandle<snowrdma::broker::Result<Broker>> {
    let dev = IpAddr::V4(device_ip());
    let truth = two_servers([dev, server_1], 0, base_port, mode);
    let server_0 = thread::spawn(move || {
        let b = Broker::new(truth, quiet)?;
        b.init(server_0_init).map(|()| b)
    });
    let impostor = Broker::new(two_servers([dev, dev], 1, base_port, mode), quiet).unwrap();
    let refused = impostor.init(Duration::from_secs(4));
    assert!(
        refused.is_err(),
        "server 0 took a server 1 that connected from the wrong address"
    );
    server_0
}

/// A peer that claims a server's id from an address other than the one
/// `hosts` gives that server is refused (it would take the real one's
/// place, and its write access to the data region); the real one, which
/// connects from its own address, is then taken.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_a_socket_peer_claiming_a_server_from_elsewhere_is_refused() {
    let base_port = 19800;
    let lo = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));
    let server_0 =
        an_impostor_is_refused(ConnectMode::Socket, base_port, lo, Duration::from_secs(30));
    let dev = IpAddr::V4(device_ip());
    // Anyone not at a server's address is refused before it hears our
    // hello, which carries the data region's key.
    let mut stranger = TcpStream::connect(SocketAddr::new(dev, base_port)).unwrap();
    stranger.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut heard = Vec::new();
    stranger.read_to_end(&mut heard).unwrap();
    assert!(heard.is_empty(), "a stranger heard {} bytes", heard.len());
    let real = Broker::new(
        two_servers([dev, lo], 1, base_port, ConnectMode::Socket),
        quiet,
    )
    .unwrap();
    real.init(Duration::from_secs(30)).unwrap();
    let server_0 = server_0.join().unwrap().unwrap();
    assert_eq!((server_0.peers().count(), real.peers().count()), (1, 1));
}

/// As above over RDMA CM, where the real server 1 would be at an address
/// the test device does not have: server 0's init ends without it.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_a_cm_peer_claiming_a_server_from_elsewhere_is_refused() {
    let elsewhere = IpAddr::V4(std::net::Ipv4Addr::new(198, 18, 0, 77));
    let server_0 =
        an_impostor_is_refused(ConnectMode::Cm, 19850, elsewhere, Duration::from_secs(6));
    match server_0.join().unwrap() {
        Err(BrokerError::InitTimeout { missing, why }) => {
            assert_eq!(missing, [1]);
            let dev = device_ip();
            assert!(
                why[0].starts_with(&format!(
                    "refused a connect request from {dev} claiming to be server 1"
                )),
                "{why:?}"
            );
        }
        other => panic!("server 0 found no server 1, and says so: {:?}", other.err()),
    }
}

/// Socket-mode brokers shake hands one at a time; a client that connects to
/// one and says nothing is given up on after the handshake's own deadline
/// (2 s), and the mesh forms within the init timeout.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_a_silent_socket_client_does_not_hold_up_the_mesh() {
    let dev = IpAddr::V4(device_ip());
    let config = move |me: usize| two_servers([dev, dev], me, 20000, ConnectMode::Socket);
    // Room for server 1's own 2 s attempts to collide with server 0's
    // wait on the silent client a few times; without the handshake's own
    // deadline, server 0 would wait on that client until this ends.
    let init = Duration::from_secs(30);
    let first = thread::spawn(move || {
        let b = Broker::new(config(0), quiet).unwrap();
        b.init(init).map(|()| b.peers().count())
    });
    // Server 0 accepts only; the silent client gets in first.
    let deadline = Instant::now() + TIMEOUT;
    let silent = loop {
        match TcpStream::connect(config(0).hosts[0]) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => thread::sleep(Duration::from_millis(5)),
            Err(e) => panic!("server 0 never listened: {e}"),
        }
    };
    let second = thread::spawn(move || {
        let b = Broker::new(config(1), quiet).unwrap();
        b.init(init).map(|()| b.peers().count())
    });
    let joined =
        |h: thread::JoinHandle<snowrdma::broker::Result<usize>>, who: &str| match h.join().unwrap()
        {
            Ok(peers) => assert_eq!(peers, 1, "{who}"),
            Err(e) => panic!("{who}: {e}"),
        };
    joined(first, "server 0");
    joined(second, "server 1");
    drop(silent);
}

/// The setups the listeners below take at once, and how long they hold
/// them.
const MAX_SETUPS: usize = 3;
const SETUP_DEADLINE: Duration = Duration::from_secs(2);

fn max_setups_options() -> Options {
    Options {
        max_setups: MAX_SETUPS,
        setup_deadline: SETUP_DEADLINE,
        ..blocking()
    }
}

/// Waits (bounded) until the listener dropped `n` setups at their deadline.
fn until_timed_out(server: &Listener, n: u64) {
    let deadline = Instant::now() + SETUP_DEADLINE + TIMEOUT;
    while server.setup_timeouts() < n {
        assert!(
            Instant::now() < deadline,
            "the silent setups were never dropped"
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until `server` has refused `n` connect requests.
fn until_refused(server: &Listener, n: u64) {
    let deadline = Instant::now() + TIMEOUT;
    while server.setups_refused() < n {
        assert!(
            Instant::now() < deadline,
            "only {} refused",
            server.setups_refused()
        );
        thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(server.setups_refused(), n);
}

/// An RDMA CM peer that completes the RDMA CM handshake and stops there
/// (a QP on its side, no ring advertised, no receive posted).
pub(crate) struct SilentCmPeer {
    // Dropped in this order: the QP before its CQ and PD, the id last.
    _qp: QueuePair,
    _cq: CompletionQueue,
    _pd: ProtectionDomain,
    id: CmId,
}

impl SilentCmPeer {
    /// Connects to `addr`; `Err` is the event it got instead of
    /// ESTABLISHED.
    pub(crate) fn connect(addr: SocketAddr) -> Result<SilentCmPeer, CmEventKind> {
        let id = CmId::resolve(addr, None, TIMEOUT).unwrap();
        let ctx = id.context().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16, None).unwrap();
        let qp = id.create_qp(&pd, &cq, &cq, &Default::default()).unwrap();
        id.connect(&ConnParam::default()).unwrap();
        let ev = id.channel().get_event(TIMEOUT).unwrap();
        if ev.kind != CmEventKind::ESTABLISHED {
            return Err(ev.kind);
        }
        Ok(SilentCmPeer {
            _qp: qp,
            _cq: cq,
            _pd: pd,
            id,
        })
    }

    /// Waits (bounded) for the server to disconnect it.
    pub(crate) fn wait_disconnected(&self) {
        self.id
            .expect_event(CmEventKind::DISCONNECTED, TIMEOUT)
            .expect("the server disconnects the silent peer");
    }
}

/// A listener that echoes, over RDMA CM or (`socket`) in socket mode.
fn echo_listener(opts: &Options, socket: bool) -> (Listener, SocketAddr) {
    let echo = Box::new(|_: &Connection| Some(Arc::new(Echo) as Arc<dyn ConnHandler>));
    crate::release::serve(socket, opts, echo)
}

/// Connect requests that never finish their setup fill `max_setups` and no
/// more: one past it is refused at once, before a QP or a ring is
/// made for it (a flood of them pinned a connection's memory each), and
/// once the silent ones are dropped at the setup deadline a client
/// connects and is served.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn cm_setups_past_max_setups_are_refused_until_the_silent_ones_go() {
    let opts = max_setups_options();
    let (server, addr) = echo_listener(&opts, false);
    let silent: Vec<_> = (0..MAX_SETUPS)
        .map(|i| SilentCmPeer::connect(addr).unwrap_or_else(|e| panic!("silent peer {i}: {e}")))
        .collect();
    let start = Instant::now();
    match SilentCmPeer::connect(addr) {
        Err(kind) => assert_eq!(kind, CmEventKind::REJECTED),
        Ok(_) => panic!("a setup past max_setups was accepted"),
    }
    assert!(start.elapsed() < SETUP_DEADLINE, "refused at once");
    assert_eq!(server.setups_refused(), 1);

    until_timed_out(&server, MAX_SETUPS as u64);
    let echo = Arc::new(Collect::default());
    let conn = Connection::connect(addr, &opts, echo.clone()).unwrap();
    assert_eq!(conn.send(b"served").unwrap(), 6);
    assert_eq!(echo.wait_bytes(6, TIMEOUT), b"served");
    assert_eq!(server.setups_refused(), 1);
    conn.close();
    drop(silent);
    server.release();
}

/// As above, in socket mode: a TCP client past `max_setups` is closed
/// before the listener sends it anything (the ones within it got the
/// listener's QP information).
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn socket_setups_past_max_setups_are_refused_until_the_silent_ones_go() {
    let opts = max_setups_options();
    let (server, addr) = echo_listener(&opts, true);
    let first_bytes = |s: &mut TcpStream| {
        s.set_read_timeout(Some(TIMEOUT)).unwrap();
        let mut buf = [0u8; 256];
        match s.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => 0,
            Err(e) => panic!("the listener neither answered nor closed the socket: {e}"),
        }
    };
    let silent: Vec<TcpStream> = (0..MAX_SETUPS)
        .map(|i| {
            let mut s = TcpStream::connect(addr).unwrap();
            assert!(
                first_bytes(&mut s) > 0,
                "silent peer {i} got no QP information"
            );
            s
        })
        .collect();
    let mut refused = TcpStream::connect(addr).unwrap();
    assert_eq!(first_bytes(&mut refused), 0, "closed without a word");
    assert_eq!(server.setups_refused(), 1);

    until_timed_out(&server, MAX_SETUPS as u64);
    let echo = Arc::new(Collect::default());
    let conn = Connection::connect_socket(addr, None, &opts, echo.clone()).unwrap();
    assert_eq!(conn.send(b"served").unwrap(), 6);
    assert_eq!(echo.wait_bytes(6, TIMEOUT), b"served");
    conn.close();
    drop(silent);
    server.release();
}

/// How many descriptors this process has open, once the count has stayed
/// the same for half a second.
fn steady_descriptor_count() -> u64 {
    let count = || std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
    let deadline = Instant::now() + TIMEOUT;
    let mut last = count();
    let mut steady_since = Instant::now();
    while steady_since.elapsed() < Duration::from_millis(500) {
        assert!(
            Instant::now() < deadline,
            "descriptors kept opening and closing"
        );
        thread::sleep(Duration::from_millis(50));
        let now = count();
        if now != last {
            last = now;
            steady_since = Instant::now();
        }
    }
    last
}

/// How many descriptors below `bound` are open, counted without opening
/// one (the process may have none left).
fn open_descriptors_below(bound: u64) -> u64 {
    // SAFETY: F_GETFD only reads the descriptor's flags.
    (0..bound as i32)
        .filter(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1)
        .count() as u64
}

/// Opens files until the process has no descriptor left.
fn take_every_descriptor(hogs: &mut Vec<std::fs::File>) {
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => hogs.push(f),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
                return;
            }
        }
    }
}

/// Lowers this process's soft limit of open files until dropped.
struct FileLimit(libc::rlimit);

impl FileLimit {
    fn lower_to(soft: u64) -> FileLimit {
        let mut old = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: plain system calls on a local struct.
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut old), 0);
            let low = libc::rlimit {
                rlim_cur: soft.min(old.rlim_cur),
                rlim_max: old.rlim_max,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &low), 0);
        }
        FileLimit(old)
    }
}

impl Drop for FileLimit {
    fn drop(&mut self) {
        // SAFETY: restores the limit read above.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &self.0) };
    }
}

/// A socket-mode listener in a process that has run out of file
/// descriptors refuses (closes) a waiting connection rather than leaving it
/// in the kernel's queue, where it kept the listening socket readable and
/// the CM thread called for it without end; once descriptors are free
/// again, clients are served.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_socket_listener_out_of_descriptors_refuses_rather_than_spins() {
    let opts = blocking();
    let (server, addr) = echo_listener(&opts, true);
    // Threads of earlier tests in this process may still be closing their
    // descriptors, which would give the listener one back.
    let open_now = steady_descriptor_count();
    let limit = FileLimit::lower_to(open_now + 16);
    let all = open_now + 16;
    let mut hogs = Vec::new();
    // Each client finds every descriptor taken but one, for its own
    // socket: none for the listener's accept but its reserve. The second
    // client checks that the reserve came back after the first refusal.
    for nth in 1..=2 {
        take_every_descriptor(&mut hogs);
        drop(hogs.pop());
        let mut refused = TcpStream::connect(addr).unwrap();
        let full = open_descriptors_below(all);
        refused.set_read_timeout(Some(TIMEOUT)).unwrap();
        let mut buf = [0u8; 64];
        match refused.read(&mut buf) {
            Ok(0) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            other => panic!("waiting connection {nth} was neither served nor closed: {other:?}"),
        }
        // A connection refused after it was accepted (its setup failed)
        // may be closed before it is counted.
        until_refused(&server, nth);
        // The listener closes the refused socket, then opens its reserve
        // again: the next round's hogs must not take that descriptor in
        // between (a program's other thread might, and the listener then
        // waits for a tick, which another test covers).
        let deadline = Instant::now() + Duration::from_secs(1);
        while open_descriptors_below(all) < full && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(1));
        }
    }

    drop(hogs);
    drop(limit);
    let echo = Arc::new(Collect::default());
    let conn = Connection::connect_socket(addr, None, &opts, echo.clone()).unwrap();
    assert_eq!(conn.send(b"served").unwrap(), 6);
    assert_eq!(echo.wait_bytes(6, TIMEOUT), b"served");
    conn.close();
    server.release();
}

/// The runtime's CM thread(s) (`snowrdma-cm`), whose CPU time is read
/// through files opened once: a process out of descriptors can still read
/// them.
struct CmThreadCpu(Vec<std::fs::File>);

impl CmThreadCpu {
    fn open() -> CmThreadCpu {
        let mut stats = Vec::new();
        for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim_end() == "snowrdma-cm" {
                stats.push(std::fs::File::open(task.path().join("stat")).unwrap());
            }
        }
        assert!(!stats.is_empty(), "no snowrdma-cm thread");
        CmThreadCpu(stats)
    }

    /// Their CPU time so far.
    fn used(&self) -> Duration {
        use std::os::unix::fs::FileExt;
        // SAFETY: sysconf has no preconditions.
        let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        let mut ticks = 0;
        for file in &self.0 {
            let mut buf = [0u8; 1024];
            let n = file.read_at(&mut buf, 0).unwrap();
            let stat = std::str::from_utf8(&buf[..n]).unwrap();
            // After the name in parentheses: state is field 3, utime 14,
            // stime 15.
            let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
            ticks += fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        }
        Duration::from_millis(ticks * 1000 / ticks_per_s)
    }

    /// Asserts they used less than a fifth of the next 500 ms.
    fn idle_for_half_a_second(&self) {
        let before = self.used();
        thread::sleep(Duration::from_millis(500));
        let used = self.used() - before;
        assert!(
            used < Duration::from_millis(100),
            "the CM thread used {used:?} of the last 500 ms"
        );
    }
}

/// A socket-mode client whose server has left does not keep the CM thread
/// busy: its socket, at its end and so readable for good, is no longer
/// watched, though the program keeps the connection.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_socket_client_whose_server_left_leaves_the_cm_thread_idle() {
    let opts = blocking();
    let (server, addr) = echo_listener(&opts, true);
    let seen = Arc::new(Collect::default());
    let conn = Connection::connect_socket(addr, None, &opts, seen.clone()).unwrap();
    server.release();
    seen.wait_disconnected(TIMEOUT);
    CmThreadCpu::open().idle_for_half_a_second();
    drop(conn);
}

/// A socket-mode listener with no descriptor in reserve (the process ran
/// out before it could keep one) can neither take nor refuse a waiting
/// connection: rather than spin on its readable socket, it looks again on
/// each tick, and serves the connection once descriptors are free.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_socket_listener_without_a_reserve_waits_idle_for_descriptors() {
    let opts = blocking();
    let any_port = SocketAddr::new(IpAddr::V4(device_ip()), 0);
    // The runtime, and so its CM thread, starts with the first listener.
    echo_listener(&opts, true).0.release();
    let cm_thread = CmThreadCpu::open();
    let limit = FileLimit::lower_to(steady_descriptor_count() + 64);
    let mut hogs = Vec::new();
    take_every_descriptor(&mut hogs);
    // Freed one at a time until the listener binds: it then has what it
    // needs to listen, and none for its reserve.
    let (server, addr) = loop {
        drop(hogs.pop().expect("the listener never bound"));
        let echo = Box::new(|_: &Connection| Some(Arc::new(Echo) as Arc<dyn ConnHandler>));
        if let Ok(server) = Listener::bind_socket(any_port, None, &opts, echo, None) {
            server.start().unwrap();
            let addr = server.local_addr().unwrap();
            break (server, addr);
        }
    };
    // Freed until the client has its socket (the listener may have
    // taken more since it bound), so that none is left.
    let mut waiting = loop {
        drop(hogs.pop().expect("the client never had a socket"));
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}"),
        }
    };
    thread::sleep(Duration::from_millis(200));
    cm_thread.idle_for_half_a_second();
    // Every descriptor is free at once: the limit rises before the hogs
    // close, so the listener cannot wake to a handful, take the
    // connection and lack the rest for its setup.
    drop(limit);
    drop(hogs);
    waiting.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut buf = [0u8; 64];
    let mut got = waiting.read(&mut buf).unwrap_or(0);
    // In the suite a thread of an earlier test may have closed a
    // descriptor while the process was out: the listener then took the
    // connection and, short of more for its setup, refused it (closed it),
    // which is as good as waiting. A new client must then be served.
    if got == 0 && server.setups_refused() > 0 {
        waiting = TcpStream::connect(addr).unwrap();
        waiting.set_read_timeout(Some(TIMEOUT)).unwrap();
        got = waiting
            .read(&mut buf)
            .expect("a new client is served once descriptors are free");
    }
    assert!(got > 0, "closed, not served, once descriptors were free");
    drop(waiting);
    server.release();
}
