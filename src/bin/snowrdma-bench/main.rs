//! The benchmark side of `make bench`: each case measured the way the
//! perftest program it is compared with measures (same size, iterations and
//! signaling; the median of per-iteration latencies), through our verbs layer
//! or through the public C API; and the report that puts both side by side.
//!
//! ```text
//!   snowrdma-bench addr                 the device and its IPv4 address
//!   snowrdma-bench cases                the cases, for scripts/bench.sh
//!   snowrdma-bench run <case> <side>    one repetition; prints the figure
//!   snowrdma-bench report <results> [--json PATH]
//! ```

mod broker_cases;
mod c_api_cases;
mod case_table;
mod cases;
mod cost;
mod cost_report;
mod kv_cases;
mod report;
mod safe_cases;
mod verbs_cases;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::builder::PossibleValuesParser;
use clap::{Parser, Subcommand, ValueEnum};
use snowrdma::verbs::Context;

use broker_cases::{serve_broker, MeshMember};
use c_api_cases::{serve_legacy_peer, serve_sink};
use cases::{print_cases, Measure, CASES};
use report::report;
use verbs_cases::serve_peer;

#[global_allocator]
static ALLOCATOR: cost::CountingAlloc = cost::CountingAlloc;

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
    /// Print the cases, one line per side, as scripts/bench.sh reads them.
    Cases,
    /// Run one repetition of a side of a case measured here and print its
    /// figure.
    Run {
        #[arg(value_parser = PossibleValuesParser::new(CASES.iter().map(|c| c.name)))]
        case: String,
        side: Side,
        /// Iterations (latency) or messages (throughput); the case's own
        /// when not given.
        #[arg(short = 'n', long)]
        iters: Option<usize>,
        /// Message size in bytes; the case's own when not given.
        #[arg(short, long)]
        size: Option<usize>,
        /// Port for the cases that run a server or talk to one.
        #[arg(short, long, default_value_t = 7700)]
        port: u16,
    },
    /// Serve as a peer that speaks only the legacy protocol (version 0, on
    /// raw verbs): accept one client on `port`, echo until it leaves.
    LegacyPeer {
        #[arg(short, long)]
        port: u16,
    },
    /// Serve as the far end of the two-process stream cases: take every
    /// message, echo the 1-byte one that ends a stream; until killed.
    Sink {
        #[arg(short, long)]
        port: u16,
    },
    /// Serve as the far end of a two-process case: accept one client on
    /// `port` and play `role` with `size`-byte messages until it goes
    /// quiet or the process is killed.
    Peer {
        role: PeerRole,
        #[arg(short, long)]
        port: u16,
        #[arg(short, long, default_value_t = 64)]
        size: usize,
        /// broker-mesh: which broker this is (1 starts the ones above it).
        #[arg(long, default_value_t = 1)]
        id: usize,
        /// broker-mesh: how many brokers (one is the client's).
        #[arg(long, default_value_t = 2)]
        servers: usize,
        /// broker-mesh: messages to each other broker.
        #[arg(short = 'n', long, default_value_t = 0)]
        iters: usize,
    },
    /// Open and close a cost window around nothing: what the window's own
    /// marks cost under perf, which scripts/bench.sh takes off each count.
    Window,
    /// Summarise a results file (lines: case, side, value) as a table and JSON.
    Report {
        results: PathBuf,
        #[arg(long, default_value = "target/bench/results.json")]
        json: PathBuf,
    },
}

/// What the far end of a two-process case does.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum PeerRole {
    /// Lends its buffer (every access) and does nothing: READ, WRITE and
    /// atomic targets.
    Target,
    /// ib_write_lat's other side: waits for each WRITE in its buffer and
    /// WRITEs the same iteration back.
    WritePong,
    /// Answers each WRITE WITH IMM with one.
    ImmPong,
    /// Answers each SEND with a SEND of the same size.
    SendPong,
    /// A broker that takes every message and answers the one that ends a
    /// stream.
    BrokerSink,
    /// A broker that answers every message from its callback.
    BrokerEcho,
    /// Brokers 1 and up of an all-to-all, each in a process of its own.
    BrokerMesh,
}

