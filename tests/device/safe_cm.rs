//! The safe API's RDMA CM path on a real device: connecting and accepting
//! yield ready-to-send queue pairs, private data goes both ways, and one
//! listener serves clients that come together and acceptors that wait
//! together.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use snowrdma::safe::{self, AccessFlags, Progress, ProtectionDomain};

use crate::safe::block_on;
use crate::{device_ip, TIMEOUT};

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn safe_rdma_cm_yields_rts_queue_pairs() {
    let pd = ProtectionDomain::open(None).unwrap();
    let listener = safe::Listener::bind(SocketAddr::new(IpAddr::V4(device_ip()), 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    let server_pd = pd.clone();
    let server = std::thread::spawn(move || {
        let cq = server_pd.create_cq(16, Progress::Thread).unwrap();
        let pending = listener.accept(server_pd.qp(&cq, &cq), TIMEOUT).unwrap();
        assert_eq!(&pending.peer_data()[..2], b"hi", "zero-padded by RDMA CM");
        let mem = server_pd.allocate::<u8>(64, AccessFlags::empty()).unwrap();
        let recv = pending.recv(mem.rw(..).unwrap()).unwrap();
        let (_qp, _) = pending.establish(b"welcome", TIMEOUT).unwrap();
        let got = block_on(recv).unwrap();
        got.memory().as_slice()[..got.byte_len() as usize].to_vec()
    });
    let cq = pd.create_cq(16, Progress::Thread).unwrap();
    let pending = safe::connect(addr, pd.qp(&cq, &cq), TIMEOUT).unwrap();
    let (qp, welcome) = pending.establish(b"hi", TIMEOUT).unwrap();
    assert_eq!(&welcome[..7], b"welcome");
    let mem = pd.allocate::<u8>(64, AccessFlags::empty()).unwrap();
    let mut m = mem.rw(..16).unwrap();
    m.as_mut_slice().copy_from_slice(b"Hello, SafeVerbs");
    block_on(qp.send(m).unwrap()).unwrap();
    assert_eq!(server.join().unwrap(), b"Hello, SafeVerbs");
}

/// A second client's connect request that reaches the listener before the
/// first connection is established waits for the next `accept`: each
/// accepted connection gets its events apart from the listener's.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn safe_a_second_client_connecting_meanwhile_is_accepted_next() {
    let pd = ProtectionDomain::open(None).unwrap();
    let listener = safe::Listener::bind(SocketAddr::new(IpAddr::V4(device_ip()), 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    // Connects with `tag`, sends it once established, returns the welcome.
    let client = |pd: ProtectionDomain, tag: &'static [u8; 5]| {
        std::thread::spawn(move || {
            let cq = pd.create_cq(16, Progress::Thread).unwrap();
            let pending = safe::connect(addr, pd.qp(&cq, &cq), TIMEOUT).unwrap();
            let (qp, welcome) = pending.establish(tag, TIMEOUT).unwrap();
            let mem = pd.allocate::<u8>(64, AccessFlags::empty()).unwrap();
            let mut m = mem.rw(..5).unwrap();
            m.as_mut_slice().copy_from_slice(tag);
            block_on(qp.send(m).unwrap()).unwrap();
            welcome[..5].to_vec()
        })
    };
    let receive = |pending: &safe::CmQp| {
        let mem = pd.allocate::<u8>(64, AccessFlags::empty()).unwrap();
        pending.recv(mem.rw(..).unwrap()).unwrap()
    };
    let cq = pd.create_cq(16, Progress::Thread).unwrap();
    let first_client = client(pd.clone(), b"first");
    let first = listener.accept(pd.qp(&cq, &cq), TIMEOUT).unwrap();
    assert_eq!(&first.peer_data()[..5], b"first");
    let first_recv = receive(&first);
    let second_client = client(pd.clone(), b"other");
    // Room for the second request to arrive before the first is
    // established (were it later, the test would pass without showing it).
    std::thread::sleep(Duration::from_millis(500));
    let (_first_qp, _) = first.establish(b"hello", TIMEOUT).unwrap();
    let cq2 = pd.create_cq(16, Progress::Thread).unwrap();
    let second = listener.accept(pd.qp(&cq2, &cq2), TIMEOUT).unwrap();
    assert_eq!(&second.peer_data()[..5], b"other");
    let second_recv = receive(&second);
    let (_second_qp, _) = second.establish(b"howdy", TIMEOUT).unwrap();
    for (recv, tag) in [(first_recv, b"first"), (second_recv, b"other")] {
        let got = block_on(recv).unwrap();
        assert_eq!(&got.memory().as_slice()[..got.byte_len() as usize], tag);
    }
    assert_eq!(first_client.join().unwrap(), b"hello");
    assert_eq!(second_client.join().unwrap(), b"howdy");
}

/// Two threads accepting on one listener at once each get one of two
/// clients' requests, and both connections carry their messages.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn safe_concurrent_accepts_each_take_one_client() {
    let pd = ProtectionDomain::open(None).unwrap();
    let listener = safe::Listener::bind(SocketAddr::new(IpAddr::V4(device_ip()), 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    let tags: [&[u8; 5]; 2] = [b"one!!", b"two!!"];
    let got = std::thread::scope(|s| {
        let acceptors: Vec<_> = (0..2)
            .map(|_| {
                let (pd, listener) = (pd.clone(), &listener);
                s.spawn(move || {
                    let cq = pd.create_cq(16, Progress::Thread).unwrap();
                    let pending = listener.accept(pd.qp(&cq, &cq), TIMEOUT).unwrap();
                    let mem = pd.allocate::<u8>(64, AccessFlags::empty()).unwrap();
                    let recv = pending.recv(mem.rw(..).unwrap()).unwrap();
                    let peer_tag = pending.peer_data()[..5].to_vec();
                    let (_qp, _) = pending.establish(&peer_tag, TIMEOUT).unwrap();
                    let got = block_on(recv).unwrap();
                    let body = got.memory().as_slice()[..got.byte_len() as usize].to_vec();
                    (peer_tag, body)
                })
            })
            .collect();
        // Both acceptors wait on the listener before the clients come.
        std::thread::sleep(Duration::from_millis(300));
        let clients: Vec<_> = tags
            .iter()
            .map(|&tag| {
                let pd = pd.clone();
                s.spawn(move || {
                    let cq = pd.create_cq(16, Progress::Thread).unwrap();
                    let pending = safe::connect(addr, pd.qp(&cq, &cq), TIMEOUT).unwrap();
                    let (qp, welcome) = pending.establish(tag, TIMEOUT).unwrap();
                    assert_eq!(
                        &welcome[..5],
                        tag,
                        "answered by the acceptor of its request"
                    );
                    let mem = pd.allocate::<u8>(64, AccessFlags::empty()).unwrap();
                    let mut m = mem.rw(..5).unwrap();
                    m.as_mut_slice().copy_from_slice(tag);
                    block_on(qp.send(m).unwrap()).unwrap();
                })
            })
            .collect();
        clients.into_iter().for_each(|c| c.join().unwrap());
        let mut got: Vec<_> = acceptors.into_iter().map(|a| a.join().unwrap()).collect();
        got.sort();
        got
    });
    for ((peer_tag, body), tag) in got.iter().zip(tags) {
        assert_eq!(peer_tag, tag, "each request taken by exactly one accept");
        assert_eq!(body, tag, "each connection's message on its own queue pair");
    }
}
