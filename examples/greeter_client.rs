//! The safe API's greeter, client side: connects and sends a greeting.
//!
//!   cargo run --example greeter_client -- [server address, default <this device's IPv4>:5000]
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::time::Duration;

use snowrdma::safe::{self, AccessFlags, Progress, ProtectionDomain};
use snowrdma::verbs::Context;

const WAIT: Duration = Duration::from_secs(60);
const GREETING: &[u8] = b"Hello, SafeVerbs";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: SocketAddr = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => {
            let ip = Context::open_with_cm(None)?
                .ipv4_address(1)?
                .ok_or("the RDMA device has no IPv4 address; give the server's address")?;
            SocketAddr::new(ip.into(), 5000)
        }
    };
    let pd = ProtectionDomain::open(None)?;
    let cq = pd.create_cq(16, Progress::Thread)?;
    let (qp, _) = safe::connect(addr, pd.qp(&cq, &cq), WAIT)?.establish(&[], WAIT)?;

    let buf = pd.allocate::<u8>(GREETING.len(), AccessFlags::empty())?;
    let mut msg = buf.rw(..)?;
    msg.as_mut_slice().copy_from_slice(GREETING);
    let done = futures::executor::block_on(qp.send(msg)?)?;
    println!("{:?}", done.wc());
    Ok(())
}
