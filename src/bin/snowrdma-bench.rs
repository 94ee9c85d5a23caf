//! The benchmark side of `make bench`: each case measured the way the
//! perftest program it is compared with measures (same size, iterations and
//! signaling; the median of per-iteration latencies), through our verbs layer
//! or through the public C API; and the report that puts both side by side.
//!
//!   snowrdma-bench addr                 the device and its IPv4 address
//!   snowrdma-bench run <case> [-n N]    one repetition; prints the figure
//!   snowrdma-bench report <results> [--json PATH]

use std::collections::BTreeMap;
use std::ffi::{c_void, CString};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand, ValueEnum};
use snowrdma::ffi::rdma::*;
use snowrdma::kv;
use snowrdma::runtime::legacy_peer::LegacyPeer;
use snowrdma::verbs::selftest::{ConnectMode, Endpoint, LoopbackPair};
use snowrdma::verbs::{Completion, Context, RemoteAddr, SendOp, SendRequest};

#[derive(Parser)]
#[command(about = "snowrdma benchmarks, compared with perftest by `make bench`")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the first device's name and IPv4 address.
    Addr,
    /// Run one repetition of a case and print its figure.
    Run {
        case: Case,
        /// Iterations (latency) or messages (throughput).
        #[arg(short = 'n', long)]
        iters: usize,
        /// Message size in bytes.
        #[arg(short, long)]
        size: usize,
        /// Port for the cases that run a server.
        #[arg(short, long, default_value_t = 7700)]
        port: u16,
    },
    /// Summarise a results file (lines: case, side, value) as a table and JSON.
    Report {
        results: PathBuf,
        #[arg(long, default_value = "target/bench/results.json")]
        json: PathBuf,
    },
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq, Debug)]
enum Case {
    /// Verbs layer: RDMA WRITE ping-pong, half round trip (ib_write_lat).
    VerbsWriteLat,
    /// Verbs layer: WRITE WITH IMM ping-pong, half round trip, each side
    /// spinning on its receive CQ: the runtime's wire operation without the
    /// runtime (ib_send_lat).
    VerbsImmLat,
    /// Verbs layer: RDMA READ, post to completion (ib_read_lat).
    VerbsReadLat,
    /// Verbs layer: atomic compare-and-swap (ib_atomic_lat).
    VerbsCasLat,
    /// Verbs layer: one signaled RDMA WRITE, post to completion.
    VerbsWriteSignaled,
    /// C API: rdmaSyncReadSignaled.
    SyncRead,
    /// C API: rdmaSyncWriteSignaled.
    SyncWrite,
    /// C API: rdmaConnSend echo, half round trip (ib_send_lat).
    EchoLat,
    /// C API: rdmaConnSend echo against a raw-verbs peer that speaks the
    /// legacy protocol (version 0, never returns credit), half round trip
    /// (the same echo against our own server).
    EchoLegacyLat,
    /// C API: rdmaConnSend streaming, MiB/s (ib_write_bw).
    StreamBw,
    /// C API: rdmaConnSend message rate, Mpps (ib_write_bw).
    MsgRate,
    /// Key-value GET, 16 B key, 64 B value, request and reply (ib_send_lat).
    KvGetLat,
    /// Key-value GET as KvGetLat, with 127 more clients connected and idle
    /// (ib_send_lat).
    KvGetLatCrowd,
    /// Key-value PUT, 16 B key, 64 B value (ib_send_lat).
    KvPutLat,
    /// Key-value one-sided GET of a remembered key: one READ of its block
    /// (ib_read_lat).
    KvOneSidedLat,
    /// Key-value GET of large values, MiB/s (ib_read_bw).
    KvGetBw,
    /// Key-value one-sided GET of large values, MiB/s (ib_read_bw).
    KvOneSidedGetBw,
    /// Key-value PUT of large values, MiB/s (ib_write_bw).
    KvPutBw,
    /// Key-value 95/5 GET/PUT mix of 64 B values, 4 clients, Mops/s.
    KvMix,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn spin_one(cq: &snowrdma::verbs::CompletionQueue) -> Completion {
    let mut wc = [Completion::default()];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if cq.poll(&mut wc).expect("poll") == 1 {
            let [wc] = wc;
            return wc.into_result().expect("completion");
        }
        assert!(Instant::now() < deadline, "a completion was lost");
    }
}

