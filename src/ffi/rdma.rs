//! The legacy SnowRDMA C ABI (`rdma.h`): the structs to the byte, the
//! globals, and the functions, over [`crate::runtime`].
//!
//! Handles: `RdmaConn *` and `RdmaListener *` point to memory the library
//! owns. Every call looks the pointer up in the connection table first, so a
//! stale or foreign pointer gets `RDMA_ERR` (or `(size_t)-1`, or NULL)
//! instead of being dereferenced.

#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::net::{SocketAddr, ToSocketAddrs};
use std::ptr::{addr_of, addr_of_mut};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use once_cell::sync::Lazy;
use rdma_sys::{ibv_comp_channel, ibv_cq, ibv_mr, ibv_pd, rdma_cm_id, rdma_event_channel};

use super::boundary::guard;
use crate::runtime::{
    self, CommMode, ConnHandler, ConnState, Connection, Listener, Options, WeakConnection,
    DEFAULT_RECV_BUF_LEN,
};
use crate::verbs::{RemoteAddr, RemoteRegion};

/// Success.
pub const RDMA_OK: c_int = 0;
/// Failure.
pub const RDMA_ERR: c_int = -1;
pub const RDMA_MAX_SGE: c_int = 1024;
/// Size of each connection's receive buffer.
pub const RDMA_DEFAULT_RX_LEN: c_int = 1024 * 1024;
const _: () = assert!(RDMA_DEFAULT_RX_LEN as usize == DEFAULT_RECV_BUF_LEN);
/// First byte of every command message ('R').
pub const RDMA_CMD_MAGIC: u8 = b'R';

