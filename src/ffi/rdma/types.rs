//! The ABI's types: constants, enums and structs laid out to the byte as
//! the legacy header's, and the callback types.

use std::ffi::{c_char, c_int, c_uint, c_void};

use rdma_sys::{ibv_comp_channel, ibv_cq, ibv_mr, ibv_pd, rdma_cm_id, rdma_event_channel};

use crate::runtime::{ConnKind, ConnState, DEFAULT_RECV_BUF_LEN};

/// Success.
pub const RDMA_OK: c_int = 0;
/// Failure.
pub const RDMA_ERR: c_int = -1;
pub const RDMA_MAX_SGE: c_int = 1024;
/// Size of each connection's receive buffer.
pub const RDMA_DEFAULT_RX_LEN: c_int = 1024 * 1024;
const _: () = assert!(RDMA_DEFAULT_RX_LEN as usize == DEFAULT_RECV_BUF_LEN);
/// Command opcodes on the wire. The legacy header's enum: an `int`, with
/// the legacy opcodes only; the runtime's `proto::Opcode` is a byte and adds
/// CREDIT. The numbers are the runtime's, checked here at compile time.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RdmaCmdType {
    REG_LOCAL_ADDR = 0,
    REG_PHYS_ADDR = 1,
    CONN_GOODBYE = 2,
}

const _: () = {
    use crate::runtime::proto::Opcode;
    assert!(RdmaCmdType::REG_LOCAL_ADDR as u8 == Opcode::RegLocalAddr as u8);
    assert!(RdmaCmdType::REG_PHYS_ADDR as u8 == Opcode::RegPhysAddr as u8);
    assert!(RdmaCmdType::CONN_GOODBYE as u8 == Opcode::ConnGoodbye as u8);
};

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

/// Called with each message; `data` holds the message during the call (a
/// later message overwrites it; the memory stays allocated while the
/// connection lives). Runs on the completion thread.
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
    pub state: ConnState,
    pub r#type: ConnKind,
    /// The peer's address as text.
    pub ip: *mut c_char,
    /// The peer's port.
    pub port: c_int,
    pub pd: *mut ibv_pd,
    pub cm_channel: *mut rdma_event_channel,
    pub comp_channel: *mut ibv_comp_channel,
    pub cq: *mut ibv_cq,
    /// The inline size asked for, as the legacy library shows it (0 when
    /// the library picks).
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