#[derive(Clone, Copy, ValueEnum)]
enum Side {
    Reference,
    Snowrdma,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The device's IPv4 address at `port`.
fn device_addr(port: u16) -> SocketAddr {
    let ip = Context::open(None)
        .and_then(|c| c.ipv4_address(1))
        .expect("an RDMA device")
        .expect("an IPv4 address on the device");
    SocketAddr::new(IpAddr::V4(ip), port)
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Runs `iters` iterations of `one` after a tenth as many to warm up, with
/// the cost window around the measured ones; the median of what each
/// returns (its latency).
fn measured(iters: usize, mut one: impl FnMut(usize) -> f64) -> f64 {
    let warm = iters / 10;
    for i in 0..warm {
        one(i);
    }
    // Sized before the window opens: its allocation is the bench's own.
    let mut lat = Vec::with_capacity(iters);
    let window = cost::Window::open();
    lat.extend((warm..warm + iters).map(&mut one));
    window.close(iters);
    median(&mut lat)
}

/// Warms up with a tenth of `iters` messages (the first find the rings and
/// queues cold), then times and counts `send_all(iters)`: (MiB/s, Mpps).
fn timed_stream(iters: usize, size: usize, send_all: impl Fn(usize)) -> (f64, f64) {
    send_all(iters / 10);
    let window = cost::Window::open();
    let t = std::time::Instant::now();
    send_all(iters);
    let secs = t.elapsed().as_secs_f64();
    window.close(iters);
    (
        (iters * size) as f64 / secs / (1 << 20) as f64,
        iters as f64 / secs / 1e6,
    )
}

/// Runs a side of a case measured in this program; None for the sides the
/// script measures (perftest, the kv_open menu).
fn run(
    case: &str,
    side: Side,
    iters: Option<usize>,
    size: Option<usize>,
    port: u16,
) -> Option<f64> {
    let case = cases::find(case)?;
    cost::set_case(case.name);
    let measure = match side {
        Side::Reference => &case.reference,
        Side::Snowrdma => &case.snowrdma,
    };
    match *measure {
        Measure::Here {
            run,
            size: s,
            iters: n,
        }
        | Measure::AgainstServer {
            run,
            size: s,
            iters: n,
            ..
        } => Some(run(iters.unwrap_or(n), size.unwrap_or(s), port)),
        Measure::Perftest { .. } | Measure::KvAppMenu { .. } | Measure::KvProcs { .. } => None,
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
        Cmd::Cases => print_cases(),
        Cmd::Window => {
            cost::set_case("window");
            cost::Window::open().close(1);
        }
        Cmd::Run {
            case,
            side,
            iters,
            size,
            port,
        } => match run(&case, side, iters, size, port) {
            Some(figure) => println!("{figure:.4}"),
            None => {
                eprintln!("{case}: that side is measured by scripts/bench.sh, not here");
                return ExitCode::FAILURE;
            }
        },
        Cmd::Sink { port } => {
            if let Err(e) = serve_sink(port) {
                eprintln!("sink: {e}");
                return ExitCode::FAILURE;
            }
        }
        Cmd::LegacyPeer { port } => {
            if let Err(e) = serve_legacy_peer(port) {
                eprintln!("legacy peer: {e}");
                return ExitCode::FAILURE;
            }
        }
        Cmd::Peer {
            role,
            port,
            size,
            id,
            servers,
            iters,
        } => {
            let served = match role {
                PeerRole::BrokerSink | PeerRole::BrokerEcho | PeerRole::BrokerMesh => {
                    let mesh = MeshMember {
                        id,
                        servers,
                        per_peer: iters,
                    };
                    serve_broker(role, port, size, mesh)
                }
                _ => serve_peer(role, port, size).map_err(|e| e.to_string()),
            };
            if let Err(e) = served {
                eprintln!("peer: {e}");
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