/// Command opcodes on the wire.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaCmdType {
    REG_LOCAL_ADDR = 0,
    REG_PHYS_ADDR = 1,
    CONN_GOODBYE = 2,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaQpCqMapping {
    ONE_TO_ONE = 0,
    MANY_TO_ONE = 1,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaCommMode {
    /// `rdmaConnSend` waits for room, up to `rdmaTimeoutms` (at least a
    /// second), then returns 0; inside a callback it queues as
    /// `RDMA_NON_BLOCKING` does.
    RDMA_BLOCKING = 0,
    /// `rdmaConnSend` never waits: a message that finds no room is queued
    /// and sent in order as room returns; 0 only when that queue is full.
    RDMA_NON_BLOCKING = 1,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaConnState {
    RDMA_CONN_STATE_NONE = 0,
    RDMA_CONN_STATE_CONNECTING = 1,
    RDMA_CONN_STATE_ACCEPTING = 2,
    RDMA_CONN_STATE_CONNECTED = 3,
    RDMA_CONN_STATE_MR_READY = 4,
    RDMA_CONN_STATE_CLOSED = 5,
    RDMA_CONN_STATE_ERROR = 6,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionType {
    ACCEPTED_CONN = 0,
    CONNECTED_CONN = 1,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaReqCtxType {
    RECV_CONTEXT = 0,
    WRITE_CONTEXT = 1,
    SEND_CONTEXT = 2,
}

/// `RdmaConn` as the callback types name it. The header declares the callback
/// types before the struct they are fields of, so they refer to it through
/// this stand-in, which the header generator renames to `RdmaConn`.
#[repr(C)]
pub struct RdmaConnFwd {
    _opaque: [u8; 0],
}

/// Called with each message; `data` is valid only during the call. Runs on
/// the completion thread.
pub type RdmaRecvCallbackFunc =
    Option<unsafe extern "C" fn(conn: *mut RdmaConnFwd, data: *mut c_void, data_len: usize)>;
/// Called when an `rdmaConnWrite` or async RDMA WRITE completed (completion thread).
pub type RdmaWriteCallbackFunc =
    Option<unsafe extern "C" fn(conn: *mut RdmaConnFwd, byte_len: usize)>;
/// Called when an async RDMA READ completed (completion thread).
pub type RdmaReadCallbackFunc =
    Option<unsafe extern "C" fn(conn: *mut RdmaConnFwd, byte_len: usize)>;
/// Called once data can flow, on both sides (completion thread).
pub type RdmaConnectedCallbackFunc = Option<unsafe extern "C" fn(conn: *mut RdmaConnFwd)>;
/// Called once when the peer went away or an operation failed, never after
/// `rdmaConnClose` (a runtime thread).
pub type RdmaDisconnectCallbackFunc = Option<unsafe extern "C" fn(conn: *mut RdmaConnFwd)>;
/// Called for each new server-side connection before it is accepted, so
/// callbacks can be set on it (CM thread).
pub type RdmaAcceptCallbackFunc = Option<unsafe extern "C" fn(conn: *mut RdmaConnFwd)>;
/// snowrdma extension: a message with its 32-bit immediate (completion thread).
pub type RdmaRecvImmCallbackFunc = Option<
    unsafe extern "C" fn(conn: *mut RdmaConnFwd, imm_data: u32, data: *mut c_void, data_len: usize),
>;

/// A command message as it travels on the wire (32 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RdmaCmd {
    pub magic: u8,
    pub version: u8,
    pub cmd_opcode: u8,
    pub rsvd: [u8; 13],
    /// Host byte order.
    pub addr: u64,
    /// Network byte order.
    pub length: u32,
    /// Network byte order.
    pub key: u32,
}

/// Work request context of the legacy library (24 bytes); kept for layout.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RdmaWrCtx {
    pub r#type: RdmaReqCtxType,
    pub rdma_conn: *mut c_void,
    pub private_data: *mut c_void,
}

/// Options of a server or connection (104 bytes). A zero field means "the
/// global default" (the `rdma*` variables), never zero.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RdmaOptions {
    pub rdma_listen_backlog: c_int,
    pub rdma_timeoutms: c_int,
    pub rdma_poll_event_timeoutms: c_int,
    pub rdma_max_inline_data: c_int,
    pub rdma_retry_count: c_int,
    pub rdma_rnr_retry_count: c_int,
    pub rdma_max_concurrent_work_requests: c_int,
    pub rdma_recv_depth: c_int,
    pub rdma_qp2cq_mode: RdmaQpCqMapping,
    pub rdma_comm_mode: RdmaCommMode,
    pub rdma_enable_phys_addr_access: bool,
    pub rdma_max_outstanding_rd_atomic: c_int,
    pub rdma_io_affinity_cpuid: c_int,
    pub recv_callback: RdmaRecvCallbackFunc,
    pub write_callback: RdmaWriteCallbackFunc,
    pub read_callback: RdmaReadCallbackFunc,
    pub connected_callback: RdmaConnectedCallbackFunc,
    pub disconnect_callback: RdmaDisconnectCallbackFunc,
    pub accept_callback: RdmaAcceptCallbackFunc,
}

pub type RdmaServerOptions = RdmaOptions;
pub type RdmaConnOptions = RdmaOptions;

/// One connection (456 bytes). The library allocates and frees it; programs
/// may read `ip`, `port`, `state`, `type`, `tx_*` and the buffer fields.
#[repr(C)]
pub struct RdmaConn {
    pub cm_id: *mut rdma_cm_id,
    pub last_errno: c_int,
    pub state: RdmaConnState,
    pub r#type: ConnectionType,
    /// The peer's address as text.
    pub ip: *mut c_char,
    /// The peer's port.
    pub port: c_int,
    pub pd: *mut ibv_pd,
    pub cm_channel: *mut rdma_event_channel,
    pub comp_channel: *mut ibv_comp_channel,
    pub cq: *mut ibv_cq,
    pub max_inline_data: u32,
    /// The peer's receive buffer.
    pub tx_addr: *mut c_char,
    pub tx_length: u32,
    pub tx_offset: u32,
    pub tx_key: u32,
    /// Our staging buffer for outgoing messages.
    pub send_buf: *mut c_char,
    pub send_length: u32,
    pub send_offset: u32,
    pub send_ops: u32,
    pub send_mr: *mut ibv_mr,
    pub rx_offset: u32,
    /// Our receive buffer (the ring peers write into).
    pub recv_buf: *mut c_char,
    pub recv_length: c_uint,
    pub recv_offset: c_uint,
    pub recv_mr: *mut ibv_mr,
    pub tx_pa_rkey: u32,
    pub tx_pa_addr: *mut c_char,
    pub tx_pa_length: c_uint,
    pub tx_pa_offset: c_uint,
    pub cmd_buf: *mut RdmaCmd,
    pub cmd_mr: *mut ibv_mr,
    pub rx_ctx: *mut RdmaWrCtx,
    pub tx_ctx: *mut RdmaWrCtx,
    pub status_cond: libc::pthread_cond_t,
    pub status_mutex: libc::pthread_mutex_t,
    pub options: RdmaConnOptions,
    pub recv_callback: RdmaRecvCallbackFunc,
    pub write_callback: RdmaWriteCallbackFunc,
    pub read_callback: RdmaReadCallbackFunc,
    pub connected_callback: RdmaConnectedCallbackFunc,
    pub disconnect_callback: RdmaDisconnectCallbackFunc,
}

/// A listening server (128 bytes), allocated and freed by the library.
#[repr(C)]
pub struct RdmaListener {
    pub cm_id: *mut rdma_cm_id,
    pub cm_channel: *mut rdma_event_channel,
    pub options: RdmaServerOptions,
    pub accept_callback: RdmaAcceptCallbackFunc,
}

const _: () = {
    assert!(std::mem::size_of::<RdmaCmd>() == 32);
    assert!(std::mem::size_of::<RdmaWrCtx>() == 24);
    assert!(std::mem::size_of::<RdmaOptions>() == 104);
    assert!(std::mem::size_of::<RdmaConn>() == 456);
    assert!(std::mem::size_of::<RdmaListener>() == 128);
};

// The globals: programs read and write them directly; they are read when a
// connection or server is created.

/// Listen backlog.
#[no_mangle]
pub static mut rdmaListenBacklog: c_int = 128;
/// Address/route resolution timeout, and the bound of each connection-setup step.
#[no_mangle]
pub static mut rdmaTimeoutms: c_int = 1000;
/// Poll timeout of the runtime threads.
#[no_mangle]
pub static mut rdmaPollEventTimeoutms: c_int = 10;
/// Inline threshold (0: no inline).
#[no_mangle]
pub static mut rdmaMaxInlineData: c_int = 0;
#[no_mangle]
pub static mut rdmaRetryCount: c_int = 7;
/// RNR retry count (7: forever on the wire).
#[no_mangle]
pub static mut rdmaRnrRetryCount: c_int = 7;
/// Completions taken per poll.
#[no_mangle]
pub static mut rdmaMaxConcurrentWorkRequests: c_int = 128 + 2048 * 2;
/// Receives posted per connection.
#[no_mangle]
pub static mut rdmaRecvDepth: c_int = 1024;
/// Outstanding READs/atomics (0: the device's maximum).
#[no_mangle]
pub static mut rdmaMaxOutstandingRdAtomic: c_int = 0;
#[no_mangle]
pub static mut rdmaQp2CqMode: RdmaQpCqMapping = RdmaQpCqMapping::ONE_TO_ONE;
#[no_mangle]
pub static mut rdmaCommMode: RdmaCommMode = RdmaCommMode::RDMA_NON_BLOCKING;
/// Ask for physical-address access (unavailable on upstream rdma-core).
#[no_mangle]
pub static mut rdmaEnablePhysAddrAccess: bool = false;
/// CPU of the completion thread (-1: not pinned; 0 is a valid CPU).
#[no_mangle]
pub static mut rdmaIoAffinityCpuId: c_int = -1;

/// Reads a C-writable int-sized field or global without trusting it to hold
/// a valid Rust enum or bool.
unsafe fn read_int<T>(p: *const T) -> c_int {
    std::ptr::read_volatile(p.cast::<c_int>())
}

unsafe fn read_bool(p: *const bool) -> bool {
    std::ptr::read_volatile(p.cast::<u8>()) != 0
}

/// Turns a C options struct (NULL: all defaults) into runtime options; every
/// zero field takes the global's value.
unsafe fn resolve_options(opt: *const RdmaOptions) -> Options {
    let pick = |field: *const c_int, global: *const c_int| -> c_int {
        let v = if field.is_null() { 0 } else { read_int(field) };
        if v != 0 {
            v
        } else {
            read_int(global)
        }
    };
    let f = |get: fn(*const RdmaOptions) -> *const c_int| {
        if opt.is_null() {
            std::ptr::null()
        } else {
            get(opt)
        }
    };
    let backlog = pick(
        f(|o| addr_of!((*o).rdma_listen_backlog)),
        addr_of!(rdmaListenBacklog),
    );
    let timeout = pick(
        f(|o| addr_of!((*o).rdma_timeoutms)),
        addr_of!(rdmaTimeoutms),
    );
    let tick = pick(
        f(|o| addr_of!((*o).rdma_poll_event_timeoutms)),
        addr_of!(rdmaPollEventTimeoutms),
    );
    let inline = pick(
        f(|o| addr_of!((*o).rdma_max_inline_data)),
        addr_of!(rdmaMaxInlineData),
    );
    let retry = pick(
        f(|o| addr_of!((*o).rdma_retry_count)),
        addr_of!(rdmaRetryCount),
    );
    let rnr = pick(
        f(|o| addr_of!((*o).rdma_rnr_retry_count)),
        addr_of!(rdmaRnrRetryCount),
    );
    let batch = pick(
        f(|o| addr_of!((*o).rdma_max_concurrent_work_requests)),
        addr_of!(rdmaMaxConcurrentWorkRequests),
    );
    let depth = pick(
        f(|o| addr_of!((*o).rdma_recv_depth)),
        addr_of!(rdmaRecvDepth),
    );
    let comm = pick(
        f(|o| addr_of!((*o).rdma_comm_mode).cast()),
        addr_of!(rdmaCommMode).cast(),
    );
    let rd = pick(
        f(|o| addr_of!((*o).rdma_max_outstanding_rd_atomic)),
        addr_of!(rdmaMaxOutstandingRdAtomic),
    );
    let cpu = pick(
        f(|o| addr_of!((*o).rdma_io_affinity_cpuid)),
        addr_of!(rdmaIoAffinityCpuId),
    );
    let pa = (!opt.is_null() && read_bool(addr_of!((*opt).rdma_enable_phys_addr_access)))
        || read_bool(addr_of!(rdmaEnablePhysAddrAccess));
    let defaults = Options::default();
    Options {
        listen_backlog: if backlog > 0 {
            backlog
        } else {
            defaults.listen_backlog
        },
        timeout: Duration::from_millis(if timeout > 0 { timeout as u64 } else { 1000 }),
        poll_event_timeout: Duration::from_millis(tick.clamp(1, 10_000) as u64),
        max_inline_data: inline.max(0) as u32,
        retry_count: retry.clamp(0, 7) as u8,
        rnr_retry_count: rnr.clamp(0, 7) as u8,
        max_concurrent_work_requests: if batch > 0 {
            batch as u32
        } else {
            defaults.max_concurrent_work_requests
        },
        recv_depth: if depth > 0 {
            depth as u32
        } else {
            defaults.recv_depth
        },
        comm_mode: if comm == RdmaCommMode::RDMA_BLOCKING as c_int {
            CommMode::Blocking
        } else {
            CommMode::NonBlocking
        },
        enable_phys_addr_access: pa,
        max_outstanding_rd_atomic: rd.max(0) as u32,
        io_affinity_cpu: usize::try_from(cpu).ok(),
        recv_buf_len: DEFAULT_RECV_BUF_LEN,
        spin: defaults.spin,
        // C callbacks run on the completion thread, as the legacy ones did.
        caller_polls: false,
        send_queue_bytes: defaults.send_queue_bytes,
    }
}

/// The library's side of one `RdmaConn`: the struct itself (stable address,
/// freed when the last holder lets go) and the runtime connection.
struct FfiConn {
    raw: Box<UnsafeCell<RdmaConn>>,
    ip: Mutex<Option<CString>>,
    imm_callback: Mutex<RdmaRecvImmCallbackFunc>,
    conn: Mutex<Option<WeakConnection>>,
    opts: Options,
}

// SAFETY: the struct is written by the library under its own discipline
// (volatile writes of plain fields) and read by C; `raw` never moves.
unsafe impl Send for FfiConn {}
unsafe impl Sync for FfiConn {}

impl FfiConn {
    fn new(opts: Options, c_opts: *const RdmaOptions, kind: ConnectionType) -> Arc<FfiConn> {
        // SAFETY: all-zero is a valid RdmaConn (NULL pointers, zero ints,
        // NONE enums, None callbacks, zeroed pthread objects).
        let raw: Box<UnsafeCell<RdmaConn>> =
            Box::new(UnsafeCell::new(unsafe { std::mem::zeroed() }));
        let p = raw.get();
        // SAFETY: p is ours; c_opts is NULL or a valid options struct.
        unsafe {
            libc::pthread_cond_init(addr_of_mut!((*p).status_cond), std::ptr::null());
            libc::pthread_mutex_init(addr_of_mut!((*p).status_mutex), std::ptr::null());
            (*p).r#type = kind;
            (*p).max_inline_data = opts.max_inline_data;
            if !c_opts.is_null() {
                (*p).options = std::ptr::read(c_opts);
                (*p).recv_callback = (*c_opts).recv_callback;
                (*p).write_callback = (*c_opts).write_callback;
                (*p).read_callback = (*c_opts).read_callback;
                (*p).connected_callback = (*c_opts).connected_callback;
                (*p).disconnect_callback = (*c_opts).disconnect_callback;
            }
        }
        Arc::new(FfiConn {
            raw,
            ip: Mutex::new(None),
            imm_callback: Mutex::new(None),
            conn: Mutex::new(None),
            opts,
        })
    }

    fn ptr(&self) -> *mut RdmaConn {
        self.raw.get()
    }

    fn connection(&self) -> Option<Connection> {
        self.conn
            .lock()
            .expect("ffi lock")
            .as_ref()
            .and_then(WeakConnection::upgrade)
    }

    fn bind(&self, conn: &Connection) {
        let mut slot = self.conn.lock().expect("ffi lock");
        if slot.is_some() {
            return;
        }
        *slot = Some(conn.downgrade());
        drop(slot);
        let p = self.ptr();
        let ring = conn.recv_ring();
        let staging = conn.staging();
        let peer = conn.peer_addr();
        let ip = peer.map(|a| CString::new(a.ip().to_string()).expect("no NUL in an address"));
        // SAFETY: p is ours; the pointers stored live as long as the connection.
        unsafe {
            let id = conn.cm_id().expect("C API connections use RDMA CM");
            (*p).cm_id = id.as_raw();
            (*p).cm_channel = (*id.as_raw()).channel;
            (*p).pd = conn.pd().as_raw();
            (*p).cq = conn.recv_cq().as_raw();
            (*p).comp_channel = (*conn.recv_cq().as_raw()).channel;
            (*p).recv_buf = ring.addr() as *mut c_char;
            (*p).recv_length = ring.len() as c_uint;
            (*p).recv_mr = ring.as_raw();
            (*p).send_buf = staging.addr() as *mut c_char;
            (*p).send_length = staging.len() as u32;
            (*p).send_mr = staging.as_raw();
            (*p).cmd_buf = conn.cmd_buffers().addr() as *mut RdmaCmd;
            (*p).cmd_mr = conn.cmd_buffers().as_raw();
            (*p).port = peer.map_or(0, |a| c_int::from(a.port()));
            (*p).ip = ip
                .as_ref()
                .map_or(std::ptr::null_mut(), |s| s.as_ptr() as *mut c_char);
        }
        *self.ip.lock().expect("ffi lock") = ip;
    }
}

impl ConnHandler for FfiConn {
    fn connected(&self, conn: &Connection) {
        self.bind(conn);
        // SAFETY: the callback field is read from our own struct.
        if let Some(cb) = unsafe { (*self.ptr()).connected_callback } {
            guard_callback("connected_callback", || unsafe { cb(self.ptr().cast()) });
        }
    }

    fn recv(&self, _conn: &Connection, data: &[u8], imm: Option<u32>) {
        let p = self.ptr();
        let ptr = data.as_ptr() as *mut c_void;
        if let Some(imm) = imm {
            if let Some(cb) = *self.imm_callback.lock().expect("ffi lock") {
                return guard_callback("recv_imm_callback", || unsafe {
                    cb(p.cast(), imm, ptr, data.len())
                });
            }
        }
        // SAFETY: as above.
        if let Some(cb) = unsafe { (*p).recv_callback } {
            guard_callback("recv_callback", || unsafe { cb(p.cast(), ptr, data.len()) });
        }
    }

    fn write_done(&self, _conn: &Connection, len: usize) {
        // SAFETY: as above.
        if let Some(cb) = unsafe { (*self.ptr()).write_callback } {
            guard_callback("write_callback", || unsafe { cb(self.ptr().cast(), len) });
        }
    }

    fn read_done(&self, _conn: &Connection, len: usize) {
        // SAFETY: as above.
        if let Some(cb) = unsafe { (*self.ptr()).read_callback } {
            guard_callback("read_callback", || unsafe { cb(self.ptr().cast(), len) });
        }
    }

    fn disconnected(&self, _conn: &Connection) {
        // SAFETY: as above.
        if let Some(cb) = unsafe { (*self.ptr()).disconnect_callback } {
            guard_callback("disconnect_callback", || unsafe { cb(self.ptr().cast()) });
        }
    }

    fn state_changed(&self, conn: &Connection, state: ConnState) {
        self.bind(conn);
        let c_state = match state {
            ConnState::None => RdmaConnState::RDMA_CONN_STATE_NONE,
            ConnState::Connecting => RdmaConnState::RDMA_CONN_STATE_CONNECTING,
            ConnState::Accepting => RdmaConnState::RDMA_CONN_STATE_ACCEPTING,
            ConnState::Connected => RdmaConnState::RDMA_CONN_STATE_CONNECTED,
            ConnState::MrReady => RdmaConnState::RDMA_CONN_STATE_MR_READY,
            ConnState::Closed => RdmaConnState::RDMA_CONN_STATE_CLOSED,
            ConnState::Error => RdmaConnState::RDMA_CONN_STATE_ERROR,
        };
        // SAFETY: a plain field of our own struct.
        unsafe {
            std::ptr::write_volatile(addr_of_mut!((*self.ptr()).state), c_state);
            if state == ConnState::Error {
                std::ptr::write_volatile(addr_of_mut!((*self.ptr()).last_errno), conn.last_errno());
            }
        }
    }

    fn peer_buffer(&self, _conn: &Connection, buf: RemoteRegion) {
        let p = self.ptr();
        // SAFETY: plain fields of our own struct.
        unsafe {
            (*p).tx_addr = buf.addr as *mut c_char;
            (*p).tx_length = buf.len as u32;
            (*p).tx_key = buf.rkey;
            (*p).tx_offset = 0;
        }
    }

    fn retired(&self, _conn: &Connection) {
        CONNS
            .lock()
            .expect("table lock")
            .remove(&(self.ptr() as usize));
    }
}

/// A C callback must not unwind into Rust either; a Rust panic inside the
/// guard (none expected) is logged.
fn guard_callback(name: &'static str, f: impl FnOnce()) {
    guard(name, (), f);
}

/// The connection table: every `RdmaConn *` handed to C, by address.
static CONNS: Lazy<Mutex<HashMap<usize, Arc<FfiConn>>>> = Lazy::new(|| Mutex::new(HashMap::new()));
/// Strong references to client connections (accepted ones are held by the
/// runtime until they end).
static CLIENTS: Lazy<Mutex<HashMap<usize, Connection>>> = Lazy::new(|| Mutex::new(HashMap::new()));

struct FfiListener {
    raw: Box<UnsafeCell<RdmaListener>>,
    listener: Listener,
}

// SAFETY: as for FfiConn.
unsafe impl Send for FfiListener {}
unsafe impl Sync for FfiListener {}

static LISTENERS: Lazy<Mutex<HashMap<usize, Arc<FfiListener>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

fn lookup(conn: *mut RdmaConn, func: &str) -> Option<Arc<FfiConn>> {
    let found = CONNS
        .lock()
        .expect("table lock")
        .get(&(conn as usize))
        .cloned();
    if found.is_none() {
        log::warn!("{func}: {conn:p} is not a live connection");
    }
    found
}

fn live(conn: *mut RdmaConn, func: &str) -> Option<Connection> {
    let c = lookup(conn, func)?.connection();
    if c.is_none() {
        log::warn!("{func}: the connection is not connected");
    }
    c
}

fn lookup_listener(l: *mut RdmaListener, func: &str) -> Option<Arc<FfiListener>> {
    let found = LISTENERS
        .lock()
        .expect("table lock")
        .get(&(l as usize))
        .cloned();
    if found.is_none() {
        log::warn!("{func}: {l:p} is not a live listener");
    }
    found
}

unsafe fn c_str<'a>(s: *const c_char) -> Option<&'a str> {
    if s.is_null() {
        None
    } else {
        CStr::from_ptr(s).to_str().ok()
    }
}

fn resolve(ip: &str, port: c_int) -> Option<SocketAddr> {
    let port = u16::try_from(port).ok()?;
    (ip, port).to_socket_addrs().ok()?.next()
}

/// Creates a server listening on `ip`:`port` (an address of an RDMA device;
/// port 0 picks a free one) and stores it in `*listener`. `opt` may be NULL;
/// its zero fields take the globals' values, and it is copied. Connections
/// are accepted once `rdmaServerStart` runs. Returns `RDMA_OK` or `RDMA_ERR`.
///
/// Also callable as `rdmaServer(&listener, ip, port)`.
///
/// # Safety
/// `listener` must be NULL or writable; `ip` NULL or a C string; `opt` NULL
/// or a valid options struct.
#[no_mangle]
pub unsafe extern "C" fn rdmaServer(
    listener: *mut *mut RdmaListener,
    ip: *const c_char,
    port: c_int,
    opt: *const RdmaServerOptions,
) -> c_int {
    guard("rdmaServer", RDMA_ERR, || {
        let (Some(ip), false) = (c_str(ip), listener.is_null()) else {
            log::warn!("rdmaServer: NULL listener or ip");
            return RDMA_ERR;
        };
        let Some(addr) = resolve(ip, port) else {
            log::warn!("rdmaServer: cannot resolve {ip}:{port}");
            return RDMA_ERR;
        };
        let opts = resolve_options(opt);
        runtime::configure(&opts);
        // SAFETY: all-zero is a valid RdmaListener.
        let raw: Box<UnsafeCell<RdmaListener>> = Box::new(UnsafeCell::new(std::mem::zeroed()));
        let raw_addr = raw.get() as usize;
        if !opt.is_null() {
            (*raw.get()).options = std::ptr::read(opt);
            (*raw.get()).accept_callback = (*opt).accept_callback;
        }
        let conn_opts = opts.clone();
        let hook = Box::new(move |conn: &Connection| -> Option<Arc<dyn ConnHandler>> {
            let l = LISTENERS
                .lock()
                .expect("table lock")
                .get(&raw_addr)
                .cloned()?;
            let lraw = l.raw.get();
            // SAFETY: the listener struct lives while it is in the table.
            let ffi = FfiConn::new(
                conn_opts.clone(),
                unsafe { addr_of!((*lraw).options) },
                ConnectionType::ACCEPTED_CONN,
            );
            ffi.bind(conn);
            CONNS
                .lock()
                .expect("table lock")
                .insert(ffi.ptr() as usize, ffi.clone());
            // SAFETY: as above.
            if let Some(cb) = unsafe { (*lraw).accept_callback } {
                guard_callback("accept_callback", || unsafe { cb(ffi.ptr().cast()) });
            }
            Some(ffi)
        });
        let l = match Listener::bind(addr, &opts, hook) {
            Ok(l) => l,
            Err(e) => {
                log::warn!("rdmaServer({ip}:{port}): {e}");
                return RDMA_ERR;
            }
        };
        let id = l.cm_id().expect("C API listeners use RDMA CM");
        (*raw.get()).cm_id = id.as_raw();
        (*raw.get()).cm_channel = (*id.as_raw()).channel;
        let ffi = Arc::new(FfiListener { raw, listener: l });
        let p = ffi.raw.get();
        LISTENERS
            .lock()
            .expect("table lock")
            .insert(p as usize, ffi);
        *listener = p;
        RDMA_OK
    })
}

/// Accepts connections until `rdmaServerStop` (from another thread or a
/// callback); blocks the calling thread meanwhile. Returns `RDMA_OK`, or
/// `RDMA_ERR` for an unknown listener.
///
/// # Safety
/// `listener` may be anything; unknown pointers are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaServerStart(listener: *mut RdmaListener) -> c_int {
    guard("rdmaServerStart", RDMA_ERR, || {
        let Some(l) = lookup_listener(listener, "rdmaServerStart") else {
            return RDMA_ERR;
        };
        l.listener.start();
        l.listener.wait_stopped();
        RDMA_OK
    })
}

