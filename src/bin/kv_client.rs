//! kv_client: the key-value store client, with the legacy program's flags
//! and commands. Interactive with line editing and history at a terminal;
//! otherwise it runs the commands given as arguments, or read from stdin.

use std::io::{BufRead, IsTerminal};
use std::net::{SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressFinish, ProgressStyle};
use rustyline::error::ReadlineError;

use snowrdma::kv::{BatchOp, Client, ClientOptions, ConnMode};

#[derive(Parser)]
#[command(
    name = "kv_client",
    version,
    about = "Key-value store client over RDMA"
)]
struct Args {
    /// Server address.
    #[arg(short = 'a', long = "address", default_value = "127.0.0.1")]
    address: String,
    #[arg(short = 'p', long, default_value_t = snowrdma::kv::SERVER_PORT)]
    port: u16,
    /// Socket mode: QP information over TCP instead of RDMA CM.
    #[arg(short = 'S', long)]
    socket: bool,
    /// RDMA device name (socket mode).
    #[arg(short = 'd', long)]
    device: Option<String>,
    /// Commands to run instead of the prompt, e.g. "put k v" "get k".
    commands: Vec<String>,
}

const USAGE: [&str; 6] = [
    "put <key> <value>",
    "get <key>",
    "del <key>",
    "cas <key> <version> <value>",
    "bench <n> [value bytes]",
    "mix <n> <value bytes> <start file>",
];

fn help() -> String {
    format!("commands: {} | quit", USAGE.join(" | "))
}

fn main() -> ExitCode {
    snowrdma::init_logging(Some("warn"));
    let args = Args::parse();
    let addr = match (args.address.as_str(), args.port)
        .to_socket_addrs()
        .map(|mut a| a.find(SocketAddr::is_ipv4))
    {
        Ok(Some(a)) => a,
        _ => {
            eprintln!("kv_client: cannot resolve {}", args.address);
            return ExitCode::FAILURE;
        }
    };
    let opts = ClientOptions {
        mode: if args.socket {
            ConnMode::Socket
        } else {
            ConnMode::Cm
        },
        device: args.device.clone(),
        ..ClientOptions::default()
    };
    let client = match Client::connect_with(addr, &opts) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kv_client: {e}");
            return ExitCode::FAILURE;
        }
    };
    let ok = if !args.commands.is_empty() {
        run_all(&client, args.commands.into_iter())
    } else if std::io::stdin().is_terminal() {
        prompt(&client)
    } else {
        run_all(
            &client,
            std::io::stdin().lock().lines().map_while(Result::ok),
        )
    };
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Runs every command up to `quit`, going on after one that failed, as
/// at the prompt; true if none failed.
fn run_all(client: &Client, lines: impl Iterator<Item = String>) -> bool {
    let mut ok = true;
    for line in lines {
        match run(client, &line) {
            Outcome::Quit => break,
            Outcome::Failed => ok = false,
            Outcome::Done => {}
        }
    }
    ok
}

fn prompt(client: &Client) -> bool {
    let mut editor = match rustyline::DefaultEditor::new() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("kv_client: no line editor: {e}");
            return false;
        }
    };
    println!("{}", help());
    loop {
        match editor.readline("kv> ") {
            Ok(line) => {
                if !line.trim().is_empty() {
                    let _ = editor.add_history_entry(line.as_str());
                }
                if run(client, &line) == Outcome::Quit {
                    return true;
                }
            }
            Err(ReadlineError::Interrupted | ReadlineError::Eof) => return true,
            Err(e) => {
                eprintln!("kv_client: {e}");
                return false;
            }
        }
    }
}

#[derive(PartialEq, Eq)]
enum Outcome {
    Done,
    Failed,
    Quit,
}

fn run(client: &Client, line: &str) -> Outcome {
    let words: Vec<&str> = line.split_whitespace().collect();
    let result: Result<String, String> = match words.as_slice() {
        [] => return Outcome::Done,
        ["quit" | "exit"] => return Outcome::Quit,
        ["help"] => Ok(help()),
        ["put", key, value @ ..] if !value.is_empty() => client
            .put(key.as_bytes(), value.join(" ").as_bytes())
            .map(|v| format!("OK (version {v})"))
            .map_err(|e| e.to_string()),
        ["get", key] => client
            .get(key.as_bytes())
            .map(|(v, version)| format!("{} (version {version})", String::from_utf8_lossy(&v)))
            .map_err(|e| e.to_string()),
        ["del", key] => client
            .delete(key.as_bytes())
            .map(|()| "OK".into())
            .map_err(|e| e.to_string()),
        ["cas", key, version, value @ ..] if !value.is_empty() => match version.parse() {
            Ok(expected) => client
                .cas(key.as_bytes(), expected, value.join(" ").as_bytes())
                .map(|v| format!("OK (version {v})"))
                .map_err(|e| e.to_string()),
            Err(_) => Err(format!("not a version: {version}")),
        },
        ["bench", n] => bench(client, n, "64"),
        ["bench", n, size] => bench(client, n, size),
        ["mix", n, size, start] => mix(client, n, size, start),
        [command, ..] => Err(
            match USAGE.iter().find(|u| u.starts_with(&format!("{command} "))) {
                Some(usage) => format!("usage: {usage}"),
                None => format!("unknown command {command:?}; {}", help()),
            },
        ),
    };
    match result {
        Ok(text) => {
            println!("{text}");
            Outcome::Done
        }
        Err(e) => {
            println!("error: {e}");
            Outcome::Failed
        }
    }
}

