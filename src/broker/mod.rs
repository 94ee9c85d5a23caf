//! An RC message broker, after RDMALib: one per worker thread, connecting
//! thread `t` of this server to thread `t` of every other server (a full
//! mesh from a list of `ip:port`). Each peer gets a ring of send slots the
//! caller fills in place; sends are batched into one doorbell
//! (`doorbell_batch` requests per `ibv_post_send`, only the last signaled);
//! SEND, WRITE and READ (with immediates) complete into one callback, run on
//! the owner's thread inside [`Broker::poll_sq`] and [`Broker::poll_rq`].
//! No hidden threads.
//!
//! Fixed against the seed: a failed completion fails that peer (a
//! [`EventKind::Failed`] event per operation, [`EventKind::PeerDown`] once)
//! and never aborts; a full ring is [`BrokerError::Full`], not a spin; a slot
//! is never handed out twice; connecting retries until the init timeout in
//! any start order, with one queue pair per pair of servers.
//!
//! Memory: the send and receive rings live in memory of the broker's own,
//! which peers cannot access; the data region (the caller's memory, or one
//! the broker allocates) is what peers READ and WRITE, by offset or address.

mod memmgr;
mod mesh;
mod peer;
mod poll;
mod post;

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

pub use memmgr::{FreeError, MemManager, FIRST_CLASS_SIZE, SIZE_CLASSES};

use crate::verbs::{
    self, AccessFlags, Context, MemoryRegion, ProtectionDomain, RemoteRegion, WcStatus,
};
use peer::Peer;

/// How the queue pairs are connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectMode {
    /// RDMA CM.
    Cm,
    /// A TCP socket exchange, then a manual RESET -> RTS.
    Socket,
}

/// What a broker is built from.
#[derive(Debug, Clone)]
pub struct Config {
    /// Every server, in server-id order; thread `t` uses port `port + t`.
    /// Each is the address the server listens on and connects to the
    /// others from, which is how they know it: a connection claiming to be
    /// server `s` from elsewhere is refused. With more than one server, no
    /// host may be `0.0.0.0` or `::`, and all are IPv4 or all IPv6.
    pub hosts: Vec<SocketAddr>,
    /// This server's index in `hosts`.
    pub server_id: usize,
    pub thread_id: u16,
    /// Send slots (and receives) per peer.
    pub slots: u32,
    /// Bytes per slot: the largest message.
    pub slot_size: u32,
    /// Requests per doorbell.
    pub doorbell_batch: u32,
    /// Bytes of the data region the broker allocates (when the caller
    /// gives none).
    pub data_len: usize,
    pub mode: ConnectMode,
    /// The RDMA device (default: `SNOWRDMA_DEVICE`, else the first).
    pub device: Option<String>,
}

impl Config {
    /// Parses `ip:port,ip:port,...`.
    pub fn parse_hosts(list: &str) -> Result<Vec<SocketAddr>> {
        list.split(',')
            .map(|h| {
                h.trim()
                    .parse()
                    .map_err(|_| BrokerError::InvalidArgument(format!("{h:?} is not ip:port")))
            })
            .collect()
    }

    fn check(&self) -> Result<()> {
        let bad = |m: &str| Err(BrokerError::InvalidArgument(m.into()));
        if self.server_id >= self.hosts.len() {
            return bad("server_id is not an index of hosts");
        }
        if self.hosts.len() > usize::from(u16::MAX) {
            return bad("too many hosts");
        }
        if self.slots == 0 || self.slots > 4096 {
            return bad("slots per peer must be 1 to 4096");
        }
        if self.slot_size == 0 || self.slot_size > 1 << 30 {
            return bad("slot_size must be 1 byte to 1 GiB");
        }
        if self.doorbell_batch == 0 || self.doorbell_batch > self.slots {
            return bad("doorbell_batch must be 1 to slots");
        }
        if self
            .hosts
            .iter()
            .any(|h| h.port().checked_add(self.thread_id).is_none())
        {
            return bad("port + thread_id exceeds 65535");
        }
        // Each server connects from its own address in `hosts`, and a peer
        // is known by it: one that no peer can reach or connect from, or
        // of another family than its peers, cannot take part.
        if self.hosts.len() > 1 {
            if self.hosts.iter().any(|h| h.ip().is_unspecified()) {
                return bad("a host is 0.0.0.0 or ::: list each server at its own address");
            }
            if self
                .hosts
                .iter()
                .any(|h| h.is_ipv4() != self.hosts[0].is_ipv4())
            {
                return bad("the hosts mix IPv4 and IPv6 addresses");
            }
        }
        Ok(())
    }
}

