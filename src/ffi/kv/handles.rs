//! The tables of live handles, and turning what C passes (strings, byte
//! ranges, the configuration, error codes) into Rust values.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, RwLock};

use once_cell::sync::Lazy;

use crate::kv::{Client, ConnMode, KvError, Server, ServerConfig};

use super::types::{conn_mode_t, kv_config, CONN_MODE_CM, CONN_MODE_SOCKET, KV_OK};

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

/// Live handles, by address: a handle is only ever used through this table.
pub(crate) struct Handles<T> {
    pub(super) map: Mutex<HashMap<usize, Arc<T>>>,
}

impl<T> Handles<T> {
    pub(crate) fn new() -> Self {
        Handles {
            map: Mutex::new(HashMap::new()),
        }
    }

    /// Registers `value` and returns a fresh opaque pointer for it.
    pub(crate) fn insert<H>(&self, value: T) -> *mut H {
        let token = Box::into_raw(Box::new(0u8)).cast::<H>();
        self.map
            .lock()
            .expect("handle table")
            .insert(token as usize, Arc::new(value));
        token
    }

    pub(crate) fn get<H>(&self, handle: *const H) -> Option<Arc<T>> {
        self.map
            .lock()
            .expect("handle table")
            .get(&(handle as usize))
            .cloned()
    }

    pub(crate) fn remove<H>(&self, handle: *mut H) -> Option<Arc<T>> {
        let found = self
            .map
            .lock()
            .expect("handle table")
            .remove(&(handle as usize));
        if found.is_some() {
            // SAFETY: the token was made by `insert` and is freed once.
            drop(unsafe { Box::from_raw(handle.cast::<u8>()) });
        }
        found
    }
}

/// A key and its value, borrowed from the caller's arrays.
pub(super) type Pair<'a> = (&'a [u8], &'a [u8]);

pub(super) static SERVERS: Lazy<Handles<Server>> = Lazy::new(Handles::new);

pub(super) static CLIENTS: Lazy<Handles<ClientSlot>> = Lazy::new(Handles::new);

pub(super) fn code<T>(r: Result<T, KvError>) -> c_int {
    match r {
        Ok(_) => KV_OK,
        Err(e) => {
            log::debug!("key-value call failed: {e}");
            e.code()
        }
    }
}

/// A NUL-terminated string inside a fixed array ("" for none).
pub(super) fn fixed_str(field: &[c_char; 64]) -> Option<String> {
    let bytes: Vec<u8> = field.iter().map(|&c| c as u8).collect();
    let end = bytes.iter().position(|&b| b == 0)?;
    String::from_utf8(bytes[..end].to_vec()).ok()
}

/// A key or value argument; NULL is refused unless `len` is 0.
///
/// # Safety
/// A non-NULL `ptr` must be valid for `len` bytes.
pub(super) unsafe fn bytes<'a>(ptr: *const c_void, len: usize) -> Result<&'a [u8], KvError> {
    if ptr.is_null() {
        return if len == 0 {
            Ok(&[])
        } else {
            Err(KvError::InvalidArgument("NULL pointer".into()))
        };
    }
    Ok(std::slice::from_raw_parts(ptr.cast(), len))
}

/// A key argument: never NULL, never empty.
pub(super) unsafe fn key<'a>(ptr: *const c_char, len: usize) -> Result<&'a [u8], KvError> {
    if ptr.is_null() {
        return Err(KvError::InvalidArgument("NULL key".into()));
    }
    bytes(ptr.cast(), len)
}

pub(super) fn config_from_c(c: &kv_config) -> Result<ServerConfig, KvError> {
    let bad = |what: &str| KvError::InvalidArgument(what.to_string());
    let ip_text =
        fixed_str(&c.bind_ip).ok_or_else(|| bad("bind_ip is not a NUL-terminated string"))?;
    let ip: IpAddr = if ip_text.is_empty() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        ip_text
            .parse()
            .map_err(|_| bad("bind_ip is not an IP address"))?
    };
    let port = u16::try_from(c.port).map_err(|_| bad("port out of range"))?;
    let device =
        fixed_str(&c.ib_dev).ok_or_else(|| bad("ib_dev is not a NUL-terminated string"))?;
    let defaults = ServerConfig::default();
    Ok(ServerConfig {
        addr: SocketAddr::new(ip, port),
        memory_size: if c.memory_size == 0 {
            defaults.memory_size
        } else {
            c.memory_size
        },
        huge_pages: c.use_huge_pages,
        table_size: if c.hash_table_size == 0 {
            defaults.table_size
        } else {
            c.hash_table_size
        },
        workers: if c.num_workers <= 0 {
            defaults.workers
        } else {
            c.num_workers as usize
        },
        conn_mode: mode_from_c(c.conn_mode)?,
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
