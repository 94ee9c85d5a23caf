//! The broker's C API (`include/snowrdma/broker.h`): a thin layer over
//! [`crate::broker`]. A broker belongs to the thread that created it: every
//! call on it must come from that thread (others get
//! `SNOWRDMA_BROKER_WRONG_THREAD`), and every callback runs on it, inside
//! `snowrdma_broker_poll_sq` / `snowrdma_broker_poll_rq`.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::addr_of;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::Arc;
use std::thread::ThreadId;
use std::time::Duration;

use once_cell::sync::Lazy;

use crate::broker::{
    Broker, BrokerError, BrokerStats, Config, ConnectMode, Event, EventKind, Local, Remote,
};
use crate::ffi::boundary::{guard, guard_or};
use crate::ffi::table::HandleTable;

/// Opaque broker handle.
#[allow(non_camel_case_types)]
pub struct snowrdma_broker {
    _private: [u8; 0],
}

/// How the brokers connect their queue pairs.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum snowrdma_broker_mode {
    /// RDMA CM.
    SNOWRDMA_BROKER_CM = 0,
    /// A TCP exchange, then a manual connection.
    SNOWRDMA_BROKER_SOCKET = 1,
}

/// A `snowrdma_broker_mode` as the int C stored: one no variant has is
/// refused before Rust ever holds it as the enum.
impl TryFrom<c_int> for ConnectMode {
    type Error = BrokerError;

    fn try_from(mode: c_int) -> Result<Self, BrokerError> {
        const CM: c_int = snowrdma_broker_mode::SNOWRDMA_BROKER_CM as c_int;
        const SOCKET: c_int = snowrdma_broker_mode::SNOWRDMA_BROKER_SOCKET as c_int;
        match mode {
            CM => Ok(ConnectMode::Cm),
            SOCKET => Ok(ConnectMode::Socket),
            m => Err(BrokerError::InvalidArgument(format!(
                "mode {m} is not a snowrdma_broker_mode"
            ))),
        }
    }
}

/// Results of the broker calls. Numbers are never reused.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum snowrdma_broker_status {
    SNOWRDMA_BROKER_OK = 0,
    /// NULL, a closed handle, or an argument out of range.
    SNOWRDMA_BROKER_INVALID_ARGUMENT = 1,
    /// No free send slot, or the send queue is full: poll and try again.
    SNOWRDMA_BROKER_AGAIN = 2,
    /// The peer has failed (its operations were reported as failed).
    SNOWRDMA_BROKER_PEER_FAILED = 3,
    /// No connection to that server (itself, or out of range).
    SNOWRDMA_BROKER_NO_PEER = 4,
    /// `snowrdma_broker_init` ran out of time (the log names who is missing).
    SNOWRDMA_BROKER_TIMEOUT = 5,
    /// A verbs, RDMA CM or socket call failed (the log says which).
    SNOWRDMA_BROKER_SYSTEM = 6,
    /// A peer broke the handshake.
    SNOWRDMA_BROKER_PROTOCOL = 7,
    /// A poll was called from inside a callback.
    SNOWRDMA_BROKER_REENTRANT = 8,
    /// Called from a thread other than the one that created the broker.
    SNOWRDMA_BROKER_WRONG_THREAD = 9,
    /// A bug in snowrdma (a caught panic).
    SNOWRDMA_BROKER_INTERNAL = 10,
}

use snowrdma_broker_status::*;

impl From<&BrokerError> for snowrdma_broker_status {
    fn from(e: &BrokerError) -> Self {
        match e {
            BrokerError::InvalidArgument(_) => SNOWRDMA_BROKER_INVALID_ARGUMENT,
            BrokerError::Full(_) => SNOWRDMA_BROKER_AGAIN,
            BrokerError::PeerFailed(_) => SNOWRDMA_BROKER_PEER_FAILED,
            BrokerError::NoSuchPeer(_) => SNOWRDMA_BROKER_NO_PEER,
            BrokerError::InitTimeout { .. } => SNOWRDMA_BROKER_TIMEOUT,
            BrokerError::Verbs(_) | BrokerError::Io(_) => SNOWRDMA_BROKER_SYSTEM,
            BrokerError::Protocol(_) => SNOWRDMA_BROKER_PROTOCOL,
            BrokerError::Reentrant => SNOWRDMA_BROKER_REENTRANT,
            BrokerError::WrongThread => SNOWRDMA_BROKER_WRONG_THREAD,
        }
    }
}