/// Errors of the broker.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error(transparent)]
    Verbs(#[from] verbs::Error),
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// No free slot, or the send queue is full: poll the send side and try
    /// again.
    #[error("server {0}: no free send slot")]
    Full(usize),
    #[error("server {0} has failed")]
    PeerFailed(usize),
    #[error("not connected to server {0}")]
    NoSuchPeer(usize),
    /// `why`: the last thing heard of each missing server, in the order of
    /// `missing` ("server 1: never heard from" when nothing was).
    #[error("init timed out; not connected to servers {missing:?} ({})", .why.join("; "))]
    InitTimeout {
        missing: Vec<usize>,
        why: Vec<String>,
    },
    #[error("a peer broke the protocol: {0}")]
    Protocol(String),
    /// A poll was called from inside a callback.
    #[error("called from inside a callback")]
    Reentrant,
    /// Debug builds: called from a thread other than the owner.
    #[error("called from a thread other than the broker's owner")]
    WrongThread,
}

pub type Result<T, E = BrokerError> = std::result::Result<T, E>;

/// What a completion was. (C: `snowrdma_broker_event_kind`, the variants
/// prefixed `SNOWRDMA_BROKER_EVENT_KIND_`.)
///
/// cbindgen:prefix-with-name
/// cbindgen:rename-all=ScreamingSnakeCase
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub enum EventKind {
    /// A message arrived (its bytes are `buf`), or a WRITE WITH IMM (empty
    /// `buf`, the immediate in `imm`).
    Recv = 0,
    SendDone = 1,
    WriteDone = 2,
    ReadDone = 3,
    /// The operation `wr_id` failed with `status`; its peer has failed.
    Failed = 4,
    /// The peer failed (its receives were flushed); once per peer.
    PeerDown = 5,
}

/// Kinds of posted operations.
pub(crate) type OpKind = EventKind;

/// One completion, handed to the callback.
#[derive(Debug)]
pub struct Event<'a> {
    pub kind: EventKind,
    pub peer: usize,
    /// What the post returned; the slot index for receives.
    pub wr_id: u64,
    pub buf: &'a [u8],
    pub imm: Option<u32>,
    pub status: WcStatus,
}

/// Counters of a broker (C: `snowrdma_broker_stats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct BrokerStats {
    pub sends: u64,
    pub writes: u64,
    pub reads: u64,
    pub recvs: u64,
    /// `ibv_post_send` calls.
    pub doorbells: u64,
    /// `ibv_post_recv` calls.
    pub recv_doorbells: u64,
    pub failed_ops: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    sends: Cell<u64>,
    writes: Cell<u64>,
    reads: Cell<u64>,
    recvs: Cell<u64>,
    doorbells: Cell<u64>,
    recv_doorbells: Cell<u64>,
    failed_ops: Cell<u64>,
}

/// Where a WRITE takes its bytes or a READ puts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Local {
    /// A send slot handed out by [`Broker::send_buf`] (it is used up).
    Slot(u32),
    /// Bytes of this broker's data region, from this offset.
    Data(u64),
}

/// Where on the peer a WRITE or READ goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Remote {
    /// An offset into the peer's data region.
    Offset(u64),
    /// An absolute address inside the peer's data region.
    Addr(u64),
}

pub(crate) struct Shared {
    pub config: Config,
    pub pd: ProtectionDomain,
    /// Send and receive rings of every peer; local access only.
    pub rings: MemoryRegion,
    pub data: MemoryRegion,
    pub data_remote: RemoteRegion,
    pub stats: Counters,
}

impl Shared {
    pub(crate) fn max_send_wr(&self) -> u32 {
        self.config.slots * 2
    }

    fn slot_addr(&self, server: usize, ring: u32, slot: u32) -> usize {
        let c = &self.config;
        let index = (server as u64 * 2 + u64::from(ring)) * u64::from(c.slots) + u64::from(slot);
        self.rings.addr() as usize + (index * u64::from(c.slot_size)) as usize
    }

    pub(crate) fn recv_slot(&self, server: usize, slot: u32) -> (usize, usize) {
        (
            self.slot_addr(server, 0, slot),
            self.config.slot_size as usize,
        )
    }

