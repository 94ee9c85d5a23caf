//! The safe API's and the broker's cases: the safe layer beside the raw
//! verbs layer, the broker beside perftest.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use snowrdma::broker::{Broker, Config, ConnectMode, EventKind};
use snowrdma::safe::{
    block_on, AccessFlags, Completion, Local, Offer, Op, Progress, ProtectionDomain, Qp, Rc, Rts,
    RwSegment,
};
use snowrdma::verbs::Context;

use super::cost::Window;
use super::{median, us};

const WAIT: Duration = Duration::from_secs(30);

fn safe_pair() -> (ProtectionDomain, Qp<Rc, Rts>, Qp<Rc, Rts>) {
    let pd = ProtectionDomain::open(None).expect("device");
    let cq_a = pd.create_cq(256, Progress::Poll).expect("cq");
    let cq_b = pd.create_cq(256, Progress::Poll).expect("cq");
    let a = pd.qp::<Rc>(&cq_a, &cq_a).build().expect("qp");
    let b = pd.qp::<Rc>(&cq_b, &cq_b).build().expect("qp");
    let (ea, eb) = (a.endpoint().expect("ep"), b.endpoint().expect("ep"));
    (
        pd,
        a.connect(&eb).expect("connect"),
        b.connect(&ea).expect("connect"),
    )
}

/// `size` bytes of `b`'s side offered to its peer for writing.
fn offer_buffer(pd: &ProtectionDomain, b: &Qp<Rc, Rts>, size: usize) -> Offer<RwSegment<u8>> {
    let dst = pd
        .allocate::<u8>(size, AccessFlags::REMOTE_WRITE)
        .expect("alloc");
    block_on(
        b.offer(dst.rw(..).unwrap(), AccessFlags::REMOTE_WRITE)
            .unwrap(),
        WAIT,
    )
    .expect("bound in time")
    .expect("offer")
}

/// One signaled safe WRITE, post to completion, as the raw `sync_write`
/// reference does it through the verbs layer.
pub(crate) fn safe_write_lat(iters: usize, size: usize) -> f64 {
    let (pd, a, b) = safe_pair();
    let offer = offer_buffer(&pd, &b, size);
    let remote = offer.remote();
    let src = pd
        .allocate::<u8>(size, AccessFlags::empty())
        .expect("alloc");
    let mut seg = src.ro(..).unwrap();
    let mut lat = Vec::with_capacity(iters);
    let mut window = None;
    let warm = iters / 10;
    for i in 0..warm + iters {
        if i == warm {
            window = Some(Window::open());
        }
        let t = Instant::now();
        let done = block_on(a.write(seg, &remote, 0).expect("post"), WAIT)
            .expect("in time")
            .expect("write");
        if i >= warm {
            lat.push(us(t.elapsed()));
        }
        seg = done.into_memory();
    }
    if let Some(w) = window {
        w.close(iters);
    }
    median(&mut lat)
}

fn wait<S: Local + Unpin>(op: Op<S>) -> Completion<S> {
    block_on(op, WAIT).expect("in time").expect("completion")
}

/// SEND ping-pong over the safe API, half a round trip, as ib_send_lat.
pub(crate) fn safe_send_lat(iters: usize, size: usize) -> f64 {
    let (pd, a, b) = safe_pair();
    let mem = pd
        .allocate::<u8>(4 * size, AccessFlags::empty())
        .expect("alloc");
    let (mut a_out, mut a_in) = (mem.rw(..size).unwrap(), mem.rw(size..2 * size).unwrap());
    let (mut b_out, mut b_in) = (
        mem.rw(2 * size..3 * size).unwrap(),
        mem.rw(3 * size..).unwrap(),
    );
    let mut lat = Vec::with_capacity(iters);
    let mut window = None;
    let warm = iters / 10;
    for i in 0..warm + iters {
        if i == warm {
            window = Some(Window::open());
        }
        let b_recv = b.recv(b_in).expect("recv");
        let a_recv = a.recv(a_in).expect("recv");
        let t = Instant::now();
        a_out = wait(a.send(a_out).expect("send")).into_memory();
        b_in = wait(b_recv).into_memory();
        b_out = wait(b.send(b_out).expect("send")).into_memory();
        a_in = wait(a_recv).into_memory();
        if i >= warm {
            lat.push(us(t.elapsed()) / 2.0);
        }
    }
    if let Some(w) = window {
        w.close(iters);
    }
    median(&mut lat)
}

/// 64 KiB safe WRITEs, `BATCH` per doorbell, `DEPTH` in flight: MiB/s.
pub(crate) fn safe_write_bw(iters: usize, size: usize) -> f64 {
    const BATCH: usize = 8;
    const DEPTH: usize = 4;
    let (pd, mut a, b) = safe_pair();
    let offer = offer_buffer(&pd, &b, size);
    let remote = offer.remote();
    let src = pd
        .allocate::<u8>(size, AccessFlags::empty())
        .expect("alloc");
    let seg = src.ro(..).unwrap();
    let mut in_flight = std::collections::VecDeque::new();
    let t = Instant::now();
    let mut posted = 0;
    while posted < iters || !in_flight.is_empty() {
        if posted < iters && in_flight.len() < DEPTH {
            let mut batch = a.batch();
            let n = BATCH.min(iters - posted);
            for _ in 0..n {
                batch.write(seg.clone(), &remote, 0).expect("write");
            }
            in_flight.push_back(batch.post().expect("post"));
            posted += n;
        } else if let Some(op) = in_flight.pop_front() {
            block_on(op, WAIT).expect("in time").expect("batch");
        }
    }
    (iters * size) as f64 / t.elapsed().as_secs_f64() / f64::from(1 << 20)
}