/// What a broker is built from. The strings are copied.
#[allow(non_camel_case_types)]
#[repr(C)]
pub struct snowrdma_broker_config {
    /// Every server, "ip:port,ip:port,..." in server-id order; thread t
    /// listens on port + t. Each server listens on its address and
    /// connects to the others from it, which is how they know it (a claim
    /// to be server s from elsewhere is refused): with more than one
    /// server, no host may be 0.0.0.0 or ::, and all are IPv4 or all IPv6.
    pub hosts: *const c_char,
    /// This server's index in `hosts`.
    pub server_id: u32,
    pub thread_id: u32,
    /// Send slots (and receives) per peer.
    pub slots_per_peer: u32,
    /// Bytes per slot: the largest message.
    pub slot_size: u32,
    /// Requests per doorbell.
    pub doorbell_batch: u32,
    /// The data region peers READ and WRITE: the caller's memory (which
    /// must outlive the broker), or NULL for one the broker allocates.
    pub memory: *mut c_char,
    /// Its length in bytes (also when the broker allocates it).
    pub memory_len: u64,
    pub mode: snowrdma_broker_mode,
    /// The RDMA device, or NULL for the default.
    pub device: *const c_char,
}

/// One completion, as the callback sees it. `buf` is valid during the
/// callback only.
#[allow(non_camel_case_types)]
#[repr(C)]
pub struct snowrdma_broker_event {
    pub kind: EventKind,
    /// The server on the other end.
    pub peer: u32,
    /// What the post returned; for receives, the receive slot.
    pub wr_id: u64,
    /// A received message (NULL for other events and a WRITE WITH IMM).
    pub buf: *const c_char,
    pub len: u32,
    /// The immediate; valid when `has_imm`.
    pub imm: u32,
    pub has_imm: bool,
    /// The work completion status (`enum ibv_wc_status`); 0 is success.
    pub status: u32,
}

/// The callback: runs on the broker's thread, inside the polls. It may call
/// any broker function except the polls (`SNOWRDMA_BROKER_REENTRANT`), and
/// may post replies, which go out before the poll returns; a wait for a
/// send slot does not wait there. It may destroy its broker: see
/// `snowrdma_broker_destroy`.
#[allow(non_camel_case_types)]
pub type snowrdma_broker_callback = Option<
    unsafe extern "C" fn(
        user: *mut c_void,
        broker: *mut snowrdma_broker,
        event: *const snowrdma_broker_event,
    ),
>;

struct BrokerHandle {
    owner: ThreadId,
    broker: Broker,
    /// The handle the callback hands C; NULL once destroyed, and then the
    /// callback no longer calls C.
    me: Arc<AtomicPtr<snowrdma_broker>>,
}

// SAFETY: every access goes through `with`, which refuses any thread but the
// owner, so the broker (which is not Sync) is only ever used by one thread.
unsafe impl Sync for BrokerHandle {}

static BROKERS: Lazy<HandleTable<BrokerHandle>> = Lazy::new(HandleTable::new);

fn status<T>(r: Result<T, BrokerError>) -> c_int {
    match r {
        Ok(_) => SNOWRDMA_BROKER_OK as c_int,
        Err(e) => {
            log::debug!("broker call failed: {e}");
            snowrdma_broker_status::from(&e) as c_int
        }
    }
}

/// Runs `f` on the broker behind `b`, on its owner thread only. The
/// reference held here keeps the broker alive until `f` returns, also when a
/// callback `f` runs destroys the handle.
fn with<T>(
    b: *const snowrdma_broker,
    f: impl FnOnce(&Broker) -> Result<T, BrokerError>,
) -> Result<T, BrokerError> {
    // The owner is checked before a reference is taken: one held by another
    // thread could be the last when the handle is destroyed, and drop the
    // broker there.
    let me = std::thread::current().id();
    let h = BROKERS
        .get_checked(b, |h| match h.owner == me {
            true => Ok(()),
            false => Err(BrokerError::WrongThread),
        })
        .ok_or_else(|| BrokerError::InvalidArgument("not a live broker handle".into()))??;
    f(&h.broker)
}

