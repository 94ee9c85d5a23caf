//! Credit by READ (protocol version 2): a stream's receiver posts nothing
//! to return credit, the sender READs it behind its messages, and a peer
//! on an older version gets the version-1 protocol either way round.

use std::sync::Arc;

use snowrdma::costs::{self, Counter};
use snowrdma::runtime::proto::VERSION;
use snowrdma::runtime::{CommMode, Connection, Options};
use snowrdma::verbs::selftest::fill_pattern;

use crate::runtime::{serve, Collect};
use crate::TIMEOUT;

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
    let conn = Connection::connect(addr, &opts(sender_version), Arc::new(Collect::default()))
        .unwrap();
    let mut sent = Vec::with_capacity(MESSAGES as usize * LEN);
    let mut msg = [0u8; LEN];
    let (all, mine) = (costs::snapshot(), costs::this_thread());
    for k in 0..MESSAGES {
        fill_pattern(&mut msg, k);
        assert_eq!(conn.send(&msg).unwrap(), LEN, "message {k}");
        sent.extend_from_slice(&msg);
    }
    let got = sink.wait_bytes(sent.len(), TIMEOUT * 3);
    let (all, mine) = (costs::snapshot().since(&all), costs::this_thread().since(&mine));
    assert!(got == sent, "the stream arrived changed");
    conn.close();
    server.release();
    let s = Stream {
        sender_doorbells: mine.get(Counter::SendDoorbells),
        sender_wrs: mine.get(Counter::SendRequests),
        receiver_doorbells: all.get(Counter::SendDoorbells) - mine.get(Counter::SendDoorbells),
    };
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
        assert_eq!((s.sender_doorbells, s.sender_wrs), (MESSAGES, MESSAGES), "{s:?}");
        assert!(s.receiver_doorbells >= MESSAGES / 512, "{s:?}");
    }
}