fn broker_config(servers: usize, me: usize, port: u16, batch: u32) -> Config {
    let ip: IpAddr = Context::open_with_cm(None)
        .expect("device")
        .ipv4_address(1)
        .expect("port")
        .expect("an IPv4 address")
        .into();
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

/// `servers` brokers, each on its own thread, each sending `per_peer`
/// messages of `size` bytes to every other; returns the messages per
/// second all together received, in millions.
fn broker_mesh_rate(servers: usize, per_peer: usize, size: usize, batch: u32, port: u16) -> f64 {
    let start = Arc::new(std::sync::Barrier::new(servers));
    let received = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..servers)
        .map(|me| {
            let start = start.clone();
            let received = received.clone();
            std::thread::spawn(move || {
                let mine = Arc::new(AtomicU64::new(0));
                let (m, r) = (mine.clone(), received.clone());
                let b = Broker::new(broker_config(servers, me, port, batch), move |_, ev| {
                    if ev.kind == EventKind::Recv {
                        m.fetch_add(1, Ordering::Relaxed);
                        r.fetch_add(1, Ordering::Relaxed);
                    }
                })
                .expect("broker");
                b.init(WAIT).expect("mesh");
                start.wait();
                let window = (me == 0).then(Window::open);
                let t = Instant::now();
                let want = (per_peer * (servers - 1)) as u64;
                for _ in 0..per_peer {
                    for to in (0..servers).filter(|&s| s != me) {
                        let mut buf = b.send_buf_wait(to, WAIT).expect("slot");
                        buf.as_mut_slice()[..size].fill(7);
                        buf.send(size as u32, 0).expect("send");
                    }
                    b.poll_rq(None).expect("poll");
                }
                b.flush_all().expect("flush");
                while mine.load(Ordering::Relaxed) < want {
                    b.poll_rq(None).expect("poll");
                    b.poll_sq(None).expect("poll");
                    assert!(t.elapsed() < WAIT, "messages lost");
                }
                let took = t.elapsed();
                if let Some(w) = window {
                    w.close(per_peer * (servers - 1));
                }
                // Keep answering until everyone is done.
                let total = want * servers as u64;
                while received.load(Ordering::Relaxed) < total && t.elapsed() < WAIT {
                    b.poll_rq(None).expect("poll");
                    b.poll_sq(None).expect("poll");
                }
                took
            })
        })
        .collect();
    let slowest = threads
        .into_iter()
        .map(|t| t.join().expect("broker thread"))
        .max()
        .expect("servers");
    (per_peer * servers * (servers - 1)) as f64 / slowest.as_secs_f64() / 1e6
}

/// 64 B message rate, one sender to one receiver, `batch` per doorbell.
pub(crate) fn broker_rate(batch: u32, iters: usize, size: usize, port: u16) -> f64 {
    broker_mesh_rate(2, iters, size, batch, port) / 2.0
}

/// All-to-all message rate of `servers` brokers, in millions per second.
pub(crate) fn broker_all_to_all(servers: usize, iters: usize, size: usize, port: u16) -> f64 {
    broker_mesh_rate(servers, iters, size, 8, port)
}

/// Ping-pong through two brokers, the reply sent from the callback: half
/// a round trip.
pub(crate) fn broker_lat(iters: usize, size: usize, port: u16) -> f64 {
    let echo = std::thread::spawn(move || {
        let b = Broker::new(broker_config(2, 1, port, 1), move |b, ev| {
            if ev.kind == EventKind::Recv {
                let mut r = b.send_buf(ev.peer).expect("slot");
                r.as_mut_slice()[..ev.buf.len()].copy_from_slice(ev.buf);
                r.send(ev.buf.len() as u32, 0).expect("reply");
            }
        })
        .expect("broker");
        b.init(WAIT).expect("mesh");
        let t = Instant::now();
        while b.stats().recvs < iters as u64 && t.elapsed() < WAIT * 4 {
            b.poll_rq(None).expect("poll");
            b.poll_sq(None).expect("poll");
        }
        std::thread::sleep(Duration::from_millis(200));
    });
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    let b = Broker::new(broker_config(2, 0, port, 1), move |_, ev| {
        if ev.kind == EventKind::Recv {
            g.fetch_add(1, Ordering::Relaxed);
        }
    })
    .expect("broker");
    b.init(WAIT).expect("mesh");
    let mut lat = Vec::with_capacity(iters);
    let mut window = None;
    // The first tenth warms up, uncounted.
    let warm = iters as u64 / 10;
    for i in 0..iters as u64 {
        if i == warm {
            window = Some(Window::open());
        }
        let t = Instant::now();
        let mut buf = b.send_buf_wait(1, WAIT).expect("slot");
        buf.as_mut_slice()[..size].fill(1);
        buf.send(size as u32, 0).expect("send");
        b.flush(1).expect("flush");
        while got.load(Ordering::Relaxed) <= i {
            b.poll_rq(None).expect("poll");
            b.poll_sq(None).expect("poll");
            assert!(t.elapsed() < WAIT, "the reply was lost");
        }
        lat.push(us(t.elapsed()) / 2.0);
    }
    if let Some(w) = window {
        w.close(iters - warm as usize);
    }
    echo.join().expect("echo thread");
    median(&mut lat)
}
