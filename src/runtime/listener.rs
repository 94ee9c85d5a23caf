//! A SnowRDMA server endpoint: listens through RDMA CM (or, in socket mode,
//! on a TCP port), accepts connections on the CM thread and hands each to
//! the owner's accept hook.

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::verbs::{CmEvent, CmEventKind, CmId, Context};

use super::conn::{CmSource, ConnHandler, ConnKind, Connection, Link, PdProvider, WeakConnection};
use super::options::Options;
use super::socket::{handshake, SocketLink};
use super::{runtime, Error, Result, Runtime};

/// Where connections come from.
enum Endpoint {
    Cm(CmId),
    /// Socket mode: QP information over TCP, QPs on `ctx`; the listener
    /// keeps its connections (RDMA CM ones are in the runtime's table).
    Socket {
        tcp: TcpListener,
        ctx: Context,
        accepted: Mutex<Vec<WeakConnection>>,
    },
}

/// Decides what handles a new connection; `None` rejects it. Runs on the CM
/// thread before the connection is accepted.
pub type AcceptHook = dyn Fn(&Connection) -> Option<Arc<dyn ConnHandler>> + Send + Sync;

pub(crate) struct ListenerInner {
    rt: Arc<Runtime>,
    endpoint: Endpoint,
    opts: Options,
    on_accept: Box<AcceptHook>,
    pds: Option<Box<PdProvider>>,
    serving: Mutex<bool>,
    cond: Condvar,
    released: AtomicBool,
    source: AtomicU64,
}

/// A listening server. Cheap to clone.
#[derive(Clone)]
pub struct Listener {
    inner: Arc<ListenerInner>,
}

impl Listener {
    /// Listens on `addr` (an address of an RDMA device; port 0 picks one).
    /// Nothing is accepted before [`Listener::start`].
    pub fn bind(addr: SocketAddr, opts: &Options, on_accept: Box<AcceptHook>) -> Result<Listener> {
        Listener::bind_shared(addr, opts, on_accept, None)
    }

    /// As [`Listener::bind`], with accepted connections built in the
    /// protection domain `pds` gives for their device.
    pub fn bind_shared(
        addr: SocketAddr,
        opts: &Options,
        on_accept: Box<AcceptHook>,
        pds: Option<Box<PdProvider>>,
    ) -> Result<Listener> {
        let endpoint = Endpoint::Cm(CmId::listen_on(addr, opts.listen_backlog)?);
        Listener::new(endpoint, opts, on_accept, pds)
    }