/// A C string argument.
unsafe fn string(p: *const c_char, what: &str) -> Result<Option<String>, BrokerError> {
    if p.is_null() {
        return Ok(None);
    }
    CStr::from_ptr(p)
        .to_str()
        .map(|s| Some(s.to_owned()))
        .map_err(|_| BrokerError::InvalidArgument(format!("{what} is not UTF-8")))
}

/// The configuration at `c`, read field by field: a `mode` no
/// `snowrdma_broker_mode` has is refused before Rust ever holds it as one.
unsafe fn config_from_c(c: *const snowrdma_broker_config) -> Result<Config, BrokerError> {
    let hosts = string(addr_of!((*c).hosts).read_unaligned(), "hosts")?
        .ok_or_else(|| BrokerError::InvalidArgument("hosts is NULL".into()))?;
    let thread_id = u16::try_from(addr_of!((*c).thread_id).read_unaligned())
        .map_err(|_| BrokerError::InvalidArgument("thread_id over 65535".into()))?;
    Ok(Config {
        hosts: Config::parse_hosts(&hosts)?,
        server_id: addr_of!((*c).server_id).read_unaligned() as usize,
        thread_id,
        slots: addr_of!((*c).slots_per_peer).read_unaligned(),
        slot_size: addr_of!((*c).slot_size).read_unaligned(),
        doorbell_batch: addr_of!((*c).doorbell_batch).read_unaligned(),
        data_len: usize::try_from(addr_of!((*c).memory_len).read_unaligned())
            .map_err(|_| BrokerError::InvalidArgument("memory_len too large".into()))?,
        mode: addr_of!((*c).mode)
            .cast::<c_int>()
            .read_unaligned()
            .try_into()?,
        device: string(addr_of!((*c).device).read_unaligned(), "device")?,
    })
}

/// Creates a broker (not connected yet: `snowrdma_broker_init`). The calling
/// thread owns it. Returns NULL on a bad configuration or a failed
/// allocation (the log, with `SNOWRDMA_LOG=warn`, says why). `user` is
/// passed to every callback. Free with `snowrdma_broker_destroy`.
///
/// # Safety
/// `config` must point to a `snowrdma_broker_config`; a non-NULL `memory`
/// must stay valid for `memory_len` bytes until the broker is destroyed.
#[no_mangle]
pub unsafe extern "C" fn snowrdma_broker_create(
    config: *const snowrdma_broker_config,
    callback: snowrdma_broker_callback,
    user: *mut c_void,
) -> *mut snowrdma_broker {
    guard(|| {
        if config.is_null() {
            log::error!("snowrdma_broker_create: config is NULL");
            return std::ptr::null_mut();
        }
        let Some(cb) = callback else {
            log::error!("snowrdma_broker_create: callback is NULL");
            return std::ptr::null_mut();
        };
        let cfg = match config_from_c(config) {
            Ok(cfg) => cfg,
            Err(e) => {
                log::error!("snowrdma_broker_create: {e}");
                return std::ptr::null_mut();
            }
        };
        // The handle is known once inserted; the callback reads it then.
        let me: Arc<AtomicPtr<snowrdma_broker>> = Arc::default();
        let me2 = me.clone();
        let user = user as usize;
        let call = move |_: &Broker, ev: &Event<'_>| {
            let handle = me2.load(Ordering::Relaxed);
            if handle.is_null() {
                // Destroyed by an earlier callback of this poll: C hears
                // nothing more of it.
                return;
            }
            let event = snowrdma_broker_event {
                kind: ev.kind,
                peer: ev.peer as u32,
                wr_id: ev.wr_id,
                buf: if ev.buf.is_empty() {
                    std::ptr::null()
                } else {
                    ev.buf.as_ptr().cast()
                },
                len: ev.buf.len() as u32,
                imm: ev.imm.unwrap_or(0),
                has_imm: ev.imm.is_some(),
                status: ev.status.0,
            };
            // SAFETY: the caller's callback, with the pointer it gave us.
            unsafe { cb(user as *mut c_void, handle, &event) };
        };
        let memory = addr_of!((*config).memory).read_unaligned();
        let made = if memory.is_null() {
            Broker::new(cfg, call)
        } else {
            let len = cfg.data_len;
            Broker::with_memory(cfg, memory.cast(), len, call)
        };
        match made {
            Ok(broker) => {
                let h: *mut snowrdma_broker = BROKERS.insert_opaque(BrokerHandle {
                    owner: std::thread::current().id(),
                    broker,
                    me: me.clone(),
                });
                me.store(h, Ordering::Relaxed);
                h
            }
            Err(e) => {
                log::error!("snowrdma_broker_create: {e}");
                std::ptr::null_mut()
            }
        }
    })
}

