//! The broker's cases beside perftest, every broker in a process of its
//! own: this one is broker 0, `snowrdma-bench peer broker-*` the others
//! ([`serve_broker`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use snowrdma::broker::{Broker, Config, ConnectMode, EventKind};

use super::cost::Window;
use super::{device_addr, measured, timed_stream, us, PeerRole};

const WAIT: Duration = Duration::from_secs(30);

/// Which broker of an all-to-all a `broker-mesh` peer is.
pub(crate) struct MeshMember {
    pub id: usize,
    pub servers: usize,
    pub per_peer: usize,
}

/// The immediate of the message that ends a stream to a `broker-sink`,
/// which answers it.
const END_OF_STREAM: u32 = 0xee;
/// The immediate of broker 0's message that starts an all-to-all.
const GO: u32 = 0x60;
/// The immediate of the message that tells broker 0 a broker received all
/// it was sent.
const DONE: u32 = 0xd0;

/// Broker `me` of `servers`, broker `i` listening at `port + 10 i`.
fn broker_config(servers: usize, me: usize, port: u16, batch: u32) -> Config {
    let ip = device_addr(port).ip();
    Config {
        hosts: (0..servers)
            .map(|i| SocketAddr::new(ip, port + 10 * i as u16))
            .collect(),
        server_id: me,
        thread_id: 0,
        slots: 128,
        slot_size: 64,
        doorbell_batch: batch,
        data_len: 4096,
        mode: ConnectMode::Cm,
        device: None,
    }
}

fn poll(b: &Broker) {
    b.poll_rq(None).expect("poll");
    b.poll_sq(None).expect("poll");
}

/// Sends one `len`-byte message with `imm` to broker `to` (queued: it goes
/// with the next doorbell).
fn send(b: &Broker, to: usize, len: usize, imm: u32) {
    let mut buf = b.send_buf_wait(to, WAIT).expect("slot");
    buf.as_mut_slice()[..len].fill(7);
    buf.send(len as u32, imm).expect("send");
}

/// The far ends of the broker cases; see [`PeerRole`]. `mesh` is the
/// all-to-all's (broker `id` of `servers`, `per_peer` messages to each
/// other): its broker 1 starts brokers 2 and up in processes of their own.
pub(crate) fn serve_broker(
    role: PeerRole,
    port: u16,
    size: usize,
    mesh: MeshMember,
) -> Result<(), String> {
    let MeshMember {
        id,
        servers,
        per_peer,
    } = mesh;
    if let PeerRole::BrokerMesh = role {
        let others = if id == 1 {
            spawn_mesh_members(port, servers, per_peer)?
        } else {
            Vec::new()
        };
        mesh_member(servers, id, per_peer, size, port, || {
            if id == 1 {
                println!("listening on {}", device_addr(port + 10));
            }
        });
        for mut child in others {
            let _ = child.wait();
        }
        return Ok(());
    }
    let echo_all = matches!(role, PeerRole::BrokerEcho);
    let b = Broker::new(broker_config(2, 1, port, 1), move |b, ev| {
        if ev.kind == EventKind::Recv && (echo_all || ev.imm == Some(END_OF_STREAM)) {
            let mut r = b.send_buf(ev.peer).expect("slot");
            r.as_mut_slice()[..ev.buf.len()].copy_from_slice(ev.buf);
            r.send(ev.buf.len() as u32, ev.imm.unwrap_or(0))
                .expect("reply");
        }
    })
    .map_err(|e| e.to_string())?;
    println!("listening on {}", device_addr(port + 10));
    b.init(WAIT).map_err(|e| e.to_string())?;
    let (mut seen, mut last) = (0, Instant::now());
    while last.elapsed() < Duration::from_secs(20) {
        poll(&b);
        let recvs = b.stats().recvs;
        if recvs != seen {
            (seen, last) = (recvs, Instant::now());
        }
    }
    Ok(())
}

/// Brokers 2 and up of an all-to-all, each this program in a process of
/// its own.
fn spawn_mesh_members(
    port: u16,
    servers: usize,
    per_peer: usize,
) -> Result<Vec<std::process::Child>, String> {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    (2..servers)
        .map(|id| {
            std::process::Command::new(&me)
                .args(["peer", "broker-mesh", "--id", &id.to_string()])
                .args(["--port", &port.to_string()])
                .args(["--servers", &servers.to_string()])
                .args(["--iters", &per_peer.to_string()])
                .spawn()
                .map_err(|e| format!("broker {id}: {e}"))
        })
        .collect()
}