    /// Listens in socket mode: clients connect to TCP `addr` and exchange QP
    /// information there; QPs are made on `device` (a name, or the first
    /// device).
    pub fn bind_socket(
        addr: SocketAddr,
        device: Option<&str>,
        opts: &Options,
        on_accept: Box<AcceptHook>,
        pds: Option<Box<PdProvider>>,
    ) -> Result<Listener> {
        let ctx = Context::open(device)?;
        let tcp = TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| Error::Socket(format!("listening on {addr}: {e}")))?;
        let endpoint = Endpoint::Socket {
            tcp,
            ctx,
            accepted: Mutex::new(Vec::new()),
        };
        Listener::new(endpoint, opts, on_accept, pds)
    }

    fn new(
        endpoint: Endpoint,
        opts: &Options,
        on_accept: Box<AcceptHook>,
        pds: Option<Box<PdProvider>>,
    ) -> Result<Listener> {
        let rt = runtime()?;
        if opts.enable_phys_addr_access {
            super::conn::warn_no_phys_addr();
        }
        Ok(Listener {
            inner: Arc::new(ListenerInner {
                rt,
                endpoint,
                opts: opts.clone(),
                on_accept,
                pds,
                serving: Mutex::new(false),
                cond: Condvar::new(),
                released: AtomicBool::new(false),
                source: AtomicU64::new(0),
            }),
        })
    }

    /// The listening RDMA CM id (`None` in socket mode).
    pub fn cm_id(&self) -> Option<&CmId> {
        match &self.inner.endpoint {
            Endpoint::Cm(id) => Some(id),
            Endpoint::Socket { .. } => None,
        }
    }

    /// The device connections will arrive through, when the listener is
    /// bound to one (a specific address, or socket mode).
    pub fn device(&self) -> Option<Context> {
        match &self.inner.endpoint {
            Endpoint::Cm(id) => id.context(),
            Endpoint::Socket { ctx, .. } => Some(ctx.clone()),
        }
    }

    /// What the CM thread watches for new connections.
    pub(crate) fn fd(&self) -> RawFd {
        match &self.inner.endpoint {
            Endpoint::Cm(id) => id.channel().fd(),
            Endpoint::Socket { tcp, .. } => tcp.as_raw_fd(),
        }
    }

    pub fn options(&self) -> &Options {
        &self.inner.opts
    }

    /// The address actually bound (with the chosen port).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        match &self.inner.endpoint {
            Endpoint::Cm(id) => id.local_addr(),
            Endpoint::Socket { tcp, .. } => tcp.local_addr().ok(),
        }
    }

    /// Starts accepting connections (on the runtime's CM thread).
    pub fn start(&self) {
        *self.inner.serving.lock().expect("listener lock") = true;
        if self.inner.source.load(Ordering::SeqCst) == 0 {
            let key = self
                .inner
                .rt
                .cm
                .add(Arc::new(CmSource::Listener(self.clone())));
            self.inner.source.store(key, Ordering::SeqCst);
        }
    }

    /// Blocks until [`Listener::stop`] is called (from any thread).
    pub fn wait_stopped(&self) {
        let mut serving = self.inner.serving.lock().expect("listener lock");
        while *serving {
            serving = self.inner.cond.wait(serving).expect("listener lock");
        }
    }

    /// Stops accepting; connections already accepted keep running, and
    /// clients of this process are not affected.
    pub fn stop(&self) {
        *self.inner.serving.lock().expect("listener lock") = false;
        self.inner.cond.notify_all();
    }

    /// Stops, closes the connections this listener accepted, and stops
    /// listening.
    pub fn release(&self) {
        self.stop();
        if self.inner.released.swap(true, Ordering::SeqCst) {
            return;
        }
        let conns = match &self.inner.endpoint {
            Endpoint::Cm(id) => self.inner.rt.accepted_by(id.id_ref()),
            Endpoint::Socket { accepted, .. } => accepted
                .lock()
                .expect("listener lock")
                .drain(..)
                .filter_map(|w| w.upgrade())
                .collect(),
        };
        for conn in conns {
            conn.close();
        }
        let key = self.inner.source.swap(0, Ordering::SeqCst);
        if key != 0 {
            self.inner.rt.cm.remove(key);
        }
    }

    /// An event on the listening channel (CM thread).
    pub(crate) fn on_cm_event(&self, mut ev: CmEvent) {
        if ev.kind != CmEventKind::CONNECT_REQUEST {
            match self.inner.rt.accepted_conn(ev.id) {
                Some(conn) => conn.on_cm_event(&ev),
                None => log::debug!("RDMA CM event {} for a connection already gone", ev.kind),
            }
            return;
        }
        let Some(id) = ev.take_new_id() else { return };
        if !*self.inner.serving.lock().expect("listener lock") {
            let _ = id.reject(&[]);
            return;
        }
        let Endpoint::Cm(listen_id) = &self.inner.endpoint else {
            return;
        };
        let conn = match Connection::build(
            self.inner.rt.clone(),
            Link::Cm(id.clone()),
            &self.inner.opts,
            ConnKind::Accepted,
            self.inner.pds.as_deref(),
        ) {
            Ok((c, _)) => c,
            Err(e) => {
                log::warn!("refusing a connection from {:?}: {e}", id.peer_addr());
                let _ = id.reject(&[]);
                return;
            }
        };
        let Some(handler) = (self.inner.on_accept)(&conn) else {
            let _ = id.reject(&[]);
            return;
        };
        conn.set_handler(handler);
        self.inner.rt.remember_accepted(listen_id.id_ref(), &conn);
        conn.start_completions();
        if let Err(e) = id.accept(&conn.conn_param()) {
            conn.fail(&format!("rdma_accept: {e}"));
        }
    }

    /// Takes the waiting TCP connections (socket mode, CM thread).
    pub(crate) fn accept_sockets(&self) {
        let Endpoint::Socket { tcp, .. } = &self.inner.endpoint else {
            return;
        };
        loop {
            match tcp.accept() {
                Ok((stream, peer)) => {
                    if let Err(e) = self.accept_socket(stream, peer) {
                        log::warn!("refusing a socket-mode connection from {peer}: {e}");
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::warn!("accepting a socket-mode connection: {e}");
                    return;
                }
            }
        }
    }

    /// Sets up one socket-mode connection. The QP exchange blocks this (CM)
    /// thread for at most the configured timeout per step.
    fn accept_socket(&self, stream: TcpStream, peer: SocketAddr) -> Result<()> {
        let Endpoint::Socket { ctx, accepted, .. } = &self.inner.endpoint else {
            return Ok(());
        };
        if !*self.inner.serving.lock().expect("listener lock") {
            return Ok(());
        }
        let dup = |s: &TcpStream| {
            s.try_clone()
                .map_err(|e| Error::Socket(format!("duplicating the socket: {e}")))
        };
        stream
            .set_nonblocking(false)
            .map_err(|e| Error::Socket(format!("{e}")))?;
        let _ = stream.set_nodelay(true);
        let link = SocketLink {
            stream: dup(&stream)?,
            peer,
            ctx: ctx.clone(),
        };
        let (conn, prepared) = Connection::build(
            self.inner.rt.clone(),
            Link::Socket(link),
            &self.inner.opts,
            ConnKind::Accepted,
            self.inner.pds.as_deref(),
        )?;
        let Some(handler) = (self.inner.on_accept)(&conn) else {
            return Ok(());
        };
        conn.set_handler(handler);
        let prepared = prepared.expect("socket-mode connections come back prepared");
        handshake(&stream, prepared, self.inner.opts.timeout)?;
        let mut list = accepted.lock().expect("listener lock");
        list.retain(|w| w.upgrade().is_some());
        list.push(conn.downgrade());
        drop(list);
        conn.socket_accepted();
        Ok(())
    }
}
