//! The tables of live handles: every pointer C passes in is looked up
//! here before it is used.

use std::ffi::{c_char, c_int, CStr};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};

use once_cell::sync::Lazy;
use rustc_hash::FxHashMap;

use crate::ffi::table::{CMemory, HandleTable};
use crate::runtime::{Connection, Listener};

use super::bridge::*;
use super::types::*;

/// Every `RdmaConn *` handed to C. An accepted connection leaves it when
/// the runtime lets go of it, a client one at `rdmaConnClose`; its struct
/// stays readable (`state` says how it ended) until the quarantine frees it.
pub(super) static CONNS: Lazy<HandleTable<FfiConn>> = Lazy::new(HandleTable::new);
/// Strong references to client connections (accepted ones are held by the
/// runtime until they end), by handle; removed with the handle.
pub(super) static CLIENTS: Lazy<Mutex<FxHashMap<usize, Connection>>> =
    Lazy::new(|| Mutex::new(FxHashMap::default()));

pub(super) struct FfiListener {
    pub(super) raw: Arc<CMemory<RdmaListener>>,
    pub(super) listener: Listener,
}

pub(super) static LISTENERS: Lazy<HandleTable<FfiListener>> = Lazy::new(HandleTable::new);

pub(super) fn lookup(conn: *mut RdmaConn, func: &str) -> Option<Arc<FfiConn>> {
    let found = CONNS.get(conn);
    if found.is_none() {
        log::warn!("{func}: {conn:p} is not a live connection");
    }
    found
}

pub(super) fn live(conn: *mut RdmaConn, func: &str) -> Option<Connection> {
    live_of(&*lookup(conn, func)?, func)
}

/// The connection behind a handle already looked up.
pub(super) fn live_of(ffi: &FfiConn, func: &str) -> Option<Connection> {
    let c = ffi.connection();
    if c.is_none() {
        log::warn!("{func}: the connection is not connected");
    }
    c
}

pub(super) fn lookup_listener(l: *mut RdmaListener, func: &str) -> Option<Arc<FfiListener>> {
    let found = LISTENERS.get(l);
    if found.is_none() {
        log::warn!("{func}: {l:p} is not a live listener");
    }
    found
}

pub(super) unsafe fn c_str<'a>(s: *const c_char) -> Option<&'a str> {
    if s.is_null() {
        None
    } else {
        CStr::from_ptr(s).to_str().ok()
    }
}

pub(super) fn resolve(ip: &str, port: c_int) -> Option<SocketAddr> {
    let port = u16::try_from(port).ok()?;
    (ip, port).to_socket_addrs().ok()?.next()
}
