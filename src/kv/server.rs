//! The key-value server: accepts clients through the runtime (RDMA CM or a
//! TCP exchange of QP information), answers requests, and keeps per-client
//! state (request buffer, leases of values being read, write targets).
//!
//! Threads: requests are parsed on the runtime's completion thread; small
//! ones are answered there, ones that copy or register large values go to
//! the client's worker (one of `workers`), and once a client has work queued
//! there, its later requests follow it, so each client's requests take
//! effect in the order it sent them.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};

use crate::runtime::{
    self, AcceptHook, CommMode, ConnHandler, Connection, Listener, Options, PdProvider, Window,
};
use crate::verbs::{self, AccessFlags, CmId, Context, EventChannel};

use super::pool::SLAB_PAGE;
use super::proto::{
    is_inline, value_checksum, Op, Reply, Request, ServerInfo, Source, BLOCK_HEADER_LEN,
};
use super::store::{Block, Store, Target};
use super::{check_key, ConnMode, KvError, Result, DEFAULT_MAX_VALUE, MAX_KEY_LEN, MAX_VALUE_ENV};

/// Leases one client may hold; beyond, its oldest lease ends.
const MAX_LEASES: usize = 4096;
/// Write targets one client may hold at once.
const MAX_TARGETS: usize = 8;

/// How a server is set up. `Default` gives the legacy program's defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    pub addr: SocketAddr,
    /// Slab pool size in bytes.
    pub memory_size: usize,
    pub huge_pages: bool,
    /// Hash index buckets.
    pub table_size: usize,
    pub workers: usize,
    pub conn_mode: ConnMode,
    /// Device name (socket mode); `None`: the first device.
    pub device: Option<String>,
    /// Largest value accepted (`SNOWRDMA_KV_MAX_VALUE`, default 1 GiB).
    pub max_value: u64,
    /// Each client's request buffer (values up to this size are PUT in one
    /// round trip).
    pub request_buf_len: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            addr: SocketAddr::from(([0, 0, 0, 0], 12345)),
            memory_size: 1024 << 20,
            huge_pages: false,
            table_size: 65536,
            workers: 4,
            conn_mode: ConnMode::Cm,
            device: None,
            max_value: std::env::var(MAX_VALUE_ENV)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(DEFAULT_MAX_VALUE),
            request_buf_len: SLAB_PAGE,
        }
    }
}

/// A snapshot of the server's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub clients: u64,
    pub clients_total: u64,
    pub gets: u64,
    pub get_misses: u64,
    pub puts: u64,
    pub deletes: u64,
    pub cas_ok: u64,
    pub cas_failed: u64,
    pub errors: u64,
    pub items: u64,
    pub pool_used: u64,
    pub pool_size: u64,
    pub large_bytes: u64,
    pub huge_pages: bool,
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "clients {} (total {}) | items {} | gets {} (misses {}) puts {} dels {} cas {}/{} failed | \
             errors {} | pool {:.1}/{:.1} MiB{} | large values {:.1} MiB",
            self.clients,
            self.clients_total,
            self.items,
            self.gets,
            self.get_misses,
            self.puts,
            self.deletes,
            self.cas_ok,
            self.cas_failed,
            self.errors,
            self.pool_used as f64 / 1048576.0,
            self.pool_size as f64 / 1048576.0,
            if self.huge_pages { " (huge pages)" } else { "" },
            self.large_bytes as f64 / 1048576.0,
        )
    }
}

#[derive(Default)]
struct Counters {
    clients: AtomicU64,
    clients_total: AtomicU64,
    gets: AtomicU64,
    get_misses: AtomicU64,
    puts: AtomicU64,
    deletes: AtomicU64,
    cas_ok: AtomicU64,
    cas_failed: AtomicU64,
    errors: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// What the server keeps per client.
struct ClientState {
    /// The only server memory this client may write, through a window
    /// bound to its QP (set once the connection is up).
    request_buf: OnceLock<Window>,
    leases: Mutex<BTreeMap<u64, Arc<Block>>>,
    targets: Mutex<HashMap<u64, Target>>,
    next_token: AtomicU64,
    worker: usize,
    /// Requests of this client waiting at or running on its worker.
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
    jobs: Mutex<Vec<Sender<Job>>>,
    next_client: AtomicUsize,
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
        let store = Store::new(
            cfg.memory_size,
            cfg.huge_pages,
            cfg.table_size,
            cfg.max_value,
        )?;
        Ok(Server {
            shared: Arc::new(Shared {
                cfg,
                store,
                counters: Counters::default(),
                jobs: Mutex::new(Vec::new()),
                next_client: AtomicUsize::new(0),
            }),
            listener: Mutex::new(None),
            workers: Mutex::new(Vec::new()),
        })
    }