/// Stops accepting and makes `rdmaServerStart` return. Accepted connections
/// and the process's client connections keep running.
///
/// # Safety
/// As `rdmaServerStart`.
#[no_mangle]
pub unsafe extern "C" fn rdmaServerStop(listener: *mut RdmaListener) -> c_int {
    guard("rdmaServerStop", RDMA_ERR, || {
        let Some(l) = lookup_listener(listener, "rdmaServerStop") else {
            return RDMA_ERR;
        };
        l.listener.stop();
        RDMA_OK
    })
}

/// Closes the server's accepted connections and frees the listener; the
/// pointer is invalid afterwards.
///
/// # Safety
/// As `rdmaServerStart`.
#[no_mangle]
pub unsafe extern "C" fn rdmaServerRelease(listener: *mut RdmaListener) {
    guard("rdmaServerRelease", (), || {
        let Some(l) = LISTENERS
            .lock()
            .expect("table lock")
            .remove(&(listener as usize))
        else {
            log::warn!("rdmaServerRelease: {listener:p} is not a live listener");
            return;
        };
        l.listener.release();
    })
}

/// Sets the callback run (on the CM thread) for each new connection, before
/// it is accepted.
///
/// # Safety
/// As `rdmaServerStart`.
#[no_mangle]
pub unsafe extern "C" fn rdmaServerSetAcceptCallback(
    listener: *mut RdmaListener,
    func: RdmaAcceptCallbackFunc,
) -> c_int {
    guard("rdmaServerSetAcceptCallback", RDMA_ERR, || {
        let Some(l) = lookup_listener(listener, "rdmaServerSetAcceptCallback") else {
            return RDMA_ERR;
        };
        // SAFETY: the struct is ours and alive.
        unsafe { (*l.raw.get()).accept_callback = func };
        RDMA_OK
    })
}

