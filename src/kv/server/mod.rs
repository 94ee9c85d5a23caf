//! The key-value server: accepts clients through the runtime (RDMA CM or a
//! TCP exchange of QP information), answers requests, and keeps per-client
//! state (request buffer, leases of values being read, write targets).
//!
//! Threads: requests are parsed on the runtime's completion thread; small
//! ones are answered there, ones that copy or register large values go to
//! the client's worker (one of `workers`), and once a client has work queued
//! there, its later requests follow it, so each client's requests take
//! effect in the order it sent them.
//!
//! Limits ([`Limits`], in `limits.rs`) bound what one client can make the
//! server hold: connections, setup time, queued replies and requests, large
//! values and leases.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock, Weak};
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::runtime::{
    self, AcceptHook, CommMode, ConnHandler, Connection, Listener, Options, PdProvider, Window,
};

use super::limits::{HostConnections, Leases, Limits, MAX_WORKERS};
use super::pool::SLAB_PAGE;
use super::proto::{Request, REQUEST_LEN};
use super::store::Store;
use super::{
    ConnMode, KvError, Result, DEFAULT_MAX_VALUE, LARGEST_MAX_VALUE, LARGEST_REQUEST_BUF,
    MAX_KEY_LEN, MAX_VALUE_ENV,
};

mod answer;
mod conn;
mod device;
mod limits;
mod stats;
mod targets;
mod threads;

use answer::Answer;
use conn::ServerConn;
use device::{only_device, socket_device};
use limits::check_limits;
pub use stats::Stats;
use stats::{bump, Counters, Episodes};
use targets::Targets;

/// Leases one client may hold; beyond, its oldest lease ends (the byte cap
/// is [`Limits::lease_bytes`]).
const MAX_LEASES: usize = 4096;

/// How a server is set up. `Default` gives the legacy program's defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub addr: SocketAddr,
    /// Slab pool size in bytes.
    pub memory_size: usize,
    pub huge_pages: bool,
    /// Hash index buckets.
    pub table_size: usize,
    /// Worker threads (0 starts one); at most [`MAX_WORKERS`].
    pub workers: usize,
    pub conn_mode: ConnMode,
    /// Device name (socket mode); `None`: the first device.
    pub device: Option<String>,
    /// Largest value accepted (`SNOWRDMA_KV_MAX_VALUE`, default 1 GiB; at
    /// most [`LARGEST_MAX_VALUE`]).
    pub max_value: u64,
    /// Each client's request buffer (values up to this size are PUT in one
    /// round trip).
    pub request_buf_len: usize,
    /// What clients may make the server hold (the starting values:
    /// [`Server::set_limits`] changes them).
    pub limits: Limits,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            addr: SocketAddr::from(([0, 0, 0, 0], crate::kv::SERVER_PORT)),
            memory_size: 1024 << 20,
            huge_pages: false,
            table_size: 65536,
            workers: 4,
            conn_mode: ConnMode::Cm,
            device: None,
            max_value: max_value_from_env(),
            request_buf_len: SLAB_PAGE,
            limits: Limits::default(),
        }
    }
}

/// `SNOWRDMA_KV_MAX_VALUE`, or the default; a value past
/// [`LARGEST_MAX_VALUE`] (say `u64::MAX` meant as "no limit") is taken as
/// that bound, with a warning, rather than making every server fail.
fn max_value_from_env() -> u64 {
    let asked = std::env::var(MAX_VALUE_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_MAX_VALUE);
    if asked > LARGEST_MAX_VALUE {
        log::warn!("{MAX_VALUE_ENV}={asked} is past the largest value any client holds: using {LARGEST_MAX_VALUE}");
    }
    asked.min(LARGEST_MAX_VALUE)
}

/// What the server keeps per client.
struct ClientState {
    /// The only server memory this client may write, through a window
    /// bound to its QP (set once the connection is up).
    request_buf: OnceLock<Window>,
    leases: Mutex<Leases>,
    targets: Mutex<Targets>,
    next_token: AtomicU64,
    worker: usize,
    /// Its address, counted in [`Shared::hosts`] until it is forgotten.
    host: Option<IpAddr>,
    /// Requests of this client waiting at or running on its worker, or
    /// served there with their answers not yet sent (at most 32 of them,
    /// for about 100 us: `threads::worker`).
    queued: AtomicUsize,
    gone: AtomicBool,
}

