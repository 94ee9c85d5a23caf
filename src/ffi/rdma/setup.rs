//! Exports that make, connect, configure and end servers and connections.

use std::ffi::{c_char, c_int};
use std::ptr::{addr_of, addr_of_mut};
use std::sync::Arc;

use rdma_sys::ibv_mr;

use crate::ffi::boundary::{guard, guard_or};
use crate::ffi::table::CMemory;
use crate::runtime::{self, ConnHandler, ConnKind, ConnState, Connection, Listener};

use super::bridge::*;
use super::globals::*;
use super::handles::*;
use super::types::*;

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
    guard_or(RDMA_ERR, || {
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
        let raw: Arc<CMemory<RdmaListener>> = CMemory::new(std::mem::zeroed());
        let raw_addr = raw.get() as usize;
        if !opt.is_null() {
            let o = copy_options(opt);
            (*raw.get()).accept_callback = o.accept_callback;
            (*raw.get()).options = o;
        }
        let conn_opts = opts.clone();
        let hook = Box::new(move |conn: &Connection| -> Option<Arc<dyn ConnHandler>> {
            let l = LISTENERS.get(raw_addr as *const RdmaListener)?;
            let lraw = l.raw.get();
            // SAFETY: the listener struct lives while it is in the table.
            let ffi = FfiConn::new(
                conn_opts.clone(),
                unsafe { addr_of!((*lraw).options) },
                ConnKind::AcceptedConn,
            );
            ffi.bind(conn);
            CONNS.insert(ffi.raw.clone(), ffi.clone());
            // SAFETY: as above.
            if let Some(cb) = unsafe { (*lraw).accept_callback } {
                guard_callback("accept_callback", || unsafe { cb(ffi.ptr().cast()) });
            }
            // A program that closed the connection, or released the
            // listener, inside its accept callback refused the peer: it is
            // rejected rather than served behind a handle nobody holds.
            if CONNS.get(ffi.ptr()).is_none()
                || LISTENERS.get(raw_addr as *const RdmaListener).is_none()
            {
                log::info!("the accept callback closed the connection or released the listener: rejecting the peer");
                if CONNS.remove(ffi.ptr()).is_some() {
                    conn.close();
                }
                return None;
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
        let memory = raw.clone();
        *listener = LISTENERS.insert(memory, Arc::new(FfiListener { raw, listener: l }));
        RDMA_OK
    })
}

/// Accepts connections until `rdmaServerStop` (from another thread or a
/// callback); blocks the calling thread meanwhile. Returns `RDMA_OK`, or
/// `RDMA_ERR` for an unknown listener or one released (by another thread)
/// before it could start.
///
/// # Safety
/// `listener` may be anything; unknown pointers are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaServerStart(listener: *mut RdmaListener) -> c_int {
    guard_or(RDMA_ERR, || {
        let Some(l) = lookup_listener(listener, "rdmaServerStart") else {
            return RDMA_ERR;
        };
        // Released by another thread since the lookup: nothing to serve.
        if let Err(e) = l.listener.start() {
            log::warn!("rdmaServerStart: {e}");
            return RDMA_ERR;
        }
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
    guard_or(RDMA_ERR, || {
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
    guard(|| {
        let Some(l) = LISTENERS.remove(listener) else {
            log::warn!("rdmaServerRelease: {listener:p} is not a live listener");
            return;
        };
        l.listener.release();
    })
}

/// Sets the callback run (on the CM thread) for each new connection, before
/// it is accepted. `rdmaConnClose` on the new connection (or
/// `rdmaServerRelease`) inside the callback rejects the peer.
///
/// # Safety
/// As `rdmaServerStart`.
#[no_mangle]
pub unsafe extern "C" fn rdmaServerSetAcceptCallback(
    listener: *mut RdmaListener,
    func: RdmaAcceptCallbackFunc,
) -> c_int {
    guard_or(RDMA_ERR, || {
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
    guard(|| {
        let opts = resolve_options(opt);
        runtime::configure(&opts);
        let ffi = FfiConn::new(opts, opt, ConnKind::ConnectedConn);
        CONNS.insert(ffi.raw.clone(), ffi).cast()
    })
}

/// Connects to a server; returns `RDMA_OK` once data can flow, or `RDMA_ERR`
/// when the server rejects, is unreachable, or does not answer in time
/// (about `rdmaTimeoutms` per setup step). On failure `errno` (and
/// `conn->last_errno`) says why: `ECONNREFUSED` (nothing listens there, or
/// the server refused), `ETIMEDOUT`, `EHOSTUNREACH` / `ENETUNREACH` (no
/// RDMA path to the address), `ECONNRESET` (the server left during setup),
/// `EINVAL` (NULL, unknown or closed connection, bad address or port),
/// `EISCONN` (already connected), `ECONNABORTED` (`rdmaConnClose` came
/// while it connected: the connection is closed, and the handle dead),
/// `ENODEV`, or the failed verb's errno. A handle whose attempt failed may
/// try again.
///
/// # Safety
/// `serverip` must be NULL or a C string.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnect(
    conn: *mut RdmaConn,
    serverip: *mut c_char,
    port: c_int,
) -> c_int {
    let r = guard_or(Err(libc::EIO), || {
        let Some(ffi) = lookup(conn, "rdmaConnect") else {
            return Err(libc::EINVAL);
        };
        let failed = |errno: c_int| {
            // SAFETY: our own struct, alive while `ffi` is.
            unsafe {
                std::ptr::write_volatile(addr_of_mut!((*ffi.ptr()).state), ConnState::Error);
                std::ptr::write_volatile(addr_of_mut!((*ffi.ptr()).last_errno), errno);
            }
            Err(errno)
        };
        if ffi.connection().is_some() {
            log::warn!("rdmaConnect: already connected");
            return Err(libc::EISCONN);
        }
        let Some(ip) = c_str(serverip) else {
            log::warn!("rdmaConnect: NULL or non-UTF-8 server address");
            return failed(libc::EINVAL);
        };
        let Some(addr) = resolve(ip, port) else {
            log::warn!("rdmaConnect: cannot resolve {ip}:{port}");
            return failed(libc::EINVAL);
        };
        match Connection::connect(addr, &ffi.opts, ffi.clone()) {
            Ok(c) => {
                // Under the lock `rdmaConnClose` takes after it has removed
                // the handle: a close that came while connecting (from
                // another thread, or from `connected_callback`) found no
                // connection to close, so this one is closed here.
                let mut clients = CLIENTS.lock().expect("table lock");
                if CONNS.get(conn).is_none() {
                    drop(clients);
                    log::warn!("rdmaConnect: the connection was closed while connecting");
                    c.close();
                    return failed(libc::ECONNABORTED);
                }
                ffi.bind(&c);
                // Two threads connected the handle at once: the connection
                // bound first keeps it, and the other is closed rather than
                // left running behind it.
                if ffi.connection().is_some_and(|bound| bound != c) {
                    drop(clients);
                    log::warn!("rdmaConnect: already connected (by another thread meanwhile)");
                    c.close();
                    return Err(libc::EISCONN);
                }
                // Before returning: the report of MR_READY may still be on
                // its way from the completion thread.
                ffi.mirror_state(&c);
                clients.insert(conn as usize, c);
                Ok(())
            }
            Err(e) => {
                log::warn!("rdmaConnect to {addr}: {e}");
                // It may have been bound at MR_READY, and failed after.
                // Another thread's attempt that connected the handle
                // meanwhile keeps it, and the state it reads.
                if !ffi.unbind_ended() {
                    return Err(connect_errno(&e));
                }
                if CONNS.get(conn).is_none() {
                    return failed(libc::ECONNABORTED);
                }
                failed(connect_errno(&e))
            }
        }
    });
    match r {
        Ok(()) => RDMA_OK,
        Err(errno) => {
            // Last, so that nothing (logging included) overwrites it.
            *libc::__errno_location() = errno;
            RDMA_ERR
        }
    }
}

/// The errno that says why connecting failed.
pub(super) fn connect_errno(e: &runtime::Error) -> c_int {
    use crate::verbs::{CmEventKind as K, Error as V};
    use runtime::Error as E;
    match e {
        E::Verbs(V::CmEvent { got, status, .. }) => match *got {
            K::REJECTED => libc::ECONNREFUSED,
            K::UNREACHABLE => libc::EHOSTUNREACH,
            K::ROUTE_ERROR => libc::ENETUNREACH,
            // RDMA CM reports why an address did not resolve as -errno.
            K::ADDR_ERROR if *status < 0 => -status,
            K::ADDR_ERROR => libc::EHOSTUNREACH,
            K::DEVICE_REMOVAL => libc::ENODEV,
            _ => libc::ECONNABORTED,
        },
        E::Verbs(V::Timeout { .. }) | E::Timeout(_) => libc::ETIMEDOUT,
        E::Verbs(V::Verb { source, .. }) | E::Thread(source) => {
            source.raw_os_error().unwrap_or(libc::EIO)
        }
        E::Verbs(V::NoDevice | V::NoSuchDevice(_)) => libc::ENODEV,
        E::Verbs(V::InvalidArgument(_)) | E::InvalidArgument(_) => libc::EINVAL,
        E::Disconnected | E::NotConnected => libc::ECONNRESET,
        _ => libc::EIO,
    }
}

/// Closes a connection (client or accepted): pending sync operations fail,
/// the peer gets its disconnect, and the memory (including buffers from
/// `rdmaConnRegMem`) is freed. The pointer is invalid afterwards; a second
/// close is refused harmlessly. No receive, write or read callback of the
/// connection starts after it returns; one running on another thread
/// (`snowrdma-cq`) is waited for, up to `rdmaTimeoutms` (at least a second),
/// so a program may free what its callbacks use once this returns.
///
/// # Safety
/// Any pointer is accepted; unknown ones are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnClose(conn: *mut RdmaConn) {
    guard(|| {
        let Some(ffi) = CONNS.remove(conn) else {
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
pub(super) fn set_callback(
    func: &'static str,
    conn: *mut RdmaConn,
    store: impl FnOnce(&FfiConn),
) -> c_int {
    guard_or(RDMA_ERR, || {
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

/// Stops the background runtime: closes accepted connections (no callback
/// follows; their handles are refused from then on, as after a disconnect);
/// the threads end once no connection uses them. Later calls start it
/// afresh.
#[no_mangle]
pub extern "C" fn rdmaRuntimeStop() {
    guard_or((), runtime::stop)
}

/// Registers a zeroed buffer of `size` bytes (local write, remote read and
/// write) on the connection. The library owns it: free it with
/// `rdmaConnDeregMem` (or it is freed when the connection is). NULL on error.
///
/// # Safety
/// Any pointer is accepted; unknown ones are refused.
#[no_mangle]
pub unsafe extern "C" fn rdmaConnRegMem(conn: *mut RdmaConn, size: usize) -> *mut ibv_mr {
    guard(|| {
        let Some(c) = live(conn, "rdmaConnRegMem") else {
            return std::ptr::null_mut();
        };
        // The C program gets the verbs MR itself; the connection keeps it
        // registered until rdmaConnDeregMem or the connection's end.
        c.register(size).map(|mr| mr.as_raw()).unwrap_or_else(|e| {
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
    guard(|| {
        if let Some(c) = live(conn, "rdmaConnDeregMem") {
            let found = c.find_registered(|r| r.as_raw() == mr);
            if !found.is_some_and(|r| c.deregister(&r)) {
                log::warn!("rdmaConnDeregMem: {mr:p} was not registered on this connection");
            }
        }
    })
}
