//! Socket mode: a TCP connection carries each side's QP information (the
//! verbs layer's `QpInfo`), the QPs are moved INIT -> RTR -> RTS by hand, and
//! the TCP connection stays open as the liveness signal: its end is the
//! RDMA connection's end (watched on the runtime's CM thread).

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use crate::verbs::{Context, PreparedQp, QpInfo, QP_INFO_WIRE_LEN};

use super::conn::Connection;
use super::poller::{Ready, Source};
use super::{Error, Result};
use crate::tcp::read_exact_by;

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
/// The whole exchange takes at most `timeout`.
pub(crate) fn handshake(stream: &TcpStream, prepared: PreparedQp, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut s = stream;
    s.set_write_timeout(Some(timeout))
        .map_err(|e| io("setting socket timeouts", e))?;
    let local = prepared.local_info()?;
    s.write_all(&local.to_bytes())
        .map_err(|e| io("sending QP information", e))?;
    let mut b = [0u8; QP_INFO_WIRE_LEN];
    read_exact_by(s, &mut b, deadline).map_err(|e| io("receiving QP information", e))?;
    let remote = QpInfo::from_bytes(&b)?;
    prepared.connect(&remote)?;
    s.write_all(&[1]).map_err(|e| io("sending ready", e))?;
    let mut ready = [0u8; 1];
    read_exact_by(s, &mut ready, deadline).map_err(|e| io("waiting for the peer's ready", e))?;
    s.set_nonblocking(true)
        .map_err(|e| io("watching the socket", e))
}

/// Watches a socket-mode connection's TCP stream (CM thread): end of stream
/// or an error means the peer is gone, and a byte (nothing is sent after
/// the handshake) that it broke the protocol: a peer streaming bytes would
/// otherwise keep the CM thread reading them, every other connection's
/// setup and end waiting behind.
pub(crate) struct SocketWatch(pub Connection);

impl Source for SocketWatch {
    fn fd(&self) -> RawFd {
        self.0.socket_link().map_or(-1, |l| l.stream.as_raw_fd())
    }

    fn ready(&self) -> Ready {
        let Some(link) = self.0.socket_link() else {
            return Ready::Done;
        };
        let mut buf = [0u8; 64];
        let ended = loop {
            match (&link.stream).read(&mut buf) {
                Ok(0) => {
                    self.0.peer_left();
                    break true;
                }
                Ok(_) => {
                    self.0
                        .fail("the peer sent bytes on its socket after the handshake");
                    break true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break false,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => {
                    self.0.peer_left();
                    break true;
                }
            }
        };
        if ended {
            // A socket at its end stays readable: watched, it would call
            // the CM thread again and again until the connection is
            // dropped (a client's may live on long after).
            self.0.unwatch_link();
        }
        Ready::Done
    }

    /// A socket, read until it would block: readable while it has something.
    fn needs_looks(&self) -> bool {
        false
    }
}

/// What an accepted socket-mode connection still waits for.
enum Step {
    /// The peer's QP information (its bytes so far).
    QpInfo(Vec<u8>),
    /// The peer's ready byte (our QP is connected, our ready byte sent).
    Ready,
}

/// The server side of the QP exchange, driven by the CM thread as the
/// peer's bytes arrive: a peer that sends nothing holds up no one else, and
/// is dropped at `deadline`.
pub(crate) struct Handshake {
    pub conn: Connection,
    stream: TcpStream,
    prepared: std::sync::Mutex<Option<PreparedQp>>,
    step: std::sync::Mutex<Step>,
    pub deadline: std::time::Instant,
}

/// How a handshake step ended.
pub(crate) enum Progress {
    Waiting,
    Done,
    Failed(Error),
}

impl Handshake {
    /// Sends our QP information (a few dozen bytes into an empty socket
    /// buffer: does not block) and waits for the peer's.
    pub fn start(
        conn: Connection,
        stream: TcpStream,
        prepared: PreparedQp,
        deadline: std::time::Instant,
    ) -> Result<Handshake> {
        stream
            .set_nonblocking(true)
            .map_err(|e| io("watching the socket", e))?;
        let local = prepared.local_info()?;
        (&stream)
            .write_all(&local.to_bytes())
            .map_err(|e| io("sending QP information", e))?;
        Ok(Handshake {
            conn,
            stream,
            prepared: std::sync::Mutex::new(Some(prepared)),
            step: std::sync::Mutex::new(Step::QpInfo(Vec::with_capacity(QP_INFO_WIRE_LEN))),
            deadline,
        })
    }

    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Takes what the peer sent so far and moves on when a step is whole.
    pub fn advance(&self) -> Progress {
        match self.take_bytes() {
            Ok(progress) => progress,
            Err(e) => Progress::Failed(e),
        }
    }

    fn take_bytes(&self) -> Result<Progress> {
        let mut step = self.step.lock().expect("handshake lock");
        loop {
            let mut buf = [0u8; QP_INFO_WIRE_LEN];
            let want = match &*step {
                Step::QpInfo(got) => QP_INFO_WIRE_LEN - got.len(),
                Step::Ready => 1,
            };
            let n = match (&self.stream).read(&mut buf[..want]) {
                Ok(0) => return Err(Error::Socket("the peer closed the socket".into())),
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(Progress::Waiting),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(io("receiving QP information", e)),
            };
            match &mut *step {
                Step::Ready => return Ok(Progress::Done),
                Step::QpInfo(got) => {
                    got.extend_from_slice(&buf[..n]);
                    if got.len() < QP_INFO_WIRE_LEN {
                        continue;
                    }
                    let remote = QpInfo::from_bytes(got)?;
                    let prepared = self.prepared.lock().expect("handshake lock").take();
                    let Some(prepared) = prepared else {
                        return Err(Error::InvalidArgument(
                            "the QP was connected already".into(),
                        ));
                    };
                    prepared.connect(&remote)?;
                    (&self.stream)
                        .write_all(&[1])
                        .map_err(|e| io("sending ready", e))?;
                    *step = Step::Ready;
                }
            }
        }
    }
}
