//! The broker's C and C++ examples (c-examples/broker_example.c and .cpp),
//! as users run them: one process per server, started in any order, with
//! the seed's flags; built normally and with ASan/UBSan.

use std::process::{Command, Output, Stdio};

use crate::device_ip;

fn program(dir: &str, name: &str) -> String {
    format!("{}/target/{dir}/{name}", env!("CARGO_MANIFEST_DIR"))
}

/// Runs `servers` processes of `prog`, the last server first, and returns
/// their outputs in server order.
fn run_mesh(prog: &str, servers: usize, base_port: u16, extra: &[&str]) -> Vec<Output> {
    let hosts: Vec<String> = (0..servers)
        .map(|i| format!("{}:{}", device_ip(), base_port + 10 * i as u16))
        .collect();
    let hosts = hosts.join(",");
    let children: Vec<_> = (0..servers)
        .rev()
        .map(|s| {
            let child = Command::new("timeout")
                .arg("120")
                .arg(prog)
                .arg(format!("--servers={hosts}"))
                .arg(format!("--server_id={s}"))
                .args(extra)
                .env("SNOWRDMA_LOG", "warn")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            (s, child)
        })
        .collect();
    let mut outs: Vec<(usize, Output)> = children
        .into_iter()
        .map(|(s, c)| (s, c.wait_with_output().unwrap()))
        .collect();
    outs.sort_by_key(|(s, _)| *s);
    outs.into_iter().map(|(_, o)| o).collect()
}

fn check(outs: &[Output]) {
    for (s, o) in outs.iter().enumerate() {
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success() && out.contains("all exchanged"),
            "server {s}: {:?}\n{out}\n{}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_c_example_three_servers_two_workers_both_modes() {
    let prog = program("c-examples", "broker_example");
    for (mode, port) in [("cm", 19900), ("socket", 19950)] {
        let outs = run_mesh(
            &prog,
            3,
            port,
            &[
                "--nrdma_workers=2",
                "--messages=40",
                &format!("--mode={mode}"),
            ],
        );
        check(&outs);
        let out = String::from_utf8_lossy(&outs[0].stdout);
        assert!(out.contains("send one byte 'a' wr:1 imm:1"), "{out}");
        assert!(
            out.contains("t:RECV") && out.contains("buf:a imm:1"),
            "{out}"
        );
    }
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn broker_cpp_example_and_both_under_asan() {
    check(&run_mesh(
        &program("c-examples", "broker_example_cpp"),
        3,
        20000,
        &[],
    ));
    check(&run_mesh(
        &program("c-examples-asan", "broker_example_cpp"),
        2,
        20050,
        &["--mode=socket"],
    ));
    check(&run_mesh(
        &program("c-examples-asan", "broker_example"),
        2,
        20100,
        &["--messages=20"],
    ));
}