/// Creates an unconnected client connection; `opt` may be NULL (also
/// callable as `rdmaConn()`). Free it with `rdmaConnClose`. Returns NULL on
/// failure.
///
/// # Safety
/// `opt` must be NULL or a valid options struct.
#[no_mangle]
pub unsafe extern "C" fn rdmaConn(opt: *const RdmaConnOptions) -> *mut RdmaConn {
    guard("rdmaConn", std::ptr::null_mut(), || {
        let opts = resolve_options(opt);
        runtime::configure(&opts);
        let ffi = FfiConn::new(opts, opt, ConnectionType::CONNECTED_CONN);
        let p = ffi.ptr();
        CONNS.lock().expect("table lock").insert(p as usize, ffi);
        p
    })
}

/// Connects to a server; returns `RDMA_OK` once data can flow, or `RDMA_ERR`
/// when the server rejects, is unreachable, or does not answer in time
/// (about `rdmaTimeoutms` per setup step).
///
/// # Safety
/// `serverip` must be NULL or a C string.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnect(
    conn: *mut RdmaConn,
    serverip: *mut c_char,
    port: c_int,
) -> c_int {
    guard("rdmaConnect", RDMA_ERR, || {
        let Some(ffi) = lookup(conn, "rdmaConnect") else {
            return RDMA_ERR;
        };
        if ffi.connection().is_some() {
            log::warn!("rdmaConnect: already connected");
            return RDMA_ERR;
        }
        let Some(ip) = c_str(serverip) else {
            log::warn!("rdmaConnect: NULL or non-UTF-8 server address");
            return RDMA_ERR;
        };
        let Some(addr) = resolve(ip, port) else {
            log::warn!("rdmaConnect: cannot resolve {ip}:{port}");
            return RDMA_ERR;
        };
        match Connection::connect(addr, &ffi.opts, ffi.clone()) {
            Ok(c) => {
                ffi.bind(&c);
                CLIENTS.lock().expect("table lock").insert(conn as usize, c);
                RDMA_OK
            }
            Err(e) => {
                log::warn!("rdmaConnect to {addr}: {e}");
                // SAFETY: our own struct.
                unsafe {
                    (*conn).state = RdmaConnState::RDMA_CONN_STATE_ERROR;
                    (*conn).last_errno = libc::ECONNREFUSED;
                }
                RDMA_ERR
            }
        }
    })
}

