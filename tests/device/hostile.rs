//! Peers that break the protocol on purpose, and clients that write where
//! they may not: each is cut off, and nobody else notices.

use std::net::{IpAddr, SocketAddr};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use snowrdma::kv::proto::{Op, Reply, Request, ServerInfo};
use snowrdma::kv::{Client, ClientOptions, KvError, Server, ServerConfig};
use snowrdma::runtime::legacy_peer::LegacyPeer;
use snowrdma::runtime::proto::{Cmd, Opcode, CMD_LEN, IMM_EXTENDED, VERSION};
use snowrdma::runtime::{ConnHandler, ConnState, Connection, Listener, Options};
use snowrdma::verbs::RemoteAddr;

use crate::kv::{kv_server, stat_falls_to};
use crate::kv_limits::Replies;
use crate::runtime::Collect;
use crate::{device_ip, TIMEOUT};

/// One way of breaking the protocol: the version the peer claims, and what
/// it does once connected.
struct Violation {
    name: &'static str,
    version: u8,
    act: fn(&mut LegacyPeer) -> snowrdma::runtime::Result<()>,
}

fn command(opcode: Opcode, addr: u64, length: u32) -> [u8; CMD_LEN] {
    Cmd::new(opcode, addr, length, 0).encode()
}

const VIOLATIONS: &[Violation] = &[
    Violation {
        name: "credit for messages never sent",
        version: VERSION,
        act: |p| p.send_command(&command(Opcode::Credit, 0, 1000)),
    },
    Violation {
        name: "credit for ring bytes never used",
        version: VERSION,
        act: |p| p.send_command(&command(Opcode::Credit, 1 << 20, 0)),
    },
    Violation {
        name: "credit from a legacy peer",
        version: 0,
        act: |p| p.send_command(&command(Opcode::Credit, 0, 0)),
    },
    Violation {
        name: "a second advertisement",
        version: VERSION,
        act: |p| {
            let mut again = Cmd::new(Opcode::RegLocalAddr, 4096, 4096, 1);
            again.recv_depth = 1024;
            p.send_command(&again.encode())
        },
    },
    Violation {
        name: "an unknown command",
        version: 0,
        act: |p| {
            let mut b = command(Opcode::ConnGoodbye, 0, 0);
            b[2] = 9;
            p.send_command(&b)
        },
    },
    Violation {
        name: "a command with a bad magic byte",
        version: 0,
        act: |p| {
            let mut b = command(Opcode::ConnGoodbye, 0, 0);
            b[0] = b'X';
            p.send_command(&b)
        },
    },
    Violation {
        name: "a credit slot from a version-1 peer",
        version: 1,
        act: |p| p.send_command(&Cmd::new(Opcode::CreditSlot, 4096, 16, 1).encode()),
    },
    Violation {
        name: "a credit slot of the wrong size",
        version: VERSION,
        act: |p| p.send_command(&Cmd::new(Opcode::CreditSlot, 4096, 8, 1).encode()),
    },
    Violation {
        name: "a second credit slot",
        version: VERSION,
        act: |p| {
            let slot = Cmd::new(Opcode::CreditSlot, 4096, 16, 1).encode();
            p.send_command(&slot)?;
            p.send_command(&slot)
        },
    },
    Violation {
        name: "credit wanted by a version-1 peer",
        version: 1,
        act: |p| p.send_command(&command(Opcode::CreditWanted, 0, 0)),
    },
    Violation {
        name: "a message out of order",
        version: 0,
        act: |p| p.write_with_imm(128, 128, &[7u8; 16]),
    },
    Violation {
        name: "an offset outside the ring",
        version: 0,
        act: |p| p.write_with_imm(0, 0x7fff_0000, &[7u8; 16]),
    },
    Violation {
        name: "an extended message from a legacy peer",
        version: 0,
        act: |p| p.write_with_imm(0, IMM_EXTENDED, &[7u8; 16]),
    },
    Violation {
        name: "a message that is no key-value request",
        version: 0,
        act: |p| p.write_with_imm(0, 0, &[7u8; 16]),
    },
];

