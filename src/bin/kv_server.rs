//! kv_server: the key-value store server, with the legacy program's flags.
//! Prints statistics every `--stats-interval` seconds and on SIGUSR1; stops
//! cleanly on SIGINT or SIGTERM.

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;

use snowrdma::kv::{ConnMode, Limits, Server, ServerConfig};

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
    #[arg(short = 'p', long, default_value_t = snowrdma::kv::SERVER_PORT)]
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
    /// Clients connected (or connecting) at once; more are refused.
    #[arg(long, default_value_t = Limits::default().max_connections)]
    max_connections: usize,
    /// Clients from one IP address connected (or connecting) at once; more
    /// from it are refused (default: no limit besides --max-connections).
    #[arg(long)]
    host_connections: Option<usize>,
    /// Milliseconds a client has to finish connecting before it is dropped.
    #[arg(long, default_value_t = ms(Limits::default().setup_deadline))]
    setup_deadline_ms: u64,
    /// Bytes of replies that may wait for one client; beyond, it is disconnected.
    #[arg(long, default_value_t = Limits::default().reply_queue_bytes)]
    reply_queue_bytes: usize,
    /// Requests that may wait for each worker; beyond, new ones wait for room.
    #[arg(long, default_value_t = Limits::default().worker_queue)]
    worker_queue: usize,
    /// Requests of one client that may wait for its worker; beyond, they are
    /// answered KV_ERR_NO_MEMORY.
    #[arg(long, default_value_t = Limits::default().client_jobs)]
    client_jobs: usize,
    /// Bytes of values stored outside the pool; beyond, large PUTs are
    /// answered KV_ERR_NO_MEMORY.
    #[arg(long, default_value_t = Limits::default().large_value_quota)]
    large_value_quota: u64,
    /// Bytes of values one client may hold leased; beyond, its oldest leases end.
    #[arg(long, default_value_t = Limits::default().lease_bytes)]
    lease_bytes: u64,
    /// Bytes of values one client may hold in write targets (large PUTs
    /// under way); beyond, its next one is answered KV_ERR_NO_MEMORY.
    #[arg(long, default_value_t = Limits::default().target_bytes)]
    target_bytes: u64,
    /// Milliseconds after which an unreleased lease ends.
    #[arg(long, default_value_t = ms(Limits::default().lease_time))]
    lease_time_ms: u64,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn main() -> ExitCode {
    snowrdma::init_logging(Some("warn"));
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
        limits: Limits {
            max_connections: args.max_connections,
            host_connections: args
                .host_connections
                .unwrap_or(Limits::default().host_connections),
            setup_deadline: Duration::from_millis(args.setup_deadline_ms),
            reply_queue_bytes: args.reply_queue_bytes,
            worker_queue: args.worker_queue,
            client_jobs: args.client_jobs,
            large_value_quota: args.large_value_quota,
            lease_bytes: args.lease_bytes,
            target_bytes: args.target_bytes,
            lease_time: Duration::from_millis(args.lease_time_ms),
        },
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
