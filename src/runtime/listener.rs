//! A SnowRDMA server endpoint: listens through RDMA CM (or, in socket mode,
//! on a TCP port), accepts connections on the CM thread and hands each to
//! the owner's accept hook.
//!
//! Setup has a deadline ([`Options::setup_deadline`]): an accepted
//! connection whose peer has not finished the handshake and advertised its
//! ring by then is dropped. Socket-mode QP exchanges are driven by the CM
//! thread as bytes arrive, never waited for, so a silent peer delays no one.
//! At most [`Options::max_setups`] setups are under way at once: a connect
//! request past them is refused before anything is built for it, so a
//! flood of requests that never finish pins no more than that many
//! connections' memory.

use std::collections::HashMap;
use std::fs::File;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Instant;

use crate::verbs::{CmEvent, CmEventKind, CmId, Context};

use super::conn::{
    CmSource, ConnHandler, ConnKind, ConnState, Connection, Link, PdProvider, WeakConnection,
};
use super::options::Options;
use super::poller::{Ready, Source};
use super::socket::{Handshake, Progress, SocketLink};
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
        /// A descriptor held in reserve (`/dev/null`), given up for a
        /// moment when the process has run out of them: see
        /// [`Listener::refuse_without_descriptors`].
        reserve: Mutex<Option<File>>,
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
    /// The poller key of the [`SetupReaper`].
    reaper: AtomicU64,
    /// Accepted connections not ready yet, with their deadlines.
    pending: Mutex<Vec<(WeakConnection, Instant)>>,
    /// Socket-mode QP exchanges under way, by poller key.
    handshakes: Mutex<HashMap<u64, Arc<HandshakeSource>>>,
    setup_timeouts: AtomicU64,
    /// Connect requests refused because `max_setups` setups were under
    /// way.
    setups_refused: AtomicU64,
    /// A refusal was logged and no connection finished its setup since.
    refusal_logged: AtomicBool,
    /// A timeout was logged and no connection finished its setup since:
    /// one line per episode, not one per silent peer.
    timeout_logged: AtomicBool,
    /// Socket mode, out of descriptors with none in reserve: the listening
    /// socket, readable while a connection waits, is not watched until the
    /// [`SetupReaper`]'s next tick.
    accept_paused: AtomicBool,
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
            reserve: Mutex::new(File::open("/dev/null").ok()),
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
                reaper: AtomicU64::new(0),
                pending: Mutex::new(Vec::new()),
                handshakes: Mutex::new(HashMap::new()),
                setup_timeouts: AtomicU64::new(0),
                setups_refused: AtomicU64::new(0),
                refusal_logged: AtomicBool::new(false),
                timeout_logged: AtomicBool::new(false),
                accept_paused: AtomicBool::new(false),
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

    /// Accepted connections dropped because their setup passed
    /// [`Options::setup_deadline`].
    pub fn setup_timeouts(&self) -> u64 {
        self.inner.setup_timeouts.load(Ordering::Relaxed)
    }

    /// Connect requests refused: [`Options::max_setups`] setups were under
    /// way, the connection could not be built (out of memory, queue pairs
    /// or file descriptors), or (socket mode) the process had no descriptor
    /// left to accept it.
    pub fn setups_refused(&self) -> u64 {
        self.inner.setups_refused.load(Ordering::Relaxed)
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
        let mut serving = self.inner.serving.lock().expect("listener lock");
        *serving = true;
        self.watch_listening();
        if self.inner.reaper.load(Ordering::SeqCst) == 0 {
            let reaper = Arc::new(SetupReaper(Arc::downgrade(&self.inner)));
            let key = self.inner.rt.cm.add(reaper);
            self.inner.reaper.store(key, Ordering::SeqCst);
        }
    }

    /// Has the CM thread watch the listening channel or socket, unless it
    /// does (under the `serving` lock).
    fn watch_listening(&self) {
        if self.inner.source.load(Ordering::SeqCst) == 0 {
            let key = self
                .inner
                .rt
                .cm
                .add(Arc::new(CmSource::Listener(self.clone())));
            self.inner.source.store(key, Ordering::SeqCst);
        }
    }

    /// Watches the listening socket again after a pause for want of
    /// descriptors ([`ListenerInner::accept_paused`]; CM thread, on a
    /// tick), unless the listener has stopped meanwhile
    /// ([`Listener::start`] watches it again).
    fn resume_accepting(&self) {
        let serving = self.inner.serving.lock().expect("listener lock");
        if self.inner.accept_paused.swap(false, Ordering::SeqCst) && *serving {
            self.watch_listening();
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
        let handshakes: Vec<_> = self
            .inner
            .handshakes
            .lock()
            .expect("listener lock")
            .drain()
            .collect();
        for (key, hs) in handshakes {
            self.inner.rt.cm.remove(key);
            hs.hs.conn.close();
        }
        for slot in [&self.inner.source, &self.inner.reaper] {
            let key = slot.swap(0, Ordering::SeqCst);
            if key != 0 {
                self.inner.rt.cm.remove(key);
            }
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
        if !*self.inner.serving.lock().expect("listener lock") || !self.inner.room_for_a_setup() {
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
            ConnKind::AcceptedConn,
            self.inner.pds.as_deref(),
        ) {
            Ok((c, _)) => c,
            Err(e) => {
                let _ = id.reject(&[]);
                self.inner
                    .refused(|| format!("refusing a connection from {:?}: {e}", id.peer_addr()));
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
        self.inner.expect_ready(&conn, self.inner.deadline());
        if let Err(e) = id.accept(&conn.conn_param()) {
            conn.fail(&format!("rdma_accept: {e}"));
        }
    }

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
        let hs = match Handshake::start(conn.clone(), stream, prepared, self.inner.deadline()) {
            Ok(hs) => hs,
            Err(e) => {
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
        Ok(())
    }
}

impl ListenerInner {
    fn deadline(&self) -> Instant {
        Instant::now() + self.opts.setup_deadline
    }

    /// Whether fewer than `max_setups` setups are under way (CM thread,
    /// which alone adds them); counts a refusal when not.
    fn room_for_a_setup(&self) -> bool {
        let most = match self.opts.max_setups {
            0 => super::options::DEFAULT_MAX_SETUPS,
            n => n,
        };
        let exchanging = self.handshakes.lock().expect("listener lock").len();
        let waiting = self
            .pending
            .lock()
            .expect("listener lock")
            .iter()
            .filter_map(|(weak, _)| weak.upgrade())
            .filter(|c| {
                !matches!(
                    c.state(),
                    ConnState::MrReady | ConnState::Closed | ConnState::Error
                )
            })
            .count();
        if exchanging + waiting < most {
            return true;
        }
        self.refused(|| {
            format!(
                "refusing connect requests: {most} setups are under way (Options::max_setups, {})",
                super::options::MAX_SETUPS_ENV
            )
        });
        false
    }

    /// Counts a refused connection, and logs `why` if it is the first
    /// refusal since a connection completed its setup.
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

    fn refused(&self, why: impl FnOnce() -> String) {
        if !self.refusal_logged.swap(true, Ordering::Relaxed) {
            log::warn!(
                "{} (further refusals are not logged until a connection completes its setup)",
                why()
            );
        }
        self.setups_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Watches an accepted connection until it is ready or its deadline.
    fn expect_ready(&self, conn: &Connection, deadline: Instant) {
        let mut pending = self.pending.lock().expect("listener lock");
        pending.push((conn.downgrade(), deadline));
    }

    /// Drops a connection whose setup took too long (CM thread).
    fn expire(&self, conn: &Connection, what: &str) {
        let deadline = self.opts.setup_deadline;
        // Checked again where it ends: it may have finished since it was
        // found late.
        if !conn.fail_setup(&format!("{what} within {deadline:?}")) {
            return;
        }
        if !self.timeout_logged.swap(true, Ordering::Relaxed) {
            log::warn!(
                "dropping {:?}: {what} within {deadline:?} (further ones are not logged until a \
                 connection completes its setup)",
                conn.peer_addr()
            );
        } else {
            log::debug!(
                "dropping {:?}: {what} within {deadline:?}",
                conn.peer_addr()
            );
        }
        // Counted once it is gone, so whoever sees the count sees it gone.
        self.setup_timeouts.fetch_add(1, Ordering::Relaxed);
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

    /// Ends the setups that passed their deadline (CM thread, each tick).
    fn reap(&self) {
        let now = Instant::now();
        let mut late = Vec::new();
        self.pending
            .lock()
            .expect("listener lock")
            .retain(|(weak, deadline)| {
                let Some(conn) = weak.upgrade() else {
                    return false;
                };
                match conn.state() {
                    ConnState::MrReady => {
                        self.timeout_logged.store(false, Ordering::Relaxed);
                        self.refusal_logged.store(false, Ordering::Relaxed);
                        false
                    }
                    ConnState::Closed | ConnState::Error => false,
                    _ if now >= *deadline => {
                        late.push(conn);
                        false
                    }
                    _ => true,
                }
            });
        for conn in late {
            self.expire(&conn, "the peer did not finish connecting");
        }
    }
}

/// A socket-mode QP exchange, watched on the CM thread.
struct HandshakeSource {
    listener: Weak<ListenerInner>,
    hs: Handshake,
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

/// Ends a listener's connections whose setup passed its deadline.
struct SetupReaper(Weak<ListenerInner>);

impl Source for SetupReaper {
    fn fd(&self) -> RawFd {
        -1
    }

    fn ready(&self) -> Ready {
        Ready::Done
    }

    /// While setups are pending (added on this thread, which looks again
    /// before it sleeps), or accepting is paused.
    fn wants_tick(&self) -> bool {
        self.0.upgrade().is_some_and(|l| {
            l.accept_paused.load(Ordering::SeqCst)
                || !l.pending.lock().expect("listener lock").is_empty()
        })
    }

    fn tick(&self) {
        if let Some(inner) = self.0.upgrade() {
            inner.reap();
            if inner.accept_paused.load(Ordering::SeqCst) {
                Listener { inner }.resume_accepting();
            }
        }
    }

    /// It has no fd, only ticks.
    fn needs_looks(&self) -> bool {
        false
    }
}
