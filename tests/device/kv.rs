//! The key-value store (Rust API) on a real device.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use snowrdma::kv::{
    BatchOp, Client, ClientOptions, ConnMode, KvError, Server, ServerConfig, Stats,
};
use snowrdma::runtime::{ConnHandler, Connection, Options};
use snowrdma::verbs::selftest::fill_pattern;

use crate::device_ip;

pub fn kv_server(huge: bool) -> (Server, SocketAddr) {
    kv_server_in(huge, ConnMode::Cm)
}

fn kv_server_in(huge: bool, conn_mode: ConnMode) -> (Server, SocketAddr) {
    let server = Server::new(ServerConfig {
        addr: SocketAddr::new(IpAddr::V4(device_ip()), 0),
        memory_size: 64 << 20,
        huge_pages: huge,
        conn_mode,
        table_size: 4096,
        workers: 2,
        max_value: 128 << 20,
        ..ServerConfig::default()
    })
    .unwrap();
    server.start().unwrap();
    let addr = server.local_addr().unwrap();
    (server, addr)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_pattern(&mut v, u64::from(seed));
    v
}

fn all_ops_at_all_sizes(huge: bool, mode: ConnMode) {
    let (server, addr) = kv_server_in(huge, mode);
    assert_eq!(
        server.stats().huge_pages,
        huge,
        "huge pages as asked (the VM reserves some)"
    );
    let opts = ClientOptions {
        mode,
        ..ClientOptions::default()
    };
    let c = Client::connect_with(addr, &opts).unwrap();
    // Inline, just above inline, staged in the request buffer (up to 2 MiB),
    // server-allocated target above it.
    for (i, len) in [
        0usize,
        1,
        64,
        4096,
        4097,
        100 << 10,
        2 << 20,
        3 << 20,
        64 << 20,
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("key-{len}");
        let value = pattern(len, i as u8);
        assert_eq!(
            c.put(key.as_bytes(), &value).unwrap(),
            1,
            "{len}: new key has version 1"
        );
        let (got, version) = c.get(key.as_bytes()).unwrap();
        assert!(got == value && version == 1, "{len}: get returns the bytes");
        let (got, _) = c.get_one_sided(key.as_bytes()).unwrap();
        assert!(got == value, "{len}: one-sided get returns the bytes");
        let mut small = vec![0u8; len.saturating_sub(1)];
        if len > 0 {
            assert_eq!(
                c.get_into(key.as_bytes(), &mut small),
                Err(KvError::BufferTooSmall { needed: len as u64 }),
                "{len}: a short buffer reports the length"
            );
        }
        let newer = pattern(len, i as u8 + 100);
        assert_eq!(c.put(key.as_bytes(), &newer).unwrap(), 2);
        assert_eq!(
            c.get_one_sided(key.as_bytes()).unwrap(),
            (newer.clone(), 2),
            "{len}: a one-sided get after a put sees it"
        );
        assert_eq!(
            c.cas(key.as_bytes(), 1, &value),
            Err(KvError::CasFailed { current: 2 }),
            "{len}: stale CAS fails with the current version"
        );
        assert_eq!(c.cas(key.as_bytes(), 2, &value).unwrap(), 3);
        let mut buf = vec![0u8; len];
        assert_eq!(c.get_into(key.as_bytes(), &mut buf).unwrap(), (len, 3));
        assert!(buf == value, "{len}: CAS stored the bytes");
        c.delete(key.as_bytes()).unwrap();
        assert_eq!(c.get(key.as_bytes()), Err(KvError::NotFound));
        assert_eq!(c.get_one_sided(key.as_bytes()), Err(KvError::NotFound));
        assert_eq!(c.delete(key.as_bytes()), Err(KvError::NotFound));
    }
    assert_eq!(c.put(&[b'k'; 1025], b"v"), Err(KvError::KeyTooLong));
    assert_eq!(c.put(&[b'k'; 1024], b"v").unwrap(), 1, "1 KiB keys work");
    assert!(matches!(
        c.put(b"huge", &vec![0u8; (128 << 20) + 1]),
        Err(KvError::ValueTooLong { .. })
    ));
    assert_eq!(c.cas(b"fresh", 0, b"x").unwrap(), 1, "CAS 0 creates");
    assert_eq!(
        c.cas(b"absent", 5, b"x"),
        Err(KvError::CasFailed { current: 0 })
    );
    let keys: Vec<String> = (0..200).map(|i| format!("batch-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..200).map(|i| pattern(i * 37 % 9000, i as u8)).collect();
    let pairs: Vec<(&[u8], &[u8])> = keys
        .iter()
        .zip(&values)
        .map(|(k, v)| (k.as_bytes(), v.as_slice()))
        .collect();
    assert!(c.batch_put(&pairs).iter().all(|r| *r == Ok(1)));
    let key_refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    for (r, v) in c.batch_get(&key_refs).into_iter().zip(&values) {
        assert_eq!(&r.unwrap().0, v);
    }
    // One-sided: first through the index buckets, then from the remembered
    // blocks; after some keys change, their old blocks no longer count.
    for _ in 0..2 {
        for (r, v) in c.batch_get_one_sided(&key_refs).into_iter().zip(&values) {
            assert_eq!(r.unwrap(), (v.clone(), 1));
        }
    }
    let changed: Vec<Vec<u8>> = (0..200)
        .map(|i| pattern(i * 53 % 9000, i as u8 + 1))
        .collect();
    for i in (0..200).step_by(3) {
        assert_eq!(c.put(key_refs[i], &changed[i]).unwrap(), 2);
    }
    for (i, r) in c.batch_get_one_sided(&key_refs).into_iter().enumerate() {
        let want = match i % 3 {
            0 => (changed[i].clone(), 2),
            _ => (values[i].clone(), 1),
        };
        assert_eq!(r.unwrap(), want, "key {i} after some changed");
    }
    // Keys that are not keys among the others, across windows of 64: each
    // answered in its place, the rest read as before.
    let too_long = [b'k'; 1025];
    let mut mixed: Vec<&[u8]> = key_refs[..130].to_vec();
    mixed[1] = &too_long;
    mixed[100] = &too_long;
    for (i, r) in c.batch_get_one_sided(&mixed).into_iter().enumerate() {
        match i {
            1 | 100 => assert_eq!(r, Err(KvError::KeyTooLong), "key {i}"),
            _ if i % 3 == 0 => assert_eq!(r.unwrap().0, changed[i], "key {i}"),
            _ => assert_eq!(r.unwrap().0, values[i], "key {i}"),
        }
    }
    // A key written twice in one batch ends with its last value, whichever
    // way each value travels: inside the request, staged in the request
    // buffer (64 KiB, several in flight), or into a server-made target
    // (3 MiB, over the 2 MiB request buffer).
    let (big, mid) = (pattern(3 << 20, 5), pattern(64 << 10, 6));
    let twice: Vec<(&[u8], &[u8])> = vec![
        (b"twice-a", &big),
        (b"twice-a", b"small"),
        (b"twice-b", b"small"),
        (b"twice-b", &mid),
        (b"twice-c", &mid),
        (b"twice-c", &big),
    ];
    assert_eq!(
        c.batch_put(&twice),
        vec![Ok(1), Ok(2), Ok(1), Ok(2), Ok(1), Ok(2)]
    );
    // READs share the bounce buffer (4 MiB) until it is full; a value over
    // that is read alone after the rest of the batch.
    let alone = pattern(5 << 20, 7);
    assert_eq!(c.put(b"alone", &alone).unwrap(), 1);
    let got = c.batch_get(&[
        b"twice-c", b"missing", b"alone", b"twice-a", b"twice-b", b"twice-c",
    ]);
    assert_eq!(got[0], Ok((big.clone(), 2)));
    assert_eq!(got[1], Err(KvError::NotFound));
    assert_eq!(got[2], Ok((alone.clone(), 1)));
    assert_eq!(got[3], Ok((b"small".to_vec(), 2)));
    assert_eq!(got[4], Ok((mid.clone(), 2)));
    assert_eq!(got[5], Ok((big.clone(), 2)));
    // Blocks outside the slab pool (over 2 MiB) are left to the server.
    let got = c.batch_get_one_sided(&[
        b"twice-c",
        b"missing",
        b"alone",
        b"twice-a",
        b"twice-b",
        &[b'k'; 1025],
    ]);
    assert_eq!(got[0], Ok((big, 2)));
    assert_eq!(got[1], Err(KvError::NotFound));
    assert_eq!(got[2], Ok((alone, 1)));
    assert_eq!(got[3], Ok((b"small".to_vec(), 2)));
    assert_eq!(got[4], Ok((mid.clone(), 2)));
    assert_eq!(got[5], Err(KvError::KeyTooLong));
    // A lent value's callback that calls back into its client gets an
    // error, not a deadlock (the transfer buffer is busy lending).
    let mut inner = None;
    c.batch_get_with(&[b"alone", b"missing"], |i, r| {
        if i == 0 {
            assert_eq!(r.map(|(v, _)| v.len()), Ok(5 << 20));
            inner = Some(c.get(b"alone"));
        } else {
            assert_eq!(r, Err(KvError::NotFound));
        }
    });
    assert!(
        matches!(inner, Some(Err(KvError::InvalidArgument(_)))),
        "{inner:?}"
    );
    assert_eq!(
        c.get(b"alone").unwrap().0.len(),
        5 << 20,
        "and the client is fine"
    );

    // A mixed batch: each operation sees the ones before it, whichever way
    // its value travels (64 KiB goes alone and is read from a lease).
    let ops = [
        BatchOp::Put(b"mixed", b"one"),
        BatchOp::Get(b"mixed"),
        BatchOp::Put(b"mixed", &mid),
        BatchOp::Get(b"mixed"),
        BatchOp::Get(b"missing"),
        BatchOp::Put(b"mixed", b"three"),
        BatchOp::Get(b"mixed"),
        BatchOp::Get(&[b'k'; 1025]),
    ];
    let mut got = vec![None; ops.len()];
    c.batch_with(&ops, |i, r| {
        assert!(got[i].is_none(), "operation {i} answered twice");
        got[i] = Some(r.map(|(v, version)| (v.to_vec(), version)));
    });
    let want = [
        Ok((vec![], 1)),
        Ok((b"one".to_vec(), 1)),
        Ok((vec![], 2)),
        Ok((mid.clone(), 2)),
        Err(KvError::NotFound),
        Ok((vec![], 3)),
        Ok((b"three".to_vec(), 3)),
        Err(KvError::KeyTooLong),
    ];
    assert_eq!(got, want.map(Some));

    // A batch ends its leases in one message: once the keys are deleted,
    // their blocks go back to the pool while this client stays connected.
    let before = server.stats().pool_used;
    let keys: Vec<String> = (0..4).map(|i| format!("leased-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..4).map(|i| pattern(256 << 10, 40 + i)).collect();
    for (k, v) in keys.iter().zip(&values) {
        c.put(k.as_bytes(), v).unwrap();
    }
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    for (got, v) in c.batch_get(&refs).into_iter().zip(&values) {
        assert_eq!(got.unwrap().0, *v);
    }
    for k in &refs {
        c.delete(k).unwrap();
    }
    pool_back_to(&server, before, "leased blocks");
    drop(c);
    server.stop();
}

#[test]
#[ignore]
fn kv_all_ops_all_sizes_normal_pages() {
    all_ops_at_all_sizes(false, ConnMode::Cm);
}

#[test]
#[ignore]
fn kv_all_ops_all_sizes_socket_mode() {
    all_ops_at_all_sizes(false, ConnMode::Socket);
}

#[test]
#[ignore]
fn kv_all_ops_all_sizes_huge_pages() {
    all_ops_at_all_sizes(true, ConnMode::Cm);
}

/// Waits up to `limit` until `counter` of the server's statistics falls
/// to `target`.
pub fn stat_falls_to(
    server: &Server,
    counter: fn(&Stats) -> u64,
    target: u64,
    limit: Duration,
    what: &str,
) {
    let deadline = Instant::now() + limit;
    loop {
        let now = counter(&server.stats());
        if now <= target {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {now}, not {target}");
        thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until the server's pool holds no more than `baseline` bytes.
fn pool_back_to(server: &Server, baseline: u64, what: &str) {
    let what = format!("{what}: bytes held in the pool");
    stat_falls_to(
        server,
        |s| s.pool_used,
        baseline,
        Duration::from_secs(5),
        &what,
    );
}

#[test]
#[ignore]
fn kv_a_panicking_value_callback_loses_nothing() {
    let (server, addr) = kv_server(false);
    let c = Client::connect(addr).unwrap();
    c.put(b"small", b"inline").unwrap();
    let baseline = server.stats().pool_used;
    // Large enough to be leased and READ through the transfer buffer.
    let keys: Vec<String> = (0..4).map(|i| format!("lent-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..4).map(|i| pattern(256 << 10, 60 + i)).collect();
    for (k, v) in keys.iter().zip(&values) {
        c.put(k.as_bytes(), v).unwrap();
    }
    let message = |payload: Box<dyn std::any::Any + Send>| {
        payload
            .downcast_ref::<&str>()
            .copied()
            .unwrap_or("?")
            .to_string()
    };

    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        c.get_with(b"lent-0", |_| -> () { panic!("deliberate panic in take") })
    }));
    assert_eq!(
        got.map(drop).map_err(message),
        Err("deliberate panic in take".into())
    );
    // Before, the panic poisoned the transfer buffer's lock and every later
    // large-value call on the client panicked.
    assert_eq!(c.get(b"lent-0").unwrap().0, values[0]);

    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        c.get_one_sided_with(b"lent-1", |_| -> () {
            panic!("deliberate panic one-sided")
        })
    }));
    assert!(got.is_err());
    assert_eq!(c.get_one_sided(b"lent-1").unwrap().0, values[1]);

    // The first answer panics: the batch still takes every reply and gives
    // back every lease, calls the closure no more, then the panic goes on.
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    let mut batch = refs.clone();
    batch.push(b"small");
    let mut calls = 0;
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        c.batch_get_with(&batch, |_, r| {
            calls += 1;
            r.unwrap();
            panic!("deliberate panic in each");
        })
    }));
    assert_eq!(got.map_err(message), Err("deliberate panic in each".into()));
    assert_eq!(calls, 1, "the closure is not called after it panicked");
    for (got, v) in c.batch_get(&batch).into_iter().zip(&values) {
        assert_eq!(got.unwrap().0, *v, "the client still serves batches");
    }

    // Nothing the panics interrupted still holds a block on the server.
    for k in &refs {
        c.delete(k).unwrap();
    }
    pool_back_to(&server, baseline, "after deleting");
    drop(c);
    server.stop();
}

