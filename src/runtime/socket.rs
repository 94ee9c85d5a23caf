//! Socket mode: a TCP connection carries each side's QP information (the
//! verbs layer's `QpInfo`), the QPs are moved INIT -> RTR -> RTS by hand, and
//! the TCP connection stays open as the liveness signal: its end is the
//! RDMA connection's end (watched on the runtime's CM thread).

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use crate::verbs::{Context, PreparedQp, QpInfo, QP_INFO_WIRE_LEN};

use super::conn::Connection;
use super::{Error, Result};

/// The TCP side of a socket-mode connection.
pub(crate) struct SocketLink {
    pub stream: TcpStream,
    pub peer: SocketAddr,
    /// The device the QP lives on (chosen by name, or the first).
    pub ctx: Context,
}

impl SocketLink {
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

fn io(what: &str, e: std::io::Error) -> Error {
    Error::Socket(format!("{what}: {e}"))
}

/// Exchanges QP information over `stream`, connects the QP, and waits until
/// both sides are ready to receive before either sends.
pub(crate) fn handshake(stream: &TcpStream, prepared: PreparedQp, timeout: Duration) -> Result<()> {
    let mut s = stream;
    s.set_read_timeout(Some(timeout))
        .and_then(|()| s.set_write_timeout(Some(timeout)))
        .map_err(|e| io("setting socket timeouts", e))?;
    let local = prepared.local_info()?;
    s.write_all(&local.to_bytes())
        .map_err(|e| io("sending QP information", e))?;
    let mut b = [0u8; QP_INFO_WIRE_LEN];
    s.read_exact(&mut b)
        .map_err(|e| io("receiving QP information", e))?;
    let remote = QpInfo::from_bytes(&b)?;
    prepared.connect(&remote)?;
    s.write_all(&[1]).map_err(|e| io("sending ready", e))?;
    let mut ready = [0u8; 1];
    s.read_exact(&mut ready)
        .map_err(|e| io("waiting for the peer's ready", e))?;
    s.set_nonblocking(true)
        .map_err(|e| io("watching the socket", e))
}

/// Watches a socket-mode connection's TCP stream (CM thread): end of stream
/// or an error means the peer is gone.
pub(crate) struct SocketWatch(pub Connection);

impl super::poller::Source for SocketWatch {
    fn fd(&self) -> RawFd {
        self.0.socket_link().map_or(-1, |l| l.stream.as_raw_fd())
    }

    fn ready(&self) {
        let Some(link) = self.0.socket_link() else {
            return;
        };
        let mut buf = [0u8; 64];
        loop {
            match (&link.stream).read(&mut buf) {
                Ok(0) => return self.0.peer_left(),
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return self.0.peer_left(),
            }
        }
    }
}