/// Post-to-completion latency of one operation, spinning on the CQ, as
/// ib_read_lat / ib_atomic_lat do.
fn verbs_op_lat(case: Case, iters: usize, size: usize) -> f64 {
    let ctx = Context::open(None).expect("device");
    let mut pair = LoopbackPair::connect(
        &ctx,
        ConnectMode::RdmaCm,
        size.max(8),
        Duration::from_secs(10),
    )
    .expect("pair");
    let remote = pair.b.mr.remote().at(0);
    let sge = pair
        .a
        .mr
        .sge(..if case == Case::VerbsCasLat { 8 } else { size });
    let mut lat = Vec::with_capacity(iters);
    for i in 0..iters {
        let op = match case {
            Case::VerbsReadLat => SendOp::Read(remote),
            Case::VerbsCasLat => SendOp::CompareSwap {
                remote,
                compare: i as u64,
                swap: i as u64 + 1,
            },
            _ => SendOp::Write(remote),
        };
        let t = Instant::now();
        // SAFETY: a's buffer is touched by nothing else until the completion.
        unsafe {
            pair.a
                .qp
                .post_send(&[SendRequest::new(i as u64, op, &[sge])])
                .expect("post")
        };
        spin_one(&pair.a.send_cq);
        lat.push(us(t.elapsed()));
    }
    pair.b.mr.as_mut_slice()[0] = 0;
    median(&mut lat)
}

/// RDMA WRITE ping-pong as ib_write_lat does it: each side writes the
/// iteration number into the other's buffer and spins on its own buffer.
fn verbs_write_lat(iters: usize, size: usize) -> f64 {
    let ctx = Context::open(None).expect("device");
    // Each buffer: [0, size) receives the peer's writes, [size, 2 size) is sent.
    let pair = LoopbackPair::connect(&ctx, ConnectMode::RdmaCm, 2 * size, Duration::from_secs(10))
        .expect("pair");
    let LoopbackPair { a, b, .. } = pair;
    let (a_rem, b_rem) = (a.mr.remote().at(0), b.mr.remote().at(0));
    let last = size as u64 - 1;
    let pong = std::thread::spawn(move || {
        let flag = (b.mr.addr() + last) as *const u8;
        let out = (b.mr.addr() + size as u64 + last) as *mut u8;
        let sge = b.mr.sge(size..2 * size);
        for i in 0..iters {
            let want = (i % 255 + 1) as u8;
            // SAFETY: the peer writes this byte; we only read it.
            while unsafe { std::ptr::read_volatile(flag) } != want {}
            // SAFETY: our send area; the previous write from it completed.
            unsafe {
                std::ptr::write_volatile(out, want);
                b.qp.post_send(&[SendRequest::new(i as u64, SendOp::Write(a_rem), &[sge])])
                    .expect("post");
            }
            spin_one(&b.send_cq);
        }
    });
    let flag = (a.mr.addr() + last) as *const u8;
    let out = (a.mr.addr() + size as u64 + last) as *mut u8;
    let sge = a.mr.sge(size..2 * size);
    let mut lat = Vec::with_capacity(iters);
    for i in 0..iters {
        let want = (i % 255 + 1) as u8;
        let t = Instant::now();
        // SAFETY: as above.
        unsafe {
            std::ptr::write_volatile(out, want);
            a.qp.post_send(&[SendRequest::new(i as u64, SendOp::Write(b_rem), &[sge])])
                .expect("post");
        }
        spin_one(&a.send_cq);
        let deadline = Instant::now() + Duration::from_secs(10);
        while unsafe { std::ptr::read_volatile(flag) } != want {
            assert!(Instant::now() < deadline, "the pong was lost");
        }
        lat.push(us(t.elapsed()) / 2.0);
    }
    pong.join().expect("pong thread");
    median(&mut lat)
}

/// Receives each side of the WRITE WITH IMM ping-pong keeps posted.
const IMM_RECVS: usize = 16;
/// Every this many writes of the ping-pong, one asks for a completion.
const IMM_SIGNAL_EVERY: usize = 32;