#[test]
#[ignore]
fn kv_cas_counter_ends_at_total_increments() {
    let (server, addr) = kv_server(false);
    const CLIENTS: usize = 4;
    const EACH: usize = 200;
    Client::connect(addr)
        .unwrap()
        .put(b"counter", b"0")
        .unwrap();
    let workers: Vec<_> = (0..CLIENTS)
        .map(|_| {
            thread::spawn(move || {
                let c = Client::connect(addr).unwrap();
                for _ in 0..EACH {
                    loop {
                        let (v, version) = c.get(b"counter").unwrap();
                        let n: u64 = std::str::from_utf8(&v).unwrap().parse().unwrap();
                        match c.cas(b"counter", version, (n + 1).to_string().as_bytes()) {
                            Ok(_) => break,
                            Err(KvError::CasFailed { .. }) => continue,
                            Err(e) => panic!("cas: {e}"),
                        }
                    }
                }
            })
        })
        .collect();
    workers.into_iter().for_each(|w| w.join().unwrap());
    let (v, version) = Client::connect(addr).unwrap().get(b"counter").unwrap();
    assert_eq!(
        std::str::from_utf8(&v).unwrap(),
        (CLIENTS * EACH).to_string()
    );
    assert_eq!(version, 1 + (CLIENTS * EACH) as u64);
    server.stop();
}

