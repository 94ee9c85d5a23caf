//! Device tests: they need an RDMA device, so they are `#[ignore]`d in a plain
//! `cargo test`; `make test` runs them (`--ignored`, one at a time) on the
//! host's device or on Soft-RoCE in a VM, through scripts/rdma-run.sh.
//!
//! Every wait is bounded, so a lost completion fails a test instead of
//! hanging it.

mod broker;
mod broker_programs;
mod c_programs;
mod callbacks;
mod credit;
mod echo_load;
mod fairness;
mod hostile;
mod hostile_links;
mod kv;
mod kv_connections;
mod kv_limits;
mod kv_programs;
mod kv_strings;
mod kv_windows;
mod kv_zero_copy;
mod release;
mod runtime;
mod safe;
mod safe_cm;
mod safe_faults;
mod verbs;

use std::net::Ipv4Addr;
use std::time::Duration;

use snowrdma::verbs::Context;

pub const TIMEOUT: Duration = Duration::from_secs(10);

pub fn ctx() -> Context {
    Context::open(None).expect("an RDMA device: run the device tests through scripts/rdma-run.sh")
}

pub fn device_ip() -> Ipv4Addr {
    ctx()
        .ipv4_address(1)
        .unwrap()
        .expect("the device has an IPv4 address")
}
