//! The benchmark side of `make bench`: each case measured the way the
//! perftest program it is compared with measures (same size, iterations and
//! signaling; the median of per-iteration latencies), through our verbs layer
//! or through the public C API; and the report that puts both side by side.
//!
//! ```text
//!   snowrdma-bench addr                 the device and its IPv4 address
//!   snowrdma-bench run <case> [-n N]    one repetition; prints the figure
//!   snowrdma-bench report <results> [--json PATH]
//! ```

mod c_api_cases;
mod kv_cases;
mod report;
mod verbs_cases;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use snowrdma::verbs::Context;

use c_api_cases::{echo_lat, echo_remote_lat, serve_legacy_peer, stream, sync_lat};
use kv_cases::{kv_bw, kv_lat, kv_mix};
use report::report;
use verbs_cases::{verbs_imm_lat, verbs_op_lat, verbs_write_lat};

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
    /// Serve as a peer that speaks only the legacy protocol (version 0, on
    /// raw verbs): accept one client on `port`, echo until it leaves.
    LegacyPeer {
        #[arg(short, long)]
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
    /// C API: rdmaConnSend echo against a server in another process on
    /// `--port` (the bench starts our `echo_server` or a legacy-protocol
    /// peer there), half round trip.
    EchoRemoteLat,
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
        Case::EchoRemoteLat => echo_remote_lat(iters, size, port),
        Case::StreamBw => stream(iters, size, port).0,
        Case::MsgRate => stream(iters, size, port).1,
        Case::KvGetLat | Case::KvGetLatCrowd | Case::KvPutLat | Case::KvOneSidedLat => {
            kv_lat(case, iters, size, port)
        }
        Case::KvGetBw | Case::KvOneSidedGetBw | Case::KvPutBw => kv_bw(case, iters, size, port),
        Case::KvMix => kv_mix(iters, size, port),
    }
}

fn main() -> ExitCode {
    snowrdma::init_logging(Some("error"));
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
        Cmd::LegacyPeer { port } => {
            if let Err(e) = serve_legacy_peer(port) {
                eprintln!("legacy peer: {e}");
                return ExitCode::FAILURE;
            }
        }
        Cmd::Report { results, json } => {
            if let Err(e) = report(&results, &json) {
                eprintln!("report: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
