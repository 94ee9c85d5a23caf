//! The kv_open / kv_set / kv_get API on a real device: the legacy-style
//! `application` / `client` pair, against `application` and `kv_server`,
//! two clients at once, a 1 GiB value, and bad input.

use std::ffi::{c_char, c_void, CString};
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use snowrdma::ffi::kv_strings::{kv_close, kv_get, kv_open, kv_release, kv_set};

use crate::c_programs::Proc;
use crate::device_ip;
use crate::kv_programs::kv_server;

fn app(name: &str) -> std::path::PathBuf {
    let p = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("target/c-examples/kv-app")
        .join(name);
    assert!(
        p.exists(),
        "{} is missing: run `make c-examples PROFILE=debug`",
        p.display()
    );
    p
}

/// Runs `client <server>` with `choice` on stdin; returns its output.
fn client(server: &str, choice: &str, big_mb: usize) -> Proc {
    let mut cmd = Command::new(app("client"));
    cmd.arg(server)
        .env("KV_CLIENT_BIG_MB", big_mb.to_string())
        .stdin(Stdio::piped());
    let mut p = Proc::start(cmd);
    p.child
        .stdin
        .take()
        .unwrap()
        .write_all(choice.as_bytes())
        .unwrap();
    p
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_app_functional_tests_with_a_1_gib_value_against_application() {
    let server = Proc::start(Command::new(app("application")));
    server.expect_line("serving on port 4792", Duration::from_secs(20));
    let mut c = client(&device_ip().to_string(), "1\n", 1024);
    c.expect_line("Passed All Tests!", Duration::from_secs(900));
    assert!(c.wait(Duration::from_secs(60)).success());
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_app_against_kv_server_and_two_clients_at_once() {
    let _server = kv_server(7801, &[]);
    let addr = format!("{}:7801", device_ip());
    // The waiting client starts first and sees the writer's keys appear.
    let mut waiter = client(&addr, "2\n", 0);
    std::thread::sleep(Duration::from_secs(1));
    let mut writer = client(&addr, "1\n", 8);
    writer.expect_line("Passed All Tests!", Duration::from_secs(300));
    waiter.expect_line("All test keys are visible", Duration::from_secs(60));
    assert!(writer.wait(Duration::from_secs(30)).success());
    assert!(waiter.wait(Duration::from_secs(30)).success());
}

#[test]
#[ignore = "needs an RDMA device: run `make test`"]
fn kv_open_api_refuses_bad_input() {
    let _server = kv_server(7802, &[]);
    let name = CString::new(format!("{}:7802", device_ip())).unwrap();
    let mut h: *mut c_void = std::ptr::null_mut();
    let mut out: *mut c_char = std::ptr::null_mut();
    unsafe {
        assert_eq!(kv_open(name.as_ptr() as *mut c_char, &mut h), 0);
        assert_eq!(kv_set(h, c"k".as_ptr(), c"v".as_ptr()), 0);
        assert_eq!(kv_set(h, std::ptr::null(), c"v".as_ptr()), 1, "NULL key");
        assert_eq!(
            kv_set(std::ptr::null_mut(), c"k".as_ptr(), c"v".as_ptr()),
            1,
            "NULL handle"
        );
        assert_eq!(
            kv_get(h, c"k".as_ptr(), std::ptr::null_mut()),
            1,
            "NULL out pointer"
        );
        assert_eq!(kv_get(h, c"k".as_ptr(), &mut out), 0);
        assert_eq!(std::ffi::CStr::from_ptr(out).to_bytes(), b"v");
        kv_release(out);
        assert_eq!(kv_get(h, c"missing".as_ptr(), &mut out), 0);
        assert_eq!(
            std::ffi::CStr::from_ptr(out).to_bytes(),
            b"",
            "a missing key reads as \"\""
        );
        kv_release(out);
        assert_eq!(kv_close(h), 0);
        assert_eq!(kv_close(h), 1, "closing twice");
        assert_eq!(
            kv_set(h, c"k".as_ptr(), c"v".as_ptr()),
            1,
            "a closed handle"
        );
        // The same from Rust.
        let rust = snowrdma::kv::Client::open(&format!("{}:7802", device_ip())).unwrap();
        assert_eq!(rust.get_string("k").unwrap(), "v", "what C stored");
        rust.set("rust", "string").unwrap();
        assert_eq!(rust.get_string("rust").unwrap(), "string");
        assert_eq!(rust.get_string("absent").unwrap(), "");
        // Nobody there: fails, in bounded time.
        let nobody = CString::new(format!("{}:7899", device_ip())).unwrap();
        let start = Instant::now();
        assert_eq!(kv_open(nobody.as_ptr() as *mut c_char, &mut h), 1);
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "took {:?}",
            start.elapsed()
        );
    }
}
