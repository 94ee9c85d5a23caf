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
use std::net::{SocketAddr, TcpListener};
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
use super::{runtime, Error, Result, Runtime};
use socket_mode::HandshakeSource;

mod socket_mode;

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
        Listener::bind_socket_on(addr, Context::open(device)?, opts, on_accept, pds)
    }

    /// [`Listener::bind_socket`] on a device already open: a server started
    /// again keeps the context its memory is registered with.
    pub fn bind_socket_on(
        addr: SocketAddr,
        ctx: Context,
        opts: &Options,
        on_accept: Box<AcceptHook>,
        pds: Option<Box<PdProvider>>,
    ) -> Result<Listener> {
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
    /// [`Error::Disconnected`] once the listener is released: its port is
    /// given back and nothing may watch it again (a start racing the
    /// release on another thread would otherwise serve, and wait, for
    /// good).
    pub fn start(&self) -> Result<()> {
        let mut serving = self.inner.serving.lock().expect("listener lock");
        if self.inner.released.load(Ordering::SeqCst) {
            return Err(Error::Disconnected);
        }
        *serving = true;
        self.watch_listening();
        if self.inner.reaper.load(Ordering::SeqCst) == 0 {
            let reaper = Arc::new(SetupReaper(Arc::downgrade(&self.inner)));
            let key = self.inner.rt.cm.add(reaper);
            self.inner.reaper.store(key, Ordering::SeqCst);
        }
        Ok(())
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
        // Under the `serving` lock, which `start` checks it under: a start
        // after this point is refused, one before it is undone below.
        let mut serving = self.inner.serving.lock().expect("listener lock");
        *serving = false;
        let again = self.inner.released.swap(true, Ordering::SeqCst);
        drop(serving);
        self.inner.cond.notify_all();
        if again {
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
        // Accepting holds the `serving` lock from its last check until the
        // connection is remembered here, so none accepted after `stop` is
        // missed. Each is retired here too: the events of an RDMA CM one
        // come on the listening channel, which is not read from now on.
        for conn in conns {
            conn.close();
            conn.retire();
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
            // Its handler was given it at accept: it hears that it ended.
            hs.hs.conn.retire();
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
        // Released while it was built, or by the hook: the release's sweep
        // of accepted connections would not find it.
        let serving = self.inner.serving.lock().expect("listener lock");
        if !*serving {
            let _ = id.reject(&[]);
            drop(serving);
            // Its handler was given it above: it hears that it ended.
            conn.retire();
            return;
        }
        self.inner.rt.remember_accepted(listen_id.id_ref(), &conn);
        conn.start_completions();
        self.inner.expect_ready(&conn, self.inner.deadline());
        let accepted = id.accept(&conn.conn_param());
        // A failure may run `disconnected`, which may stop the listener.
        drop(serving);
        if let Err(e) = accepted {
            conn.fail(&format!("rdma_accept: {e}"));
        }
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
