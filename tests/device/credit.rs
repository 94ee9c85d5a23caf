//! Credit by READ (protocol version 2): a stream's receiver posts nothing
//! to return credit, the sender READs it behind its messages, and a peer
//! on an older version gets the version-1 protocol either way round.

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use snowrdma::costs::{self, Counter};
use snowrdma::runtime::legacy_peer::LegacyPeer;
use snowrdma::runtime::proto::{CreditWords, VERSION};
use snowrdma::runtime::{self, CommMode, ConnHandler, Connection, Listener, Options};
use snowrdma::verbs::selftest::fill_pattern;

use crate::runtime::{serve, Collect, Echo};
use crate::{device_ip, TIMEOUT};

/// Messages of the stream: four times the receive queue, so credit must
/// come back at least three times.
const MESSAGES: u64 = 4096;
const LEN: usize = 200;

/// What one stream cost, in send-queue doorbells and work requests.
#[derive(Debug)]
struct Stream {
    /// The sending thread's.
    sender_doorbells: u64,
    sender_wrs: u64,
    /// Every other thread's: the receiver's side, in this process.
    receiver_doorbells: u64,
}

/// Runs `send`, which sends and appends what it sent to what `sink` got
/// before (`sent`), waits until `sink` has it all and checks it; counts
/// the doorbells and work requests of this thread and the others' meanwhile.
fn counted(sink: &Collect, mut sent: Vec<u8>, send: impl FnOnce(&mut Vec<u8>)) -> Stream {
    let (all, mine) = (costs::snapshot(), costs::this_thread());
    send(&mut sent);
    let got = sink.wait_bytes(sent.len(), TIMEOUT * 3);
    let (all, mine) = (
        costs::snapshot().since(&all),
        costs::this_thread().since(&mine),
    );
    assert!(got == sent, "the stream arrived changed");
    Stream {
        sender_doorbells: mine.get(Counter::SendDoorbells),
        sender_wrs: mine.get(Counter::SendRequests),
        receiver_doorbells: all.get(Counter::SendDoorbells) - mine.get(Counter::SendDoorbells),
    }
}