    pub(crate) fn send_slot(&self, server: usize, slot: u32) -> (usize, usize) {
        (
            self.slot_addr(server, 1, slot),
            self.config.slot_size as usize,
        )
    }
}

type Callback = Box<dyn FnMut(&Broker, &Event<'_>) + Send>;

/// A broker: see the module documentation.
pub struct Broker {
    shared: Shared,
    /// Set once by `init`: the peers by server id, and in CM mode the
    /// listener, which reports the accepted connections' events.
    links: std::cell::OnceCell<(Vec<Option<Peer>>, Option<verbs::CmId>)>,
    callback: RefCell<Callback>,
    owner: Cell<Option<std::thread::ThreadId>>,
    down_reported: RefCell<Vec<bool>>,
    last_cm_check: Cell<Instant>,
    /// The operations one completion finished, gathered before their
    /// callbacks run (which may post); kept for the next poll.
    finished: Cell<Vec<peer::Posted>>,
    /// Room for a poll's completions, kept for the next poll: a fresh one
    /// is 1.5 KiB to zero, most of what an empty poll of a spinning loop
    /// would cost.
    room: Cell<Option<Box<PollRoom>>>,
}

/// Completions one poll of one CQ takes.
const POLL_BATCH: usize = 32;
type PollRoom = verbs::CompletionRoom<POLL_BATCH>;

/// How often the polls look at RDMA CM events (a system call each).
const CM_CHECK: Duration = Duration::from_millis(10);

// SAFETY: the broker is used by one thread at a time (its owner; debug
// builds check); the RefCells and Cells are never shared across threads
// because `Broker` is not `Sync`.
unsafe impl Send for Broker {}

/// A send slot handed out by [`Broker::send_buf`].
pub struct SendBuf<'b> {
    broker: &'b Broker,
    peer: usize,
    slot: u32,
    posted: bool,
}

impl Broker {
    /// A broker whose data region it allocates (`config.data_len` bytes),
    /// with `callback` for every completion. Not connected yet: call
    /// [`Broker::init`].
    pub fn new(
        config: Config,
        callback: impl FnMut(&Broker, &Event<'_>) + Send + 'static,
    ) -> Result<Broker> {
        config.check()?;
        let pd = Context::open_with_cm(config.device.as_deref())?.alloc_pd()?;
        let data = pd.allocate(config.data_len.max(1), data_access())?;
        Self::build(config, pd, data, Box::new(callback))
    }

    /// A broker over the caller's memory as data region.
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay valid until the broker is dropped; peers may
    /// write it at any time.
    pub unsafe fn with_memory(
        config: Config,
        ptr: *mut u8,
        len: usize,
        callback: impl FnMut(&Broker, &Event<'_>) + Send + 'static,
    ) -> Result<Broker> {
        config.check()?;
        let pd = Context::open_with_cm(config.device.as_deref())?.alloc_pd()?;
        let data = pd.register_raw(ptr, len, data_access())?;
        Self::build(config, pd, data, Box::new(callback))
    }

    fn build(
        config: Config,
        pd: ProtectionDomain,
        data: MemoryRegion,
        callback: Callback,
    ) -> Result<Broker> {
        let ring_bytes = (config.hosts.len() as u64)
            .checked_mul(2 * u64::from(config.slots) * u64::from(config.slot_size))
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| BrokerError::InvalidArgument("rings too large".into()))?;
        let rings = pd.allocate(ring_bytes, AccessFlags::LOCAL_WRITE)?;
        let data_remote = data.remote();
        let n = config.hosts.len();
        let shared = Shared {
            config,
            pd,
            rings,
            data,
            data_remote,
            stats: Counters::default(),
        };
        // What one poll can finish of a peer's: all it has in flight.
        let finished = Vec::with_capacity(shared.max_send_wr() as usize);
        Ok(Broker {
            shared,
            links: std::cell::OnceCell::new(),
            callback: RefCell::new(callback),
            owner: Cell::new(None),
            down_reported: RefCell::new(vec![false; n]),
            last_cm_check: Cell::new(Instant::now()),
            finished: Cell::new(finished),
            room: Cell::new(None),
        })
    }

    /// Connects to every other server, retrying until `timeout`. The thread
    /// that calls it owns the broker from then on.
    pub fn init(&self, timeout: Duration) -> Result<()> {
        if self.links.get().is_some() {
            return Err(BrokerError::InvalidArgument("already initialised".into()));
        }
        self.owner.set(Some(std::thread::current().id()));
        let links = self.shared.build_mesh(Instant::now() + timeout)?;
        let _ = self.links.set(links);
        Ok(())
    }

    /// The peers by server id (none before `init`).
    fn all(&self) -> &[Option<Peer>] {
        self.links.get().map_or(&[], |l| &l.0)
    }

    fn listener(&self) -> Option<&verbs::CmId> {
        self.links.get().and_then(|l| l.1.as_ref())
    }

    /// Makes the calling thread the owner (after the broker moved to it).
    pub fn take_ownership(&mut self) {
        self.owner.set(Some(std::thread::current().id()));
    }

    fn check_owner(&self) -> Result<()> {
        if cfg!(debug_assertions)
            && self
                .owner
                .get()
                .is_some_and(|o| o != std::thread::current().id())
        {
            return Err(BrokerError::WrongThread);
        }
        Ok(())
    }

    fn peer(&self, server: usize) -> Result<&Peer> {
        self.check_owner()?;
        let p = self
            .all()
            .get(server)
            .and_then(Option::as_ref)
            .ok_or(BrokerError::NoSuchPeer(server))?;
        if p.failed.get() {
            return Err(BrokerError::PeerFailed(server));
        }
        Ok(p)
    }

    /// The connected servers.
    pub fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        self.all().iter().flatten().map(|p| p.server)
    }