struct Job {
    conn: Connection,
    client: Arc<ClientState>,
    msg: Vec<u8>,
}

struct Shared {
    cfg: ServerConfig,
    store: Store,
    counters: Counters,
    episodes: Episodes,
    limits: RwLock<Limits>,
    jobs: Mutex<Vec<Sender<Job>>>,
    next_client: AtomicUsize,
    /// Clients per address, against [`Limits::host_connections`].
    hosts: HostConnections,
    /// For the lease sweep.
    clients: Mutex<Vec<Weak<ClientState>>>,
    /// To the housekeeping thread, while running.
    chores: Mutex<Option<Sender<Chore>>>,
    /// Jobs' message buffers, handed back by the workers for the next job.
    spare_msgs: (Sender<Vec<u8>>, Receiver<Vec<u8>>),
}

/// Work for the housekeeping thread (which also ends expired leases).
enum Chore {
    /// The lease time may have changed: wakes the thread to look.
    Sweep,
    /// Memory to let go of ([`Shared::discard`]).
    Discard(Box<dyn Send>),
    Stop,
}

/// Chores waiting for the housekeeping thread (a wake to sweep is
/// dropped when one is waiting already, memory to let go of is let go of
/// where it is).
const CHORES: usize = 256;

/// Jobs' message buffers kept for reuse: more than the requests a burst
/// of large PUTs keeps in the workers' queues at once.
const SPARE_MSGS: usize = 256;

/// A kept buffer's largest capacity: room for a request's header and longest key
/// (a worker's job carries no value, except an inline one queued behind
/// this client's jobs, which may grow a buffer past this).
const SPARE_MSG_BYTES: usize = REQUEST_LEN + 2 * MAX_KEY_LEN;

/// The pool of jobs' message buffers, full from the start (half a MiB): a
/// burst of large PUTs bigger than any before (as when the completion
/// thread takes a stream's requests a nap's worth at a time) then takes its
/// buffers from it rather than from the heap.
fn spare_msgs() -> (Sender<Vec<u8>>, Receiver<Vec<u8>>) {
    let (tx, rx) = bounded(SPARE_MSGS);
    for _ in 0..SPARE_MSGS {
        let _ = tx.try_send(Vec::with_capacity(SPARE_MSG_BYTES));
    }
    (tx, rx)
}

