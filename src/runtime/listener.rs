//! A SnowRDMA server endpoint: listens through RDMA CM, accepts connections
//! on the CM thread and hands each to the owner's accept hook.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::verbs::{CmEvent, CmEventKind, CmId};

use super::conn::{CmSource, ConnHandler, ConnKind, Connection, PdProvider};
use super::options::Options;
use super::{runtime, Result, Runtime};

/// Decides what handles a new connection; `None` rejects it. Runs on the CM
/// thread before the connection is accepted.
pub type AcceptHook = dyn Fn(&Connection) -> Option<Arc<dyn ConnHandler>> + Send + Sync;

pub(crate) struct ListenerInner {
    rt: Arc<Runtime>,
    id: CmId,
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
        let rt = runtime()?;
        let id = CmId::listen_on(addr, opts.listen_backlog)?;
        if opts.enable_phys_addr_access {
            super::conn::warn_no_phys_addr();
        }
        Ok(Listener {
            inner: Arc::new(ListenerInner {
                rt,
                id,
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

    pub fn cm_id(&self) -> &CmId {
        &self.inner.id
    }

    pub fn options(&self) -> &Options {
        &self.inner.opts
    }

    /// The address actually bound (with the chosen port).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.id.local_addr()
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
        for conn in self.inner.rt.accepted_by(self.inner.id.id_ref()) {
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
        let conn = match Connection::build(
            self.inner.rt.clone(),
            id.clone(),
            &self.inner.opts,
            ConnKind::Accepted,
            self.inner.pds.as_deref(),
        ) {
            Ok(c) => c,
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
        self.inner
            .rt
            .remember_accepted(self.inner.id.id_ref(), &conn);
        conn.start_completions();
        if let Err(e) = id.accept(&conn.conn_param()) {
            conn.fail(&format!("rdma_accept: {e}"));
        }
    }
}
