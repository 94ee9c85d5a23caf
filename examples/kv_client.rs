//! The key-value client against a running `kv_server`.
//!
//!   kv_server --address <ip> &
//!   cargo run --example kv_client -- <ip>:12345

use snowrdma::kv::Client;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .ok_or("usage: kv_client <ip:port>")?
        .parse()?;
    let client = Client::connect(addr)?;
    let version = client.put(b"greeting", b"hello")?;
    let (value, got_version) = client.get(b"greeting")?;
    println!(
        "greeting = {:?} (version {got_version}, put as {version})",
        String::from_utf8_lossy(&value)
    );
    // Values of any size up to the server's limit; large ones move by RDMA
    // READ and WRITE straight between the two processes' memory.
    let big = vec![7u8; 8 << 20];
    client.put(b"big", &big)?;
    assert_eq!(client.get(b"big")?.0, big);
    client.close();
    Ok(())
}
