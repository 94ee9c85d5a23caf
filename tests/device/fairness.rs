//! One connection's traffic cannot hold the completion thread from the
//! others: a peer that sends faster than its messages are handled still
//! leaves every other connection of the runtime served.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use snowrdma::runtime::{ConnHandler, Connection, DRAIN_BUDGET};

use crate::runtime::{blocking, serve, Collect};
use crate::TIMEOUT;

/// Set in the child that runs the test with the completion thread never
/// spinning (where it drains each connection it is woken for).
const CHILD_ENV: &str = "SNOWRDMA_TEST_FAIRNESS_CHILD";

/// Takes 300 us over each message that starts with `F` (a slow consumer:
/// its peer can send faster), and echoes every other one.
#[derive(Default)]
struct SlowOrEcho {
    flood_seen: AtomicU64,
}

impl ConnHandler for SlowOrEcho {
    fn recv(&self, conn: &Connection, data: &[u8], _imm: Option<u32>) {
        if data.first() == Some(&b'F') {
            self.flood_seen.fetch_add(1, Ordering::SeqCst);
            thread::sleep(Duration::from_micros(300));
        } else {
            assert_eq!(conn.send(data).unwrap(), data.len(), "echo");
        }
    }
}

/// For each of 10 echo round trips on one connection while another
/// connection to the same server floods it: how many flood messages the
/// server handled meanwhile. And whether the flood was still going when the
/// last echo came back.
fn echoes_beside_a_flood() -> (Vec<u64>, bool) {
    let opts = blocking();
    let handler = Arc::new(SlowOrEcho::default());
    let (server, addr) = serve(&opts, handler.clone());
    let flooder = Connection::connect(addr, &opts, Arc::new(Collect::default())).unwrap();
    let sink = Arc::new(Collect::default());
    let pinger = Connection::connect(addr, &opts, sink.clone()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = stop.clone();
        let flooder = flooder.clone();
        thread::spawn(move || {
            // Far longer than the echoes take once served.
            let until = Instant::now() + Duration::from_secs(8);
            while !stop.load(Ordering::SeqCst) && Instant::now() < until {
                // Blocking: waits for room in the server's ring.
                let _ = flooder.send(&[b'F'; 64]);
            }
        })
    };
    let deadline = Instant::now() + TIMEOUT;
    while handler.flood_seen.load(Ordering::SeqCst) < 100 {
        assert!(
            Instant::now() < deadline,
            "the flood never reached the server"
        );
        thread::sleep(Duration::from_millis(1));
    }
    let beside = (1..=10)
        .map(|i| {
            let before = handler.flood_seen.load(Ordering::SeqCst);
            assert_eq!(pinger.send(b"ping....").unwrap(), 8);
            sink.wait_bytes(i * 8, TIMEOUT);
            handler.flood_seen.load(Ordering::SeqCst) - before
        })
        .collect();
    let flooding = !flood.is_finished();
    stop.store(true, Ordering::SeqCst);
    flood.join().unwrap();
    pinger.close();
    flooder.close();
    server.release();
    (beside, flooding)
}

/// Counted, not timed: the server's completion thread may handle a few
/// drains' worth of the flood before it gets to the echo on each side (its
/// turn comes after the others' turns), where it once handled the flood
/// until the flooder ran out of room (hundreds to thousands of messages,
/// 0.8-1 s per echo).
fn check(mode: &str) {
    let (beside, flooding) = echoes_beside_a_flood();
    eprintln!("{mode}: flood messages handled during each echo: {beside:?}");
    assert!(flooding, "{mode}: the flood ended before the echoes did");
    let most = beside.iter().max().copied().unwrap_or(0);
    assert!(
        most <= 4 * DRAIN_BUDGET as u64,
        "{mode}: the server handled {most} of another connection's messages during one echo"
    );
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn a_flooding_connection_leaves_the_others_served() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return check("never spinning");
    }
    check("as configured");
    // Again in a process whose completion thread never spins: it then
    // drains each connection it is woken for rather than polling them in
    // turn, which is where one connection could keep it.
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "fairness::a_flooding_connection_leaves_the_others_served",
            "--nocapture",
        ])
        .env(CHILD_ENV, "1")
        .env("SNOWRDMA_SPIN_US", "0")
        .status()
        .unwrap();
    assert!(
        status.success(),
        "the run without spinning failed: {status}"
    );
}