#[test]
#[ignore]
fn hostile_peers_are_cut_off_and_nobody_else_notices() {
    let (server, addr) = kv_server(false);
    let good = Client::connect(addr).unwrap();
    good.put(b"precious", b"original").unwrap();
    for v in VIOLATIONS {
        let mut peer = LegacyPeer::connect_claiming(addr, TIMEOUT, v.version)
            .unwrap_or_else(|e| panic!("{}: connecting: {e}", v.name));
        // The server may cut it off before the act completes.
        let _ = (v.act)(&mut peer);
        assert!(
            peer.cut_off(Instant::now() + TIMEOUT),
            "{}: the server kept the peer",
            v.name
        );
        assert_eq!(
            good.get(b"precious").unwrap().0,
            b"original",
            "after {}",
            v.name
        );
    }
    // Every rogue is gone; the good client and a new one are served.
    stat_falls_to(&server, |s| s.clients, 1, TIMEOUT, "clients connected");
    assert_eq!(
        server.stats().errors,
        1,
        "the malformed request was not seen"
    );
    let late = Client::connect(addr).unwrap();
    late.put(b"late", b"fine").unwrap();
    assert_eq!(good.get(b"late").unwrap().0, b"fine");
    server.stop();
}

struct Quiet;
impl ConnHandler for Quiet {}

/// RDMA WRITEs 64 bytes from a fresh buffer of `conn`'s to `target`.
fn write_64(conn: &Connection, target: RemoteAddr) -> snowrdma::runtime::Result<usize> {
    let mr = conn.register(4096)?;
    // SAFETY: a live registration from `register`.
    let (laddr, lkey) = (mr.addr(), mr.lkey());
    conn.write_sync(laddr, lkey, target, 64)
}

/// Client B writes, with client A's rkeys and addresses, into A's request
/// buffer, A's receive ring and A's write target: the NIC refuses each
/// write, and A's own writes work.
#[test]
#[ignore]
fn hostile_clients_cannot_write_each_others_buffers() {
    let (server, addr) = kv_server(false);
    let a = Client::connect(addr).unwrap();
    a.put(b"a-key", b"a-value").unwrap();
    let info = *a.server_info();
    let opts = Options::default();
    let a_conn = Connection::connect(addr, &opts, Arc::new(Quiet)).unwrap();
    let a_ring = a_conn.peer_buffer().expect("the server's ring for A");
    let targets = [
        (
            "A's request buffer",
            RemoteAddr {
                addr: info.request_buf,
                rkey: info.request_buf_rkey,
            },
        ),
        (
            "A's receive ring",
            RemoteAddr {
                addr: a_ring.addr,
                rkey: a_ring.rkey,
            },
        ),
    ];
    for (what, target) in targets {
        // A failed write ends B's connection: a new B for each.
        let b = Connection::connect(addr, &opts, Arc::new(Quiet)).unwrap();
        assert!(write_64(&b, target).is_err(), "B wrote into {what}");
    }
    // A's write target for a large value: writable by A's connection only.
    let sink = Arc::new(Collect::default());
    let a_raw = Connection::connect(addr, &opts, sink.clone()).unwrap();
    let mut alloc = Request::new(Op::Alloc, 1);
    alloc.value_len = 1 << 20;
    assert!(a_raw.send(&alloc.encode(b"a-big", &[])).unwrap() > 0);
    let bytes = sink.wait_bytes(1, TIMEOUT);
    let (reply, _) = Reply::decode(&bytes).unwrap();
    assert_eq!(reply.status, 0, "the server made a write target");
    let target = RemoteAddr {
        addr: reply.addr,
        rkey: reply.rkey,
    };
    let b = Connection::connect(addr, &opts, Arc::new(Quiet)).unwrap();
    assert!(
        write_64(&b, target).is_err(),
        "B wrote into A's write target"
    );
    assert_eq!(
        write_64(&a_raw, target).unwrap(),
        64,
        "A writes its own target"
    );
    // A is untouched and still served, over both of its connections.
    assert_eq!(a.get(b"a-key").unwrap().0, b"a-value");
    a.put(b"a-key", &vec![3u8; 3000]).unwrap();
    assert_eq!(a.get(b"a-key").unwrap().0, vec![3u8; 3000]);
    assert_eq!(a_conn.state(), ConnState::MrReady);
    server.stop();
}