#[test]
#[ignore]
fn kv_a_hundred_and_twenty_eight_clients_connect_and_are_served() {
    const CLIENTS: usize = 128;
    let (server, addr) = kv_server(false);
    let clients: Vec<Client> = (0..CLIENTS)
        .map(|i| Client::connect(addr).unwrap_or_else(|e| panic!("client {i}: {e}")))
        .collect();
    assert_eq!(server.stats().clients, CLIENTS as u64);
    for (i, c) in clients.iter().enumerate() {
        c.put(format!("client-{i}").as_bytes(), &pattern(100 + i, i as u8))
            .unwrap();
    }
    // Each reads its neighbour's key, the last ones first, so the server
    // answers connections that have been quiet a while.
    for (i, c) in clients.iter().enumerate().rev() {
        let j = (i + 1) % CLIENTS;
        let (value, version) = c.get(format!("client-{j}").as_bytes()).unwrap();
        assert_eq!((value, version), (pattern(100 + j, j as u8), 1));
    }
    drop(clients);
    stat_falls_to(
        &server,
        |s| s.clients,
        0,
        Duration::from_secs(10),
        "clients counted",
    );
    server.stop();
}

#[test]
#[ignore]
fn kv_eight_clients_match_a_sequential_model() {
    let (server, addr) = kv_server(false);
    let workers: Vec<_> = (0..8u64)
        .map(|id| {
            thread::spawn(move || {
                let c = Client::connect(addr).unwrap();
                let mut model = std::collections::HashMap::new();
                let mut rng = id * 7919 + 1;
                for op in 0..10_000u64 {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    // Keys are shared among clients by name but each client
                    // writes only its own, so its model is the truth.
                    let key = format!("c{id}-k{}", rng % 64);
                    match rng % 10 {
                        0..=4 => {
                            let want = model.get(&key).cloned();
                            // All three GETs, one-sided ones meeting blocks
                            // that other clients' writes freed and reused.
                            let got = match op % 3 {
                                0 => c.get(key.as_bytes()),
                                1 => c.get_one_sided(key.as_bytes()),
                                _ => c.batch_get_one_sided(&[key.as_bytes()]).remove(0),
                            };
                            match got {
                                Ok((v, _)) => assert_eq!(Some(v), want, "op {op}"),
                                Err(KvError::NotFound) => assert_eq!(want, None, "op {op}"),
                                Err(e) => panic!("get: {e}"),
                            }
                        }
                        5..=8 => {
                            let v = pattern((rng % 6000) as usize, op as u8);
                            c.put(key.as_bytes(), &v).unwrap();
                            model.insert(key, v);
                        }
                        _ => {
                            let r = c.delete(key.as_bytes());
                            assert_eq!(r.is_ok(), model.remove(&key).is_some(), "op {op}");
                        }
                    }
                }
                for (k, v) in &model {
                    assert_eq!(&c.get_one_sided(k.as_bytes()).unwrap().0, v);
                }
                model.len()
            })
        })
        .collect();
    let live: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert_eq!(server.stats().items, live as u64);
    server.stop();
}