/// Closes a connection (client or accepted): pending sync operations fail,
/// the peer gets its disconnect, and the memory (including buffers from
/// `rdmaConnRegMem`) is freed. The pointer is invalid afterwards; a second
/// close is refused harmlessly.
///
/// # Safety
/// Any pointer is accepted; unknown ones are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnClose(conn: *mut RdmaConn) {
    guard("rdmaConnClose", (), || {
        let Some(ffi) = CONNS.lock().expect("table lock").remove(&(conn as usize)) else {
            log::warn!("rdmaConnClose: {conn:p} is not a live connection (closed twice?)");
            return;
        };
        let client = CLIENTS.lock().expect("table lock").remove(&(conn as usize));
        if let Some(c) = client.or_else(|| ffi.connection()) {
            c.close();
        }
    })
}

/// Stores a callback where the connection's handler reads it.
fn set_callback(func: &'static str, conn: *mut RdmaConn, store: impl FnOnce(&FfiConn)) -> c_int {
    guard(func, RDMA_ERR, || {
        let Some(ffi) = lookup(conn, func) else {
            return RDMA_ERR;
        };
        store(&ffi);
        RDMA_OK
    })
}

/// Sets the callback for each received message (completion thread). Returns `RDMA_OK`, or `RDMA_ERR` for an unknown connection.
///
/// # Safety
/// Any pointer is accepted; unknown ones are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnSetRecvCallback(
    conn: *mut RdmaConn,
    func: RdmaRecvCallbackFunc,
) -> c_int {
    // SAFETY: the struct is alive while in the table.
    set_callback("rdmaConnSetRecvCallback", conn, |f| unsafe {
        std::ptr::write_volatile(addr_of_mut!((*f.ptr()).recv_callback), func)
    })
}