/// Broker `me` of an all-to-all of `servers` brokers (one process each):
/// after broker 0's go, sends `per_peer` messages of `size` bytes to every
/// other and waits for all that were sent to it; the others then tell
/// broker 0, which returns the time from its go to the last of them
/// (theirs: zero). `listening` runs once the broker exists.
fn mesh_member(
    servers: usize,
    me: usize,
    per_peer: usize,
    size: usize,
    port: u16,
    listening: impl FnOnce(),
) -> Duration {
    let got = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let go = Arc::new(AtomicBool::new(false));
    let down = Arc::new(AtomicBool::new(false));
    let (g, d, o, w) = (got.clone(), done.clone(), go.clone(), down.clone());
    let b = Broker::new(broker_config(servers, me, port, 8), move |_, ev| {
        match ev.kind {
            EventKind::Recv => match ev.imm {
                Some(GO) => o.store(true, Ordering::Release),
                Some(DONE) => {
                    d.fetch_add(1, Ordering::Release);
                }
                _ => {
                    g.fetch_add(1, Ordering::Release);
                }
            },
            EventKind::PeerDown if ev.peer == 0 => w.store(true, Ordering::Release),
            _ => {}
        }
    })
    .expect("broker");
    listening();
    b.init(WAIT).expect("mesh");
    let others: Vec<usize> = (0..servers).filter(|&s| s != me).collect();
    let window = (me == 0).then(Window::open);
    let t = Instant::now();
    if me == 0 {
        for &to in &others {
            send(&b, to, 1, GO);
        }
        b.flush_all().expect("flush");
    } else {
        while !go.load(Ordering::Acquire) {
            poll(&b);
            assert!(t.elapsed() < WAIT, "broker 0 never said go");
        }
    }
    for _ in 0..per_peer {
        for &to in &others {
            send(&b, to, size, 0);
        }
        b.poll_rq(None).expect("poll");
    }
    b.flush_all().expect("flush");
    let want = (per_peer * others.len()) as u64;
    while got.load(Ordering::Acquire) < want {
        poll(&b);
        assert!(t.elapsed() < WAIT, "messages lost");
    }
    if me != 0 {
        send(&b, 0, 1, DONE);
        b.flush(0).expect("flush");
        // Broker 0 leaves when every broker is done: nobody sends any more.
        while !down.load(Ordering::Acquire) && t.elapsed() < WAIT {
            poll(&b);
        }
        return Duration::ZERO;
    }
    while done.load(Ordering::Acquire) < others.len() as u64 {
        poll(&b);
        assert!(t.elapsed() < WAIT, "a broker never finished");
    }
    let took = t.elapsed();
    if let Some(w) = window {
        w.close(per_peer * others.len());
    }
    took
}

/// All-to-all message rate of `servers` brokers, this one and `servers - 1`
/// started by a `broker-mesh` peer at `port`: every message all of them
/// received, in millions per second.
pub(crate) fn broker_all_to_all(servers: usize, iters: usize, size: usize, port: u16) -> f64 {
    let took = mesh_member(servers, 0, iters, size, port, || {});
    (iters * servers * (servers - 1)) as f64 / took.as_secs_f64() / 1e6
}

/// 64 B messages to a `broker-sink` peer at `port`, `batch` per doorbell:
/// million messages per second, from the first send until the sink
/// answered the message sent after the last.
pub(crate) fn broker_rate(batch: u32, iters: usize, size: usize, port: u16) -> f64 {
    let answers = Arc::new(AtomicU64::new(0));
    let a = answers.clone();
    let b = Broker::new(broker_config(2, 0, port, batch), move |_, ev| {
        if ev.kind == EventKind::Recv {
            a.fetch_add(1, Ordering::Release);
        }
    })
    .expect("broker");
    b.init(WAIT).expect("mesh");
    let send_all = |n: usize| {
        let before = answers.load(Ordering::Acquire);
        for _ in 0..n {
            send(&b, 1, size, 0);
        }
        send(&b, 1, 1, END_OF_STREAM);
        b.flush(1).expect("flush");
        let t = Instant::now();
        while answers.load(Ordering::Acquire) == before {
            poll(&b);
            assert!(t.elapsed() < WAIT, "the end of the stream was lost");
        }
    };
    timed_stream(iters, size, send_all).1
}

/// Ping-pong with a `broker-echo` peer at `port`, which replies from its
/// callback: half a round trip.
pub(crate) fn broker_lat(iters: usize, size: usize, port: u16) -> f64 {
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    let b = Broker::new(broker_config(2, 0, port, 1), move |_, ev| {
        if ev.kind == EventKind::Recv {
            g.fetch_add(1, Ordering::Relaxed);
        }
    })
    .expect("broker");
    b.init(WAIT).expect("mesh");
    let mut sent = 0;
    measured(iters, |_| {
        let t = Instant::now();
        send(&b, 1, size, 0);
        b.flush(1).expect("flush");
        sent += 1;
        while got.load(Ordering::Relaxed) < sent {
            poll(&b);
            assert!(t.elapsed() < WAIT, "the reply was lost");
        }
        us(t.elapsed()) / 2.0
    })
}