/// Connects to every other server, retrying until `timeout_ms` (any start
/// order; a server connects to those listed before it and accepts those
/// after it).
#[no_mangle]
pub extern "C" fn snowrdma_broker_init(b: *mut snowrdma_broker, timeout_ms: u32) -> c_int {
    guard_or(SNOWRDMA_BROKER_INTERNAL as c_int, || {
        status(with(b, |br| {
            br.init(Duration::from_millis(u64::from(timeout_ms)))
                .inspect_err(|e| log::error!("snowrdma_broker_init: {e}"))
        }))
    })
}

fn set_errno(e: &BrokerError) {
    let code = match e {
        BrokerError::Full(_) => libc::EAGAIN,
        BrokerError::PeerFailed(_) | BrokerError::NoSuchPeer(_) => libc::ENOTCONN,
        BrokerError::WrongThread | BrokerError::Reentrant => libc::EPERM,
        _ => libc::EINVAL,
    };
    // SAFETY: errno is thread-local.
    unsafe { *libc::__errno_location() = code };
}

/// The next send slot for `peer` (`slot_size` bytes): fill it and pass it to
/// `snowrdma_broker_post_send` or `_post_write`. NULL when the ring is full
/// (errno `EAGAIN`: poll the send side and try again), the peer has failed
/// or does not exist (`ENOTCONN`), or the handle is bad (`EINVAL`). A slot
/// is never handed out twice before its completion.
#[no_mangle]
pub extern "C" fn snowrdma_broker_send_buf(b: *mut snowrdma_broker, peer: u32) -> *mut c_char {
    guard(|| {
        match with(b, |br| {
            let slot = br.hand_out(peer as usize)?;
            Ok(br.slot_ptr(peer as usize, slot).0)
        }) {
            Ok(p) => p.cast(),
            Err(e) => {
                set_errno(&e);
                std::ptr::null_mut()
            }
        }
    })
}

/// Queues a SEND of `len` bytes of a slot from `snowrdma_broker_send_buf`
/// for `peer` (`imm` 0: no immediate); it goes out with its doorbell batch
/// (or `snowrdma_broker_flush`). `*wr_id` (if not NULL) gets its id, which
/// the send's callback carries.
///
/// # Safety
/// A non-NULL `wr_id` must be writable.
#[no_mangle]
pub unsafe extern "C" fn snowrdma_broker_post_send(
    b: *mut snowrdma_broker,
    buf: *const c_char,
    len: u32,
    peer: u32,
    imm: u32,
    wr_id: *mut u64,
) -> c_int {
    guard_or(SNOWRDMA_BROKER_INTERNAL as c_int, || {
        status(with(b, |br| {
            let slot = br.slot_at(peer as usize, buf.cast()).ok_or_else(|| {
                BrokerError::InvalidArgument("buf is not a send slot of that peer".into())
            })?;
            let id = br.post_send(peer as usize, slot, len, imm)?;
            out(wr_id, id);
            Ok(())
        }))
    })
}

unsafe fn out(p: *mut u64, v: u64) {
    if let Some(p) = p.as_mut() {
        *p = v;
    }
}

fn remote(addr: u64, is_offset: bool) -> Remote {
    if is_offset {
        Remote::Offset(addr)
    } else {
        Remote::Addr(addr)
    }
}

