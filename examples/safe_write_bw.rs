//! RDMA WRITE bandwidth over the safe API, comparable with perftest's
//! `ib_write_bw` (the seed's UC write test; `--rc` for RC). Start the
//! receiver, then the sender with `-c <receiver's address>`.
//!
//!   cargo run --release --example safe_write_bw -- [-d dev] [-s 65536]
//!   cargo run --release --example safe_write_bw -- -c 10.0.0.1 -n 100000
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use clap::Parser;
use snowrdma::safe::{
    AccessFlags, BatchOp, Connected, Progress, ProtectionDomain, Qp, QpInfo, Rc, RemoteRegion, Rts,
    Uc,
};
use snowrdma::verbs::{QP_INFO_WIRE_LEN, REMOTE_REGION_WIRE_LEN};

/// UC (or RC) RDMA WRITE bandwidth test.
#[derive(Parser, Debug, Clone)]
struct Args {
    /// The receiver to connect to; without it, this side is the receiver.
    #[arg(short = 'c', long)]
    connect: Option<String>,
    /// TCP port of the out-of-band exchange.
    #[arg(short = 'p', long, default_value_t = 5000)]
    port: u16,
    /// RDMA device (default: SNOWRDMA_DEVICE, else the first).
    #[arg(short = 'd', long)]
    device: Option<String>,
    /// Send queue depth (max_send_wr).
    #[arg(short = 't', long, default_value_t = 128)]
    tx_depth: u32,
    /// Measured iterations.
    #[arg(short = 'n', long, default_value_t = 5000)]
    num_iters: usize,
    /// Warm-up iterations, not measured.
    #[arg(short = 'w', long, default_value_t = 100)]
    warmup: usize,
    /// Message size in bytes.
    #[arg(short = 's', long, default_value_t = 65536)]
    size: usize,
    /// Writes per doorbell.
    #[arg(short = 'b', long, default_value_t = 16)]
    batch: usize,
    /// Reliable connection instead of UC.
    #[arg(long)]
    rc: bool,
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let args = Args::parse();
    if args.size == 0 || args.batch == 0 || args.tx_depth == 0 {
        return Err("size, batch and tx depth must be positive".into());
    }
    if args.rc {
        run::<Rc>(&args)
    } else {
        run::<Uc>(&args)
    }
}

fn run<T: Connected>(args: &Args) -> Res<()> {
    let pd = ProtectionDomain::open(args.device.as_deref())?;
    let cq = pd.create_cq(args.tx_depth * 2, Progress::Poll)?;
    let qp = pd
        .qp::<T>(&cq, &cq)
        .max_send_wr(args.tx_depth)
        .max_recv_wr(1)
        .build()?;
    let local = qp.endpoint()?;
    let region = pd.allocate::<u8>(args.size, AccessFlags::REMOTE_WRITE)?;
    match &args.connect {
        None => {
            let listener = TcpListener::bind(("0.0.0.0", args.port))?;
            let (mut tcp, _) = listener.accept()?;
            let peer = QpInfo::from_bytes(&read_exact::<QP_INFO_WIRE_LEN>(&mut tcp)?)?;
            let qp = qp.connect(&peer)?;
            let offer =
                futures::executor::block_on(qp.offer(region.rw(..)?, AccessFlags::REMOTE_WRITE)?)?;
            tcp.write_all(&local.to_bytes())?;
            tcp.write_all(&offer.remote().to_bytes())?;
            // The sender says when it is done; the window stays until then.
            let _ = read_exact::<1>(&mut tcp)?;
            offer.revoke();
            println!("receiver: done");
        }
        Some(host) => {
            let mut tcp = connect_retrying(host, args.port)?;
            tcp.write_all(&local.to_bytes())?;
            let peer = QpInfo::from_bytes(&read_exact::<QP_INFO_WIRE_LEN>(&mut tcp)?)?;
            let remote =
                RemoteRegion::from_bytes(&read_exact::<REMOTE_REGION_WIRE_LEN>(&mut tcp)?)?;
            let mut qp = qp.connect(&peer)?;
            let mut src = region.rw(..)?;
            src.as_mut_slice().fill(0x5a);
            let src = src.freeze();
            write_many(&mut qp, &src, &remote, args, args.warmup)?;
            let start = Instant::now();
            write_many(&mut qp, &src, &remote, args, args.num_iters)?;
            report(args, start.elapsed());
            tcp.write_all(&[1])?;
        }
    }
    Ok(())
}

/// `n` writes of the whole source, `batch` per doorbell, keeping at most
/// `tx_depth` in flight.
fn write_many<T: Connected>(
    qp: &mut Qp<T, Rts>,
    src: &snowrdma::safe::RoSegment<u8>,
    remote: &RemoteRegion,
    args: &Args,
    n: usize,
) -> Res<()> {
    let mut in_flight: VecDeque<(usize, BatchOp)> = VecDeque::new();
    let mut outstanding = 0;
    let mut left = n;
    while left > 0 || !in_flight.is_empty() {
        let now = left.min(args.batch);
        if now > 0 && outstanding + now <= args.tx_depth as usize {
            let mut batch = qp.batch();
            for _ in 0..now {
                batch.write(src.clone(), remote, 0)?;
            }
            in_flight.push_back((now, batch.post()?));
            outstanding += now;
            left -= now;
        } else if let Some((k, op)) = in_flight.pop_front() {
            futures::executor::block_on(op)?;
            outstanding -= k;
        }
    }
    Ok(())
}

fn report(args: &Args, took: Duration) {
    let bytes = (args.size * args.num_iters) as f64;
    let mib_s = bytes / took.as_secs_f64() / (1 << 20) as f64;
    let mpps = args.num_iters as f64 / took.as_secs_f64() / 1e6;
    let line = "-".repeat(87);
    println!("{line}");
    println!(" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]");
    println!(
        " {:<10} {:<16} {:<18.2} {:<20.2} {:.6}",
        args.size, args.num_iters, mib_s, mib_s, mpps
    );
    println!("{line}");
}

/// The receiver may still be starting (slowly, on a loaded emulator): try
/// for a minute.
fn connect_retrying(host: &str, port: u16) -> Res<TcpStream> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match TcpStream::connect((host, port)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < deadline => {
                log::debug!("connecting to the receiver: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn read_exact<const N: usize>(tcp: &mut TcpStream) -> Res<[u8; N]> {
    let mut b = [0; N];
    tcp.read_exact(&mut b)?;
    Ok(b)
}
