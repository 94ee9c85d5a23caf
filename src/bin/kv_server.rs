//! kv_server: the key-value store server, with the legacy program's flags.
//! Prints statistics every `--stats-interval` seconds and on SIGUSR1; stops
//! cleanly on SIGINT or SIGTERM.

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;

use snowrdma::kv::{ConnMode, Server, ServerConfig};

#[derive(Parser)]
#[command(
    name = "kv_server",
    version,
    about = "Key-value store server over RDMA"
)]
struct Args {
    /// Address to listen on.
    #[arg(short = 'a', long = "address", default_value = "0.0.0.0")]
    address: IpAddr,
    #[arg(short = 'p', long, default_value_t = 12345)]
    port: u16,
    /// Memory pool size in MiB.
    #[arg(short = 'm', long = "memory", default_value_t = 1024)]
    memory_mb: usize,
    /// Hash index buckets.
    #[arg(short = 't', long = "table", default_value_t = 65536)]
    table: usize,
    /// Worker threads for large values.
    #[arg(short = 'w', long, default_value_t = 4)]
    workers: usize,
    /// Back the pool with huge pages (falls back to normal pages with a warning).
    #[arg(short = 'H', long = "hugepages")]
    huge_pages: bool,
    /// Socket mode: QP information over TCP instead of RDMA CM.
    #[arg(short = 'S', long)]
    socket: bool,
    /// RDMA device name (socket mode).
    #[arg(short = 'd', long)]
    device: Option<String>,
    /// Largest value accepted, in bytes (default: SNOWRDMA_KV_MAX_VALUE or 1 GiB).
    #[arg(long)]
    max_value: Option<u64>,
    /// Seconds between statistics lines (0: only on SIGUSR1 and at exit).
    #[arg(long, default_value_t = 10)]
    stats_interval: u64,
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    let defaults = ServerConfig::default();
    let cfg = ServerConfig {
        addr: SocketAddr::new(args.address, args.port),
        memory_size: args.memory_mb << 20,
        huge_pages: args.huge_pages,
        table_size: args.table,
        workers: args.workers,
        conn_mode: if args.socket {
            ConnMode::Socket
        } else {
            ConnMode::Cm
        },
        device: args.device,
        max_value: args.max_value.unwrap_or(defaults.max_value),
        ..defaults
    };
    let server = match Server::new(cfg).and_then(|s| s.start().map(|()| s)) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kv_server: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut signals = match Signals::new([SIGINT, SIGTERM, SIGUSR1]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("kv_server: cannot handle signals: {e}");
            return ExitCode::FAILURE;
        }
    };
    let addr = server.local_addr().map_or("?".into(), |a| a.to_string());
    println!(
        "kv_server: listening on {addr} ({} MiB pool{}, {} buckets, {} workers)",
        args.memory_mb,
        if server.stats().huge_pages {
            ", huge pages"
        } else {
            ""
        },
        args.table,
        args.workers
    );
    let interval = (args.stats_interval > 0).then(|| Duration::from_secs(args.stats_interval));
    let handle = signals.handle();
    let ticker = interval.map(|every| {
        std::thread::spawn(move || loop {
            std::thread::sleep(every);
            if handle.is_closed() {
                return;
            }
            // Wakes the signal loop below, which prints.
            let _ = signal_hook::low_level::raise(SIGUSR1);
        })
    });
    for sig in signals.forever() {
        println!("kv_server: {}", server.stats());
        if sig != SIGUSR1 {
            break;
        }
    }
    signals.handle().close();
    server.stop();
    println!("kv_server: stopped");
    drop(ticker);
    ExitCode::SUCCESS
}