/// Latencies of one phase, in microseconds.
struct Phase {
    name: &'static str,
    micros: Vec<f64>,
    elapsed: Duration,
}

impl Phase {
    fn row(&mut self) -> String {
        self.micros.sort_by(f64::total_cmp);
        let pct = |p: f64| self.micros[((self.micros.len() - 1) as f64 * p).round() as usize];
        format!(
            "{:<14} {:>8} {:>12.0} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
            self.name,
            self.micros.len(),
            self.micros.len() as f64 / self.elapsed.as_secs_f64(),
            pct(0.5),
            pct(0.99),
            pct(0.999),
            pct(1.0)
        )
    }
}

/// Operations of the mix in one batch (up to 64 of them in flight).
const MIX_BATCH: usize = 256;

/// `n` operations, 95% GETs and 5% PUTs of `size`-byte values over 1000
/// keys of this process's own, in batches of [`MIX_BATCH`] (as a
/// throughput-minded program sends them), timed from when `start` appears (so that
/// several client processes start together, connected and seeded; each
/// says it is ready with a file `<start>.ready-<pid>`): prints
/// `<ops> <start> <end>`, the times in nanoseconds since the Unix epoch.
fn mix(client: &Client, n: &str, size: &str, start: &str) -> Result<String, String> {
    const KEYS: usize = 1000;
    let n: usize = n.parse().map_err(|_| format!("not a count: {n}"))?;
    let size: usize = size.parse().map_err(|_| format!("not a size: {size}"))?;
    let value = vec![b'v'; size];
    let keys: Vec<String> = (0..KEYS)
        .map(|i| format!("mix-{}-{i}", std::process::id()))
        .collect();
    for k in &keys {
        client
            .put(k.as_bytes(), &value)
            .map_err(|e| e.to_string())?;
    }
    // Says it is connected and seeded: `<start>.ready-<pid>`.
    std::fs::write(format!("{start}.ready-{}", std::process::id()), "")
        .map_err(|e| format!("{start}.ready: {e}"))?;
    let waited = Instant::now();
    while !std::path::Path::new(start).exists() {
        if waited.elapsed() > Duration::from_secs(300) {
            return Err(format!("{start} did not appear in 5 minutes"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let unix_ns = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    };
    let began = unix_ns();
    let mut ops = Vec::with_capacity(MIX_BATCH);
    for first in (0..n).step_by(MIX_BATCH) {
        ops.clear();
        ops.extend((first..n.min(first + MIX_BATCH)).map(|i| {
            let key = keys[(i * 7) % KEYS].as_bytes();
            if i % 20 == 0 {
                BatchOp::Put(key, &value)
            } else {
                BatchOp::Get(key)
            }
        }));
        let mut failed = None;
        client.batch_with(&ops, |i, result| match result {
            Ok((got, _)) if matches!(ops[i], BatchOp::Put(..)) || got.len() == size => {}
            Ok((got, _)) => failed = Some(format!("a {}-byte value came back", got.len())),
            Err(e) => failed = Some(format!("operation {}: {e}", first + i)),
        });
        if let Some(why) = failed {
            return Err(why);
        }
    }
    Ok(format!("{n} {began} {}", unix_ns()))
}

fn bench(client: &Client, n: &str, size: &str) -> Result<String, String> {
    let n: usize = n.parse().map_err(|_| format!("not a count: {n}"))?;
    let size: usize = size.parse().map_err(|_| format!("not a size: {size}"))?;
    if n == 0 {
        return Err("bench needs at least one operation".into());
    }
    let value = vec![b'v'; size];
    let key = |i: usize| format!("benchmark_key_{i:08}");
    let mut phases = Vec::new();
    type Op<'a> = Box<dyn Fn(&str) -> Result<(), String> + 'a>;
    let ops: [(&'static str, Op); 3] = [
        (
            "put",
            Box::new(|k: &str| {
                client
                    .put(k.as_bytes(), &value)
                    .map(drop)
                    .map_err(|e| e.to_string())
            }),
        ),
        (
            "get",
            Box::new(|k: &str| {
                client
                    .get(k.as_bytes())
                    .map(drop)
                    .map_err(|e| e.to_string())
            }),
        ),
        (
            "get one-sided",
            Box::new(|k: &str| {
                client
                    .get_one_sided(k.as_bytes())
                    .map(drop)
                    .map_err(|e| e.to_string())
            }),
        ),
    ];
    for (name, op) in ops.iter() {
        // Cleared when dropped, so an operation that fails midway leaves
        // only its error on the screen.
        let bar = ProgressBar::new(n as u64)
            .with_message(*name)
            .with_finish(ProgressFinish::AndClear);
        bar.set_style(
            ProgressStyle::with_template("{msg:>14} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
                .expect("progress template")
                .progress_chars("=> "),
        );
        let mut micros = Vec::with_capacity(n);
        let start = Instant::now();
        for i in 0..n {
            let t = Instant::now();
            op(&key(i)).map_err(|e| format!("{name} {}: {e}", key(i)))?;
            micros.push(t.elapsed().as_secs_f64() * 1e6);
            bar.inc(1);
        }
        phases.push(Phase {
            name,
            micros,
            elapsed: start.elapsed(),
        });
    }
    let mut table = format!(
        "{:<14} {:>8} {:>12} {:>9} {:>9} {:>9} {:>9}\n",
        format!("op ({size} B)"),
        "count",
        "ops/s",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "max us"
    );
    for p in &mut phases {
        table.push_str(&p.row());
        table.push('\n');
    }
    Ok(table.trim_end().to_string())
}