/// A key-value server. Create, [`Server::start`], [`Server::stop`]; dropping
/// it stops it.
pub struct Server {
    shared: Arc<Shared>,
    listener: Mutex<Option<Listener>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl Server {
    /// Maps the pool and the index; nothing listens before `start`.
    pub fn new(cfg: ServerConfig) -> Result<Server> {
        if cfg.table_size == 0 || cfg.memory_size == 0 {
            return Err(KvError::InvalidArgument(
                "the table size and memory size must be positive".into(),
            ));
        }
        // Checked here, not at start: every worker is a thread spawned
        // then, and a count no machine can use is a mistake.
        if cfg.workers > MAX_WORKERS {
            return Err(KvError::InvalidArgument(format!(
                "{} workers asked for, more than the maximum of {MAX_WORKERS}",
                cfg.workers
            )));
        }
        // Clients refuse a server advertising more: refused here, it is a
        // clear error at create rather than every connect failing.
        if cfg.max_value > LARGEST_MAX_VALUE {
            return Err(KvError::InvalidArgument(format!(
                "a largest value of {} bytes, more than the maximum of {LARGEST_MAX_VALUE}",
                cfg.max_value
            )));
        }
        if cfg.request_buf_len as u64 > LARGEST_REQUEST_BUF {
            return Err(KvError::InvalidArgument(format!(
                "a request buffer of {} bytes, more than the maximum of {LARGEST_REQUEST_BUF}",
                cfg.request_buf_len
            )));
        }
        check_limits(&cfg.limits)?;
        let store = Store::new(
            cfg.memory_size,
            cfg.huge_pages,
            cfg.table_size,
            cfg.max_value,
        )?;
        store
            .large_quota
            .store(cfg.limits.large_value_quota, Ordering::Relaxed);
        Ok(Server {
            shared: Arc::new(Shared {
                limits: RwLock::new(cfg.limits.clone()),
                cfg,
                store,
                counters: Counters::default(),
                episodes: Episodes::default(),
                jobs: Mutex::new(Vec::new()),
                next_client: AtomicUsize::new(0),
                hosts: HostConnections::default(),
                clients: Mutex::new(Vec::new()),
                chores: Mutex::new(None),
                spare_msgs: spare_msgs(),
            }),
            listener: Mutex::new(None),
            workers: Mutex::new(Vec::new()),
        })
    }

    /// The configuration it was created with (`limits` as they were then:
    /// see [`Server::limits`]).
    pub fn config(&self) -> &ServerConfig {
        &self.shared.cfg
    }

    pub fn limits(&self) -> Limits {
        self.shared.limits.read().expect("limits lock").clone()
    }

    /// Changes the limits. The connection, request, quota and lease limits
    /// apply at once; `setup_deadline`, `reply_queue_bytes` and
    /// `worker_queue` from the next [`Server::start`].
    pub fn set_limits(&self, limits: Limits) -> Result<()> {
        self.update_limits(|l| *l = limits)
    }

    /// Changes some of the limits, in one step against others changing
    /// them: `change` gets the limits now, and what it leaves is checked
    /// and set as by [`Server::set_limits`] (or, refused, nothing changes).
    pub fn update_limits(&self, change: impl FnOnce(&mut Limits)) -> Result<()> {
        let mut now = self.shared.limits.write().expect("limits lock");
        let mut limits = now.clone();
        change(&mut limits);
        check_limits(&limits)?;
        self.shared
            .store
            .large_quota
            .store(limits.large_value_quota, Ordering::Relaxed);
        *now = limits;
        drop(now);
        // The housekeeping thread may sleep until a lease's end under the
        // old lease time: it compares the lease time at every wakeup, and
        // this wakes it (a full queue of chores wakes it anyway).
        if let Some(chores) = self.shared.chores.lock().expect("chores lock").as_ref() {
            let _ = chores.try_send(Chore::Sweep);
        }
        Ok(())
    }

    /// Starts the workers and listens; returns once clients can connect.
    pub fn start(&self) -> Result<()> {
        let mut slot = self.listener.lock().expect("server lock");
        if slot.is_some() {
            return Err(KvError::InvalidArgument(
                "the server is already running".into(),
            ));
        }
        self.start_workers()?;
        let limits = self.limits();
        // Replies never wait for room: one that finds none is queued, up to
        // the client's cap, so a slow client never holds up a worker that
        // serves others too.
        let opts = Options {
            comm_mode: CommMode::NonBlocking,
            max_inline_data: super::MESSAGE_INLINE,
            send_queue_bytes: limits.reply_queue_bytes,
            setup_deadline: limits.setup_deadline,
            ..Options::default()
        };
        let accept_shared = self.shared.clone();
        let pd_shared = self.shared.clone();
        let on_accept: Box<AcceptHook> = Box::new(move |conn| Shared::accept(&accept_shared, conn));
        let pds: Box<PdProvider> = Box::new(move |ctx| {
            pd_shared.store.attach(ctx).map_err(|e| {
                runtime::Error::InvalidArgument(format!("cannot serve this client: {e}"))
            })
        });
        let cfg = &self.shared.cfg;
        let listener = match cfg.conn_mode {
            ConnMode::Cm => Listener::bind_shared(cfg.addr, &opts, on_accept, Some(pds)),
            ConnMode::Socket => {
                socket_device(&self.shared.store, cfg.device.as_deref()).and_then(|ctx| {
                    Listener::bind_socket_on(cfg.addr, ctx, &opts, on_accept, Some(pds))
                })
            }
        }
        .map_err(|e| KvError::Internal(format!("listening on {}: {e}", cfg.addr)))?;
        // Registering the pool faults in and pins all of it, which takes
        // seconds for a large pool on a slow machine: done now rather than
        // inside the first client's connection setup, which would time out.
        if let Some(ctx) = listener.device().or_else(|| only_device(cfg.addr)) {
            self.shared.store.attach(&ctx)?;
        }
        // A listener made here, released only through `slot`: it starts.
        listener
            .start()
            .map_err(|e| KvError::Internal(format!("starting the listener: {e}")))?;
        *slot = Some(listener);
        Ok(())
    }

    fn start_workers(&self) -> Result<()> {
        let mut jobs = self.shared.jobs.lock().expect("jobs lock");
        let mut handles = self.workers.lock().expect("workers lock");
        let depth = self.limits().worker_queue;
        // A worker polls for its next job under the runtime's spin policy
        // and budget before it sleeps on its queue (`threads::worker`).
        let spin = Options::default().spin;
        for n in 0..self.shared.cfg.workers.max(1) {
            let (tx, rx) = bounded::<Job>(depth);
            let shared = self.shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("kv-worker-{n}"))
                .spawn(move || threads::worker(shared, rx, spin))
                .map_err(|e| KvError::Internal(format!("starting a worker: {e}")))?;
            jobs.push(tx);
            handles.push(handle);
        }
        let (tx, rx) = bounded::<Chore>(CHORES);
        // In place before the thread starts, so that no `set_limits` in
        // between goes unheard.
        *self.shared.chores.lock().expect("chores lock") = Some(tx);
        let shared = self.shared.clone();
        let housekeeper = std::thread::Builder::new()
            .name("kv-housekeeping".into())
            .spawn(move || threads::housekeeping(shared, rx))
            .map_err(|e| {
                *self.shared.chores.lock().expect("chores lock") = None;
                KvError::Internal(format!("starting the housekeeping thread: {e}"))
            })?;
        handles.push(housekeeper);
        Ok(())
    }

