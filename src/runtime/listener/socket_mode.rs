//! Socket mode's side of a listener: taking TCP connections (or refusing
//! them when the process is out of descriptors) and the QP exchange that
//! follows, on the CM thread.

use std::fs::File;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

use super::super::conn::{ConnKind, Connection, Link};
use super::super::poller::{Ready, Source};
use super::super::socket::{Handshake, Progress, SocketLink};
use super::super::{Error, Result};
use super::{Endpoint, Listener, ListenerInner};

impl Listener {
    /// Takes up to `budget` waiting TCP connections (socket mode, CM
    /// thread); true when it stopped with more perhaps waiting.
    pub(crate) fn accept_sockets(&self, budget: usize) -> bool {
        let Endpoint::Socket { tcp, .. } = &self.inner.endpoint else {
            return false;
        };
        let mut taken = 0;
        while taken < budget {
            match tcp.accept() {
                Ok((stream, peer)) => {
                    taken += 1;
                    if let Err(e) = self.accept_socket(stream, peer) {
                        self.inner.refused(|| {
                            format!("refusing a socket-mode connection from {peer}: {e}")
                        });
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                    if !self.refuse_without_descriptors() {
                        return false;
                    }
                    taken += 1;
                }
                Err(e) => {
                    log::warn!("accepting a socket-mode connection: {e}");
                    return false;
                }
            }
        }
        true
    }

    /// The process (or the system) has no descriptor left for a waiting TCP
    /// connection, which stays in the kernel's queue and keeps the socket
    /// readable: the CM thread would be called for it again and again. The
    /// reserve descriptor is closed for the moment it takes to accept that
    /// connection and close it (it is refused), then taken back. False when
    /// there was no reserve or nothing was taken.
    fn refuse_without_descriptors(&self) -> bool {
        let Endpoint::Socket { tcp, reserve, .. } = &self.inner.endpoint else {
            return false;
        };
        let mut reserve = reserve.lock().expect("listener lock");
        if reserve.is_none() {
            // Lost to another thread of the process while it was given up,
            // or never had at bind.
            *reserve = File::open("/dev/null").ok();
        }
        if reserve.take().is_none() {
            self.inner.pause_accepting();
            return false;
        }
        let taken = match tcp.accept() {
            Ok((stream, peer)) => {
                self.inner.refused(|| {
                    format!(
                        "refusing socket-mode connections (the first from {peer}): out of file \
                         descriptors"
                    )
                });
                // Closed before the reserve is opened again: it holds the
                // reserve's descriptor.
                drop(stream);
                true
            }
            Err(_) => false,
        };
        *reserve = File::open("/dev/null").ok();
        taken
    }

    /// Sets up one socket-mode connection: builds it, sends our QP
    /// information and leaves the rest of the exchange to the CM thread as
    /// the peer's bytes arrive ([`HandshakeSource`]).
    fn accept_socket(&self, stream: TcpStream, peer: SocketAddr) -> Result<()> {
        let Endpoint::Socket { ctx, .. } = &self.inner.endpoint else {
            return Ok(());
        };
        // Dropping the stream closes it.
        if !*self.inner.serving.lock().expect("listener lock") || !self.inner.room_for_a_setup() {
            return Ok(());
        }
        let _ = stream.set_nodelay(true);
        let link = SocketLink {
            stream: stream
                .try_clone()
                .map_err(|e| Error::Socket(format!("duplicating the socket: {e}")))?,
            peer,
            ctx: ctx.clone(),
        };
        let (conn, prepared) = Connection::build(
            self.inner.rt.clone(),
            Link::Socket(link),
            &self.inner.opts,
            ConnKind::AcceptedConn,
            self.inner.pds.as_deref(),
        )?;
        let Some(handler) = (self.inner.on_accept)(&conn) else {
            return Ok(());
        };
        conn.set_handler(handler);
        let prepared = prepared.expect("socket-mode connections come back prepared");
        // As for RDMA CM: none accepted after a release has swept.
        let serving = self.inner.serving.lock().expect("listener lock");
        if !*serving {
            drop(serving);
            // Its handler was given it above: it hears that it ended.
            conn.retire();
            return Ok(());
        }
        let hs = match Handshake::start(conn.clone(), stream, prepared, self.inner.deadline()) {
            Ok(hs) => hs,
            Err(e) => {
                // A failure may run `disconnected`, which may stop the
                // listener.
                drop(serving);
                conn.fail(&format!("socket-mode setup: {e}"));
                return Ok(());
            }
        };
        let source = Arc::new(HandshakeSource {
            listener: Arc::downgrade(&self.inner),
            hs,
            key: AtomicU64::new(0),
        });
        // Registered before it is watched, so its first event finds it.
        let mut handshakes = self.inner.handshakes.lock().expect("listener lock");
        let key = self.inner.rt.cm.add(source.clone());
        source.key.store(key, Ordering::SeqCst);
        handshakes.insert(key, source);
        drop(serving);
        Ok(())
    }
}

impl ListenerInner {
    /// Out of descriptors with none in reserve, a waiting TCP connection
    /// can be neither taken nor refused, and keeps the listening socket
    /// readable: it is not watched until the next tick, when the reserve is
    /// tried again (CM thread).
    fn pause_accepting(&self) {
        if !self.refusal_logged.swap(true, Ordering::Relaxed) {
            log::error!(
                "out of file descriptors, with none in reserve: socket-mode connections wait \
                 (tried again every tick)"
            );
        }
        self.accept_paused.store(true, Ordering::SeqCst);
        let key = self.source.swap(0, Ordering::SeqCst);
        if key != 0 {
            self.rt.cm.remove(key);
        }
    }

