//! The key-value cases: latency, throughput in batches, and the GET/PUT mix.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use snowrdma::kv;
use snowrdma::runtime::Options;

use super::cost::Window;
use super::{device_addr, median, us};

/// A key-value server on the device, for the kv cases.
fn kv_server(port: u16) -> kv::Server {
    let server = kv::Server::new(kv::ServerConfig {
        addr: device_addr(port),
        memory_size: 256 << 20,
        table_size: 65536,
        ..kv::ServerConfig::default()
    })
    .expect("kv server");
    server.start().expect("kv server start");
    server
}

/// The operations the kv latency and throughput cases measure.
pub(crate) enum KvOp {
    /// GET through the server.
    Get,
    Put,
    /// GET by READing the key's block (its place remembered).
    GetOneSided,
}

/// Median microseconds of one GET, PUT or one-sided GET (16 B key), with
/// `idle` more clients connected.
pub(crate) fn kv_lat(op: KvOp, idle: usize, iters: usize, size: usize, port: u16) -> f64 {
    let server = kv_server(port);
    let addr = server.local_addr().expect("bound");
    let _idle: Vec<kv::Client> = (0..idle)
        .map(|_| kv::Client::connect(addr).expect("kv connect"))
        .collect();
    kv_lat_at(addr, op, iters, size)
}

/// As [`kv_lat`], against a `kv_server` another process runs on the device
/// at `port`.
pub(crate) fn kv_lat_remote(op: KvOp, iters: usize, size: usize, port: u16) -> f64 {
    kv_lat_at(device_addr(port), op, iters, size)
}

fn kv_lat_at(addr: SocketAddr, op: KvOp, iters: usize, size: usize) -> f64 {
    let client = kv::Client::connect(addr).expect("kv connect");
    let key = b"bench-key-16byte";
    let value = vec![7u8; size];
    client.put(key, &value).expect("put");
    // Into the caller's buffer, as a program that cares for its allocations
    // would (`get` returns a new Vec each time).
    let mut out = vec![0u8; size];
    let puts = matches!(op, KvOp::Put);
    let mut op = |c: &kv::Client| match op {
        KvOp::Get => c.get_into(key, &mut out).map(drop),
        KvOp::Put => c.put(key, &value).map(drop),
        KvOp::GetOneSided => c.get_one_sided_into(key, &mut out).map(drop),
    };
    for _ in 0..iters / 10 {
        op(&client).expect("warm-up");
    }
    let warm = Instant::now();
    while warm.elapsed() < steady_after(puts) {
        op(&client).expect("warm-up");
    }
    let mut lat = Vec::with_capacity(iters);
    let window = Window::open();
    for _ in 0..iters {
        let t = Instant::now();
        op(&client).expect("kv op");
        lat.push(us(t.elapsed()));
    }
    window.close(iters);
    median(&mut lat)
}

/// MiB/s of GETs (through the server or one-sided) or PUTs of `size`-byte
/// values, in batches of [`BW_BATCH`] keys (several in flight, as perftest
/// keeps its queue full).
pub(crate) fn kv_bw(op: KvOp, iters: usize, size: usize, port: u16) -> f64 {
    let server = kv_server(port);
    kv_bw_at(server.local_addr().expect("bound"), op, iters, size)
}

/// As [`kv_bw`], against a `kv_server` another process runs on the device
/// at `port`.
pub(crate) fn kv_bw_remote(op: KvOp, iters: usize, size: usize, port: u16) -> f64 {
    kv_bw_at(device_addr(port), op, iters, size)
}

fn kv_bw_at(addr: SocketAddr, op: KvOp, iters: usize, size: usize) -> f64 {
    let client = kv::Client::connect(addr).expect("kv connect");
    // The values in memory registered on the client, as perftest's are:
    // the NIC moves them from there, with no copy.
    let mut mem = client.register(size).expect("registering the values");
    mem.as_mut_slice().fill(7);
    let value = mem.as_slice();
    let keys: Vec<String> = (0..BW_BATCH).map(|i| format!("bw-{i}")).collect();
    let pairs: Vec<(&[u8], &[u8])> = keys.iter().map(|k| (k.as_bytes(), value)).collect();
    let key_refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    let batch = || {
        let ok = match op {
            // Each value lent where it landed (here and one-sided): nothing
            // allocated or copied.
            KvOp::Get => {
                let mut ok = true;
                client.batch_get_with(&key_refs, |_, r| {
                    ok &= r.is_ok_and(|(v, _)| v.len() == size)
                });
                ok
            }
            KvOp::GetOneSided => {
                let mut ok = true;
                client.batch_get_one_sided_with(&key_refs, |_, r| {
                    ok &= r.is_ok_and(|(v, _)| v.len() == size)
                });
                ok
            }
            KvOp::Put => {
                let mut ok = true;
                client.batch_put_with(&pairs, |_, r| ok &= r.is_ok());
                ok
            }
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
    // A thread that served only the PUTs above (a kv worker, for GETs)
    // polls for more work for up to the spin budget before it sleeps on
    // its queue: it settles before the window.
    let settle = steady_after(matches!(op, KvOp::Put)).max(Options::default().spin * 2);
    let warm = Instant::now();
    while warm.elapsed() < settle {
        batch();
    }
    let batches = iters.div_ceil(BW_BATCH);
    let window = Window::open();
    let start = Instant::now();
    for _ in 0..batches {
        batch();
    }
    let secs = start.elapsed().as_secs_f64();
    window.close(batches);
    (batches * BW_BATCH * size) as f64 / secs / 1048576.0
}

/// How long a case warms up before its steady state: a stream of PUTs
/// once the first replaced values' blocks come back from the store's
/// quarantine (until then its queue and the pool's free lists grow, seen
/// as allocations and `mprotect`s in the window).
fn steady_after(puts: bool) -> Duration {
    match puts {
        true => kv::QUARANTINE + kv::QUARANTINE / 2,
        false => Duration::ZERO,
    }
}

/// Clients connected besides the measuring one in kv_get_lat_crowd.
pub(crate) const IDLE_CLIENTS: usize = 127;

/// Keys per batch in the kv throughput cases.
const BW_BATCH: usize = 32;

/// Clients in the kv mix case, each on its own thread.
const MIX_CLIENTS: usize = 4;

/// Million operations per second of 4 clients doing 95% GETs, 5% PUTs.
pub(crate) fn kv_mix(iters: usize, size: usize, port: u16) -> f64 {
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