/// Client B READs, with the rkey the server gave client A, the slot where
/// the server publishes the credit it returns to A: the NIC refuses it (a
/// window bound to A's queue pair alone), ending B's connection; A reads
/// its own slot, stays connected, and the server goes on serving.
#[test]
#[ignore]
fn hostile_clients_cannot_read_each_others_credit() {
    let (server, addr) = kv_server(false);
    let opts = Options::default();
    let a = Connection::connect(addr, &opts, Arc::new(Quiet)).unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let slot = loop {
        if let Some(slot) = a.peer_credit_slot() {
            break slot;
        }
        assert!(
            Instant::now() < deadline,
            "the server offered no credit slot"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    let target = RemoteAddr {
        addr: slot.addr,
        rkey: slot.rkey,
    };
    let read_16 = |conn: &Connection| {
        let mr = conn.register(4096)?;
        conn.read_sync(mr.addr(), mr.lkey(), target, 16)
    };
    let b = Connection::connect(addr, &opts, Arc::new(Quiet)).unwrap();
    assert!(read_16(&b).is_err(), "B read A's credit slot");
    // The failed READ ends B's connection (its state is set just after the
    // READ's error is handed to the waiter).
    let deadline = Instant::now() + TIMEOUT;
    while b.state() == ConnState::MrReady {
        assert!(Instant::now() < deadline, "B's connection did not end");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(read_16(&a).unwrap(), 16, "A reads its own slot");
    // A is still connected, and the server serves as before.
    let client = Client::connect(addr).unwrap();
    client.put(b"key", b"value").unwrap();
    assert_eq!(client.get(b"key").unwrap().0, b"value");
    assert_eq!(a.state(), ConnState::MrReady);
    server.stop();
}

/// Echoes, and panics on "boom".
struct Touchy;
impl ConnHandler for Touchy {
    fn recv(&self, conn: &Connection, data: &[u8], _imm: Option<u32>) {
        assert!(data != b"boom", "a defect in the handler");
        let _ = conn.send(data);
    }
}

/// A panic in a Rust handler ends its connection; the completion and CM
/// threads go on serving the others.
#[test]
#[ignore]
fn a_panicking_handler_ends_only_its_connection() {
    let listener = Listener::bind(
        SocketAddr::new(IpAddr::V4(device_ip()), 0),
        &Options::default(),
        Box::new(|_| Some(Arc::new(Touchy) as Arc<dyn ConnHandler>)),
    )
    .unwrap();
    listener.start().unwrap();
    let addr = listener.local_addr().unwrap();
    let opts = Options::default();
    let doomed = Arc::new(Collect::default());
    let a = Connection::connect(addr, &opts, doomed.clone()).unwrap();
    let other = Arc::new(Collect::default());
    let b = Connection::connect(addr, &opts, other.clone()).unwrap();
    assert!(a.send(b"boom").unwrap() > 0);
    // The server disconnects at once; the news can take RDMA CM a while on
    // a loaded emulated machine (one suite run took over 10 s).
    doomed.wait_disconnected(3 * TIMEOUT);
    assert!(b.send(b"still served").unwrap() > 0);
    assert_eq!(other.wait_bytes(12, TIMEOUT), b"still served");
    let late = Arc::new(Collect::default());
    let c = Connection::connect(addr, &opts, late.clone()).unwrap();
    assert!(c.send(b"late").unwrap() > 0);
    assert_eq!(late.wait_bytes(4, TIMEOUT), b"late");
    listener.release();
}

/// A small PUT the server stores straight from its receive ring is checked
/// as any other: a key of no bytes or too many, or a value too long, is
/// answered with its error and stores nothing; a good one is stored whole.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn puts_stored_from_the_ring_are_checked_like_any_other() {
    let server = Server::new(ServerConfig {
        addr: SocketAddr::new(IpAddr::V4(device_ip()), 0),
        memory_size: 16 << 20,
        table_size: 1024,
        workers: 1,
        max_value: 100,
        ..ServerConfig::default()
    })
    .unwrap();
    server.start().unwrap();
    let addr = server.local_addr().unwrap();
    let (tx, replies) = mpsc::channel();
    let raw =
        Connection::connect(addr, &Options::default(), Arc::new(Replies(Mutex::new(tx)))).unwrap();
    let put = |id: u64, key: &[u8], value: &[u8]| {
        let mut req = Request::new(Op::Write, id);
        req.value_len = value.len() as u64;
        let msg = req.encode(key, value);
        assert_eq!(msg[0], 0xb1, "a compact request");
        assert!(raw.send(&msg).unwrap() > 0);
        let reply = replies.recv_timeout(TIMEOUT).expect("a reply");
        assert_eq!(reply.req_id, id);
        reply.status
    };
    let code = |e: KvError| e.code();
    let too_long_key = vec![b'k'; 1025];
    assert_eq!(
        put(1, b"", b"value"),
        code(KvError::InvalidArgument(String::new()))
    );
    assert_eq!(put(2, &too_long_key, b"value"), code(KvError::KeyTooLong));
    assert_eq!(
        put(3, b"key", &[7; 101]),
        code(KvError::ValueTooLong { max: 100 })
    );
    assert_eq!(put(4, b"key", &[7; 100]), 0);
    assert_eq!(put(5, b"empty", b""), 0);
    let client = Client::connect(addr).unwrap();
    assert_eq!(client.get(b"key").unwrap(), (vec![7; 100], 1));
    assert_eq!(client.get(b"empty").unwrap(), (vec![], 1));
    let stats = server.stats();
    // A value too long is the client's to know, not counted as an error.
    assert_eq!(
        (stats.puts, stats.items, stats.errors),
        (2, 2, 2),
        "{stats:?}"
    );
    assert_eq!(
        raw.state(),
        ConnState::MrReady,
        "errors are answered, not fatal"
    );
    server.stop();
}

/// A kv "server" that answers HELLO as a server would, and every other
/// request with what `answer` makes of its id.
struct Liar {
    answer: Answer,
}

/// The message a [`Liar`] sends for a request's id.
type Answer = fn(u64) -> Vec<u8>;

impl ConnHandler for Liar {
    fn recv(&self, conn: &Connection, data: &[u8], _imm: Option<u32>) {
        let Ok((req, _, _)) = Request::decode(data) else {
            return;
        };
        let msg = if req.op == Op::Hello {
            let info = ServerInfo {
                request_buf: 4096,
                request_buf_len: 4096,
                request_buf_rkey: 1,
                index_addr: 8192,
                index_rkey: 2,
                buckets: 16,
                pool_rkey: 3,
                max_key: 1024,
                max_value: 1 << 20,
            }
            .encode();
            let hello = Reply {
                req_id: req.req_id,
                value_len: info.len() as u64,
                ..Reply::default()
            };
            hello.encode(&info)
        } else {
            (self.answer)(req.req_id)
        };
        let _ = conn.send(&msg);
    }
}

/// A [`Liar`] answering with `answer`, and a client connected to it (whose
/// calls wait up to 30 s for a reply).
fn liar_and_client(answer: Answer) -> (Listener, Client) {
    let liar = Listener::bind(
        SocketAddr::new(IpAddr::V4(device_ip()), 0),
        &Options::default(),
        Box::new(move |_| Some(Arc::new(Liar { answer }) as Arc<dyn ConnHandler>)),
    )
    .unwrap();
    liar.start().unwrap();
    let opts = ClientOptions {
        timeout: Duration::from_secs(30),
        ..ClientOptions::default()
    };
    let client = Client::connect_with(liar.local_addr().unwrap(), &opts).unwrap();
    (liar, client)
}

/// Replies that break the protocol end the client's connection: the call
/// waiting for one fails at once with `Disconnected` (not after its
/// timeout), and no byte of them reaches the caller's buffer.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_server_that_garbles_its_replies_is_cut_off() {
    let garbled: [(&str, Answer); 5] = [
        // A compact reply's tag, then less than its header.
        ("a cut compact header", |id| {
            vec![0xa1, 1, 0, 0, 0, 0, 0, id as u8]
        }),
        ("a full header with a bad magic", |id| {
            let mut m = Reply {
                req_id: id,
                ..Reply::default()
            }
            .encode(&[]);
            m.resize(56, 0);
            m[..4].copy_from_slice(b"EVIL");
            m
        }),
        ("a full header cut short", |id| {
            let mut m = Reply::error(id, KvError::NotFound).encode(&[]);
            m.truncate(40);
            m
        }),
        ("twelve zero bytes", |_| vec![0; 12]),
        // Well formed, but to a request the client never sent: filed, it
        // would sit in the client's replies for good.
        ("a reply to another id", |id| {
            Reply::error(id.wrapping_add(1000), KvError::NotFound).encode(&[])
        }),
    ];
    for (what, answer) in garbled {
        let (liar, client) = liar_and_client(answer);
        let mut buf = [0x33u8; 64];
        let began = Instant::now();
        let got = client.get_into(b"key", &mut buf);
        assert!(
            matches!(got, Err(KvError::Disconnected(_))),
            "{what}: {got:?}"
        );
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "{what}: waited for the timeout"
        );
        assert_eq!(buf, [0x33; 64], "{what}");
        assert!(
            matches!(client.get(b"key"), Err(KvError::Disconnected(_))),
            "{what}"
        );
        liar.release();
    }
}

