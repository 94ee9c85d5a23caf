//! The kv server's limits against clients it does not control, each hit on
//! purpose with a small setting: what the client sees (an error code, a
//! disconnect) and the counter the server keeps.

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use snowrdma::kv::proto::{block_len, Op, Reply, Request, Source};
use snowrdma::kv::{Client, ClientOptions, ConnMode, KvError, Limits, Server, ServerConfig, Stats};
use snowrdma::runtime::{ConnHandler, ConnState, Connection, Options};

use crate::{device_ip, TIMEOUT};

pub(crate) fn server(mode: ConnMode, limits: Limits, workers: usize) -> (Server, SocketAddr) {
    let server = Server::new(ServerConfig {
        addr: SocketAddr::new(IpAddr::V4(device_ip()), 0),
        memory_size: 16 << 20,
        table_size: 1024,
        workers,
        conn_mode: mode,
        device: (mode == ConnMode::Socket).then(|| "rxe0".into()),
        max_value: 16 << 20,
        limits,
        ..ServerConfig::default()
    })
    .unwrap();
    server.start().unwrap();
    let addr = server.local_addr().unwrap();
    (server, addr)
}

pub(crate) fn client(addr: SocketAddr, mode: ConnMode) -> Result<Client, KvError> {
    let opts = ClientOptions {
        mode,
        ..ClientOptions::default()
    };
    Client::connect_with(addr, &opts)
}

/// Waits (bounded) until the server's statistics satisfy `done`.
pub(crate) fn until(server: &Server, what: &str, done: impl Fn(&Stats) -> bool) -> Stats {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let stats = server.stats();
        if done(&stats) {
            return stats;
        }
        assert!(Instant::now() < deadline, "{what}: {stats}");
        thread::sleep(Duration::from_millis(50));
    }
}

pub(crate) fn works(c: &Client, key: &str) {
    c.put(key.as_bytes(), b"value").unwrap();
    assert_eq!(c.get(key.as_bytes()).unwrap().0, b"value");
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_limit_queued_requests_per_client_and_per_worker() {
    let limits = Limits {
        client_jobs: 2,
        worker_queue: 1,
        ..Limits::default()
    };
    let (server, addr) = server(ConnMode::Cm, limits, 1);
    // Four clients, one worker: each pipelines PUTs of values just above
    // the inline size (staged in its request buffer: the worker checks and
    // copies them), faster than one worker answers them all.
    let value = vec![7u8; 5000];
    let batch = |c: &Client, name: &str| {
        let keys: Vec<String> = (0..64).map(|i| format!("{name}-{i}")).collect();
        let pairs: Vec<(&[u8], &[u8])> = keys.iter().map(|k| (k.as_bytes(), &value[..])).collect();
        c.batch_put(&pairs)
    };
    let clients: Vec<Client> = (0..4)
        .map(|_| client(addr, ConnMode::Cm).unwrap())
        .collect();
    let results: Vec<_> = thread::scope(|s| {
        let runs: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(i, c)| s.spawn(move || batch(c, &format!("c{i}"))))
            .collect();
        runs.into_iter().flat_map(|r| r.join().unwrap()).collect()
    });
    assert!(
        results
            .iter()
            .all(|r| r.is_ok() || *r == Err(KvError::NoMemory)),
        "{results:?}"
    );
    let busy = results.iter().filter(|r| r.is_err()).count() as u64;
    let stats = server.stats();
    println!("    {stats}");
    assert!(
        busy > 0,
        "the pipelined batches pass a client's cap: {stats}"
    );
    assert_eq!(stats.busy_refusals, busy, "{stats}");
    assert_eq!(stats.puts, 256 - busy, "{stats}");
    assert!(
        stats.worker_queue_full > 0,
        "the worker queue filled: {stats}"
    );
    // Refused, not dropped: the clients go on.
    for (i, c) in clients.iter().enumerate() {
        works(c, &format!("after-{i}"));
    }
}

/// Replies of a raw connection, as they come.
pub(crate) struct Replies(pub(crate) Mutex<mpsc::Sender<Reply>>);

/// A connection that speaks the kv protocol by hand, and its replies.
pub(crate) fn raw_client(addr: SocketAddr) -> (Connection, mpsc::Receiver<Reply>) {
    let (tx, replies) = mpsc::channel();
    let handler = Arc::new(Replies(Mutex::new(tx)));
    let conn = Connection::connect(addr, &Options::default(), handler).unwrap();
    (conn, replies)
}

