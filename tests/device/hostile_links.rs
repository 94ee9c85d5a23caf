//! Peers that misuse the TCP side of socket mode: bytes after the
//! handshake, and a client that connects and says nothing.

use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use snowrdma::broker::{Broker, Config, ConnectMode};
use snowrdma::runtime::{ConnHandler, Connection, Listener};

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
    let server = Listener::bind_socket(
        SocketAddr::new(IpAddr::V4(device_ip()), 0),
        None,
        &opts,
        Box::new(|_| Some(Arc::new(Echo) as Arc<dyn ConnHandler>)),
        None,
    )
    .unwrap();
    server.start();
    let addr = server.local_addr().unwrap();
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

/// Socket-mode brokers shake hands one at a time; a client that connects to
/// one and says nothing is given up on after the handshake's own deadline
/// (2 s), and the mesh forms within the init timeout.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_a_silent_socket_client_does_not_hold_up_the_mesh() {
    let base_port = 20000;
    let config = move |me: usize| Config {
        hosts: (0..2)
            .map(|i| SocketAddr::new(IpAddr::V4(device_ip()), base_port + 10 * i as u16))
            .collect(),
        server_id: me,
        thread_id: 0,
        slots: 16,
        slot_size: 256,
        doorbell_batch: 4,
        data_len: 1 << 16,
        mode: ConnectMode::Socket,
        device: None,
    };
    // Room for server 1's own 2 s attempts to collide with server 0's
    // wait on the silent client a few times; without the handshake's own
    // deadline, server 0 would wait on that client until this ends.
    let init = Duration::from_secs(30);
    let first = thread::spawn(move || {
        let b = Broker::new(config(0), |_: &Broker, _: &snowrdma::broker::Event<'_>| {}).unwrap();
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
        let b = Broker::new(config(1), |_: &Broker, _: &snowrdma::broker::Event<'_>| {}).unwrap();
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