    pub fn config(&self) -> &ServerConfig {
        &self.shared.cfg
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
        let opts = Options {
            comm_mode: CommMode::Blocking,
            max_inline_data: super::MESSAGE_INLINE,
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
                Listener::bind_socket(cfg.addr, cfg.device.as_deref(), &opts, on_accept, Some(pds))
            }
        }
        .map_err(|e| KvError::Internal(format!("listening on {}: {e}", cfg.addr)))?;
        // Registering the pool faults in and pins all of it, which takes
        // seconds for a large pool on a slow machine: done now rather than
        // inside the first client's connection setup, which would time out.
        if let Some(ctx) = listener.device().or_else(|| only_device(cfg.addr)) {
            self.shared.store.attach(&ctx)?;
        }
        listener.start();
        *slot = Some(listener);
        Ok(())
    }

    fn start_workers(&self) -> Result<()> {
        let mut jobs = self.shared.jobs.lock().expect("jobs lock");
        let mut handles = self.workers.lock().expect("workers lock");
        for n in 0..self.shared.cfg.workers.max(1) {
            let (tx, rx) = unbounded::<Job>();
            let shared = self.shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("kv-worker-{n}"))
                .spawn(move || {
                    for job in rx {
                        shared.serve(&job.conn, &job.client, &job.msg);
                        job.client.queued.fetch_sub(1, Ordering::AcqRel);
                    }
                })
                .map_err(|e| KvError::Internal(format!("starting a worker: {e}")))?;
            jobs.push(tx);
            handles.push(handle);
        }
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
        }
        self.shared.jobs.lock().expect("jobs lock").clear();
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
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

struct ServerConn {
    shared: Arc<Shared>,
    client: Arc<ClientState>,
}