/// WRITE WITH IMM ping-pong: each side writes `size` bytes and an
/// immediate into the other's buffer and spins on its receive CQ, with a
/// receive reposted for each one taken and every 32nd write signaled, as
/// the runtime does it.
fn verbs_imm_lat(iters: usize, size: usize) -> f64 {
    let ctx = Context::open(None).expect("device");
    let pair = LoopbackPair::connect(&ctx, ConnectMode::RdmaCm, 2 * size, Duration::from_secs(10))
        .expect("pair");
    let LoopbackPair { a, b, .. } = pair;
    for side in [&a, &b] {
        for i in 0..IMM_RECVS {
            // SAFETY: no scatter list: the data lands by the write.
            unsafe { side.qp.post_recv(i as u64, &[]).expect("post recv") };
        }
    }
    // One write to `peer`; the signaled ones are waited for here.
    fn turn(side: &Endpoint, peer: RemoteAddr, size: usize, i: usize) {
        let sges = [side.mr.sge(size..2 * size)];
        let mut req = SendRequest::new(i as u64, SendOp::WriteWithImm(peer, i as u32), &sges);
        let signaled = i % IMM_SIGNAL_EVERY == IMM_SIGNAL_EVERY - 1;
        if !signaled {
            req = req.unsignaled();
        }
        // SAFETY: our send area; nothing rewrites it.
        unsafe { side.qp.post_send(&[req]).expect("post") };
        if signaled {
            spin_one(&side.send_cq);
        }
    }
    let (a_rem, b_rem) = (a.mr.remote().at(0), b.mr.remote().at(0));
    let pong = std::thread::spawn(move || {
        for i in 0..iters {
            spin_one(&b.recv_cq);
            // SAFETY: as above.
            unsafe { b.qp.post_recv(i as u64, &[]).expect("post recv") };
            turn(&b, a_rem, size, i);
        }
    });
    let mut lat = Vec::with_capacity(iters);
    for i in 0..iters {
        let t = Instant::now();
        turn(&a, b_rem, size, i);
        spin_one(&a.recv_cq);
        lat.push(us(t.elapsed()) / 2.0);
        // SAFETY: as above.
        unsafe { a.qp.post_recv(i as u64, &[]).expect("post recv") };
    }
    pong.join().expect("pong thread");
    median(&mut lat)
}

static RECEIVED: AtomicU64 = AtomicU64::new(0);
static RECEIVED_BYTES: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" fn echo_back(conn: *mut RdmaConnFwd, data: *mut c_void, len: usize) {
    rdmaConnSend(conn.cast(), data, len);
}

unsafe extern "C" fn count(_conn: *mut RdmaConnFwd, _data: *mut c_void, len: usize) {
    RECEIVED.fetch_add(1, Ordering::Release);
    RECEIVED_BYTES.fetch_add(len as u64, Ordering::Release);
}

/// An in-process server and a connected client through the public C API.
struct CPair {
    listener: *mut RdmaListener,
    conn: *mut RdmaConn,
    server: Option<std::thread::JoinHandle<()>>,
}

impl CPair {
    fn new(port: u16, server_recv: RdmaRecvCallbackFunc) -> CPair {
        let ip = Context::open(None)
            .unwrap()
            .ipv4_address(1)
            .unwrap()
            .expect("an IPv4 address");
        let ip = CString::new(ip.to_string()).unwrap();
        // SAFETY: zeroed options are the C programs' `{0}`.
        unsafe {
            rdmaCommMode = RdmaCommMode::RDMA_BLOCKING;
            let mut opt: RdmaServerOptions = std::mem::zeroed();
            opt.recv_callback = server_recv;
            let mut listener = std::ptr::null_mut();
            assert_eq!(
                rdmaServer(&mut listener, ip.as_ptr(), port as i32, &opt),
                RDMA_OK
            );
            let l = listener as usize;
            let server = std::thread::spawn(move || {
                rdmaServerStart(l as *mut RdmaListener);
            });
            let mut copt: RdmaConnOptions = std::mem::zeroed();
            copt.recv_callback = Some(count);
            let conn = rdmaConn(&copt);
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(
                rdmaConnect(conn, ip.as_ptr() as *mut _, port as i32),
                RDMA_OK
            );
            CPair {
                listener,
                conn,
                server: Some(server),
            }
        }
    }
}