#[test]
#[ignore]
fn kv_one_sided_gets_never_see_torn_values() {
    let (server, addr) = kv_server(false);
    // Both connected before the writer starts, so the reader runs beside
    // every one of its writes.
    let c = Client::connect(addr).unwrap();
    let w = Client::connect(addr).unwrap();
    let writer = thread::spawn(move || {
        for round in 0..250u32 {
            // Every byte of a value is its round number, with a length that
            // changes too, so a torn read would show mixed bytes or lengths.
            let len = 1000 + (round as usize % 7) * 900;
            w.put(b"hot", &vec![round as u8; len]).unwrap();
        }
    });
    let mut seen = 0;
    let mut newest = 0;
    while !writer.is_finished() {
        // Alternately the single and the batched one-sided GET.
        let got = if seen % 2 == 0 {
            c.get_one_sided(b"hot")
        } else {
            c.batch_get_one_sided(&[b"hot"]).remove(0)
        };
        match got {
            Ok((v, version)) => {
                let round = v[0];
                assert!(v.iter().all(|&b| b == round), "a torn value");
                assert_eq!(v.len(), 1000 + (round as usize % 7) * 900, "a torn length");
                assert!(version >= newest, "version {version} read after {newest}");
                newest = version;
                seen += 1;
            }
            Err(KvError::NotFound) => {}
            Err(e) => panic!("one-sided get: {e}"),
        }
    }
    writer.join().unwrap();
    assert!(
        seen > 10,
        "the reader ran alongside the writer ({seen} reads)"
    );
    server.stop();
}

