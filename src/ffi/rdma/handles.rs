//! The tables of live handles: every pointer C passes in is looked up
//! here before it is used.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, CStr};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};

use once_cell::sync::Lazy;

use crate::runtime::{Connection, Listener};

use super::bridge::*;
use super::types::*;

/// The connection table: every `RdmaConn *` handed to C, by address.
pub(super) static CONNS: Lazy<Mutex<HashMap<usize, Arc<FfiConn>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));
/// Strong references to client connections (accepted ones are held by the
/// runtime until they end).
pub(super) static CLIENTS: Lazy<Mutex<HashMap<usize, Connection>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

pub(super) struct FfiListener {
    pub(super) raw: Box<UnsafeCell<RdmaListener>>,
    pub(super) listener: Listener,
}

// SAFETY: as for FfiConn.
unsafe impl Send for FfiListener {}
unsafe impl Sync for FfiListener {}

pub(super) static LISTENERS: Lazy<Mutex<HashMap<usize, Arc<FfiListener>>>> =
    Lazy::new(|| Mutex::new(HashMap::new()));

pub(super) fn lookup(conn: *mut RdmaConn, func: &str) -> Option<Arc<FfiConn>> {
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

pub(super) fn live(conn: *mut RdmaConn, func: &str) -> Option<Connection> {
    let c = lookup(conn, func)?.connection();
    if c.is_none() {
        log::warn!("{func}: the connection is not connected");
    }
    c
}

pub(super) fn lookup_listener(l: *mut RdmaListener, func: &str) -> Option<Arc<FfiListener>> {
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
