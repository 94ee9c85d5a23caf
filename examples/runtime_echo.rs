//! The runtime: an echo server and a client in one process, over RDMA CM.
//!
//!   cargo run --example runtime_echo -- <ip of the RDMA interface>

use std::net::{IpAddr, SocketAddr};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use snowrdma::runtime::{ConnHandler, Connection, Listener, Options};

/// Sends every message back.
struct Echo;
impl ConnHandler for Echo {
    fn recv(&self, conn: &Connection, data: &[u8], _imm: Option<u32>) {
        let _ = conn.send(data);
    }
}

/// Hands what arrives to the main thread.
struct Inbox(Mutex<mpsc::Sender<Vec<u8>>>);
impl ConnHandler for Inbox {
    fn recv(&self, _conn: &Connection, data: &[u8], _imm: Option<u32>) {
        let _ = self.0.lock().unwrap().send(data.to_vec());
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ip: IpAddr = std::env::args()
        .nth(1)
        .ok_or("usage: runtime_echo <ip>")?
        .parse()?;
    snowrdma::init_logging(Some("warn"));
    let opts = Options::default();
    let server = Listener::bind(
        SocketAddr::new(ip, 0),
        &opts,
        Box::new(|_| Some(Arc::new(Echo) as Arc<dyn ConnHandler>)),
    )?;
    server.start()?;
    let addr = server.local_addr().ok_or("no address")?;

    let (tx, rx) = mpsc::channel();
    let conn = Connection::connect(addr, &opts, Arc::new(Inbox(Mutex::new(tx))))?;
    conn.send(b"hello over RDMA")?;
    let back = rx.recv_timeout(Duration::from_secs(5))?;
    println!("echoed: {}", String::from_utf8_lossy(&back));
    conn.close();
    server.release();
    Ok(())
}