impl ConnHandler for Replies {
    fn recv(&self, _conn: &Connection, data: &[u8], _imm: Option<u32>) {
        let (reply, _) = Reply::decode(data).unwrap();
        let _ = self.0.lock().unwrap().send(reply);
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_limit_large_value_quota_and_leases_capped_and_expired() {
    const MIB: u64 = 1 << 20;
    let limits = Limits {
        large_value_quota: 8 * MIB,
        lease_bytes: 4 * MIB,
        // Shortened below, while the lease is out.
        lease_time: Duration::from_secs(3600),
        ..Limits::default()
    };
    let (server, addr) = server(ConnMode::Cm, limits.clone(), 2);
    let c = client(addr, ConnMode::Cm).unwrap();
    // 3 MiB values live outside the (2 MiB-class) pool.
    let big = |seed: u8| vec![seed; 3 << 20];
    c.put(b"big-1", &big(1)).unwrap();
    c.put(b"big-2", &big(2)).unwrap();
    assert_eq!(c.put(b"big-3", &big(3)), Err(KvError::NoMemory), "quota");
    assert_eq!(server.stats().quota_refusals, 1);
    // A leased read is checksummed, and still reads right.
    assert_eq!(c.get(b"big-1").unwrap().0, big(1));

    // A client that GETs large values and never releases them.
    let (hoarder, replies) = raw_client(addr);
    for (id, key) in [(1, &b"big-1"[..]), (2, b"big-2")] {
        hoarder
            .send(&Request::new(Op::Get, id).encode(key, &[]))
            .unwrap();
        let reply = replies.recv_timeout(TIMEOUT).unwrap();
        assert!(reply.status == 0 && reply.lease != 0, "{reply:?}");
    }
    assert_eq!(server.stats().leases_capped, 1, "6 MiB leased, cap 4 MiB");
    // Gone from the store, still pinned by the lease left.
    c.delete(b"big-1").unwrap();
    c.delete(b"big-2").unwrap();
    let leased = server.stats().large_bytes;
    assert!(leased >= 3 * MIB, "the leased value is held: {leased}");
    // The housekeeping thread sleeps until the lease's end an hour away;
    // a shorter lease time wakes it to look again.
    let shortened = Instant::now();
    server
        .set_limits(Limits {
            lease_time: Duration::from_secs(2),
            ..limits
        })
        .unwrap();
    let stats = until(&server, "the lease expires", |s| s.leases_expired == 1);
    assert!(
        shortened.elapsed() < Duration::from_secs(4),
        "it ended {:?} after the lease time was shortened to 2 s",
        shortened.elapsed()
    );
    assert_eq!(stats.large_bytes, 0, "and its memory is freed");
    // The quota has room again.
    c.put(b"big-3", &big(3)).unwrap();
    assert_eq!(c.get(b"big-3").unwrap().0, big(3));
    hoarder.close();
}

/// A client that asks for write targets and never writes them holds at
/// most its share ([`Limits::target_bytes`]): the rest of the large-value
/// quota stays for the others' large PUTs. Its share comes back when it
/// releases a target, and a client holding none always gets one.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_limit_a_client_holds_at_most_target_bytes_of_write_targets() {
    const MIB: u64 = 1 << 20;
    let limits = Limits {
        large_value_quota: 16 * MIB,
        target_bytes: 4 * MIB,
        ..Limits::default()
    };
    let (server, addr) = server(ConnMode::Cm, limits, 1);
    let (hoarder, replies) = raw_client(addr);
    let alloc = |id: u64, value_len: u64| -> Reply {
        let mut req = Request::new(Op::Alloc, id);
        req.value_len = value_len;
        hoarder.send(&req.encode(b"hoard", &[])).unwrap();
        let reply = replies.recv_timeout(TIMEOUT).unwrap();
        assert_eq!(reply.req_id, id);
        reply
    };
    let release = |token: u64| {
        let (req, more) = Request::release(&[token], &mut []);
        hoarder.send(&req.encode(more, &[])).unwrap();
    };
    // As many as a client may ask for at once (8), of 3 MiB each.
    let granted: Vec<Reply> = (1..=8)
        .map(|id| alloc(id, 3 * MIB))
        .filter(|r| r.status == 0)
        .collect();
    assert_eq!(granted.len(), 1, "3 MiB write targets, a 4 MiB share");
    assert_eq!(server.stats().targets_capped, 7);
    // Too long for the server is said as such, whatever the share.
    let too_long = alloc(9, 17 * MIB);
    assert_eq!(too_long.status, KvError::ValueTooLong { max: 0 }.code());
    assert_eq!(server.stats().targets_capped, 7);
    let c = client(addr, ConnMode::Cm).unwrap();
    let big = vec![7u8; 3 << 20];
    c.put(b"big", &big).unwrap();
    assert_eq!(c.get(b"big").unwrap().0, big);
    assert_eq!(server.stats().quota_refusals, 0);
    // Released, the share is there again.
    release(granted[0].lease);
    let again = alloc(10, 3 * MIB);
    assert_eq!(again.status, 0, "the share is back after a release");
    // A share below the value: one target at a time, never none.
    server.update_limits(|l| l.target_bytes = MIB).unwrap();
    assert_ne!(
        alloc(11, 3 * MIB).status,
        0,
        "a second one is past the share"
    );
    assert_eq!(server.stats().targets_capped, 8);
    release(again.lease);
    assert_eq!(
        alloc(12, 3 * MIB).status,
        0,
        "holding none, a client gets one"
    );
    hoarder.close();
}

/// A client that sends ALLOCs, each followed by the RELEASE of the token
/// it will get (tokens are counted, so it can know them), no longer has
/// its worker map and register its share again for every pair in its
/// queue: room is reserved as an ALLOC arrives, so the ALLOCs that come
/// while one is being made are refused.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_limit_alloc_and_release_churn_is_held_to_the_share() {
    const MIB: u64 = 1 << 20;
    // The largest value the test server takes: a target this size takes
    // the worker milliseconds to make, the burst microseconds to read.
    const TARGET: u64 = 16 * MIB;
    const PAIRS: u64 = 16;
    let limits = Limits {
        target_bytes: TARGET,
        ..Limits::default()
    };
    let (server, addr) = server(ConnMode::Cm, limits, 1);
    let (churner, replies) = raw_client(addr);
    let alloc = |id: u64| {
        let mut req = Request::new(Op::Alloc, id);
        req.value_len = TARGET;
        req.encode(b"churn", &[])
    };
    let release = |token: u64| {
        let (req, more) = Request::release(&[token], &mut []);
        req.encode(more, &[])
    };
    // ALLOCs refused for their key hold no room (before, each held one of
    // the client's 8 for good).
    for id in 100..110 {
        let mut req = Request::new(Op::Alloc, id);
        req.value_len = TARGET;
        churner.send(&req.encode(b"", &[])).unwrap();
        let refused = replies.recv_timeout(TIMEOUT).unwrap();
        assert_eq!(
            refused.status,
            KvError::InvalidArgument(String::new()).code()
        );
    }
    // One on its own, to learn where the tokens are.
    churner.send(&alloc(0)).unwrap();
    let first = replies.recv_timeout(TIMEOUT).unwrap();
    assert_eq!(first.status, 0);
    churner.send(&release(first.lease)).unwrap();
    // Then the burst, with one doorbell: were each ALLOC served in turn,
    // the k-th would get token first + k, and be released at once.
    let burst: Vec<Vec<u8>> = (1..=PAIRS)
        .flat_map(|id| [alloc(id), release(first.lease + id)])
        .collect();
    let parts: Vec<[&[u8]; 1]> = burst.iter().map(|m| [&m[..]]).collect();
    let msgs: Vec<&[&[u8]]> = parts.iter().map(|p| &p[..]).collect();
    assert_eq!(churner.send_batch(&msgs).unwrap(), msgs.len());
    let granted = (1..=PAIRS)
        .filter(|_| replies.recv_timeout(TIMEOUT).unwrap().status == 0)
        .count() as u64;
    let capped = server.stats().targets_capped;
    assert_eq!(
        (granted, capped),
        (1, PAIRS - 1),
        "the ALLOCs that came while one was being made"
    );
    churner.close();
}