/// A client speaking garbage, and one writing where it may not.
#[test]
#[ignore]
fn kv_rogue_client_cannot_crash_or_corrupt() {
    let (server, addr) = kv_server(false);
    let good = Client::connect(addr).unwrap();
    good.put(b"precious", b"original").unwrap();
    let info = *good.server_info();

    struct Quiet;
    impl ConnHandler for Quiet {}
    let opts = Options::default();
    // Malformed requests: the server drops this client and nothing else.
    let rogue = Connection::connect(addr, &opts, Arc::new(Quiet)).unwrap();
    for junk in [&b"x"[..], &[0u8; 56], &[0xffu8; 300]] {
        let _ = rogue.send(junk);
    }
    // Writes into the index and beyond this connection's request buffer.
    let rogue2 = Connection::connect(addr, &opts, Arc::new(Quiet)).unwrap();
    let mr = rogue2.register(4096).unwrap();
    let (laddr, lkey) = (mr.addr(), mr.lkey());
    let index = snowrdma::verbs::RemoteAddr {
        addr: info.index_addr,
        rkey: info.index_rkey,
    };
    assert!(
        rogue2.write_sync(laddr, lkey, index, 64).is_err(),
        "writing the index is refused"
    );
    let rogue3 = Connection::connect(addr, &opts, Arc::new(Quiet)).unwrap();
    let mr = rogue3.register(4096).unwrap();
    let (laddr, lkey) = (mr.addr(), mr.lkey());
    let beyond = snowrdma::verbs::RemoteAddr {
        addr: info.request_buf + info.request_buf_len,
        rkey: info.request_buf_rkey,
    };
    assert!(
        rogue3.write_sync(laddr, lkey, beyond, 64).is_err(),
        "writing past the buffer is refused"
    );
    assert_eq!(good.get(b"precious").unwrap().0, b"original");
    assert_eq!(good.get_one_sided(b"precious").unwrap().0, b"original");
    assert_eq!(
        Client::connect(addr).unwrap().get(b"precious").unwrap().0,
        b"original"
    );
    server.stop();
}
