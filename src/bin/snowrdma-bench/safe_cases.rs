//! The safe API's cases: the safe layer beside the raw verbs layer and
//! perftest, the far end in a process of its own (`snowrdma-bench peer`).

use std::time::{Duration, Instant};

use snowrdma::safe::{
    block_on, AccessFlags, Completion, Local, Op, Progress, ProtectionDomain, Qp, Rc, Rts,
};
use snowrdma::verbs::{RemoteRegion, REMOTE_REGION_WIRE_LEN};

use super::{device_addr, measured, us};

const WAIT: Duration = Duration::from_secs(30);

/// A safe queue pair connected through RDMA CM to the peer at `port`, and
/// the buffer the peer lent (a `target` peer lends one).
fn safe_connect(pd: &ProtectionDomain, port: u16) -> (Qp<Rc, Rts>, Option<RemoteRegion>) {
    let cq = pd.create_cq(256, Progress::Poll).expect("cq");
    let (qp, lent) = snowrdma::safe::connect(device_addr(port), pd.qp::<Rc>(&cq, &cq), WAIT)
        .expect("connect")
        .establish(&[], WAIT)
        .expect("establish");
    let lent = lent
        .get(..REMOTE_REGION_WIRE_LEN)
        .and_then(|b| RemoteRegion::from_bytes(b).ok());
    (qp, lent)
}

/// One signaled safe WRITE to a `target` peer at `port`, post to
/// completion, as the raw `sync_write` reference does it through the verbs
/// layer.
pub(crate) fn safe_write_lat(iters: usize, size: usize, port: u16) -> f64 {
    let pd = ProtectionDomain::open(None).expect("device");
    let (a, lent) = safe_connect(&pd, port);
    let remote = lent.expect("the target lends its buffer");
    let src = pd
        .allocate::<u8>(size, AccessFlags::empty())
        .expect("alloc");
    let mut seg = Some(src.ro(..).unwrap());
    measured(iters, |_| {
        let t = Instant::now();
        let written = seg.take().expect("the segment is back");
        let done = block_on(a.write(written, &remote, 0).expect("post"), WAIT)
            .expect("in time")
            .expect("write");
        let lat = us(t.elapsed());
        seg = Some(done.into_memory());
        lat
    })
}

fn wait<S: Local + Unpin>(op: Op<S>) -> Completion<S> {
    block_on(op, WAIT).expect("in time").expect("completion")
}

/// SEND ping-pong over the safe API with a `send-pong` peer at `port`,
/// half a round trip, as ib_send_lat.
pub(crate) fn safe_send_lat(iters: usize, size: usize, port: u16) -> f64 {
    let pd = ProtectionDomain::open(None).expect("device");
    let (a, _) = safe_connect(&pd, port);
    let mem = pd
        .allocate::<u8>(2 * size, AccessFlags::empty())
        .expect("alloc");
    let mut bufs = Some((mem.rw(..size).unwrap(), mem.rw(size..).unwrap()));
    measured(iters, |_| {
        let (out, inbox) = bufs.take().expect("the buffers are back");
        let reply = a.recv(inbox).expect("recv");
        let t = Instant::now();
        let out = wait(a.send(out).expect("send")).into_memory();
        let inbox = wait(reply).into_memory();
        let half_rtt = us(t.elapsed()) / 2.0;
        bufs = Some((out, inbox));
        half_rtt
    })
}

/// 64 KiB safe WRITEs to a `target` peer at `port`, `BATCH` per doorbell,
/// `DEPTH` in flight: MiB/s.
pub(crate) fn safe_write_bw(iters: usize, size: usize, port: u16) -> f64 {
    const BATCH: usize = 8;
    const DEPTH: usize = 4;
    let pd = ProtectionDomain::open(None).expect("device");
    let (mut a, lent) = safe_connect(&pd, port);
    let remote = lent.expect("the target lends its buffer");
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