/// Sets the callback for completed writes (completion thread). Returns `RDMA_OK`, or `RDMA_ERR` for an unknown connection.
///
/// # Safety
/// Any pointer is accepted; unknown ones are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnSetWriteCallback(
    conn: *mut RdmaConn,
    func: RdmaWriteCallbackFunc,
) -> c_int {
    // SAFETY: the struct is alive while in the table.
    set_callback("rdmaConnSetWriteCallback", conn, |f| unsafe {
        std::ptr::write_volatile(addr_of_mut!((*f.ptr()).write_callback), func)
    })
}

/// Sets the callback for completed async reads (completion thread). Returns `RDMA_OK`, or `RDMA_ERR` for an unknown connection.
///
/// # Safety
/// Any pointer is accepted; unknown ones are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnSetReadCallback(
    conn: *mut RdmaConn,
    func: RdmaReadCallbackFunc,
) -> c_int {
    // SAFETY: the struct is alive while in the table.
    set_callback("rdmaConnSetReadCallback", conn, |f| unsafe {
        std::ptr::write_volatile(addr_of_mut!((*f.ptr()).read_callback), func)
    })
}

/// Sets the callback for "data can flow" (completion thread). Returns `RDMA_OK`, or `RDMA_ERR` for an unknown connection.
///
/// # Safety
/// Any pointer is accepted; unknown ones are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnSetConnectedCallback(
    conn: *mut RdmaConn,
    func: RdmaConnectedCallbackFunc,
) -> c_int {
    // SAFETY: the struct is alive while in the table.
    set_callback("rdmaConnSetConnectedCallback", conn, |f| unsafe {
        std::ptr::write_volatile(addr_of_mut!((*f.ptr()).connected_callback), func)
    })
}

/// Sets the callback for the end of the connection (a runtime thread). Returns `RDMA_OK`, or `RDMA_ERR` for an unknown connection.
///
/// # Safety
/// Any pointer is accepted; unknown ones are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnSetDisconnectCallback(
    conn: *mut RdmaConn,
    func: RdmaDisconnectCallbackFunc,
) -> c_int {
    // SAFETY: the struct is alive while in the table.
    set_callback("rdmaConnSetDisconnectCallback", conn, |f| unsafe {
        std::ptr::write_volatile(addr_of_mut!((*f.ptr()).disconnect_callback), func)
    })
}

/// snowrdma extension: the callback for messages sent with an immediate
/// (`rdmaConnSendWithImm`, `rdmaConnWriteWithImm`). Without it, such messages
/// go to the receive callback and the immediate is dropped.
///
/// # Safety
/// Any pointer is accepted; unknown ones are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnSetRecvImmCallback(
    conn: *mut RdmaConn,
    func: RdmaRecvImmCallbackFunc,
) -> c_int {
    set_callback("rdmaConnSetRecvImmCallback", conn, |f| {
        *f.imm_callback.lock().expect("ffi lock") = func;
    })
}

/// Stops the background runtime: closes accepted connections; the threads
/// end once no connection uses them. Later calls start it afresh.
#[no_mangle]
pub extern "C" fn rdmaRuntimeStop() {
    guard("rdmaRuntimeStop", (), runtime::stop)
}

/// Registers a zeroed buffer of `size` bytes (local write, remote read and
/// write) on the connection. The library owns it: free it with
/// `rdmaConnDeregMem` (or it is freed when the connection is). NULL on error.
///
/// # Safety
/// Any pointer is accepted; unknown ones are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnRegMem(conn: *mut RdmaConn, size: usize) -> *mut ibv_mr {
    guard("rdmaConnRegMem", std::ptr::null_mut(), || {
        let Some(c) = live(conn, "rdmaConnRegMem") else {
            return std::ptr::null_mut();
        };
        c.register(size).unwrap_or_else(|e| {
            log::warn!("rdmaConnRegMem({size}): {e}");
            std::ptr::null_mut()
        })
    })
}

/// Deregisters and frees a buffer from `rdmaConnRegMem`.
///
/// # Safety
/// Any pointers are accepted; unknown ones are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnDeregMem(conn: *mut RdmaConn, mr: *mut ibv_mr) {
    guard("rdmaConnDeregMem", (), || {
        if let Some(c) = live(conn, "rdmaConnDeregMem") {
            if !c.deregister(mr) {
                log::warn!("rdmaConnDeregMem: {mr:p} was not registered on this connection");
            }
        }
    })
}

const SIZE_ERR: usize = usize::MAX;

fn send_result(func: &str, r: runtime::Result<usize>) -> usize {
    r.unwrap_or_else(|e| {
        log::warn!("{func}: {e}");
        SIZE_ERR
    })
}

unsafe fn bytes<'a>(data: *const c_void, len: usize, func: &str) -> Option<&'a [u8]> {
    if data.is_null() || len == 0 {
        log::warn!("{func}: NULL data or zero length");
        return None;
    }
    Some(std::slice::from_raw_parts(data.cast::<u8>(), len))
}

/// Sends a message (copied; `data` may be reused at once). A message that
/// finds no room in the peer's buffer now waits in the connection's send
/// queue and is sent in order as room returns, so a send from a callback is
/// never lost. Returns `data_len` once the message is sent or queued; 0 when
/// the send queue is full (`SNOWRDMA_SEND_QUEUE_BYTES`, default 64 MiB per
/// connection; logged once per episode), when blocking mode waited out its
/// timeout outside a callback, or when a legacy peer's buffer is used up for
/// good; `(size_t)-1` on error (NULL, zero length, larger than the peer's
/// buffer, connection ended). `rdmaConnClose` sends what is queued first,
/// waiting up to `rdmaTimeoutms` (at least a second) for room; what is left
/// then is dropped and logged.
///
/// # Safety
/// `data` must be NULL or readable for `data_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnSend(
    conn: *mut RdmaConn,
    data: *mut c_void,
    data_len: usize,
) -> usize {
    guard("rdmaConnSend", SIZE_ERR, || {
        let (Some(c), Some(d)) = (
            live(conn, "rdmaConnSend"),
            bytes(data, data_len, "rdmaConnSend"),
        ) else {
            return SIZE_ERR;
        };
        send_result("rdmaConnSend", c.send(d))
    })
}