/// A target's room comes back as the PUT that stores it is queued, not
/// when the worker comes to it: an ALLOC sent right behind that PUT, in
/// the same doorbell, is granted under a share that holds one. A PUT
/// naming a target ends it even when refused, and an ALLOC too long for
/// the server says so whatever the client holds.
#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_limit_a_target_being_stored_gives_its_room_to_the_next_alloc() {
    const MIB: u64 = 1 << 20;
    let limits = Limits {
        target_bytes: 4 * MIB,
        ..Limits::default()
    };
    let (server, addr) = server(ConnMode::Cm, limits, 1);
    let (writer, replies) = raw_client(addr);
    let alloc = |id: u64, value_len: u64| {
        let mut req = Request::new(Op::Alloc, id);
        req.value_len = value_len;
        // A target is made for a key of this length.
        req.encode(b"stored-x", &[])
    };
    let put = |id: u64, key: &[u8], token: u64| {
        let mut req = Request::new(Op::Write, id);
        req.value_len = 3 * MIB;
        req.source = Source::Allocated { token };
        req.encode(key, &[])
    };
    let reply = |id: u64| {
        let reply = replies.recv_timeout(TIMEOUT).unwrap();
        assert_eq!(
            reply.req_id, id,
            "an ALLOC refused as it came is answered first"
        );
        reply
    };
    writer.send(&alloc(1, 3 * MIB)).unwrap();
    let mut token = reply(1).lease;
    for round in 0..4u64 {
        let (put_id, alloc_id) = (10 + 2 * round, 11 + 2 * round);
        let key = format!("stored-{round}");
        let (p, a) = (put(put_id, key.as_bytes(), token), alloc(alloc_id, 3 * MIB));
        assert_eq!(writer.send_batch(&[&[&p[..]], &[&a[..]]]).unwrap(), 2);
        assert_eq!(reply(put_id).status, 0, "round {round}: stored");
        let next = reply(alloc_id);
        assert_eq!(next.status, 0, "round {round}: the room came back");
        token = next.lease;
    }
    assert_eq!(server.stats().targets_capped, 0);
    // Refused for its key, the PUT still ends the target it names.
    let (p, a) = (put(20, b"", token), alloc(21, 3 * MIB));
    assert_eq!(writer.send_batch(&[&[&p[..]], &[&a[..]]]).unwrap(), 2);
    let invalid = KvError::InvalidArgument(String::new()).code();
    assert_eq!(reply(20).status, invalid);
    let fresh = reply(21);
    assert_eq!(fresh.status, 0, "the refused PUT's target left");
    writer.send(&put(22, b"stored-9", token)).unwrap();
    assert_eq!(reply(22).status, invalid, "an ended target is unknown");
    // Holding as many targets as a client may (8), one too long for the
    // server is refused as too long.
    server.update_limits(|l| l.target_bytes = 64 * MIB).unwrap();
    for id in 30..37 {
        writer.send(&alloc(id, MIB)).unwrap();
        assert_eq!(reply(id).status, 0);
    }
    writer.send(&alloc(37, 17 * MIB)).unwrap();
    assert_eq!(
        reply(37).status,
        KvError::ValueTooLong { max: 0 }.code(),
        "too long, not out of room"
    );
    writer.send(&alloc(38, MIB)).unwrap();
    assert_eq!(
        reply(38).status,
        KvError::NoMemory.code(),
        "a ninth target is out of room"
    );
    let c = client(addr, ConnMode::Cm).unwrap();
    for round in 0..4 {
        let (value, _) = c.get(format!("stored-{round}").as_bytes()).unwrap();
        assert_eq!(value.len() as u64, 3 * MIB, "round {round}'s value");
    }
    writer.close();
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_limit_a_release_is_taken_when_the_client_queue_is_full() {
    const MIB: usize = 1 << 20;
    // The largest value the test server takes: registering a target this
    // size keeps the worker busy for milliseconds.
    const TARGET: usize = 16 * MIB;
    let limits = Limits {
        // Only a release can end the lease within the test.
        lease_time: Duration::from_secs(3600),
        ..Limits::default()
    };
    let (server, addr) = server(ConnMode::Cm, limits.clone(), 1);
    // Set up under the default limits: with one job per client, the
    // client's own PUT could find its previous job still counted.
    let c = client(addr, ConnMode::Cm).unwrap();
    c.put(b"leased", &vec![3u8; 3 * MIB]).unwrap();
    let (raw, replies) = raw_client(addr);
    raw.send(&Request::new(Op::Get, 1).encode(b"leased", &[]))
        .unwrap();
    let leased = replies.recv_timeout(TIMEOUT).unwrap();
    assert!(leased.status == 0 && leased.lease != 0, "{leased:?}");
    // Gone from the store: only the lease holds the value now.
    c.delete(b"leased").unwrap();
    assert!(
        server.stats().large_bytes >= 3 * MIB as u64,
        "the lease holds the value"
    );
    server
        .set_limits(Limits {
            client_jobs: 1,
            ..limits
        })
        .unwrap();

    // One doorbell: a request for the worker (it fills the client's queue
    // of one), the release, and a GET that must wait behind the first.
    let mut alloc = Request::new(Op::Alloc, 2);
    alloc.value_len = TARGET as u64;
    let alloc = alloc.encode(b"target", &[]);
    let (release, more) = Request::release(&[leased.lease], &mut []);
    let release = release.encode(more, &[]);
    let probe = Request::new(Op::Get, 3).encode(b"leased", &[]);
    let posted = raw
        .send_batch(&[&[&alloc[..]], &[&release[..]], &[&probe[..]]])
        .unwrap();
    assert_eq!(posted, 3, "all three go together");
    // The stats as the GET's answer comes: the release, before it in the
    // connection's order, has been dealt with by then.
    let mut at_probe = None;
    let mut got = Vec::new();
    for _ in 0..2 {
        let reply = replies.recv_timeout(TIMEOUT).unwrap();
        if reply.req_id == 3 {
            at_probe = Some(server.stats());
        }
        got.push(reply);
    }
    got.sort_by_key(|r| r.req_id);
    let ids: Vec<u64> = got.iter().map(|r| r.req_id).collect();
    assert_eq!(ids, [2, 3], "the release takes no reply: {got:?}");
    let (alloc, probe) = (&got[0], &got[1]);
    assert_eq!(alloc.status, 0, "the target is granted: {alloc:?}");
    // The GET found the queue full. Only the release came between it and
    // the request that filled the queue, and with one job per client a
    // release never joins the queue, so the release found it full too. No
    // worker can be held deterministically: a registration of 16 MiB
    // outlasts the arrival of three messages sent together by far.
    assert_eq!(
        probe.status,
        KvError::NoMemory.code(),
        "the GET behind the queued request is refused busy: {probe:?}"
    );
    let stats = at_probe.unwrap();
    assert_eq!(
        stats.busy_refusals, 1,
        "only the GET, not the release: {stats}"
    );
    // The lease ended at once, an hour before its time, not behind the
    // queued request: only the target may be held, and the worker may not
    // have counted it yet.
    let target = block_len(b"target".len(), TARGET) as u64;
    assert!(
        [0, target].contains(&stats.large_bytes),
        "the leased value is freed: {stats}"
    );
    assert_eq!(
        (stats.leases_expired, stats.leases_capped),
        (0, 0),
        "{stats}"
    );
    raw.close();
}