impl Drop for CPair {
    fn drop(&mut self) {
        // SAFETY: handles from CPair::new.
        unsafe {
            rdmaConnClose(self.conn);
            rdmaServerStop(self.listener);
            if let Some(t) = self.server.take() {
                let _ = t.join();
            }
            rdmaServerRelease(self.listener);
        }
    }
}

fn sync_lat(read: bool, iters: usize, size: usize, port: u16) -> f64 {
    let p = CPair::new(port, None);
    // SAFETY: the connection is live; the MR is ours.
    unsafe {
        let mr = rdmaConnRegMem(p.conn, size.max(64));
        let (local, lkey) = ((*mr).addr as u64, (*mr).lkey);
        let (remote, rkey) = ((*p.conn).tx_addr as u64, (*p.conn).tx_key);
        let mut lat = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            let r = if read {
                rdmaSyncReadSignaled(p.conn, local, lkey, remote, rkey, size as u32)
            } else {
                rdmaSyncWriteSignaled(p.conn, local, lkey, remote, rkey, size as u32)
            };
            assert_eq!(r, size as i32);
            lat.push(us(t.elapsed()));
        }
        rdmaConnDeregMem(p.conn, mr);
        median(&mut lat)
    }
}

fn echo_lat(iters: usize, size: usize, port: u16) -> f64 {
    let p = CPair::new(port, Some(echo_back));
    // SAFETY: the pair keeps the connection live.
    unsafe { ping_pong(p.conn, iters, size) }
}

/// Median half round trip of `iters` messages of `size` bytes that a
/// server echoes back to `conn` (whose receive callback is `count`).
///
/// # Safety
/// `conn` must be a live connection.
unsafe fn ping_pong(conn: *mut RdmaConn, iters: usize, size: usize) -> f64 {
    let msg = vec![7u8; size];
    let mut lat = Vec::with_capacity(iters);
    for _ in 0..iters {
        let before = RECEIVED.load(Ordering::Acquire);
        let t = Instant::now();
        assert_eq!(rdmaConnSend(conn, msg.as_ptr() as *mut _, size), size);
        let deadline = t + Duration::from_secs(10);
        while RECEIVED.load(Ordering::Acquire) == before {
            assert!(Instant::now() < deadline, "the echo was lost");
            std::hint::spin_loop();
        }
        lat.push(us(t.elapsed()) / 2.0);
    }
    median(&mut lat)
}