    /// A socket-mode exchange ended: the connection starts, or fails.
    fn handshake_done(&self, source: &HandshakeSource, result: Option<Error>) {
        let key = source.key.load(Ordering::SeqCst);
        if self
            .handshakes
            .lock()
            .expect("listener lock")
            .remove(&key)
            .is_none()
        {
            return; // Released meanwhile.
        }
        self.rt.cm.remove(key);
        let conn = &source.hs.conn;
        match result {
            None => {
                if let Endpoint::Socket { accepted, .. } = &self.endpoint {
                    let mut list = accepted.lock().expect("listener lock");
                    list.retain(|w| w.upgrade().is_some());
                    list.push(conn.downgrade());
                }
                self.expect_ready(conn, source.hs.deadline);
                conn.socket_accepted();
            }
            Some(e) if Instant::now() >= source.hs.deadline => {
                log::debug!("socket-mode setup of {:?}: {e}", conn.peer_addr());
                self.expire(conn, "no QP information");
            }
            Some(e) => conn.fail(&format!("socket-mode setup: {e}")),
        }
    }
}

/// A socket-mode QP exchange, watched on the CM thread.
pub(super) struct HandshakeSource {
    listener: Weak<ListenerInner>,
    pub(super) hs: Handshake,
    key: AtomicU64,
}

impl Source for HandshakeSource {
    fn fd(&self) -> RawFd {
        self.hs.fd()
    }

    fn ready(&self) -> Ready {
        let Some(listener) = self.listener.upgrade() else {
            return Ready::Done;
        };
        match self.hs.advance() {
            Progress::Waiting => self.tick(),
            Progress::Done => listener.handshake_done(self, None),
            Progress::Failed(e) => listener.handshake_done(self, Some(e)),
        }
        Ready::Done
    }

    /// It lives only until its exchange ends, or its deadline.
    fn wants_tick(&self) -> bool {
        true
    }

    /// A socket: readable while it has something.
    fn needs_looks(&self) -> bool {
        false
    }

    fn tick(&self) {
        if Instant::now() < self.hs.deadline {
            return;
        }
        if let Some(listener) = self.listener.upgrade() {
            let e = Error::Socket("no QP information".into());
            listener.handshake_done(self, Some(e));
        }
    }
}
