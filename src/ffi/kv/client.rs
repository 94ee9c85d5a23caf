//! The `kv_client_*` exports that make, connect and end clients.

use std::ffi::{c_char, c_int, CStr};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::RwLock;

use crate::ffi::boundary::{guard, guard_or};
use crate::kv::{Client, ClientOptions, ConnMode, KvError};

use super::handles::{mode_from_c, setup_code, ClientSlot, CLIENTS};
use super::types::{
    conn_mode_t, kv_client, KV_ERR_DISCONNECTED, KV_ERR_INTERNAL, KV_ERR_INVALID_ARGUMENT,
};

/// Creates an unconnected client for `mode` (`CONN_MODE_CM` or
/// `CONN_MODE_SOCKET`); NULL for an unknown mode. Free with
/// `kv_client_destroy`.
#[no_mangle]
pub extern "C" fn kv_client_create(mode: conn_mode_t) -> *mut kv_client {
    guard(|| match mode_from_c(mode) {
        Ok(mode) => CLIENTS.insert_opaque(ClientSlot {
            mode,
            client: RwLock::new(None),
        }),
        Err(e) => {
            log::error!("kv_client_create: {e}");
            std::ptr::null_mut()
        }
    })
}

pub(super) fn resolve(host: *const c_char, port: c_int) -> Result<SocketAddr, KvError> {
    if host.is_null() {
        return Err(KvError::InvalidArgument("NULL server address".into()));
    }
    // SAFETY: non-NULL, and the caller passes a C string.
    let host = unsafe { CStr::from_ptr(host) }
        .to_str()
        .map_err(|_| KvError::InvalidArgument("the server address is not UTF-8".into()))?;
    let port =
        u16::try_from(port).map_err(|_| KvError::InvalidArgument("port out of range".into()))?;
    (host, port)
        .to_socket_addrs()
        .map_err(|e| KvError::InvalidArgument(format!("resolving {host}: {e}")))?
        .find(SocketAddr::is_ipv4)
        .ok_or_else(|| KvError::InvalidArgument(format!("{host} has no IPv4 address")))
}

pub(super) fn connect(
    client: *mut kv_client,
    host: *const c_char,
    port: c_int,
    device: Option<String>,
    mode: ConnMode,
) -> c_int {
    let Some(slot) = CLIENTS.get(client) else {
        return KV_ERR_INVALID_ARGUMENT;
    };
    if slot.mode != mode {
        log::error!("this client was created for {:?} mode", slot.mode);
        return KV_ERR_INVALID_ARGUMENT;
    }
    let opts = ClientOptions {
        mode,
        device,
        ..ClientOptions::default()
    };
    let r = resolve(host, port)
        .and_then(|addr| Client::connect_with(addr, &opts))
        .map(|c| *slot.client.write().expect("client lock") = Some(c));
    setup_code("kv_client_connect", r)
}

/// Connects a `CONN_MODE_CM` client to `server_ip:port` (a name or an
/// address). `KV_OK`; `KV_ERR_INVALID_ARGUMENT` for a bad or destroyed
/// handle, a client of the other mode, or a bad address or port; else the
/// code of what failed (`KV_ERR_TIMEOUT`, `KV_ERR_DISCONNECTED`,
/// `KV_ERR_INTERNAL` when the server is unreachable, within a few seconds);
/// never `KV_ERR_NOT_FOUND`. A connected client reconnects (the old
/// connection is closed).
#[no_mangle]
pub extern "C" fn kv_client_connect(
    client: *mut kv_client,
    server_ip: *const c_char,
    port: c_int,
) -> c_int {
    guard_or(KV_ERR_INTERNAL, || {
        connect(client, server_ip, port, None, ConnMode::Cm)
    })
}

/// Connects a `CONN_MODE_SOCKET` client: QP information is exchanged over
/// TCP at `server_ip:port`; `ib_dev` names the device (NULL: the first).
/// Returns as `kv_client_connect`.
///
/// # Safety
/// A non-NULL `ib_dev` must be a C string.
#[no_mangle]
pub unsafe extern "C" fn kv_client_connect_socket(
    client: *mut kv_client,
    server_ip: *const c_char,
    port: c_int,
    ib_dev: *const c_char,
) -> c_int {
    guard_or(KV_ERR_INTERNAL, || {
        let device =
            (!ib_dev.is_null()).then(|| CStr::from_ptr(ib_dev).to_string_lossy().into_owned());
        connect(client, server_ip, port, device, ConnMode::Socket)
    })
}

/// Disconnects (the handle stays valid for another connect). Calls other
/// threads have in flight on this client return `KV_ERR_DISCONNECTED`.
#[no_mangle]
pub extern "C" fn kv_client_disconnect(client: *mut kv_client) {
    guard(|| {
        if let Some(slot) = CLIENTS.get(client) {
            slot.disconnect();
        }
    })
}

/// Disconnects and frees the client; the handle is invalid afterwards.
/// Calls other threads have in flight on it return `KV_ERR_DISCONNECTED`;
/// the client is freed once they have.
#[no_mangle]
pub extern "C" fn kv_client_destroy(client: *mut kv_client) {
    guard(|| {
        if let Some(slot) = CLIENTS.remove(client) {
            slot.disconnect();
        }
    })
}

/// Runs `f` with the connected client behind `handle`.
pub(super) fn with_client(handle: *mut kv_client, f: impl FnOnce(&Client) -> c_int) -> c_int {
    let Some(slot) = CLIENTS.get(handle) else {
        return KV_ERR_INVALID_ARGUMENT;
    };
    let guard = slot.client.read().expect("client lock");
    match guard.as_ref() {
        Some(c) => f(c),
        None => KV_ERR_DISCONNECTED,
    }
}