/// Queues a WRITE of `len` bytes at `buf` (a send slot of `peer`, or inside
/// the data region) to the peer's data region: at offset `remote` when
/// `remote_is_offset`, else at address `remote`. `imm` != 0 makes it a WRITE
/// WITH IMM, which the peer's callback sees as a receive.
///
/// # Safety
/// A non-NULL `wr_id` must be writable.
#[no_mangle]
pub unsafe extern "C" fn snowrdma_broker_post_write(
    b: *mut snowrdma_broker,
    buf: *const c_char,
    len: u32,
    peer: u32,
    remote_addr: u64,
    remote_is_offset: bool,
    imm: u32,
    wr_id: *mut u64,
) -> c_int {
    one_sided(b, buf, len, peer, wr_id, |br, local| {
        br.post_write(
            peer as usize,
            local,
            len,
            remote(remote_addr, remote_is_offset),
            imm,
        )
    })
}

/// The body of the WRITE and READ exports: finds where `buf` lies, posts,
/// and reports the id.
#[track_caller]
unsafe fn one_sided(
    b: *mut snowrdma_broker,
    buf: *const c_char,
    len: u32,
    peer: u32,
    wr_id: *mut u64,
    post: impl FnOnce(&Broker, Local) -> Result<u64, BrokerError>,
) -> c_int {
    guard_or(SNOWRDMA_BROKER_INTERNAL as c_int, || {
        status(with(b, |br| {
            let local = br.locate(peer as usize, buf.cast(), len).ok_or_else(|| {
                BrokerError::InvalidArgument(
                    "buf is neither a send slot nor in the data region".into(),
                )
            })?;
            out(wr_id, post(br, local)?);
            Ok(())
        }))
    })
}

/// Queues a READ of `len` bytes of the peer's data region (offset or
/// address, as for writes) into `buf` (a send slot of `peer`, or inside the
/// data region).
///
/// # Safety
/// A non-NULL `wr_id` must be writable.
#[no_mangle]
pub unsafe extern "C" fn snowrdma_broker_post_read(
    b: *mut snowrdma_broker,
    buf: *mut c_char,
    len: u32,
    peer: u32,
    remote_addr: u64,
    remote_is_offset: bool,
    wr_id: *mut u64,
) -> c_int {
    one_sided(b, buf, len, peer, wr_id, |br, local| {
        br.post_read(
            peer as usize,
            local,
            len,
            remote(remote_addr, remote_is_offset),
        )
    })
}

/// Posts the queued requests of `peer` (negative: of every peer) now.
#[no_mangle]
pub extern "C" fn snowrdma_broker_flush(b: *mut snowrdma_broker, peer: i32) -> c_int {
    guard_or(SNOWRDMA_BROKER_INTERNAL as c_int, || {
        status(with(b, |br| match usize::try_from(peer) {
            Ok(p) => br.flush(p),
            Err(_) => br.flush_all(),
        }))
    })
}

fn polled(r: Result<u32, BrokerError>) -> i64 {
    match r {
        Ok(n) => i64::from(n),
        Err(e) => -(snowrdma_broker_status::from(&e) as i64),
    }
}

/// Reaps send completions of `peer` (negative: all), running the callback
/// for each finished operation. Returns how many finished, or minus a
/// `snowrdma_broker_status`.
#[no_mangle]
pub extern "C" fn snowrdma_broker_poll_sq(b: *mut snowrdma_broker, peer: i32) -> i64 {
    guard_or(-(SNOWRDMA_BROKER_INTERNAL as i64), || {
        polled(with(b, |br| br.poll_sq(usize::try_from(peer).ok())))
    })
}

/// Reaps received messages of `peer` (negative: all), running the callback
/// on each, reposts their receives, then posts every queued request (so
/// replies made in the callback go out now). Returns how many arrived, or
/// minus a `snowrdma_broker_status`.
#[no_mangle]
pub extern "C" fn snowrdma_broker_poll_rq(b: *mut snowrdma_broker, peer: i32) -> i64 {
    guard_or(-(SNOWRDMA_BROKER_INTERNAL as i64), || {
        polled(with(b, |br| br.poll_rq(usize::try_from(peer).ok())))
    })
}