    /// The address clients connect to (with the port actually bound).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener
            .lock()
            .expect("server lock")
            .as_ref()
            .and_then(|l| l.local_addr())
    }

    /// Stops listening, disconnects every client and ends the workers.
    pub fn stop(&self) {
        if let Some(listener) = self.listener.lock().expect("server lock").take() {
            listener.release();
            self.shared
                .counters
                .setup_timeouts
                .fetch_add(listener.setup_timeouts(), Ordering::Relaxed);
        }
        self.shared.jobs.lock().expect("jobs lock").clear();
        if let Some(chores) = self.shared.chores.lock().expect("chores lock").take() {
            let _ = chores.send(Chore::Stop);
        }
        for handle in self.workers.lock().expect("workers lock").drain(..) {
            let _ = handle.join();
        }
    }

    pub fn stats(&self) -> Stats {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let store = &self.shared.store;
        Stats {
            clients: get(&c.clients),
            clients_total: get(&c.clients_total),
            gets: get(&c.gets),
            get_misses: get(&c.get_misses),
            puts: get(&c.puts),
            deletes: get(&c.deletes),
            cas_ok: get(&c.cas_ok),
            cas_failed: get(&c.cas_failed),
            errors: get(&c.errors),
            items: store.items(),
            pool_used: store.pool().used(),
            pool_size: store.pool().mapping().len() as u64,
            large_bytes: store.own_bytes(),
            huge_pages: store.pool().mapping().is_huge(),
            refused_connections: get(&c.refused_connections),
            setup_timeouts: get(&c.setup_timeouts)
                + self
                    .listener
                    .lock()
                    .expect("server lock")
                    .as_ref()
                    .map_or(0, |l| l.setup_timeouts()),
            reply_overflows: get(&c.reply_overflows),
            busy_refusals: get(&c.busy_refusals),
            worker_queue_full: get(&c.worker_queue_full),
            quota_refusals: store.quota_refusals(),
            leases_capped: get(&c.leases_capped),
            leases_expired: get(&c.leases_expired),
            targets_capped: get(&c.targets_capped),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    /// Sets up a new client (CM thread, before the connection is accepted).
    fn accept(self: &Arc<Self>, conn: &Connection) -> Option<Arc<dyn ConnHandler>> {
        let max = self.limit(|l| l.max_connections);
        if self.counters.clients.load(Ordering::Relaxed) >= max as u64 {
            bump(&self.counters.refused_connections);
            self.episodes.refused.hit(|| {
                format!(
                    "refusing {:?}: {max} clients connected (the maximum)",
                    conn.peer_addr()
                )
            });
            return None;
        }
        let host = conn.peer_addr().map(|a| a.ip());
        if let Some(ip) = host {
            let cap = self.limit(|l| l.host_connections);
            if !self.hosts.admit(ip, cap) {
                bump(&self.counters.refused_connections);
                self.episodes.refused.hit(|| {
                    format!("refusing {ip}: {cap} clients from it connected (the maximum)")
                });
                return None;
            }
        }
        let client = Arc::new(ClientState {
            request_buf: OnceLock::new(),
            leases: Mutex::new(Leases::default()),
            targets: Mutex::new(Targets::default()),
            next_token: AtomicU64::new(1),
            worker: self.next_client.fetch_add(1, Ordering::Relaxed),
            host,
            queued: AtomicUsize::new(0),
            gone: AtomicBool::new(false),
        });
        bump(&self.counters.clients);
        bump(&self.counters.clients_total);
        let mut clients = self.clients.lock().expect("clients lock");
        clients.retain(|c| c.strong_count() > 0);
        clients.push(Arc::downgrade(&client));
        drop(clients);
        log::info!("client {:?} connected", conn.peer_addr());
        Some(Arc::new(ServerConn::new(self.clone(), client)))
    }

    /// A client went away: its leases and targets end now.
    fn forget(&self, client: &ClientState) {
        if client.gone.swap(true, Ordering::SeqCst) {
            return;
        }
        self.counters.clients.fetch_sub(1, Ordering::Relaxed);
        if let Some(ip) = client.host {
            self.hosts.leave(ip);
        }
        // A request that panicked holding one of these (the reason it is
        // forgotten, perhaps) left it poisoned; it is emptied all the same.
        let leases =
            std::mem::take(&mut *client.leases.lock().unwrap_or_else(PoisonError::into_inner));
        let targets = client
            .targets
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take_all();
        // This runs on the completion thread when the client leaves.
        self.discard((leases, targets));
    }

    /// Lets go of `what` on the housekeeping thread: unregistering and
    /// unmapping a large value or a write target takes milliseconds per
    /// MiB (far more under emulation), and the completion thread, which
    /// answers every client's light requests (a RELEASE, a GET), must not
    /// spend them. Here, when that thread is not running or its queue is
    /// full.
    pub(super) fn discard(&self, what: impl Send + 'static) {
        let chore = Chore::Discard(Box::new(what));
        let chores = self.chores.lock().unwrap_or_else(PoisonError::into_inner);
        let left = match chores.as_ref() {
            Some(tx) => tx.try_send(chore).err().map(|e| e.into_inner()),
            None => Some(chore),
        };
        drop(chores);
        drop(left);
    }

    /// The answer to one request message (a worker's job), if it takes
    /// one.
    fn serve(&self, conn: &Connection, client: &ClientState, msg: &[u8]) -> Option<Answer> {
        match Request::decode(msg) {
            Ok((req, key, inline)) => self.answer(conn, client, &req, key, inline),
            Err(why) => {
                self.drop_malformed(conn, client, why);
                None
            }
        }
    }

    /// Serving a request of this client, or sending its answers, panicked:
    /// the client goes (and nobody else). Dropped, not closed: a close
    /// waits (up to the timeout) for the replies queued for it to drain,
    /// while the completion thread may be waiting for room in this
    /// worker's queue, which stalls every client for that long.
    fn serving_panicked(&self, conn: &Connection, client: &ClientState) {
        log::error!(
            "closing {:?}: serving its request panicked",
            conn.peer_addr()
        );
        conn.drop_peer("serving its request panicked");
        self.forget(client);
    }

    /// A malformed request ends its client's connection (and nothing else).
    fn drop_malformed(&self, conn: &Connection, client: &ClientState, why: &str) {
        bump(&self.counters.errors);
        log::warn!("closing {:?}: malformed request: {why}", conn.peer_addr());
        // Not a close, which waits (bounded) for queued replies to drain:
        // this thread serves every client. Dropped first, so its targets
        // end at once: their windows' binds wait for nothing on an ended
        // connection (one of a client that takes no replies never runs).
        conn.drop_peer("malformed request");
        self.forget(client);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_largest_value_no_client_accepts_is_refused_at_create() {
        let cfg = |max_value| ServerConfig {
            memory_size: 4 << 20,
            table_size: 16,
            max_value,
            ..ServerConfig::default()
        };
        assert!(Server::new(cfg(LARGEST_MAX_VALUE)).is_ok());
        for too_large in [LARGEST_MAX_VALUE + 1, u64::MAX] {
            assert!(matches!(
                Server::new(cfg(too_large)),
                Err(KvError::InvalidArgument(_))
            ));
        }
    }
}