/// As [`echo_lat`], against a version-0 echo server on raw verbs (the
/// wire as a legacy SnowRDMA server speaks it) in a thread of its own.
fn echo_legacy_lat(iters: usize, size: usize, port: u16) -> f64 {
    let ip = Context::open(None)
        .unwrap()
        .ipv4_address(1)
        .unwrap()
        .expect("an IPv4 address");
    let (tx, rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        let mut peer = LegacyPeer::accept(
            SocketAddr::new(IpAddr::V4(ip), port),
            Duration::from_secs(10),
            |a| tx.send(a).expect("bench thread"),
        )
        .expect("legacy peer");
        peer.echo(Instant::now() + Duration::from_secs(120))
            .expect("legacy echo")
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the legacy peer listens");
    let ip = CString::new(ip.to_string()).unwrap();
    // SAFETY: zeroed options are the C programs' `{0}`; the connection is
    // live until closed below.
    let half_rtt = unsafe {
        let mut copt: RdmaConnOptions = std::mem::zeroed();
        copt.recv_callback = Some(count);
        let conn = rdmaConn(&copt);
        assert_eq!(
            rdmaConnect(conn, ip.as_ptr() as *mut _, port as i32),
            RDMA_OK
        );
        let half_rtt = ping_pong(conn, iters, size);
        rdmaConnClose(conn);
        half_rtt
    };
    server.join().expect("legacy peer thread");
    half_rtt
}

/// Streams `iters` messages of `size` bytes to a server that only counts;
/// returns (MiB/s, Mpps) from the first send until the last byte arrived.
fn stream(iters: usize, size: usize, port: u16) -> (f64, f64) {
    unsafe extern "C" fn sink(_c: *mut RdmaConnFwd, _d: *mut c_void, len: usize) {
        RECEIVED.fetch_add(1, Ordering::Release);
        RECEIVED_BYTES.fetch_add(len as u64, Ordering::Release);
    }
    let p = CPair::new(port, Some(sink));
    let msg = vec![1u8; size];
    RECEIVED.store(0, Ordering::Release);
    let t = Instant::now();
    let mut sent = 0;
    while sent < iters {
        // SAFETY: live connection, readable message.
        match unsafe { rdmaConnSend(p.conn, msg.as_ptr() as *mut _, size) } {
            0 => std::hint::spin_loop(),
            n if n == size => sent += 1,
            n => panic!("rdmaConnSend returned {n}"),
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while RECEIVED.load(Ordering::Acquire) < iters as u64 {
        assert!(Instant::now() < deadline, "messages were lost");
        std::hint::spin_loop();
    }
    let secs = t.elapsed().as_secs_f64();
    (
        (iters * size) as f64 / secs / (1 << 20) as f64,
        iters as f64 / secs / 1e6,
    )
}

fn run(case: Case, iters: usize, size: usize, port: u16) -> f64 {
    match case {
        Case::VerbsWriteLat => verbs_write_lat(iters, size),
        Case::VerbsImmLat => verbs_imm_lat(iters, size),
        Case::VerbsReadLat | Case::VerbsCasLat | Case::VerbsWriteSignaled => {
            verbs_op_lat(case, iters, size)
        }
        Case::SyncRead => sync_lat(true, iters, size, port),
        Case::SyncWrite => sync_lat(false, iters, size, port),
        Case::EchoLat => echo_lat(iters, size, port),
        Case::EchoLegacyLat => echo_legacy_lat(iters, size, port),
        Case::StreamBw => stream(iters, size, port).0,
        Case::MsgRate => stream(iters, size, port).1,
        Case::KvGetLat | Case::KvGetLatCrowd | Case::KvPutLat | Case::KvOneSidedLat => {
            kv_lat(case, iters, size, port)
        }
        Case::KvGetBw | Case::KvOneSidedGetBw | Case::KvPutBw => kv_bw(case, iters, size, port),
        Case::KvMix => kv_mix(iters, size, port),
    }
}

/// A key-value server on the device, for the kv cases.
fn kv_server(port: u16) -> kv::Server {
    let ip = Context::open(None)
        .and_then(|c| c.ipv4_address(1))
        .expect("an RDMA device")
        .expect("an IPv4 address on the device");
    let server = kv::Server::new(kv::ServerConfig {
        addr: SocketAddr::new(IpAddr::V4(ip), port),
        memory_size: 256 << 20,
        table_size: 65536,
        ..kv::ServerConfig::default()
    })
    .expect("kv server");
    server.start().expect("kv server start");
    server
}

/// Median microseconds of one GET, PUT or one-sided GET (16 B key).
fn kv_lat(case: Case, iters: usize, size: usize, port: u16) -> f64 {
    let server = kv_server(port);
    let addr = server.local_addr().expect("bound");
    let client = kv::Client::connect(addr).expect("kv connect");
    let idle = if case == Case::KvGetLatCrowd {
        IDLE_CLIENTS
    } else {
        0
    };
    let _idle: Vec<kv::Client> = (0..idle)
        .map(|_| kv::Client::connect(addr).expect("kv connect"))
        .collect();
    let key = b"bench-key-16byte";
    let value = vec![7u8; size];
    client.put(key, &value).expect("put");
    let op = |c: &kv::Client| match case {
        Case::KvGetLat | Case::KvGetLatCrowd => c.get(key).map(drop),
        Case::KvPutLat => c.put(key, &value).map(drop),
        _ => c.get_one_sided(key).map(drop),
    };
    for _ in 0..iters / 10 {
        op(&client).expect("warm-up");
    }
    let mut lat: Vec<f64> = (0..iters)
        .map(|_| {
            let t = Instant::now();
            op(&client).expect("kv op");
            us(t.elapsed())
        })
        .collect();
    median(&mut lat)
}

/// MiB/s of GETs (through the server or one-sided) or PUTs of `size`-byte
/// values, in batches of [`BW_BATCH`] keys (several in flight, as perftest
/// keeps its queue full).
fn kv_bw(case: Case, iters: usize, size: usize, port: u16) -> f64 {
    let server = kv_server(port);
    let client = kv::Client::connect(server.local_addr().expect("bound")).expect("kv connect");
    let value = vec![7u8; size];
    let keys: Vec<String> = (0..BW_BATCH).map(|i| format!("bw-{i}")).collect();
    let pairs: Vec<(&[u8], &[u8])> = keys.iter().map(|k| (k.as_bytes(), &value[..])).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    let batch = || {
        let ok = match case {
            Case::KvGetBw => client.batch_get(&key_refs).iter().all(Result::is_ok),
            Case::KvOneSidedGetBw => client
                .batch_get_one_sided(&key_refs)
                .iter()
                .all(Result::is_ok),
            _ => client.batch_put(&pairs).iter().all(Result::is_ok),
        };
        assert!(ok, "a batched kv operation failed");
    };
    // Untimed, as perftest registers its buffers before its clock starts:
    // the first batch registers the client's bounce buffer (4 MiB, about a
    // batch's time under emulation) and first touches the values' memory.
    // For the GETs, it is a PUT first, to have something to get.
    let stored = client.batch_put(&pairs);
    assert!(
        stored.iter().all(Result::is_ok),
        "the values were not stored"
    );
    batch();
    let batches = iters.div_ceil(BW_BATCH);
    let start = Instant::now();
    for _ in 0..batches {
        batch();
    }
    (batches * BW_BATCH * size) as f64 / start.elapsed().as_secs_f64() / 1048576.0
}

/// Clients connected besides the measuring one in KvGetLatCrowd.
const IDLE_CLIENTS: usize = 127;

/// Keys per batch in the kv throughput cases.
const BW_BATCH: usize = 32;

/// Clients in the kv mix case, each on its own thread.
const MIX_CLIENTS: usize = 4;

/// Million operations per second of 4 clients doing 95% GETs, 5% PUTs.
fn kv_mix(iters: usize, size: usize, port: u16) -> f64 {
    let server = kv_server(port);
    let addr = server.local_addr().expect("bound");
    let value = vec![7u8; size];
    let seed = kv::Client::connect(addr).expect("kv connect");
    for i in 0..1000 {
        seed.put(format!("mix-{i}").as_bytes(), &value)
            .expect("put");
    }
    // Connected before the clock starts, as perftest sets up before its own
    // (a connection takes tens of ms under emulation).
    let clients: Vec<kv::Client> = (0..MIX_CLIENTS)
        .map(|_| kv::Client::connect(addr).expect("kv connect"))
        .collect();
    let start = Instant::now();
    std::thread::scope(|s| {
        for (t, c) in clients.iter().enumerate() {
            let value = &value;
            s.spawn(move || {
                for i in 0..iters / MIX_CLIENTS {
                    let key = format!("mix-{}", (i * 7 + t * 251) % 1000);
                    if i % 20 == 0 {
                        c.put(key.as_bytes(), value).expect("put");
                    } else {
                        c.get(key.as_bytes()).expect("get");
                    }
                }
            });
        }
    });
    (iters / MIX_CLIENTS * MIX_CLIENTS) as f64 / start.elapsed().as_secs_f64() / 1e6
}

/// One row of the report: what is compared with what, and which way is better.
struct Row {
    case: &'static str,
    what: &'static str,
    reference: &'static str,
    unit: &'static str,
    higher_is_better: bool,
    target: &'static str,
}

const ROWS: &[Row] = &[
    Row {
        case: "write_lat",
        what: "verbs RDMA WRITE 64 B, half RTT",
        reference: "ib_write_lat",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.05",
    },
    Row {
        case: "read_lat",
        what: "verbs RDMA READ 64 B",
        reference: "ib_read_lat",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.05",
    },
    Row {
        case: "cas_lat",
        what: "verbs atomic CAS",
        reference: "ib_atomic_lat",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.05",
    },
    Row {
        case: "sync_read",
        what: "rdmaSyncReadSignaled 64 B",
        reference: "ib_read_lat",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.10",
    },
    Row {
        case: "sync_write",
        what: "rdmaSyncWriteSignaled 64 B",
        reference: "verbs signaled WRITE",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.10",
    },
    Row {
        case: "imm_lat",
        what: "verbs WRITE WITH IMM 64 B, half RTT",
        reference: "ib_send_lat",
        unit: "us",
        higher_is_better: false,
        target: "reported",
    },
    Row {
        case: "echo_lat",
        what: "rdmaConnSend echo 64 B, half RTT",
        reference: "ib_send_lat",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.30",
    },
    Row {
        case: "echo_legacy_lat",
        what: "rdmaConnSend echo 64 B vs a legacy-protocol peer, half RTT",
        reference: "echo_lat (ours)",
        unit: "us",
        higher_is_better: false,
        target: "<= 1.0",
    },
    Row {
        case: "stream_bw",
        what: "rdmaConnSend stream 64 KiB",
        reference: "ib_write_bw",
        unit: "MiB/s",
        higher_is_better: true,
        target: ">= 0.90",
    },
    Row {
        case: "msg_rate",
        what: "rdmaConnSend 64 B message rate",
        reference: "ib_write_bw -s 64",
        unit: "Mpps",
        higher_is_better: true,
        target: ">= 0.80",
    },
    Row {
        case: "kv_get_lat",
        what: "kv GET 16 B key, 64 B value (full RTT)",
        reference: "ib_send_lat (half RTT)",
        unit: "us",
        higher_is_better: false,
        target: "<= 2.30",
    },
    Row {
        case: "kv_get_lat_crowd",
        what: "kv GET as above, 127 more clients connected",
        reference: "ib_send_lat (half RTT)",
        unit: "us",
        higher_is_better: false,
        target: "reported",
    },
    Row {
        case: "kv_put_lat",
        what: "kv PUT 16 B key, 64 B value (full RTT)",
        reference: "ib_send_lat (half RTT)",
        unit: "us",
        higher_is_better: false,
        target: "<= 2.30",
    },
    Row {
        case: "kv_onesided_lat",
        what: "kv one-sided GET 64 B (1 READ)",
        reference: "ib_read_lat",
        unit: "us",
        higher_is_better: false,
        target: "<= 2.20",
    },
    Row {
        case: "kv_get_bw",
        what: "kv batch_get 64 KiB, 32 per batch",
        reference: "ib_read_bw",
        unit: "MiB/s",
        higher_is_better: true,
        target: ">= 0.80",
    },
    Row {
        case: "kv_onesided_get_bw",
        what: "kv one-sided batch GET 64 KiB, 32 per batch",
        reference: "ib_read_bw",
        unit: "MiB/s",
        higher_is_better: true,
        target: ">= 0.80",
    },
    Row {
        case: "kv_put_bw",
        what: "kv batch_put 64 KiB, 32 per batch",
        reference: "ib_write_bw",
        unit: "MiB/s",
        higher_is_better: true,
        target: ">= 0.80",
    },
    Row {
        case: "kv_mix",
        what: "kv 95/5 GET/PUT 64 B, 4 clients",
        reference: "ib_send_bw -s 64 (Mpps)",
        unit: "Mops",
        higher_is_better: true,
        target: "reported",
    },
    Row {
        case: "kv_app_write_1024",
        what: "kv_set+kv_get 1 KiB (menu 3)",
        reference: "ib_write_bw 1 KiB",
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
    },
    Row {
        case: "kv_app_read_1024",
        what: "kv_set+kv_get 1 KiB (menu 3)",
        reference: "ib_read_bw 1 KiB",
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
    },
    Row {
        case: "kv_app_write_65536",
        what: "kv_set+kv_get 64 KiB (menu 3)",
        reference: "ib_write_bw 64 KiB",
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
    },
    Row {
        case: "kv_app_read_65536",
        what: "kv_set+kv_get 64 KiB (menu 3)",
        reference: "ib_read_bw 64 KiB",
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
    },
    Row {
        case: "kv_app_write_16777216",
        what: "kv_set+kv_get 16 MiB (menu 3)",
        reference: "ib_write_bw 16 MiB",
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
    },
    Row {
        case: "kv_app_read_16777216",
        what: "kv_set+kv_get 16 MiB (menu 3)",
        reference: "ib_read_bw 16 MiB",
        unit: "MB/s",
        higher_is_better: true,
        target: "reported",
    },
];

/// "median [min-max]" with enough digits for small figures (Mpps).
fn spread(med: f64, min: f64, max: f64) -> String {
    let digits = if med < 1.0 { 4 } else { 2 };
    format!("{med:.digits$} [{min:.digits$}-{max:.digits$}]")
}

fn stats(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn report(results: &PathBuf, json: &PathBuf) -> std::io::Result<()> {
    let text = std::fs::read_to_string(results)?;
    let mut data: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let [case, side, value] = f[..] {
            if let Ok(v) = value.parse::<f64>() {
                data.entry((case.to_string(), side.to_string()))
                    .or_default()
                    .push(v);
            }
        }
    }
    // Columns as wide as their longest entry, so every row lines up.
    let w = ROWS.iter().map(|r| r.what.len()).max().unwrap_or(0);
    let rw = ROWS.iter().map(|r| r.reference.len()).max().unwrap_or(0);
    println!(
        "{:<w$} {:<rw$} {:>23} {:>23} {:>7}  {:>7}",
        "case", "reference", "reference med [min-max]", "snowrdma med [min-max]", "ratio", "target"
    );
    let mut out = Vec::new();
    for row in ROWS {
        let mut r = data
            .get(&(row.case.into(), "reference".into()))
            .cloned()
            .unwrap_or_default();
        let mut o = data
            .get(&(row.case.into(), "snowrdma".into()))
            .cloned()
            .unwrap_or_default();
        if r.is_empty() || o.is_empty() {
            println!(
                "{:<w$} {:<rw$} (missing: a run failed, see the log)",
                row.what, row.reference
            );
            continue;
        }
        let (rm, rmin, rmax) = stats(&mut r);
        let (om, omin, omax) = stats(&mut o);
        let ratio = om / rm;
        println!(
            "{:<w$} {:<rw$} {:>23} {:>23} {:>7.2}  {:>7} {}",
            row.what,
            row.reference,
            spread(rm, rmin, rmax),
            spread(om, omin, omax),
            ratio,
            row.target,
            row.unit
        );
        out.push(format!(
            "{{\"case\":\"{}\",\"what\":\"{}\",\"reference\":\"{}\",\"unit\":\"{}\",\"higher_is_better\":{},\"target\":\"{}\",\
             \"reference_median\":{rm},\"reference_min\":{rmin},\"reference_max\":{rmax},\"reference_runs\":{},\
             \"snowrdma_median\":{om},\"snowrdma_min\":{omin},\"snowrdma_max\":{omax},\"snowrdma_runs\":{},\"ratio\":{ratio}}}",
            row.case, row.what, row.reference, row.unit, row.higher_is_better, row.target, r.len(), o.len()
        ));
    }
    if let Some(dir) = json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(json, format!("[\n  {}\n]\n", out.join(",\n  ")))?;
    println!(
        "ratio = snowrdma / reference (medians of interleaved runs); JSON: {}",
        json.display()
    );
    Ok(())
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::new().filter("SNOWRDMA_LOG")).init();
    match Args::parse().cmd {
        Cmd::Addr => {
            let ctx = match Context::open(None) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            };
            let ip = ctx.ipv4_address(1).ok().flatten().map(IpAddr::V4);
            println!(
                "{} {}",
                ctx.name(),
                ip.map_or("-".into(), |i| SocketAddr::new(i, 0).ip().to_string())
            );
        }
        Cmd::Run {
            case,
            iters,
            size,
            port,
        } => println!("{:.4}", run(case, iters, size, port)),
        Cmd::Report { results, json } => {
            if let Err(e) = report(&results, &json) {
                eprintln!("report: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
