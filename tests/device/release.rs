//! Releasing a listener: every connection it accepted is closed and let go
//! of, including one accepted while the release ran.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use snowrdma::runtime::{AcceptHook, ConnHandler, ConnState, Connection, Listener, Options};
use snowrdma::verbs::QpState;

use crate::runtime::{blocking, Collect};
use crate::{device_ip, TIMEOUT};

/// Counts `retired`, and tells of it.
#[derive(Default)]
struct Retired {
    count: AtomicUsize,
    told: Mutex<Option<mpsc::Sender<()>>>,
}

impl ConnHandler for Retired {
    fn retired(&self, _conn: &Connection) {
        self.count.fetch_add(1, Ordering::SeqCst);
        if let Some(tx) = self.told.lock().unwrap().as_ref() {
            let _ = tx.send(());
        }
    }
}

/// A started listener on any port, in socket mode or RDMA CM's.
pub(crate) fn serve(socket: bool, opts: &Options, hook: Box<AcceptHook>) -> (Listener, SocketAddr) {
    let any_port = SocketAddr::new(IpAddr::V4(device_ip()), 0);
    let server = match socket {
        true => Listener::bind_socket(any_port, None, opts, hook, None),
        false => Listener::bind(any_port, opts, hook),
    }
    .unwrap();
    server.start().unwrap();
    let addr = server.local_addr().unwrap();
    (server, addr)
}

/// A released listener lets go of the connections it accepted (their
/// `retired` runs): in RDMA CM mode their events come on the listening
/// channel, which nobody reads after the release, and they stayed in the
/// runtime's table, and their C handles alive, for good.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_released_listener_retires_what_it_accepted() {
    for socket in [false, true] {
        let opts = blocking();
        let seen = Arc::new(Retired::default());
        let (tx, rx) = mpsc::channel();
        *seen.told.lock().unwrap() = Some(tx);
        let hook = {
            let seen = seen.clone();
            Box::new(move |_: &Connection| Some(seen.clone() as Arc<dyn ConnHandler>))
        };
        let (server, addr) = serve(socket, &opts, hook);
        let client = Arc::new(Collect::default());
        let conn = match socket {
            true => Connection::connect_socket(addr, None, &opts, client.clone()),
            false => Connection::connect(addr, &opts, client.clone()),
        }
        .unwrap();
        server.release();
        rx.recv_timeout(TIMEOUT).unwrap_or_else(|_| {
            panic!("socket mode {socket}: the accepted connection was never retired")
        });
        client.wait_disconnected(TIMEOUT);
        assert_eq!(seen.count.load(Ordering::SeqCst), 1);
        conn.close();
    }
}