/// Streams [`MESSAGES`] from a sender speaking `sender_version` to a
/// receiver speaking `receiver_version`, checks every byte arrived in
/// order, and counts.
fn stream(sender_version: u8, receiver_version: u8) -> Stream {
    let opts = |version| Options {
        comm_mode: CommMode::Blocking,
        protocol_version: version,
        ..Options::default()
    };
    let sink = Arc::new(Collect::default());
    let (server, addr) = serve(&opts(receiver_version), sink.clone());
    let conn =
        Connection::connect(addr, &opts(sender_version), Arc::new(Collect::default())).unwrap();
    // The receiver's part of the setup (its credit slot's offer) is done
    // once it has a first message: counting starts after that.
    assert_eq!(conn.send(&[0]).unwrap(), 1);
    sink.wait_bytes(1, TIMEOUT);
    let s = counted(&sink, vec![0], |sent| {
        let mut msg = [0u8; LEN];
        for k in 0..MESSAGES {
            fill_pattern(&mut msg, k);
            assert_eq!(conn.send(&msg).unwrap(), LEN, "message {k}");
            sent.extend_from_slice(&msg);
        }
    });
    conn.close();
    server.release();
    eprintln!("sender v{sender_version}, receiver v{receiver_version}: {s:?}");
    s
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_streams_receiver_returns_credit_without_posting() {
    let s = stream(VERSION, VERSION);
    // The sender posts each message with a doorbell of its own, plus one
    // for each time it found no room and asked for credit; the receiver
    // posts only to answer those.
    assert!(s.sender_doorbells >= MESSAGES, "{s:?}");
    let asked = s.sender_doorbells - MESSAGES;
    assert!(s.receiver_doorbells <= asked, "{s:?}");
    // Credit came back by READs chained to the messages: at least one per
    // receive queue's worth.
    let reads = s.sender_wrs - MESSAGES - asked;
    assert!(reads >= MESSAGES / 1024 - 1, "{s:?}");
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn peers_on_version_1_get_credit_as_commands_either_way_round() {
    for (sender, receiver) in [(1, VERSION), (VERSION, 1)] {
        let s = stream(sender, receiver);
        // No READs: the sender posts its messages and nothing else, and the
        // receiver sends the credit.
        assert_eq!(
            (s.sender_doorbells, s.sender_wrs),
            (MESSAGES, MESSAGES),
            "{s:?}"
        );
        assert!(s.receiver_doorbells >= MESSAGES / 512, "{s:?}");
    }
}

/// Hands each message on after a pause: a receiver slower than its sender.
struct Slow(Arc<Collect>);
impl ConnHandler for Slow {
    fn recv(&self, conn: &Connection, data: &[u8], imm: Option<u32>) {
        std::thread::sleep(Duration::from_micros(300));
        self.0.recv(conn, data, imm);
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_sender_that_finds_no_room_asks_for_credit_and_gets_it() {
    // A small ring, messages that wrap it at odd places, and a receiver
    // slower than its sender: the sender keeps finding no room. Blocking,
    // the sending thread waits and asks; non-blocking, messages queue and
    // go out (with READs of the credit) as room returns.
    for mode in [CommMode::Blocking, CommMode::NonBlocking] {
        let opts = Options {
            comm_mode: mode,
            recv_buf_len: 64 << 10,
            ..Options::default()
        };
        let sink = Arc::new(Collect::default());
        let (server, addr) = serve(&opts, Arc::new(Slow(sink.clone())));
        let conn = Connection::connect(addr, &opts, Arc::new(Collect::default())).unwrap();
        // As in `stream`: the receiver's setup (its credit slot's offer, a
        // doorbell) is done once it has a first message, and would count
        // as an answer if it fell inside the count.
        assert_eq!(conn.send(&[0]).unwrap(), 1);
        sink.wait_bytes(1, TIMEOUT);
        let s = counted(&sink, vec![0], |sent| {
            for k in 0..200u64 {
                let mut msg = vec![0u8; 1 + (k as usize * 7919) % (30 << 10)];
                fill_pattern(&mut msg, k);
                assert_eq!(conn.send(&msg).unwrap(), msg.len(), "{mode:?}: message {k}");
                sent.extend_from_slice(&msg);
            }
        });
        if mode == CommMode::Blocking {
            // Only the sending thread posts the messages and the requests.
            let asked = s.sender_doorbells - 200;
            let answers = s.receiver_doorbells;
            eprintln!("asked {asked} times, answered {answers}");
            assert!(
                asked > 0 && answers > 0 && answers <= asked,
                "asked {asked}, answered {answers}"
            );
        }
        conn.close();
        server.release();
    }
}

/// A peer claiming version 2 whose credit slot says `words`: whether the
/// other side's connection ended within `wait` after it sent the peer
/// 600 messages (half the receive queue is 504).
fn ended_over_lying_slot(words: CreditWords, wait: Duration) -> bool {
    ended_over_slot(move |peer| peer.offer_credit_slot(words), wait)
}

/// A peer claiming version 2 that offers its credit slot with `offer`:
/// whether the other side's connection ended within `wait` after it sent
/// the peer 600 messages.
fn ended_over_slot(
    offer: impl FnOnce(&mut LegacyPeer) -> snowrdma::runtime::Result<()> + Send + 'static,
    wait: Duration,
) -> bool {
    let (tx, rx) = mpsc::channel();
    let peer = std::thread::spawn(move || {
        let mut peer = LegacyPeer::accept_claiming(
            SocketAddr::new(IpAddr::V4(device_ip()), 0),
            TIMEOUT,
            VERSION,
            |a| tx.send(a).unwrap(),
        )
        .unwrap();
        offer(&mut peer).unwrap();
        // Takes the messages until the other side leaves.
        peer.cut_off(Instant::now() + TIMEOUT * 2)
    });
    let addr = rx.recv_timeout(TIMEOUT).unwrap();
    let events = Arc::new(Collect::default());
    let opts = Options {
        comm_mode: CommMode::Blocking,
        ..Options::default()
    };
    let conn = Connection::connect(addr, &opts, events.clone()).unwrap();
    for _ in 0..600 {
        if !matches!(conn.send(&[7u8; 64]), Ok(64)) {
            break;
        }
    }
    let ended = events.ended_within(wait);
    conn.close();
    assert!(peer.join().unwrap(), "the peer never saw the end");
    ended
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_peer_whose_slot_shows_credit_never_given_is_cut_off() {
    // Once half the peer's receive queue is unacknowledged, the sender
    // READs the slot: ring bytes or messages beyond what it sent end the
    // connection.
    for words in [
        CreditWords {
            bytes: 1 << 40,
            msgs: 0,
        },
        CreditWords {
            bytes: 0,
            msgs: 5000,
        },
    ] {
        assert!(ended_over_lying_slot(words, TIMEOUT), "{words:?}");
    }
    // Nothing consumed yet is the truth, and no violation.
    assert!(!ended_over_lying_slot(
        CreditWords::default(),
        Duration::from_secs(2)
    ));
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_peer_whose_slot_cannot_be_read_is_cut_off() {
    // The READ completes with an error: that connection ends, as at any
    // failed work request; a connection made after it is served.
    assert!(ended_over_slot(
        |peer| peer.offer_unreadable_credit_slot(),
        TIMEOUT
    ));
    assert!(!ended_over_lying_slot(
        CreditWords::default(),
        Duration::from_secs(2)
    ));
}

/// Messages of `len` bytes, `count` of them, sent at once from a callback,
/// where a send that finds no room queues rather than waits; keeps what it
/// sent, after the sink's first byte.
struct Burst {
    sent: Mutex<Vec<u8>>,
    count: u64,
    len: usize,
}

impl Burst {
    fn new(count: u64, len: usize) -> Self {
        Burst {
            sent: Mutex::new(vec![0]),
            count,
            len,
        }
    }

    fn send_on(&self, conn: &Connection) {
        let mut sent = self.sent.lock().unwrap();
        let mut msg = vec![0u8; self.len];
        for k in 0..self.count {
            fill_pattern(&mut msg, k);
            assert_eq!(conn.send(&msg).unwrap(), self.len, "message {k}");
            sent.extend_from_slice(&msg);
        }
    }

    /// All of it must reach `sink`, byte for byte, within `wait`.
    fn check_arrived(&self, sink: &Collect, wait: Duration) {
        let got = sink.wait_bytes(1 + self.count as usize * self.len, wait);
        let sent = self.sent.lock().unwrap();
        assert_eq!(got.len(), sent.len());
        assert!(got == *sent, "the burst arrived changed");
    }
}

/// At its first message, sends its burst on `target` from the receive
/// callback (the completion thread, in a drain of another connection).
struct BurstOnOther {
    target: Mutex<Option<Connection>>,
    burst: Burst,
}

impl ConnHandler for BurstOnOther {
    fn recv(&self, _conn: &Connection, _data: &[u8], _imm: Option<u32>) {
        if let Some(target) = self.target.lock().unwrap().take() {
            self.burst.send_on(&target);
        }
    }
}

/// At its first `write_done`, sends its burst on its own connection: from
/// a round the completion thread runs for the callbacks owed alone, with
/// no completion in it (not a drain).
struct BurstAfterWrite {
    fired: AtomicBool,
    burst: Burst,
}

impl ConnHandler for BurstAfterWrite {
    fn write_done(&self, conn: &Connection, _len: usize) {
        if !self.fired.swap(true, Ordering::SeqCst) {
            self.burst.send_on(conn);
        }
    }
}

/// Runs the test `name` again in a process of its own with the completion
/// thread not spinning (the runtime takes its spin once per process; the
/// rest of the suite runs with the default). True in the parent, which has
/// nothing more to do.
fn rerun_without_spin(name: &str) -> bool {
    if std::env::var("SNOWRDMA_SPIN_US").as_deref() == Ok("0") {
        return false;
    }
    let status = Command::new("timeout")
        .arg("120")
        .arg(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", name, "--test-threads=1"])
        .env("SNOWRDMA_SPIN_US", "0")
        .status()
        .unwrap();
    assert!(status.success(), "the run without spinning: {status}");
    true
}

/// Puts the completion thread's look at every connection (each 100 ticks),
/// which would find what nothing armed for, past a test's wait: a 1 s tick.
fn put_off_the_look_at_every_connection() {
    runtime::configure(&Options {
        poll_event_timeout: Duration::from_secs(1),
        ..Options::default()
    });
}

/// A receive-only sink (whose options are `sink_opts`) and a connection to
/// it with `handler`, which has sent the sink its first byte: the sink's
/// credit slot is offered by then. Its credit comes back by the sender's
/// READs, or when the sender asks for it.
fn sink_and_sender(
    sink_opts: &Options,
    handler: Arc<dyn ConnHandler>,
) -> (Arc<Collect>, Listener, Connection) {
    let sink = Arc::new(Collect::default());
    let (sink_server, sink_addr) = serve(sink_opts, sink.clone());
    let conn = Connection::connect(sink_addr, &Options::default(), handler).unwrap();
    assert_eq!(conn.send(&[0]).unwrap(), 1);
    sink.wait_bytes(1, TIMEOUT);
    (sink, sink_server, conn)
}

/// A receive callback of another connection sends `burst` to a
/// receive-only sink (whose options are `sink_opts`); all of it must
/// arrive within `wait`.
fn burst_from_a_callback(sink_opts: &Options, burst: Burst, wait: Duration) {
    let (sink, sink_server, target) = sink_and_sender(sink_opts, Arc::new(Collect::default()));
    let sender = Arc::new(BurstOnOther {
        target: Mutex::new(Some(target.clone())),
        burst,
    });
    let (echo_server, echo_addr) = serve(&Options::default(), Arc::new(Echo));
    let trigger = Connection::connect(echo_addr, &Options::default(), sender.clone()).unwrap();
    assert_eq!(trigger.send(&[1]).unwrap(), 1);
    sender.burst.check_arrived(&sink, wait);
    trigger.close();
    target.close();
    echo_server.release();
    sink_server.release();
}

const CREDIT_BURST_TEST: &str =
    "credit::a_burst_queued_by_a_callback_on_another_connection_arrives_with_spinning_off";

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_burst_queued_by_a_callback_on_another_connection_arrives_with_spinning_off() {
    // Sixteen times the sink's receive queue: most of it waits in the send
    // queue for credit. A completion thread that does not spin polls only
    // the connections it has events for, and nothing arms for a READ of
    // the peer's credit alone: the queueing send does, and the drains that
    // flush the queue poll it.
    if rerun_without_spin(CREDIT_BURST_TEST) {
        return;
    }
    burst_from_a_callback(&Options::default(), Burst::new(16 * 1024, 200), TIMEOUT * 3);
}

const ROOM_BURST_TEST: &str =
    "credit::a_burst_a_callback_sends_past_another_connections_send_queue_arrives_without_an_idle_look";

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_burst_a_callback_sends_past_another_connections_send_queue_arrives_without_an_idle_look() {
    // Here the limit is the sender's own send queue (1,024 work requests),
    // not credit: the sink's receive queue is four times that, and the
    // burst stays below the half of it that sends a READ of its credit.
    // Room comes back in send completions, which raise an event only when
    // that CQ is armed, and the callback runs on another connection's
    // drain, which does not poll it: the queueing send must arm it.
    if rerun_without_spin(ROOM_BURST_TEST) {
        return;
    }
    put_off_the_look_at_every_connection();
    let sink_opts = Options {
        recv_depth: 4096,
        ..Options::default()
    };
    burst_from_a_callback(&sink_opts, Burst::new(1800, 16), TIMEOUT * 3);
}

const WRITE_BURST_TEST: &str =
    "credit::a_burst_a_write_callback_sends_on_its_own_connection_arrives_without_an_idle_look";

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_burst_a_write_callback_sends_on_its_own_connection_arrives_without_an_idle_look() {
    // A write callback runs in a round the completion thread runs when
    // woken for it, not in a drain: most of the burst waits in the send
    // queue for credit (a READ of it goes out once half the sink's receive
    // queue is used) and for our own send queue, and the round must arm
    // the send CQ for the completions that bring room, as a drain's end
    // does.
    if rerun_without_spin(WRITE_BURST_TEST) {
        return;
    }
    put_off_the_look_at_every_connection();
    let sender = Arc::new(BurstAfterWrite {
        fired: AtomicBool::new(false),
        burst: Burst::new(4096, 64),
    });
    let (sink, sink_server, conn) = sink_and_sender(&Options::default(), sender.clone());
    // Lands in the sink's ring with no callback there.
    assert_eq!(conn.write_silent(b"w").unwrap(), 1);
    sender.burst.check_arrived(&sink, TIMEOUT * 3);
    conn.close();
    sink_server.release();
}

/// Collects what it receives, and from its connection's start sends 64 B
/// every 2 ms until stopped: a peer that is never quiet for a tick.
struct Chatter {
    sink: Arc<Collect>,
    stop: Arc<AtomicBool>,
}

impl ConnHandler for Chatter {
    fn connected(&self, conn: &Connection) {
        let (conn, stop) = (conn.clone(), self.stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Acquire) && conn.send(&[7u8; 64]).is_ok() {
                std::thread::sleep(Duration::from_millis(2));
            }
        });
    }

    fn recv(&self, conn: &Connection, data: &[u8], imm: Option<u32>) {
        self.sink.recv(conn, data, imm);
    }
}

/// Sends `sizes`, pattern-filled, over version 1 from a sender with 64
/// KiB of staging to a receiver with a ring of `ring` bytes that sends
/// every 2 ms ([`Chatter`]); checks every send went whole, at once (within
/// its 5 s timeout), and the receiver got it all.
fn to_a_chatty_peer(ring: usize, sizes: impl Iterator<Item = usize>) {
    let opts = |recv_buf_len| Options {
        comm_mode: CommMode::Blocking,
        protocol_version: 1,
        recv_buf_len,
        timeout: Duration::from_secs(5),
        ..Options::default()
    };
    let sink = Arc::new(Collect::default());
    let stop = Arc::new(AtomicBool::new(false));
    let chatter = Chatter {
        sink: sink.clone(),
        stop: stop.clone(),
    };
    let (server, addr) = serve(&opts(ring), Arc::new(chatter));
    let conn = Connection::connect(addr, &opts(64 << 10), Arc::new(Collect::default())).unwrap();
    let mut sent = Vec::new();
    for (k, len) in sizes.enumerate() {
        let mut msg = vec![0u8; len];
        fill_pattern(&mut msg, k as u64);
        assert_eq!(conn.send(&msg).unwrap(), len, "message {k}");
        sent.extend_from_slice(&msg);
    }
    let got = sink.wait_bytes(sent.len(), TIMEOUT * 3);
    stop.store(true, Ordering::Release);
    assert!(got == sent, "the stream arrived changed");
    conn.close();
    server.release();
}

/// A version-1 sender whose staging buffer is far smaller than its peer's
/// ring (16x here) gets its credit back. Before, the peer measured "an
/// eighth" against its whole ring, which such a sender never has in
/// flight, and sent the credit alone only at a tick on which it had sent
/// nothing: a peer that kept sending never did, and the 17th send waited
/// out its timeout.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_small_sender_gets_credit_from_a_peer_with_a_much_larger_ring() {
    // 16 rings' worth, 16 messages to a ring (fewer than the receive
    // queue's eighth, so the message count returns no credit either).
    to_a_chatty_peer(1 << 20, std::iter::repeat_n(4096, 256));
}

/// A sender blocked with less than an eighth of the ring in flight (32
/// KiB reported at once, at half; then 3 KiB; then 40 KiB, which fits
/// only from the ring's start, where the 3 KiB are in the way) gets that
/// credit from a peer that keeps sending: with the peer's next message
/// after a tick. Before, less than an eighth went only alone, at a tick
/// on which the peer had sent nothing.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_sender_blocked_on_less_than_an_eighth_gets_it_from_a_chatty_peer() {
    let round = [32 << 10, 3 << 10, 40 << 10];
    to_a_chatty_peer(64 << 10, round.into_iter().cycle().take(3 * 8));
}
