//! The kv server's limits on connections: how many clients in all and per
//! host, what a stop does to clients still connecting, and the setup
//! deadline against peers that connect and go silent.

use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use snowrdma::kv::{Client, ConnMode, Limits, Server};

use crate::hostile_links::SilentCmPeer;
use crate::kv_limits::{client, server, until, works};
use crate::TIMEOUT;

/// Under `limits`, which allow two clients here, a third is refused at
/// once and counted; a slot comes back when a client leaves. Returns the
/// server and the two clients connected at the end.
fn two_clients_and_a_third_refused(limits: Limits) -> (Server, SocketAddr, [Client; 2]) {
    let (server, addr) = server(ConnMode::Cm, limits, 1);
    let first = client(addr, ConnMode::Cm).unwrap();
    let second = client(addr, ConnMode::Cm).unwrap();
    let start = Instant::now();
    let refused = client(addr, ConnMode::Cm);
    assert!(refused.is_err(), "a third client is refused");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "refused at once, not after a timeout: {:?}",
        start.elapsed()
    );
    assert_eq!(server.stats().refused_connections, 1);
    works(&first, "still-served");
    drop(first);
    until(&server, "the first client's slot is free", |s| {
        s.clients == 1
    });
    let again = client(addr, ConnMode::Cm).unwrap();
    works(&again, "again");
    assert_eq!(server.stats().refused_connections, 1);
    (server, addr, [second, again])
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_limit_max_connections_refuses_at_once_and_counts() {
    two_clients_and_a_third_refused(Limits {
        max_connections: 2,
        ..Limits::default()
    });
}

/// Every client here comes from the device's one address: past
/// `host_connections` of them the next is refused, well below
/// `max_connections`, and a raised limit applies to the next client.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_limit_host_connections_refuses_a_host_past_its_share() {
    let limits = Limits {
        host_connections: 2,
        ..Limits::default()
    };
    assert!(limits.max_connections > 2);
    let (server, addr, _two) = two_clients_and_a_third_refused(limits);
    server.update_limits(|l| l.host_connections = 3).unwrap();
    works(&client(addr, ConnMode::Cm).unwrap(), "raised");
    assert_eq!(server.stats().refused_connections, 1);
}

/// A client still connecting when the server stops is counted out: its
/// handler is told it ended, so once started again the server has its
/// host's slot free (before, a stop left it counted for good).
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_limit_a_stop_frees_the_slots_of_clients_still_connecting() {
    let limits = Limits {
        host_connections: 1,
        ..Limits::default()
    };
    let (server, addr) = server(ConnMode::Socket, limits, 1);
    // Connects over TCP and never sends its QP information.
    let silent = TcpStream::connect(addr).unwrap();
    until(&server, "the silent peer is taken in", |s| s.clients == 1);
    server.stop();
    assert_eq!(server.stats().clients, 0, "counted out at the stop");
    server.start().unwrap();
    let addr = server.local_addr().unwrap();
    let c = client(addr, ConnMode::Socket).expect("the host's one slot is free");
    works(&c, "after a restart");
    drop(silent);
}

const DEADLINE: Duration = Duration::from_secs(2);

/// A peer that connects and goes silent is dropped at the setup deadline,
/// while a client connecting meanwhile is served at once.
fn silent_peer_is_dropped(mode: ConnMode, silent: impl FnOnce(SocketAddr) -> Box<dyn FnOnce()>) {
    let limits = Limits {
        setup_deadline: DEADLINE,
        ..Limits::default()
    };
    let (server, addr) = server(mode, limits, 1);
    let start = Instant::now();
    let gone = silent(addr);
    let good = client(addr, mode).unwrap();
    works(&good, "meanwhile");
    assert!(
        start.elapsed() < DEADLINE,
        "the silent peer held up no one ({:?})",
        start.elapsed()
    );
    let stats = until(&server, "the silent peer is dropped", |s| {
        s.setup_timeouts > 0
    });
    assert_eq!(stats.setup_timeouts, 1);
    assert_eq!(stats.clients, 1, "only the good client is left");
    assert!(start.elapsed() >= DEADLINE, "not before its deadline");
    gone();
    works(&good, "after");
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_limit_setup_deadline_drops_a_silent_socket_peer() {
    silent_peer_is_dropped(ConnMode::Socket, |addr| {
        // Connects over TCP and never sends its QP information.
        let mut raw = TcpStream::connect(addr).unwrap();
        Box::new(move || {
            raw.set_read_timeout(Some(TIMEOUT)).unwrap();
            let mut buf = [0u8; 256];
            loop {
                match raw.read(&mut buf) {
                    Ok(0) => return,
                    Ok(_) => {} // the server's QP information
                    Err(e) if e.kind() == ErrorKind::ConnectionReset => return,
                    Err(e) => panic!("the server did not close the socket: {e}"),
                }
            }
        })
    });
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_limit_setup_deadline_drops_a_silent_cm_peer() {
    silent_peer_is_dropped(ConnMode::Cm, |addr| {
        let silent = SilentCmPeer::connect(addr).expect("the RDMA CM handshake");
        Box::new(move || silent.wait_disconnected())
    });
}
