//! The C programs in c-examples/ against the real library on a real device:
//! built by `make c-examples` (which `make test` runs first). Servers are
//! killed when a test ends, whether it passed or not.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::device_ip;

pub fn program(name: &str) -> PathBuf {
    built("c-examples", name)
}

/// The program built with AddressSanitizer and UBSan (`make
/// c-examples-asan`): a finding ends it with a non-zero status.
pub fn asan_program(name: &str) -> PathBuf {
    built("c-examples-asan", name)
}

fn built(dir: &str, name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target")
        .join(dir)
        .join(name);
    assert!(
        p.exists(),
        "{} is missing: run `make {dir} PROFILE=debug`",
        p.display()
    );
    p
}

/// A command for a C program, sanitized or not. libibverbs keeps some
/// allocations until exit by design, so ASan's leak check is off.
pub fn c_command(path: PathBuf) -> Command {
    let mut cmd = Command::new(path);
    cmd.env("ASAN_OPTIONS", "detect_leaks=0");
    cmd
}

/// A child process killed on drop, with its stdout lines on a channel.
pub struct Proc {
    pub child: Child,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    fn spawn(name: &str, args: &[String]) -> Proc {
        Proc::spawn_path(program(name), args)
    }

    fn spawn_path(path: PathBuf, args: &[String]) -> Proc {
        let mut cmd = c_command(path);
        cmd.args(args);
        Proc::start(cmd)
    }

    /// Starts `cmd` with its stdout and stderr captured, line by line, on
    /// one channel (stdin as the command has it).
    pub fn start(mut cmd: Command) -> Proc {
        let name = format!("{:?}", cmd.get_program());
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let (tx, lines) = mpsc::channel();
        let out: Box<dyn std::io::Read + Send> = Box::new(child.stdout.take().unwrap());
        let err: Box<dyn std::io::Read + Send> = Box::new(child.stderr.take().unwrap());
        for stream in [out, err] {
            let tx = tx.clone();
            thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    println!("    | {line}");
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Proc { child, lines }
    }

    /// Waits for a line containing `needle`.
    pub fn expect_line(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.contains(needle) => return line,
                Ok(_) => {}
                Err(_) => panic!("no line with {needle:?} within {timeout:?}"),
            }
        }
    }

    /// The lines not yet taken that contain one of `needles`, read until the
    /// output ends or for `within`.
    pub fn lines_containing(&self, needles: &[&str], within: Duration) -> Vec<String> {
        let deadline = Instant::now() + within;
        let mut found = Vec::new();
        while let Ok(line) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            if needles.iter().any(|n| line.contains(n)) {
                found.push(line);
            }
        }
        found
    }

    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "did not exit within {timeout:?}");
            thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn echo_server(port: u16) -> Proc {
    echo_server_at(program("echo_server"), port)
}

fn echo_server_at(path: PathBuf, port: u16) -> Proc {
    let server = Proc::spawn_path(path, &[device_ip().to_string(), port.to_string()]);
    server.expect_line("listening on", Duration::from_secs(60));
    server
}

fn run(name: &str, args: &[&str], timeout: Duration) -> ExitStatus {
    run_path(program(name), args, timeout)
}

/// Runs a program with the device's address as its first argument.
fn run_path(path: PathBuf, args: &[&str], timeout: Duration) -> ExitStatus {
    let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    args.insert(0, device_ip().to_string());
    let mut p = Proc::spawn_path(path, &args);
    p.wait(timeout)
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn c_echo_of_64_mib_in_random_sizes_over_one_connection() {
    let _server = echo_server(7601);
    let status = run(
        "client",
        &["7601", "-b", "67108864", "-m", "262144", "-l", "200"],
        Duration::from_secs(600),
    );
    assert!(status.success(), "client: {status}");
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn c_echo_over_16_connections_at_once() {
    let _server = echo_server(7602);
    let status = run(
        "client",
        &[
            "7602", "-c", "16", "-b", "4194304", "-m", "262144", "-l", "20",
        ],
        Duration::from_secs(600),
    );
    assert!(status.success(), "client: {status}");
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn c_bad_input_gives_error_codes() {
    let _server = echo_server(7603);
    for path in [program("misuse"), asan_program("misuse")] {
        let status = run_path(path.clone(), &["7603", "7699"], Duration::from_secs(120));
        assert!(status.success(), "{}: {status}", path.display());
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn c_dead_handles_give_errors_and_are_never_freed_memory() {
    for (path, port) in [
        (program("handles"), "7610"),
        (asan_program("handles"), "7613"),
    ] {
        let status = run_path(path.clone(), &[port], Duration::from_secs(120));
        assert!(status.success(), "{}: {status}", path.display());
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn c_every_call_from_inside_every_callback_kind() {
    // The program's own alarm ends it (exit 3) when a call hangs.
    for (path, port) in [
        (program("callbacks"), "7616"),
        (asan_program("callbacks"), "7617"),
    ] {
        let status = run_path(path.clone(), &[port], Duration::from_secs(150));
        assert!(status.success(), "{}: {status}", path.display());
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn c_echo_sanitized() {
    let _server = echo_server_at(asan_program("echo_server"), 7618);
    let status = run_path(
        asan_program("client"),
        &["7618", "-c", "2", "-b", "1048576", "-m", "65536", "-l", "5"],
        Duration::from_secs(300),
    );
    assert!(status.success(), "client: {status}");
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn c_legacy_style_program_runs_dynamic_and_static() {
    for (name, port) in [("legacy_style", "7604"), ("legacy_style-static", "7605")] {
        let status = run(name, &[port], Duration::from_secs(60));
        assert!(status.success(), "{name}: {status}");
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn c_server_survives_a_client_killed_mid_stream() {
    let server = echo_server(7606);
    let ip = device_ip().to_string();
    let mut victim = Proc::spawn(
        "client",
        &[ip, "7606".into(), "-b".into(), "1073741824".into()],
    );
    server.expect_line("connected", Duration::from_secs(60));
    thread::sleep(Duration::from_millis(1500));
    victim.kill();
    server.expect_line("disconnected", Duration::from_secs(30));
    let status = run(
        "client",
        &["7606", "-b", "1048576", "-l", "10"],
        Duration::from_secs(60),
    );
    assert!(status.success(), "a client after the killed one: {status}");
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn c_client_learns_of_a_server_killed_mid_stream() {
    let mut server = echo_server(7607);
    let ip = device_ip().to_string();
    let mut client = Proc::spawn(
        "client",
        &[ip, "7607".into(), "-b".into(), "1073741824".into()],
    );
    server.expect_line("connected", Duration::from_secs(60));
    thread::sleep(Duration::from_millis(1500));
    server.kill();
    let start = Instant::now();
    let status = client.wait(Duration::from_secs(60));
    assert_eq!(
        status.code(),
        Some(3),
        "the client reports the disconnect (exit 3): {status}"
    );
    println!("client noticed after {:?}", start.elapsed());
}