/// A server whose leases cannot be READ (a bad rkey, half the batch's
/// replies) fails the READs in the middle of a batch and, with them, the
/// connection: every key is answered once, none with bytes the READ did
/// not bring, the batch ends at once rather than at its timeout, and the
/// client says Disconnected from then on.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_server_whose_leases_cannot_be_read_fails_the_batch_not_the_caller() {
    const KEYS: usize = 16;
    const INLINE: [u8; 64] = [0x42; 64];
    let (liar, client) = liar_and_client(|id| match id % 2 {
        // A small value, inline: good.
        0 => Reply {
            req_id: id,
            version: 1,
            value_len: INLINE.len() as u64,
            ..Reply::default()
        }
        .encode(&INLINE),
        // A large value lent where no memory is registered.
        _ => Reply {
            req_id: id,
            version: 1,
            value_len: 65536,
            remote: true,
            addr: 0x1000,
            rkey: 0xdead,
            lease: id,
            ..Reply::default()
        }
        .encode(&[]),
    });
    let names: Vec<String> = (0..KEYS).map(|i| format!("key-{i}")).collect();
    let keys: Vec<&[u8]> = names.iter().map(|k| k.as_bytes()).collect();
    let mut answered = [0usize; KEYS];
    let mut failed = 0;
    let began = Instant::now();
    client.batch_get_with(&keys, |i, r| {
        answered[i] += 1;
        match r {
            Ok((value, _)) => assert_eq!(value, INLINE, "key {i}: bytes no READ brought"),
            Err(_) => failed += 1,
        }
    });
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "the batch waited for its timeout"
    );
    assert_eq!(answered, [1; KEYS], "every key answered once");
    assert!(failed >= KEYS / 2, "only {failed} of {KEYS} failed");
    assert!(
        matches!(client.get(b"key-0"), Err(KvError::Disconnected(_))),
        "the connection outlived the failed READs"
    );
    liar.release();
}