impl ConnHandler for ServerConn {
    fn recv(&self, conn: &Connection, data: &[u8], _imm: Option<u32>) {
        let client = &self.client;
        // Parsed once here; only requests handed to a worker are parsed
        // again there (they are copied out of the ring anyway).
        let parts = match Request::decode(data) {
            Ok(parts) => parts,
            Err(why) => return self.shared.drop_malformed(conn, client, why),
        };
        let req = &parts.0;
        let heavy = req.op == Op::Alloc || (req.op == Op::Write && req.source != Source::Inline);
        if heavy || client.queued.load(Ordering::Acquire) > 0 {
            let jobs = self.shared.jobs.lock().expect("jobs lock");
            if let Some(tx) = jobs.get(client.worker % jobs.len().max(1)) {
                client.queued.fetch_add(1, Ordering::AcqRel);
                let job = Job {
                    conn: conn.clone(),
                    client: client.clone(),
                    msg: data.to_vec(),
                };
                if tx.send(job).is_ok() {
                    return;
                }
                client.queued.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.shared.serve_parsed(conn, client, parts);
    }

    fn connected(&self, conn: &Connection) {
        // Bound now that the QP can send: before the client's first request
        // (RC keeps its advertisement ahead of it), and only its QP can use it.
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND;
        let window = conn
            .pd()
            .allocate(self.shared.cfg.request_buf_len, access)
            .map_err(runtime::Error::from)
            .and_then(|mr| conn.expose(mr, AccessFlags::REMOTE_WRITE));
        match window {
            Ok(w) => {
                let _ = self.client.request_buf.set(w);
            }
            Err(e) => {
                log::warn!("closing {:?}: no request buffer: {e}", conn.peer_addr());
                conn.close();
                self.shared.forget(&self.client);
            }
        }
    }

    fn disconnected(&self, _conn: &Connection) {
        self.shared.forget(&self.client);
    }

    fn retired(&self, _conn: &Connection) {
        self.shared.forget(&self.client);
    }
}

impl Shared {
    /// Sets up a new client (CM thread, before the connection is accepted).
    fn accept(self: &Arc<Self>, conn: &Connection) -> Option<Arc<dyn ConnHandler>> {
        let client = Arc::new(ClientState {
            request_buf: OnceLock::new(),
            leases: Mutex::new(BTreeMap::new()),
            targets: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(1),
            worker: self.next_client.fetch_add(1, Ordering::Relaxed),
            queued: AtomicUsize::new(0),
            gone: AtomicBool::new(false),
        });
        bump(&self.counters.clients);
        bump(&self.counters.clients_total);
        log::info!("client {:?} connected", conn.peer_addr());
        Some(Arc::new(ServerConn {
            shared: self.clone(),
            client,
        }))
    }

    /// A client went away: its leases and targets end now.
    fn forget(&self, client: &ClientState) {
        if client.gone.swap(true, Ordering::SeqCst) {
            return;
        }
        self.counters.clients.fetch_sub(1, Ordering::Relaxed);
        client.leases.lock().expect("lease lock").clear();
        client.targets.lock().expect("target lock").clear();
    }

    /// Answers one request message.
    fn serve(&self, conn: &Connection, client: &ClientState, msg: &[u8]) {
        match Request::decode(msg) {
            Ok(parts) => self.serve_parsed(conn, client, parts),
            Err(why) => self.drop_malformed(conn, client, why),
        }
    }

    /// A malformed request ends its client's connection (and nothing else).
    fn drop_malformed(&self, conn: &Connection, client: &ClientState, why: &str) {
        bump(&self.counters.errors);
        log::warn!("closing {:?}: malformed request: {why}", conn.peer_addr());
        conn.close();
        self.forget(client);
    }

    /// Answers a parsed request.
    fn serve_parsed(
        &self,
        conn: &Connection,
        client: &ClientState,
        (req, key, inline): (Request, &[u8], &[u8]),
    ) {
        let Some(reply) = self.answer(conn, client, &req, key, inline) else {
            return;
        };
        match conn.send(&reply) {
            Ok(n) if n > 0 => {}
            Ok(_) | Err(_) => {
                log::warn!(
                    "closing {:?}: it does not take its replies",
                    conn.peer_addr()
                );
                conn.close();
                self.forget(client);
            }
        }
    }

    /// The encoded reply to a request (`None`: it takes none).
    fn answer(
        &self,
        conn: &Connection,
        client: &ClientState,
        req: &Request,
        key: &[u8],
        inline: &[u8],
    ) -> Option<Vec<u8>> {
        let id = req.req_id;
        if req.op == Op::Release {
            // Leases and write targets are numbered from one counter, so a
            // number names one or the other.
            let mut leases = client.leases.lock().expect("lease lock");
            let mut targets = client.targets.lock().expect("target lock");
            for n in req.released(key) {
                if leases.remove(&n).is_none() {
                    targets.remove(&n);
                }
            }
            return None;
        }
        if req.op == Op::Hello {
            return Some(self.hello(client, id));
        }
        if let Err(e) = check_key(key) {
            bump(&self.counters.errors);
            return Some(Reply::error(id, e).encode(&[]));
        }
        let result = match req.op {
            Op::Get => return Some(self.get(client, id, key)),
            Op::Write => self.write(client, req, key, inline).map(|version| Reply {
                version,
                ..Reply::default()
            }),
            Op::Alloc => self.alloc(conn, client, req, key),
            Op::Delete => {
                bump(&self.counters.deletes);
                self.store.delete(key).map(|()| Reply::default())
            }
            Op::Hello | Op::Release => unreachable!("handled above"),
        };
        let reply = match result {
            Ok(mut r) => {
                r.req_id = id;
                r
            }
            Err(e) => self.error_reply(id, e),
        };
        Some(reply.encode(&[]))
    }

    fn error_reply(&self, id: u64, e: KvError) -> Reply {
        let mut r = Reply::error(id, e.clone());
        match e {
            KvError::CasFailed { current } => {
                bump(&self.counters.cas_failed);
                r.version = current;
            }
            KvError::ValueTooLong { max } => r.value_len = max,
            KvError::NotFound => {}
            other => {
                bump(&self.counters.errors);
                log::debug!("request {id} failed: {other}");
            }
        }
        r
    }

    fn hello(&self, client: &ClientState, id: u64) -> Vec<u8> {
        let Some(dev) = self.store.device() else {
            return Reply::error(id, KvError::Internal("no device".into())).encode(&[]);
        };
        let Some(request_buf) = client.request_buf.get().map(Window::remote) else {
            return Reply::error(id, KvError::Internal("no request buffer".into())).encode(&[]);
        };
        let info = ServerInfo {
            request_buf: request_buf.addr,
            request_buf_len: request_buf.len,
            request_buf_rkey: request_buf.rkey,
            index_addr: dev.index_mr.addr(),
            index_rkey: dev.index_mr.rkey(),
            buckets: self.store.index().buckets() as u64,
            pool_rkey: dev.pool_mr.rkey(),
            max_key: MAX_KEY_LEN as u32,
            max_value: self.store.max_value,
        };
        Reply {
            req_id: id,
            ..Reply::default()
        }
        .encode(&info.encode())
    }

    fn get(&self, client: &ClientState, id: u64, key: &[u8]) -> Vec<u8> {
        bump(&self.counters.gets);
        let (block, version) = match self.store.get(key) {
            Ok(found) => found,
            Err(e) => {
                if e == KvError::NotFound {
                    bump(&self.counters.get_misses);
                }
                return self.error_reply(id, e).encode(&[]);
            }
        };
        let value_len = block.len() - BLOCK_HEADER_LEN - key.len();
        let mut reply = Reply {
            req_id: id,
            version,
            value_len: value_len as u64,
            ..Reply::default()
        };
        if is_inline(key.len(), value_len) {
            return reply.encode(block.value(key.len()));
        }
        // The client READs the block; it stays allocated until it says it
        // is done (or goes away).
        let lease = client.next_token.fetch_add(1, Ordering::Relaxed);
        reply.remote = true;
        reply.addr = block.addr();
        reply.rkey = block.rkey();
        reply.lease = lease;
        let mut leases = client.leases.lock().expect("lease lock");
        if leases.len() >= MAX_LEASES {
            leases.pop_first();
        }
        leases.insert(lease, block);
        reply.encode(&[])
    }

    fn write(&self, client: &ClientState, req: &Request, key: &[u8], inline: &[u8]) -> Result<u64> {
        self.store.check_value_len(req.value_len)?;
        let result = match req.source {
            Source::Inline => self.store.put(key, inline, req.cas),
            Source::Staged { offset, checksum } => {
                let buf = client
                    .request_buf
                    .get()
                    .ok_or_else(|| KvError::Internal("no request buffer".into()))?
                    .region();
                let range = usize::try_from(offset)
                    .ok()
                    .and_then(|start| Some(start..start.checked_add(req.value_len as usize)?))
                    .filter(|r| r.end <= buf.len())
                    .ok_or_else(|| {
                        KvError::InvalidArgument(
                            "the staged value is outside the request buffer".into(),
                        )
                    })?;
                // The client can write its buffer again at any moment: the
                // value is copied once, and the copy is checked and stored.
                let mut value = Vec::new();
                buf.copy_out(range, &mut value);
                let value = &value[..];
                if value_checksum(value) != checksum {
                    return Err(KvError::InvalidArgument(
                        "the staged value did not arrive whole (checksum mismatch)".into(),
                    ));
                }
                // Verified above: the same hash seals the block.
                self.store.put_hashed(key, value, checksum, req.cas)
            }
            Source::Allocated { token } => {
                let target = client
                    .targets
                    .lock()
                    .expect("target lock")
                    .remove(&token)
                    .ok_or_else(|| KvError::InvalidArgument("unknown write target".into()))?;
                if target.value_len() as u64 != req.value_len {
                    return Err(KvError::InvalidArgument(
                        "the length differs from the target's".into(),
                    ));
                }
                self.store.commit(key, target, req.cas)
            }
        };
        match (&result, req.cas) {
            (Ok(_), Some(_)) => bump(&self.counters.cas_ok),
            (Ok(_), None) => bump(&self.counters.puts),
            _ => {}
        }
        result
    }

    fn alloc(
        &self,
        conn: &Connection,
        client: &ClientState,
        req: &Request,
        key: &[u8],
    ) -> Result<Reply> {
        let mut targets = client.targets.lock().expect("target lock");
        if targets.len() >= MAX_TARGETS {
            return Err(KvError::NoMemory);
        }
        // Writable through a window on this client's QP only.
        let target = self.store.target(key.len(), req.value_len, |mr| {
            conn.expose(mr, AccessFlags::REMOTE_WRITE).map_err(|e| {
                log::warn!("exposing a write target: {e}");
                KvError::NoMemory
            })
        })?;
        let token = client.next_token.fetch_add(1, Ordering::Relaxed);
        let reply = Reply {
            addr: target.value_addr(),
            rkey: target.rkey(),
            value_len: req.value_len,
            lease: token,
            ..Reply::default()
        };
        targets.insert(token, target);
        Ok(reply)
    }
}

/// The device a wildcard listener will serve when the machine has just one:
/// RDMA CM's own context for it (the one accepted connections get), from an
/// id bound to the device's address. `None` when that is not clear.
fn only_device(listen: SocketAddr) -> Option<Context> {
    if !listen.ip().is_unspecified() {
        return None;
    }
    let devices = verbs::devices().ok()?;
    let [only] = &devices[..] else {
        return None;
    };
    let ip = Context::open(Some(&only.name))
        .ok()?
        .ipv4_address(1)
        .ok()??;
    let channel = EventChannel::new().ok()?;
    let id = CmId::new(&channel).ok()?;
    id.bind(SocketAddr::new(ip.into(), 0)).ok()?;
    id.context()
}
