//! The verbs probe: what each RDMA device supports, then a loopback check of
//! every posted operation, through RDMA CM and through a manual connection,
//! with a line per verified operation. Exits non-zero when any check fails.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use snowrdma::verbs::selftest::{ConnectMode, LoopbackPair, Op};
use snowrdma::verbs::{self, Context, GidKind, PortState};

#[derive(Parser)]
#[command(
    version,
    about = "Show what the RDMA devices support and verify every operation on them"
)]
struct Args {
    /// Only this device (default: all).
    #[arg(short, long)]
    device: Option<String>,
    /// Message sizes to verify, in bytes.
    #[arg(short, long, value_delimiter = ',', default_values_t = [1usize, 64, 4096, 1 << 20])]
    sizes: Vec<usize>,
    /// Bound on every wait, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    timeout_ms: u64,
    /// Only list the devices; post nothing.
    #[arg(long)]
    list_only: bool,
}

fn main() -> ExitCode {
    snowrdma::init_logging(Some("error"));
    let args = Args::parse();
    let names: Vec<String> = match (&args.device, verbs::devices()) {
        (Some(d), _) => vec![d.clone()],
        (None, Ok(list)) => list.into_iter().map(|d| d.name).collect(),
        (None, Err(e)) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if names.is_empty() {
        eprintln!("no RDMA device found (run through scripts/rdma-run.sh to use Soft-RoCE)");
        return ExitCode::FAILURE;
    }
    let mut failures = 0;
    for name in &names {
        match probe(name, &args) {
            Ok(failed) => failures += failed,
            Err(e) => {
                eprintln!("error: {name}: {e}");
                failures += 1;
            }
        }
    }
    if failures == 0 {
        println!("all checks passed");
        ExitCode::SUCCESS
    } else {
        println!("{failures} check(s) failed");
        ExitCode::FAILURE
    }
}

/// Prints the device and runs the checks; returns how many failed.
fn probe(name: &str, args: &Args) -> verbs::Result<usize> {
    let ctx = Context::open(Some(name))?;
    let dev = ctx.query_device()?;
    println!("device {name}");
    println!(
        "  firmware {}  node GUID {:016x}",
        dev.fw_ver, dev.node_guid
    );
    println!(
        "  max QPs {}  max QP WRs {}  max SGEs {}  max CQEs {}  max MR size {:#x}",
        dev.max_qp, dev.max_qp_wr, dev.max_sge, dev.max_cqe, dev.max_mr_size
    );
    println!(
        "  outstanding READ/atomic per QP: {} as target, {} as initiator  atomics: {}",
        dev.max_qp_rd_atom,
        dev.max_qp_init_rd_atom,
        if dev.atomics { "yes" } else { "no" }
    );
    for port in 1..=dev.phys_port_cnt {
        let p = ctx.query_port(port)?;
        println!(
            "  port {port}: {}  link {:?}  MTU active {} max {}  LID {}",
            p.state, p.link_layer, p.active_mtu, p.max_mtu, p.lid
        );
        for g in ctx.gid_table(port)? {
            let kind = match g.kind {
                GidKind::RoceV2 => "RoCE v2",
                GidKind::IbOrRoceV1 => "IB/RoCE v1",
                GidKind::Unknown => "?",
            };
            println!(
                "    GID[{}] {}  {kind}  {}",
                g.index,
                g.gid,
                g.netdev.as_deref().unwrap_or("")
            );
        }
        println!(
            "    GID index for manual connections: {}",
            ctx.default_gid_index(port)?
        );
    }
    if args.list_only {
        return Ok(0);
    }
    if ctx.query_port(1)?.state != PortState::ACTIVE {
        println!("  port 1 is not active: no operation checked");
        return Ok(1);
    }
    let timeout = Duration::from_millis(args.timeout_ms);
    let buf_len = args.sizes.iter().copied().max().unwrap_or(8).max(8);
    let mut failed = 0;
    for mode in [ConnectMode::RdmaCm, ConnectMode::Manual] {
        let mut pair = match LoopbackPair::connect(&ctx, mode, buf_len, timeout) {
            Ok(p) => p,
            Err(e) => {
                println!("FAIL {mode:<8} connect: {e}");
                failed += 1;
                continue;
            }
        };
        for op in Op::ALL {
            let sizes = if op.is_atomic() {
                &[8][..]
            } else {
                &args.sizes[..]
            };
            for &size in sizes {
                match pair.verify(op, size) {
                    Ok(t) => println!(
                        "ok   {mode:<8} {op:<17} {size:>8} B  {:>8.1} us",
                        t.as_secs_f64() * 1e6
                    ),
                    Err(e) => {
                        println!("FAIL {mode:<8} {op:<17} {size:>8} B  {e}");
                        failed += 1;
                        // A failed completion puts the QP in error: reconnect.
                        match LoopbackPair::connect(&ctx, mode, buf_len, timeout) {
                            Ok(p) => pair = p,
                            Err(_) => break,
                        }
                    }
                }
            }
        }
    }
    Ok(failed)
}