/// Blocks the connection's callbacks (so it returns no credit) until opened.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    cond: Condvar,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cond.notify_all();
    }
}

struct Withholds(Arc<Gate>);

impl ConnHandler for Withholds {
    fn recv(&self, _conn: &Connection, _data: &[u8], _imm: Option<u32>) {
        let open = self.0.open.lock().unwrap();
        // Bounded: the test opens it; this thread is the process's
        // completion thread.
        let _ = self
            .0
            .cond
            .wait_timeout_while(open, Duration::from_secs(60), |o| !*o)
            .unwrap();
    }
}

/// Opens the gate even when the test fails, freeing the completion thread.
struct OpenOnDrop(Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_server_disconnects_a_client_that_withholds_credit() {
    // A server process, so that blocking this process's completion thread
    // stalls only the withholding client.
    let port = 7711;
    let server = crate::kv_programs::kv_server(port, &["--reply-queue-bytes", "16384"]);
    let addr = SocketAddr::new(IpAddr::V4(device_ip()), port);
    client(addr, ConnMode::Cm)
        .unwrap()
        .put(b"small", &[5u8; 200])
        .unwrap();
    let gate = Arc::new(Gate::default());
    let _open = OpenOnDrop(gate.clone());
    // Its ring holds about 250 replies; the server may queue 16 KiB more.
    let opts = Options {
        recv_buf_len: 64 << 10,
        ..Options::default()
    };
    let rogue = Connection::connect(addr, &opts, Arc::new(Withholds(gate.clone()))).unwrap();
    for id in 1..=800 {
        rogue
            .send(&Request::new(Op::Get, id).encode(b"small", &[]))
            .unwrap();
    }
    server.expect_line("reply overflows 1", Duration::from_secs(20));
    // Everyone else is served.
    let out = Command::new("timeout")
        .args(["60", env!("CARGO_BIN_EXE_kv_client")])
        .args(["-a", &device_ip().to_string(), "-p", &port.to_string()])
        .args(["put other fine", "get other"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("fine"), "{text}");
    gate.open();
    let deadline = Instant::now() + TIMEOUT;
    while !matches!(rogue.state(), ConnState::Closed | ConnState::Error) {
        assert!(Instant::now() < deadline, "the rogue was not disconnected");
        thread::sleep(Duration::from_millis(50));
    }
}
