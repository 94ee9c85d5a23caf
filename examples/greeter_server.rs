//! The safe API's greeter, server side: waits for one client, prints the
//! work completion and the greeting it received.
//!
//!   cargo run --example greeter_server -- [listen address, default 0.0.0.0:5000]
#![forbid(unsafe_code)]

use std::time::Duration;

use snowrdma::safe::{self, AccessFlags, Progress, ProtectionDomain};

const WAIT: Duration = Duration::from_secs(60);

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "0.0.0.0:5000".into())
        .parse()?;
    let pd = ProtectionDomain::open(None)?;
    let cq = pd.create_cq(16, Progress::Thread)?;
    let listener = safe::Listener::bind(addr)?;
    println!("listening on {}", listener.local_addr().unwrap_or(addr));

    let incoming = listener.accept(pd.qp(&cq, &cq), WAIT)?;
    let buf = pd.allocate::<u8>(64, AccessFlags::empty())?;
    // Posted before the connection exists, so the greeting finds it.
    let greeting = incoming.recv(buf.rw(..)?)?;
    let (_qp, _) = incoming.establish(&[], WAIT)?;
    let done = futures::executor::block_on(greeting)?;
    println!("{:?}", done.wc());
    let text = &done.memory().as_slice()[..done.byte_len() as usize];
    println!("{}", String::from_utf8_lossy(text));
    Ok(())
}