/// Sends a message that also delivers `imm_data` to the peer (see
/// `rdmaConnSetRecvImmCallback`). Returns as `rdmaConnSend`; a legacy peer
/// cannot receive it (`(size_t)-1`).
///
/// # Safety
/// As `rdmaConnSend`.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnSendWithImm(
    conn: *mut RdmaConn,
    imm_data: u32,
    data: *const c_void,
    data_len: usize,
) -> usize {
    guard("rdmaConnSendWithImm", SIZE_ERR, || {
        let (Some(c), Some(d)) = (
            live(conn, "rdmaConnSendWithImm"),
            bytes(data, data_len, "rdmaConnSendWithImm"),
        ) else {
            return SIZE_ERR;
        };
        send_result("rdmaConnSendWithImm", c.send_with_imm(imm_data, d))
    })
}

/// Writes `data` into the peer's receive buffer without notifying it; the
/// bytes are copied (`data` may be reused at once) and, when no room is free
/// now, queued in order with the messages, as `rdmaConnSend` does. The write
/// callback fires, on the calling thread, once the bytes are accepted.
/// Returns as `rdmaConnSend`.
///
/// # Safety
/// As `rdmaConnSend`.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnWrite(
    conn: *mut RdmaConn,
    data: *const c_void,
    data_len: usize,
) -> usize {
    guard("rdmaConnWrite", SIZE_ERR, || {
        let (Some(c), Some(d)) = (
            live(conn, "rdmaConnWrite"),
            bytes(data, data_len, "rdmaConnWrite"),
        ) else {
            return SIZE_ERR;
        };
        send_result("rdmaConnWrite", c.write_silent(d))
    })
}

/// Writes `data` into the peer's buffer with an immediate, delivered to the
/// peer with the data. Returns `data_len`, 0 when there is no room now, or
/// `RDMA_ERR`.
///
/// # Safety
/// As `rdmaConnSend`.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnWriteWithImm(
    conn: *mut RdmaConn,
    imm_data: u32,
    data: *const c_void,
    data_len: usize,
) -> c_int {
    guard("rdmaConnWriteWithImm", RDMA_ERR, || {
        if data_len > c_int::MAX as usize {
            return RDMA_ERR;
        }
        let (Some(c), Some(d)) = (
            live(conn, "rdmaConnWriteWithImm"),
            bytes(data, data_len, "rdmaConnWriteWithImm"),
        ) else {
            return RDMA_ERR;
        };
        match c.send_with_imm(imm_data, d) {
            Ok(n) => n as c_int,
            Err(e) => {
                log::warn!("rdmaConnWriteWithImm: {e}");
                RDMA_ERR
            }
        }
    })
}

fn op_result(func: &str, r: runtime::Result<usize>) -> c_int {
    match r {
        Ok(n) => c_int::try_from(n).unwrap_or(RDMA_ERR),
        Err(e) => {
            log::warn!("{func}: {e}");
            RDMA_ERR
        }
    }
}

fn checked_len(length: usize, func: &str) -> Option<u32> {
    match u32::try_from(length) {
        Ok(l) if l > 0 && l <= c_int::MAX as u32 => Some(l),
        _ => {
            log::warn!("{func}: length {length} out of range");
            None
        }
    }
}

/// Starts an RDMA READ of `length` bytes from the peer's `remote_buf`
/// (`rkey`) into `local_buf` (`lkey`, from `rdmaConnRegMem` on this
/// connection); the read callback fires on completion. Returns `length` or
/// `RDMA_ERR`.
///
/// # Safety
/// `local_buf` must stay untouched until the read callback.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnRead(
    conn: *mut RdmaConn,
    local_buf: *mut c_void,
    lkey: u32,
    remote_buf: *mut c_void,
    rkey: u32,
    length: usize,
) -> c_int {
    guard("rdmaConnRead", RDMA_ERR, || {
        let (Some(c), Some(len)) = (
            live(conn, "rdmaConnRead"),
            checked_len(length, "rdmaConnRead"),
        ) else {
            return RDMA_ERR;
        };
        let remote = RemoteAddr {
            addr: remote_buf as u64,
            rkey,
        };
        op_result("rdmaConnRead", unsafe {
            c.read(local_buf as u64, lkey, remote, len)
        })
    })
}

/// The README's short form `rdmaConnRead(conn, buf, len)`: reads `len` bytes
/// from the start of the peer's receive buffer into `buf`, which must lie in
/// a buffer from `rdmaConnRegMem`. Returns `len` or `RDMA_ERR`.
///
/// # Safety
/// As `rdmaConnRead`.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnReadBuf(
    conn: *mut RdmaConn,
    buf: *mut c_void,
    buf_len: usize,
) -> c_int {
    guard("rdmaConnReadBuf", RDMA_ERR, || {
        let (Some(c), Some(len)) = (
            live(conn, "rdmaConnReadBuf"),
            checked_len(buf_len, "rdmaConnReadBuf"),
        ) else {
            return RDMA_ERR;
        };
        let (Some(peer), Some(lkey)) = (c.peer_buffer(), c.registered_lkey(buf as u64, buf_len))
        else {
            log::warn!(
                "rdmaConnReadBuf: not connected, or buf is not in a buffer from rdmaConnRegMem"
            );
            return RDMA_ERR;
        };
        if u64::from(len) > peer.len {
            log::warn!(
                "rdmaConnReadBuf: {len} bytes exceed the peer's {}-byte buffer",
                peer.len
            );
            return RDMA_ERR;
        }
        op_result("rdmaConnReadBuf", unsafe {
            c.read(buf as u64, lkey, peer.at(0), len)
        })
    })
}

fn sync_one_sided(
    func: &'static str,
    read: bool,
    conn: *mut RdmaConn,
    local_addr: u64,
    lkey: u32,
    remote: RemoteAddr,
    length: u32,
) -> c_int {
    guard(func, RDMA_ERR, || {
        let (Some(c), Some(len)) = (live(conn, func), checked_len(length as usize, func)) else {
            return RDMA_ERR;
        };
        let r = if read {
            c.read_sync(local_addr, lkey, remote, len)
        } else {
            c.write_sync(local_addr, lkey, remote, len)
        };
        op_result(func, r)
    })
}

