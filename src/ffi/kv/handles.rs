//! The tables of live handles, and turning what C passes (strings, byte
//! ranges, the configuration, error codes) into Rust values.

use std::ffi::{c_char, c_int, c_void};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ptr::addr_of;
use std::sync::RwLock;

use once_cell::sync::Lazy;

use crate::ffi::boundary::fits_in_memory;
use crate::ffi::table::HandleTable;
use crate::kv::{Client, ConnMode, KvError, Server, ServerConfig};

use super::types::{
    conn_mode_t, kv_config, CONN_MODE_CM, CONN_MODE_SOCKET, KV_ERR_INTERNAL, KV_ERR_NOT_FOUND,
    KV_MAX_KEY_LEN, KV_OK,
};

pub(super) struct ClientSlot {
    pub(super) mode: ConnMode,
    pub(super) client: RwLock<Option<Client>>,
}

impl ClientSlot {
    /// Ends the connection, if any. Calls other threads have in flight on
    /// it return `KV_ERR_DISCONNECTED` at once, so taking the client (which
    /// waits for them to leave) never waits out a call's timeout.
    pub(super) fn disconnect(&self) {
        if let Some(c) = self.client.read().expect("client lock").as_ref() {
            c.close();
        }
        self.client.write().expect("client lock").take();
    }
}

/// A key and its value, borrowed from the caller's arrays.
pub(super) type Pair<'a> = (&'a [u8], &'a [u8]);

pub(super) static SERVERS: Lazy<HandleTable<Server>> = Lazy::new(HandleTable::new);

pub(super) static CLIENTS: Lazy<HandleTable<ClientSlot>> = Lazy::new(HandleTable::new);

pub(super) fn code<T>(r: Result<T, KvError>) -> c_int {
    match r {
        Ok(_) => KV_OK,
        Err(e) => {
            log::debug!("key-value call failed: {e}");
            e.code()
        }
    }
}

/// The result of a server start or a client connect: `KV_OK` or the code
/// of what failed. -1, `KV_ERR_NOT_FOUND`, was the legacy's answer for any
/// failure there; "no such key" describes none of them, so it is never one.
pub(super) fn setup_code(what: &str, r: Result<(), KvError>) -> c_int {
    match r {
        Ok(()) => KV_OK,
        Err(e) => {
            log::error!("{what}: {e}");
            match e.code() {
                KV_ERR_NOT_FOUND => KV_ERR_INTERNAL,
                other => other,
            }
        }
    }
}

/// A NUL-terminated string inside a fixed array ("" for none).
pub(super) fn fixed_str(field: &[c_char; 64]) -> Option<String> {
    let bytes: Vec<u8> = field.iter().map(|&c| c as u8).collect();
    let end = bytes.iter().position(|&b| b == 0)?;
    String::from_utf8(bytes[..end].to_vec()).ok()
}

/// A key or value argument; NULL is refused unless `len` is 0, and so is a
/// length no object can have.
///
/// # Safety
/// A non-NULL `ptr` must be valid for `len` bytes.
pub(super) unsafe fn bytes<'a>(ptr: *const c_void, len: usize) -> Result<&'a [u8], KvError> {
    if !fits_in_memory(len) {
        return Err(KvError::InvalidArgument(format!("length {len}")));
    }
    if ptr.is_null() {
        return if len == 0 {
            Ok(&[])
        } else {
            Err(KvError::InvalidArgument("NULL pointer".into()))
        };
    }
    Ok(std::slice::from_raw_parts(ptr.cast(), len))
}

/// A key argument: never NULL, never longer than keys may be.
pub(super) unsafe fn key<'a>(ptr: *const c_char, len: usize) -> Result<&'a [u8], KvError> {
    if ptr.is_null() {
        return Err(KvError::InvalidArgument("NULL key".into()));
    }
    if len > KV_MAX_KEY_LEN {
        return Err(KvError::KeyTooLong);
    }
    bytes(ptr.cast(), len)
}

/// The server settings of a C `kv_config_t`, read field by field (the
/// struct may be unaligned; the bool is any nonzero byte): no Rust value is
/// made from C bytes that may not be one.
///
/// # Safety
/// `c` must point to a readable `kv_config_t`.
pub(super) unsafe fn config_from_c(c: *const kv_config) -> Result<ServerConfig, KvError> {
    let bad = |what: &str| KvError::InvalidArgument(what.to_string());
    let bind_ip = addr_of!((*c).bind_ip).read_unaligned();
    let port = addr_of!((*c).port).read_unaligned();
    let memory_size = addr_of!((*c).memory_size).read_unaligned();
    let huge_pages = addr_of!((*c).use_huge_pages).cast::<u8>().read_unaligned() != 0;
    let hash_table_size = addr_of!((*c).hash_table_size).read_unaligned();
    let num_workers = addr_of!((*c).num_workers).read_unaligned();
    let conn_mode = addr_of!((*c).conn_mode).read_unaligned();
    let ib_dev = addr_of!((*c).ib_dev).read_unaligned();
    let ip_text =
        fixed_str(&bind_ip).ok_or_else(|| bad("bind_ip is not a NUL-terminated string"))?;
    let ip: IpAddr = if ip_text.is_empty() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        ip_text
            .parse()
            .map_err(|_| bad("bind_ip is not an IP address"))?
    };
    let port = u16::try_from(port).map_err(|_| bad("port out of range"))?;
    let device = fixed_str(&ib_dev).ok_or_else(|| bad("ib_dev is not a NUL-terminated string"))?;
    let defaults = ServerConfig::default();
    Ok(ServerConfig {
        addr: SocketAddr::new(ip, port),
        memory_size: if memory_size == 0 {
            defaults.memory_size
        } else {
            memory_size
        },
        huge_pages,
        table_size: if hash_table_size == 0 {
            defaults.table_size
        } else {
            hash_table_size
        },
        workers: if num_workers <= 0 {
            defaults.workers
        } else {
            num_workers as usize
        },
        conn_mode: mode_from_c(conn_mode)?,
        device: (!device.is_empty()).then_some(device),
        ..defaults
    })
}

pub(super) fn mode_from_c(mode: conn_mode_t) -> Result<ConnMode, KvError> {
    match mode {
        CONN_MODE_CM => Ok(ConnMode::Cm),
        CONN_MODE_SOCKET => Ok(ConnMode::Socket),
        other => Err(KvError::InvalidArgument(format!(
            "unknown connection mode {other}"
        ))),
    }
}
