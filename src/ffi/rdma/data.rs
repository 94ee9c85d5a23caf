//! Exports that move data: messages, one-sided and synchronous operations,
//! and the physical-address operations this stack cannot offer.

use std::ffi::{c_int, c_void};

use crate::ffi::boundary::{fits_in_memory, guard_or};
use crate::runtime::{self, Connection};
use crate::verbs::RemoteAddr;

use super::handles::*;
use super::types::*;

const SIZE_ERR: usize = usize::MAX;

pub(super) fn send_result(func: &str, r: runtime::Result<usize>) -> usize {
    r.unwrap_or_else(|e| {
        log::warn!("{func}: {e}");
        SIZE_ERR
    })
}

pub(super) unsafe fn bytes<'a>(data: *const c_void, len: usize, func: &str) -> Option<&'a [u8]> {
    if data.is_null() || len == 0 || !fits_in_memory(len) {
        log::warn!("{func}: NULL data, or length {len} out of range");
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
/// then is dropped and logged. With a write callback set, it is called with
/// `data_len` for each message sent or queued, on the completion thread,
/// after this call returned and before `rdmaConnClose` returns (unless the
/// connection ended first: none follows the disconnect callback); never
/// inside this call. (The legacy library signaled every message when a write
/// callback was set and called it on the message's completion; here it
/// means the bytes were accepted, which a failure may still drop.)
///
/// # Safety
/// `data` must be NULL or readable for `data_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnSend(
    conn: *mut RdmaConn,
    data: *mut c_void,
    data_len: usize,
) -> usize {
    send_export(
        "rdmaConnSend",
        conn,
        data,
        data_len,
        Written::Tell,
        |c, d| c.send(d),
    )
}

/// Whether a send owes the write callback: the legacy library posted every
/// message as a signaled WRITE WITH IMM when a write callback was set, so
/// the callback followed each `rdmaConnSend`; `rdmaConnWrite`'s is owed by
/// the runtime itself ([`Connection::write_silent`]). The legacy
/// `rdmaConnWriteWithImm` sent nothing and called nothing, so it owes none.
#[derive(Clone, Copy, PartialEq)]
enum Written {
    Tell,
    RuntimeTells,
}

/// The body of the exports that send bytes: the panic boundary, the handle
/// and buffer checks, and the result as a `size_t`.
///
/// # Safety
/// `data` must be NULL or readable for `data_len` bytes.
#[track_caller]
unsafe fn send_export(
    func: &'static str,
    conn: *mut RdmaConn,
    data: *const c_void,
    data_len: usize,
    written: Written,
    op: impl FnOnce(&Connection, &[u8]) -> runtime::Result<usize>,
) -> usize {
    guard_or(SIZE_ERR, || {
        let Some(ffi) = lookup(conn, func) else {
            return SIZE_ERR;
        };
        let (Some(c), Some(d)) = (live_of(&ffi, func), bytes(data, data_len, func)) else {
            return SIZE_ERR;
        };
        let sent = send_result(func, op(&c, d));
        if written == Written::Tell && sent != SIZE_ERR && sent > 0 && ffi.wants_write_done() {
            c.notify_written(sent);
        }
        sent
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
    send_export(
        "rdmaConnSendWithImm",
        conn,
        data,
        data_len,
        Written::Tell,
        |c, d| c.send_with_imm(imm_data, d),
    )
}

/// Writes `data` into the peer's receive buffer without notifying it; the
/// bytes are copied (`data` may be reused at once) and, when no room is free
/// now, queued in order with the messages, as `rdmaConnSend` does. The write
/// callback follows on the completion thread (see `rdmaConnSend`).
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
    send_export(
        "rdmaConnWrite",
        conn,
        data,
        data_len,
        Written::RuntimeTells,
        |c, d| c.write_silent(d),
    )
}

/// Writes `data` into the peer's buffer with an immediate, delivered to the
/// peer with the data (queued when no room is free now, as `rdmaConnSend`
/// does). Returns `data_len`, 0 when the send queue is full, or `RDMA_ERR`.
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
    guard_or(RDMA_ERR, || {
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

pub(super) fn op_result(func: &str, r: runtime::Result<usize>) -> c_int {
    match r {
        Ok(n) => c_int::try_from(n).unwrap_or(RDMA_ERR),
        Err(e) => {
            log::warn!("{func}: {e}");
            RDMA_ERR
        }
    }
}

pub(super) fn checked_len(length: usize, func: &str) -> Option<u32> {
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
    guard_or(RDMA_ERR, || {
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
    guard_or(RDMA_ERR, || {
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

#[track_caller]
pub(super) fn sync_one_sided(
    func: &'static str,
    read: bool,
    conn: *mut RdmaConn,
    local_addr: u64,
    lkey: u32,
    remote: RemoteAddr,
    length: u32,
) -> c_int {
    guard_or(RDMA_ERR, || {
        let Some(ffi) = lookup(conn, func) else {
            return RDMA_ERR;
        };
        let (Some(c), Some(len)) = (live_of(&ffi, func), checked_len(length as usize, func)) else {
            return RDMA_ERR;
        };
        let r = if read {
            c.read_sync(local_addr, lkey, remote, len)
        } else {
            c.write_sync(local_addr, lkey, remote, len)
        };
        if r.is_err() {
            // A failed completion ended the connection before the failure
            // reached us; the struct shows it before the caller has
            // RDMA_ERR (the report from the thread that ended it may come
            // after).
            ffi.mirror_state(&c);
        }
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
#[track_caller]
pub(super) fn pa_unsupported(func: &'static str, conn: *mut RdmaConn) -> c_int {
    guard_or(RDMA_ERR, || {
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