/// RDMA WRITE of `length` bytes from `local_addr` (in a buffer from
/// `rdmaConnRegMem`, checked) to the peer's `remote_addr`/`rkey`; returns
/// `length` once its own completion arrived, or `RDMA_ERR` when it failed (a
/// failed completion also ends the connection, with the disconnect callback).
///
/// # Safety
/// Any pointers are accepted; the local range is checked, the remote one is
/// the device's to check.
#[no_mangle]
pub unsafe extern "C" fn rdmaSyncWriteSignaled(
    conn: *mut RdmaConn,
    local_addr: u64,
    lkey: u32,
    remote_addr: u64,
    rkey: u32,
    length: u32,
) -> c_int {
    let remote = RemoteAddr {
        addr: remote_addr,
        rkey,
    };
    sync_one_sided(
        "rdmaSyncWriteSignaled",
        false,
        conn,
        local_addr,
        lkey,
        remote,
        length,
    )
}

/// RDMA READ, as `rdmaSyncWriteSignaled` in the other direction.
///
/// # Safety
/// As `rdmaSyncWriteSignaled`.
#[no_mangle]
pub unsafe extern "C" fn rdmaSyncReadSignaled(
    conn: *mut RdmaConn,
    local_addr: u64,
    lkey: u32,
    remote_addr: u64,
    rkey: u32,
    length: u32,
) -> c_int {
    let remote = RemoteAddr {
        addr: remote_addr,
        rkey,
    };
    sync_one_sided(
        "rdmaSyncReadSignaled",
        true,
        conn,
        local_addr,
        lkey,
        remote,
        length,
    )
}

/// Physical-address operations need MLNX_OFED's experimental verbs; upstream
/// rdma-core has no physical-address registration, so they fail cleanly.
fn pa_unsupported(func: &'static str, conn: *mut RdmaConn) -> c_int {
    guard(func, RDMA_ERR, || {
        if lookup(conn, func).is_some() {
            log::warn!(
                "{func}: physical-address access needs MLNX_OFED experimental verbs (ibv_exp_reg_mr \
                 with physical-address access), absent from this rdma-core stack"
            );
        }
        RDMA_ERR
    })
}

/// Physical-address RDMA WRITE: `RDMA_ERR` with a logged reason on stacks
/// without physical-address memory registration (upstream rdma-core).
///
/// # Safety
/// Touches no memory.
#[no_mangle]
pub unsafe extern "C" fn rdmaPAWriteSignaled(
    conn: *mut RdmaConn,
    _local_addr: u64,
    _lkey: u32,
    _remote_addr: u64,
    _length: u32,
) -> c_int {
    pa_unsupported("rdmaPAWriteSignaled", conn)
}

/// Physical-address RDMA READ: `RDMA_ERR` as `rdmaPAWriteSignaled`.
///
/// # Safety
/// Touches no memory.
#[no_mangle]
pub unsafe extern "C" fn rdmaPAReadSignaled(
    conn: *mut RdmaConn,
    _local_addr: u64,
    _lkey: u32,
    _remote_addr: u64,
    _length: u32,
) -> c_int {
    pa_unsupported("rdmaPAReadSignaled", conn)
}

/// Synchronous physical-address RDMA WRITE: `RDMA_ERR` as `rdmaPAWriteSignaled`.
///
/// # Safety
/// Touches no memory.
#[no_mangle]
pub unsafe extern "C" fn rdmaPASyncWriteSignaled(
    conn: *mut RdmaConn,
    _local_addr: u64,
    _lkey: u32,
    _remote_addr: u64,
    _length: u32,
) -> c_int {
    pa_unsupported("rdmaPASyncWriteSignaled", conn)
}

/// Synchronous physical-address RDMA READ: `RDMA_ERR` as `rdmaPAWriteSignaled`.
///
/// # Safety
/// Touches no memory.
#[no_mangle]
pub unsafe extern "C" fn rdmaPASyncReadSignaled(
    conn: *mut RdmaConn,
    _local_addr: u64,
    _lkey: u32,
    _remote_addr: u64,
    _length: u32,
) -> c_int {
    pa_unsupported("rdmaPASyncReadSignaled", conn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_fields_take_the_globals_and_set_fields_are_honoured() {
        // SAFETY: all-zero is the `RdmaConnOptions opt = {0};` of C programs.
        let mut opt: RdmaOptions = unsafe { std::mem::zeroed() };
        let defaults = unsafe { resolve_options(&opt) };
        assert_eq!(defaults, unsafe { resolve_options(std::ptr::null()) });
        assert_eq!(defaults.timeout, Duration::from_millis(1000));
        assert_eq!(defaults.recv_depth, 1024);
        assert_eq!(defaults.comm_mode, CommMode::NonBlocking);
        assert_eq!(defaults.io_affinity_cpu, None);

        opt.rdma_timeoutms = 2500;
        opt.rdma_recv_depth = 64;
        opt.rdma_io_affinity_cpuid = 1;
        opt.rdma_rnr_retry_count = 3;
        let set = unsafe { resolve_options(&opt) };
        assert_eq!(set.timeout, Duration::from_millis(2500));
        assert_eq!(set.recv_depth, 64);
        assert_eq!(set.io_affinity_cpu, Some(1));
        assert_eq!(set.rnr_retry_count, 3);

        // A program that sets a global changes the default of zero fields;
        // CPU 0 is chosen through the global (a zero field means "default").
        unsafe {
            rdmaCommMode = RdmaCommMode::RDMA_BLOCKING;
            rdmaIoAffinityCpuId = 0;
        }
        let from_globals = unsafe { resolve_options(std::ptr::null()) };
        unsafe {
            rdmaCommMode = RdmaCommMode::RDMA_NON_BLOCKING;
            rdmaIoAffinityCpuId = -1;
        }
        assert_eq!(from_globals.comm_mode, CommMode::Blocking);
        assert_eq!(from_globals.io_affinity_cpu, Some(0));
    }

    #[test]
    fn unknown_handles_are_refused_without_being_touched() {
        let mut junk = [0u8; 512];
        let fake = junk.as_mut_ptr().cast::<RdmaConn>();
        unsafe {
            assert_eq!(rdmaConnSend(fake, junk.as_mut_ptr().cast(), 4), usize::MAX);
            assert_eq!(rdmaConnSetRecvCallback(fake, None), RDMA_ERR);
            assert_eq!(rdmaSyncReadSignaled(fake, 0, 0, 0, 0, 8), RDMA_ERR);
            assert!(rdmaConnRegMem(std::ptr::null_mut(), 8).is_null());
            rdmaConnClose(fake);
            assert_eq!(rdmaServerStop(junk.as_mut_ptr().cast()), RDMA_ERR);
            assert_eq!(rdmaPAReadSignaled(fake, 0, 0, 0, 8), RDMA_ERR);
        }
        assert!(
            junk.iter().all(|&b| b == 0),
            "nothing was written through the bad pointer"
        );
    }
}