/// A connect request whose accept hook is still running when the listener
/// is released is refused: it was accepted after the release had swept, and
/// was never closed.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_connection_accepted_while_the_listener_is_released_is_refused() {
    for socket in [false, true] {
        let opts = blocking();
        let (in_hook, hook_entered) = mpsc::channel();
        let (let_go, hook_waits) = mpsc::channel::<()>();
        let hook_waits = Mutex::new(hook_waits);
        let hook = Box::new(move |_: &Connection| {
            let _ = in_hook.send(());
            let _ = hook_waits.lock().unwrap().recv_timeout(TIMEOUT);
            Some(Arc::new(Collect::default()) as Arc<dyn ConnHandler>)
        });
        let (server, addr) = serve(socket, &opts, hook);
        let client = Arc::new(Collect::default());
        let connecting = {
            let (opts, client) = (opts.clone(), client.clone());
            thread::spawn(move || match socket {
                true => Connection::connect_socket(addr, None, &opts, client),
                false => Connection::connect(addr, &opts, client),
            })
        };
        hook_entered
            .recv_timeout(TIMEOUT)
            .expect("the accept hook never ran");
        let releasing = {
            let server = server.clone();
            thread::spawn(move || server.release())
        };
        // The release has stopped the listener and swept by now (it does
        // not wait for the hook).
        releasing.join().unwrap();
        let_go.send(()).unwrap();
        let since = Instant::now();
        match connecting.join().unwrap() {
            // Refused at once, not left to time out.
            Err(e) => assert!(
                since.elapsed() < Duration::from_secs(3),
                "socket mode {socket}: refused only after {:?}: {e}",
                since.elapsed()
            ),
            Ok(conn) => {
                // Connected after all: it must be ended, not left running.
                assert!(
                    client.ended_within(TIMEOUT),
                    "socket mode {socket}: a connection accepted after the release lives on"
                );
                conn.close();
            }
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// A start that comes after the release (a thread that looked the listener
/// up before another released it, as `rdmaServerStart` racing
/// `rdmaServerRelease`) is refused: it neither serves nor waits, and the
/// port is free for a new listener. Before, it watched the released
/// listener again, its caller waited for a stop nobody could send, and the
/// port stayed bound.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_start_after_the_release_is_refused_and_gives_the_port_back() {
    for socket in [false, true] {
        let opts = blocking();
        let hook = || {
            Box::new(|_: &Connection| Some(Arc::new(Collect::default()) as Arc<dyn ConnHandler>))
        };
        let (server, addr) = serve(socket, &opts, hook());
        server.release();
        assert!(
            server.start().is_err(),
            "socket mode {socket}: started after its release"
        );
        let waiting = {
            let server = server.clone();
            thread::spawn(move || server.wait_stopped())
        };
        let deadline = Instant::now() + TIMEOUT;
        while !waiting.is_finished() {
            assert!(
                Instant::now() < deadline,
                "socket mode {socket}: waits for a stop for good"
            );
            thread::sleep(Duration::from_millis(10));
        }
        waiting.join().unwrap();
        // The last holder gone, the port is free: nothing the release
        // left (a watched channel or socket) keeps the listener.
        drop(server);
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            let again = match socket {
                true => Listener::bind_socket(addr, None, &opts, hook(), None),
                false => Listener::bind(addr, &opts, hook()),
            };
            match again {
                Ok(_) => break,
                Err(e) => assert!(
                    Instant::now() < deadline,
                    "socket mode {socket}: the port is still bound: {e}"
                ),
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// An ended connection's queue pair is stopped (the error state) before
/// its end is told to anyone: closed here, left by its peer, or failed. In
/// socket mode a close only shut the socket, and the QP went on taking
/// the peer's writes into our memory until the last handle was gone.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn an_ended_connection_stops_its_queue_pair() {
    for socket in [false, true] {
        let opts = blocking();
        let (accepted_tx, accepted) = mpsc::channel();
        let accepted_tx = Mutex::new(accepted_tx);
        let hook = Box::new(move |c: &Connection| {
            let _ = accepted_tx.lock().unwrap().send(c.clone());
            Some(Arc::new(Collect::default()) as Arc<dyn ConnHandler>)
        });
        let (server, addr) = serve(socket, &opts, hook);
        let connect = || {
            match socket {
                true => Connection::connect_socket(addr, None, &opts, Arc::new(Collect::default())),
                false => Connection::connect(addr, &opts, Arc::new(Collect::default())),
            }
            .unwrap()
        };
        let mode = if socket { "socket" } else { "RDMA CM" };
        // Closed here; its peer sees it leave.
        let conn = connect();
        let peer: Connection = accepted.recv_timeout(TIMEOUT).unwrap();
        assert_eq!(conn.qp_state().unwrap(), QpState::RTS, "{mode}");
        conn.close();
        assert_eq!(conn.qp_state().unwrap(), QpState::ERR, "{mode}: closed");
        until_ended(&peer, &format!("{mode}: the peer of a closed connection"));
        assert_eq!(peer.qp_state().unwrap(), QpState::ERR, "{mode}: left");
        // Failed: a WRITE with a wrong key ends it.
        let conn = connect();
        let _peer = accepted.recv_timeout(TIMEOUT).unwrap();
        let mr = conn.register(64).unwrap();
        let mut bad = conn.peer_buffer().unwrap().at(0);
        bad.rkey ^= 0x77;
        let err = conn.write_sync(mr.addr(), mr.lkey(), bad, 64).unwrap_err();
        // Ended by the failure (which the operation may report first), or
        // by the peer, whose QP the wrong key failed too, leaving first.
        until_ended(
            &conn,
            &format!("{mode}: a connection whose WRITE failed ({err})"),
        );
        assert_eq!(conn.qp_state().unwrap(), QpState::ERR, "{mode}: failed");
        conn.close();
        server.release();
    }
}

/// Waits (bounded) until `conn` is closed or failed.
fn until_ended(conn: &Connection, what: &str) {
    let since = Instant::now();
    while !matches!(conn.state(), ConnState::Error | ConnState::Closed) {
        assert!(since.elapsed() < TIMEOUT, "{what} never ended");
        thread::sleep(Duration::from_millis(5));
    }
}

/// `retire_sends` (what a kv call that timed out waits for before the
/// caller may reuse its value's memory) gives a tail of messages posted
/// without a completion one: a zero-length WRITE behind them, one doorbell,
/// which the peer never sees. Then everything posted has completed; a
/// second call posts nothing; the connection goes on, with or without the
/// caller polling it.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn retiring_sends_completes_an_unsignaled_tail_and_the_peer_sees_nothing_of_it() {
    use snowrdma::costs::{self, Counter};
    for caller_polls in [false, true] {
        let sink = Arc::new(Collect::default());
        let handler = sink.clone();
        let (server, addr) = serve(
            false,
            &blocking(),
            Box::new(move |_| Some(handler.clone() as Arc<dyn ConnHandler>)),
        );
        let opts = Options {
            caller_polls,
            ..blocking()
        };
        let conn = Connection::connect(addr, &opts, Arc::new(Collect::default())).unwrap();
        for m in [&b"one "[..], b"two ", b"three "] {
            assert_eq!(conn.send(m).unwrap(), m.len());
        }
        let before = costs::this_thread();
        assert!(conn.retire_sends(TIMEOUT), "caller_polls {caller_polls}");
        let d = costs::this_thread().since(&before);
        assert_eq!(d.get(Counter::SendDoorbells), 1, "{d:?}");
        let before = costs::this_thread();
        assert!(conn.retire_sends(TIMEOUT));
        let d = costs::this_thread().since(&before);
        assert_eq!(d.get(Counter::SendDoorbells), 0, "nothing left: {d:?}");
        assert_eq!(conn.send(b"four").unwrap(), 4);
        assert_eq!(&sink.wait_bytes(18, TIMEOUT), b"one two three four");
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(
            sink.wait_bytes(18, TIMEOUT).len(),
            18,
            "nothing more arrived"
        );
        assert_eq!(conn.state(), ConnState::MrReady);
        conn.close();
        server.release();
    }
}

/// Sends a peer does not take (a legacy peer that posts no receive again:
/// once its own are used up, the messages wait in RNR retries) never
/// complete: `retire_sends` gives up after the time it was given, fails
/// the connection and stops its QP, so the device reads the messages'
/// memory no more.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn retiring_sends_a_peer_does_not_take_fails_the_connection_in_time() {
    use snowrdma::runtime::legacy_peer::LegacyPeer;
    let (at, addr) = mpsc::channel();
    let peer = thread::spawn(move || {
        let any_port = SocketAddr::new(IpAddr::V4(device_ip()), 0);
        let mut peer = LegacyPeer::accept(any_port, TIMEOUT, |a| at.send(a).unwrap()).unwrap();
        peer.stop_reposting();
        peer.cut_off(Instant::now() + 3 * TIMEOUT)
    });
    let addr = addr.recv_timeout(TIMEOUT).unwrap();
    let conn =
        Connection::connect(addr, &Options::default(), Arc::new(Collect::default())).unwrap();
    // More than the legacy library's 1024 receives; the rest are queued.
    for _ in 0..1100 {
        assert_eq!(conn.send(&[3u8; 64]).unwrap(), 64);
    }
    let within = Duration::from_millis(500);
    let t = Instant::now();
    assert!(!conn.retire_sends(within), "the sends completed");
    let took = t.elapsed();
    // RNR retries would run out later (seconds, at the CM's RNR timer).
    assert!(
        took >= within && took < within * 4,
        "gave up after {took:?}"
    );
    assert_eq!(conn.state(), ConnState::Error);
    assert_eq!(conn.qp_state().unwrap(), QpState::ERR);
    assert!(peer.join().unwrap(), "the peer was not told");
}