    /// This broker's data region as peers see it.
    pub fn data_region(&self) -> RemoteRegion {
        self.shared.data_remote
    }

    /// A peer's data region.
    pub fn peer_region(&self, server: usize) -> Result<RemoteRegion> {
        Ok(self.peer(server)?.remote)
    }

    pub fn config(&self) -> &Config {
        &self.shared.config
    }

    /// The counters.
    pub fn stats(&self) -> BrokerStats {
        let c = &self.shared.stats;
        BrokerStats {
            sends: c.sends.get(),
            writes: c.writes.get(),
            reads: c.reads.get(),
            recvs: c.recvs.get(),
            doorbells: c.doorbells.get(),
            recv_doorbells: c.recv_doorbells.get(),
            failed_ops: c.failed_ops.get(),
        }
    }

    /// Bytes of the data region at `offset`, copied out (peers may write the
    /// region at any time).
    pub fn read_data(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        let data = &self.shared.data;
        if offset.checked_add(out.len()).is_none_or(|e| e > data.len()) {
            return Err(BrokerError::InvalidArgument(
                "outside the data region".into(),
            ));
        }
        // SAFETY: inside the region (checked); a plain copy of memory the
        // peers may be writing, as any shared memory is read.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (data.addr() as usize + offset) as *const u8,
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// Writes bytes into the data region at `offset`.
    pub fn write_data(&self, offset: usize, bytes: &[u8]) -> Result<()> {
        let data = &self.shared.data;
        if offset
            .checked_add(bytes.len())
            .is_none_or(|e| e > data.len())
        {
            return Err(BrokerError::InvalidArgument(
                "outside the data region".into(),
            ));
        }
        // SAFETY: inside the region (checked).
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                (data.addr() as usize + offset) as *mut u8,
                bytes.len(),
            )
        };
        Ok(())
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        // Peers learn at once (a disconnect, or the socket shut) instead of
        // by retries, and every QP is stopped before the rings and the data
        // region, which the fields' order drops first, are deregistered.
        for p in self.all().iter().flatten() {
            p.stop();
        }
    }
}

fn data_access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(hosts: &str) -> Config {
        Config {
            hosts: Config::parse_hosts(hosts).unwrap(),
            server_id: 0,
            thread_id: 0,
            slots: 16,
            slot_size: 256,
            doorbell_batch: 4,
            data_len: 1 << 16,
            mode: ConnectMode::Socket,
            device: None,
        }
    }

    #[test]
    fn hosts_a_peer_cannot_be_known_by_are_refused() {
        for ok in [
            "10.0.0.1:7000,10.0.0.2:7000",
            "[fe80::1%2]:7000,[fe80::2%2]:7000",
            "0.0.0.0:7000",
        ] {
            assert!(config(ok).check().is_ok(), "{ok}");
        }
        for bad in [
            "0.0.0.0:7000,10.0.0.2:7000",
            "10.0.0.1:7000,[::]:7000",
            "10.0.0.1:7000,[fe80::2%2]:7000",
        ] {
            assert!(
                matches!(config(bad).check(), Err(BrokerError::InvalidArgument(_))),
                "{bad}"
            );
        }
    }
}