/// Every message, whole.
struct Messages(Mutex<mpsc::Sender<Vec<u8>>>);
impl ConnHandler for Messages {
    fn recv(&self, _conn: &Connection, data: &[u8], _imm: Option<u32>) {
        let _ = self.0.lock().unwrap().send(data.to_vec());
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_staged_value_is_stored_only_if_it_arrived_as_its_checksum_says() {
    use snowrdma::kv::proto::{value_checksum, Source};
    const LEN: usize = 8192;
    let (server, addr) = kv_server(false);
    let (tx, rx) = mpsc::channel();
    let raw = Connection::connect(
        addr,
        &Options::default(),
        Arc::new(Messages(Mutex::new(tx))),
    )
    .unwrap();
    let call = |msg: &[u8], staged: Option<&snowrdma::verbs::MemoryRegion>, to: RemoteAddr| {
        let sent = match staged {
            // SAFETY: the region stays untouched until the reply.
            Some(mr) => unsafe {
                raw.write_then_send(mr.addr(), mr.lkey(), to, LEN as u32, &[msg])
            },
            None => raw.send(msg),
        };
        assert!(sent.unwrap() > 0);
        let bytes = rx.recv_timeout(TIMEOUT).expect("a reply");
        let (reply, payload) = Reply::decode(&bytes).unwrap();
        (reply, payload.to_vec())
    };
    let (_, hello) = call(
        &Request::new(Op::Hello, 1).encode(&[], &[]),
        None,
        RemoteAddr { addr: 0, rkey: 0 },
    );
    let info = ServerInfo::decode(&hello).unwrap();
    let value = raw.register(LEN).unwrap();
    // SAFETY: our own registered memory, not posted anywhere yet.
    unsafe { std::ptr::write_bytes(value.addr() as *mut u8, 0x5a, LEN) };
    let right = value_checksum(&vec![0x5a; LEN]);
    let buf = RemoteAddr {
        addr: info.request_buf,
        rkey: info.request_buf_rkey,
    };
    // The value is written at `at` of the request buffer; the request says
    // it is at `offset`.
    let staged_put = |id: u64, at: u64, offset: u64, checksum: u64| {
        let mut req = Request::new(Op::Write, id);
        req.value_len = LEN as u64;
        req.source = Source::Staged { offset, checksum };
        call(
            &req.encode(b"staged", &[]),
            Some(&value),
            RemoteAddr {
                addr: buf.addr + at,
                rkey: buf.rkey,
            },
        )
        .0
    };
    let invalid = KvError::InvalidArgument(String::new()).code();
    // Torn on the way (or rewritten after its checksum): not stored.
    assert_eq!(staged_put(2, 0, 0, right ^ 1).status, invalid);
    // Past the end of the request buffer.
    let past = info.request_buf_len - LEN as u64 + 64;
    assert_eq!(staged_put(3, 0, past, right).status, invalid);
    let client = Client::connect(addr).unwrap();
    assert!(matches!(client.get(b"staged"), Err(KvError::NotFound)));
    // Whole: stored, and read back as written.
    let stored = staged_put(4, 64, 64, right);
    assert_eq!((stored.status, stored.version), (0, 1));
    assert_eq!(client.get(b"staged").unwrap(), (vec![0x5a; LEN], 1));
    assert_eq!(
        raw.state(),
        ConnState::MrReady,
        "errors are answered, not fatal"
    );
    server.stop();
}