/// The data region (peers may write it at any time); `*len` gets its size.
/// NULL for a bad handle.
///
/// # Safety
/// A non-NULL `len` must be writable.
#[no_mangle]
pub unsafe extern "C" fn snowrdma_broker_data(
    b: *mut snowrdma_broker,
    len: *mut u64,
) -> *mut c_char {
    guard(|| match with(b, |br| Ok(br.data_ptr())) {
        Ok((p, l)) => {
            out(len, l as u64);
            p.cast()
        }
        Err(_) => std::ptr::null_mut(),
    })
}

/// A peer's data region: its address and length (for absolute addresses).
///
/// # Safety
/// `addr` and `len` must be writable.
#[no_mangle]
pub unsafe extern "C" fn snowrdma_broker_peer_region(
    b: *mut snowrdma_broker,
    peer: u32,
    addr: *mut u64,
    len: *mut u64,
) -> c_int {
    guard_or(SNOWRDMA_BROKER_INTERNAL as c_int, || {
        status(with(b, |br| {
            let r = br.peer_region(peer as usize)?;
            out(addr, r.addr);
            out(len, r.len);
            Ok(())
        }))
    })
}

/// Copies the counters into `*stats`.
///
/// # Safety
/// `stats` must be writable.
#[no_mangle]
pub unsafe extern "C" fn snowrdma_broker_get_stats(
    b: *mut snowrdma_broker,
    stats: *mut BrokerStats,
) -> c_int {
    guard_or(SNOWRDMA_BROKER_INTERNAL as c_int, || {
        status(with(b, |br| {
            let out = stats
                .as_mut()
                .ok_or_else(|| BrokerError::InvalidArgument("stats is NULL".into()))?;
            *out = br.stats();
            Ok(())
        }))
    })
}

/// Disconnects and frees the broker, on its owner thread (others get
/// `SNOWRDMA_BROKER_WRONG_THREAD`). The handle is dead once this returns:
/// a second call, or any call with it, returns
/// `SNOWRDMA_BROKER_INVALID_ARGUMENT` (and one with NULL does too).
///
/// From inside the broker's own callback it returns `SNOWRDMA_BROKER_OK`
/// too, but the poll that runs the callback still uses the broker, so the
/// broker is freed when that poll returns (on this thread, before
/// `snowrdma_broker_poll_sq` / `_poll_rq` returns to the caller). Until then
/// no further callback runs, so `user` is not used again; the data region
/// (`memory`) is still the broker's, and peers may write it, until that
/// poll returns. The poll returns its count as usual.
///
/// The library frees what it allocated; `user` and a caller-given data
/// region stay the caller's.
#[no_mangle]
pub extern "C" fn snowrdma_broker_destroy(b: *mut snowrdma_broker) -> c_int {
    guard_or(SNOWRDMA_BROKER_INTERNAL as c_int, || {
        let r = with(b, |_| Ok(())).map(|()| {
            if let Some(h) = BROKERS.remove(b) {
                h.me.store(std::ptr::null_mut(), Ordering::Relaxed);
                // The last reference, unless a poll of this broker is
                // running a callback: that poll's `with` holds another, and
                // the broker is dropped when it lets go.
                drop(h);
            }
        });
        status(r)
    })
}

/// A short description of a `snowrdma_broker_status`. A static string.
#[no_mangle]
pub extern "C" fn snowrdma_broker_strerror(status: c_int) -> *const c_char {
    let s: &'static CStr = match status {
        0 => c"success",
        1 => c"invalid argument",
        2 => c"no free send slot: poll and try again",
        3 => c"the peer has failed",
        4 => c"no such peer",
        5 => c"init timed out",
        6 => c"a system call failed",
        7 => c"a peer broke the protocol",
        8 => c"called from inside a callback",
        9 => c"called from a thread other than the owner",
        10 => c"internal error",
        _ => c"unknown status",
    };
    s.as_ptr()
}

#[cfg(test)]
#[path = "broker_tests.rs"]
mod tests;
