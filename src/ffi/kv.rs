//! The key-value C API of `kv_store.h`: `kv_server_*` and `kv_client_*`
//! (binary keys and values, versions, CAS), served by [`crate::kv`].
//!
//! Handles are opaque; every call checks its handle against the table of
//! live ones, so a NULL, destroyed or foreign handle is refused with an
//! error instead of crashing. All calls are blocking and may be made from
//! any thread; one client handle may be shared among threads.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex, RwLock};

use once_cell::sync::Lazy;

use super::boundary::guard;
use crate::kv::{Client, ClientOptions, ConnMode, KvError, Server, ServerConfig};

/// How a client reaches the server (`conn_mode_t`).
#[allow(non_camel_case_types)]
pub type conn_mode_t = c_int;
/// RDMA CM (the default).
pub const CONN_MODE_CM: conn_mode_t = 0;
/// A TCP connection exchanges QP information; QP states are set by hand.
pub const CONN_MODE_SOCKET: conn_mode_t = 1;

/// Success.
pub const KV_OK: c_int = 0;
/// No such key.
pub const KV_ERR_NOT_FOUND: c_int = -1;
/// The key exists.
pub const KV_ERR_EXISTS: c_int = -2;
/// CAS: the version did not match (the current one is reported).
pub const KV_ERR_CAS_FAILED: c_int = -3;
/// The key is longer than 1024 bytes.
pub const KV_ERR_KEY_TOO_LONG: c_int = -4;
/// The value is longer than the server's maximum (default 1 GiB).
pub const KV_ERR_VALUE_TOO_LONG: c_int = -5;
/// The server has no memory for the value.
pub const KV_ERR_NO_MEMORY: c_int = -6;
/// Anything else (a broken reply, a failed RDMA operation).
pub const KV_ERR_INTERNAL: c_int = -7;
/// snowrdma: a NULL, empty or unknown argument or handle.
pub const KV_ERR_INVALID_ARGUMENT: c_int = -8;
/// snowrdma: not connected, or the server went away.
pub const KV_ERR_DISCONNECTED: c_int = -9;
/// snowrdma: the server did not answer in time.
pub const KV_ERR_TIMEOUT: c_int = -10;
/// snowrdma: `value_buf` is too small; `*value_len` says how long the value is.
pub const KV_ERR_BUFFER_TOO_SMALL: c_int = -11;
/// Longest key accepted.
pub const KV_MAX_KEY_LEN: usize = crate::kv::MAX_KEY_LEN;

#[allow(non_camel_case_types)]
/// Server settings, in the legacy field order; zero fields take defaults
/// (port 0 lets the system choose one: see `kv_server_port`).
#[repr(C)]
pub struct kv_config {
    /// Address to listen on, NUL-terminated; "" means 0.0.0.0.
    pub bind_ip: [c_char; 64],
    pub port: c_int,
    /// Slab pool size in bytes (0: 1 GiB).
    pub memory_size: usize,
    /// Back the pool with 2 MiB huge pages (falls back with a warning).
    pub use_huge_pages: bool,
    /// Hash index buckets (0: 65536).
    pub hash_table_size: usize,
    /// Worker threads for large values (0: 4).
    pub num_workers: c_int,
    pub conn_mode: conn_mode_t,
    /// Device name for socket mode, NUL-terminated; "" means the first.
    pub ib_dev: [c_char; 64],
}

#[allow(non_camel_case_types)]
/// Opaque server handle (`kv_server_t`).
pub struct kv_server {
    _private: [u8; 0],
}

#[allow(non_camel_case_types)]
/// Opaque client handle (`kv_client_t`).
pub struct kv_client {
    _private: [u8; 0],
}

struct ClientSlot {
    mode: ConnMode,
    client: RwLock<Option<Client>>,
}

impl ClientSlot {
    /// Ends the connection, if any. Calls other threads have in flight on
    /// it return `KV_ERR_DISCONNECTED` at once, so taking the client (which
    /// waits for them to leave) never waits out a call's timeout.
    fn disconnect(&self) {
        if let Some(c) = self.client.read().expect("client lock").as_ref() {
            c.close();
        }
        self.client.write().expect("client lock").take();
    }
}

/// Live handles, by address: a handle is only ever used through this table.
pub(super) struct Handles<T> {
    map: Mutex<HashMap<usize, Arc<T>>>,
}

impl<T> Handles<T> {
    pub(super) fn new() -> Self {
        Handles {
            map: Mutex::new(HashMap::new()),
        }
    }

    /// Registers `value` and returns a fresh opaque pointer for it.
    pub(super) fn insert<H>(&self, value: T) -> *mut H {
        let token = Box::into_raw(Box::new(0u8)).cast::<H>();
        self.map
            .lock()
            .expect("handle table")
            .insert(token as usize, Arc::new(value));
        token
    }

    pub(super) fn get<H>(&self, handle: *const H) -> Option<Arc<T>> {
        self.map
            .lock()
            .expect("handle table")
            .get(&(handle as usize))
            .cloned()
    }

    pub(super) fn remove<H>(&self, handle: *mut H) -> Option<Arc<T>> {
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
type Pair<'a> = (&'a [u8], &'a [u8]);

static SERVERS: Lazy<Handles<Server>> = Lazy::new(Handles::new);
static CLIENTS: Lazy<Handles<ClientSlot>> = Lazy::new(Handles::new);

fn code<T>(r: Result<T, KvError>) -> c_int {
    match r {
        Ok(_) => KV_OK,
        Err(e) => {
            log::debug!("key-value call failed: {e}");
            e.code()
        }
    }
}

/// A NUL-terminated string inside a fixed array ("" for none).
fn fixed_str(field: &[c_char; 64]) -> Option<String> {
    let bytes: Vec<u8> = field.iter().map(|&c| c as u8).collect();
    let end = bytes.iter().position(|&b| b == 0)?;
    String::from_utf8(bytes[..end].to_vec()).ok()
}

/// A key or value argument; NULL is refused unless `len` is 0.
///
/// # Safety
/// A non-NULL `ptr` must be valid for `len` bytes.
unsafe fn bytes<'a>(ptr: *const c_void, len: usize) -> Result<&'a [u8], KvError> {
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
unsafe fn key<'a>(ptr: *const c_char, len: usize) -> Result<&'a [u8], KvError> {
    if ptr.is_null() {
        return Err(KvError::InvalidArgument("NULL key".into()));
    }
    bytes(ptr.cast(), len)
}

fn config_from_c(c: &kv_config) -> Result<ServerConfig, KvError> {
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

fn mode_from_c(mode: conn_mode_t) -> Result<ConnMode, KvError> {
    match mode {
        CONN_MODE_CM => Ok(ConnMode::Cm),
        CONN_MODE_SOCKET => Ok(ConnMode::Socket),
        other => Err(KvError::InvalidArgument(format!(
            "unknown connection mode {other}"
        ))),
    }
}

/// Creates a server from `config` (copied; NULL means all defaults): maps
/// its memory pool and index. Returns NULL on bad settings or no memory (the
/// log, enabled with `SNOWRDMA_LOG`, says why). Free with
/// `kv_server_destroy`.
///
/// # Safety
/// A non-NULL `config` must point to a `kv_config_t`.
#[no_mangle]
pub unsafe extern "C" fn kv_server_create(config: *const kv_config) -> *mut kv_server {
    guard("kv_server_create", std::ptr::null_mut(), || {
        let cfg = match config.as_ref() {
            None => Ok(ServerConfig::default()),
            Some(c) => config_from_c(c),
        };
        match cfg.and_then(Server::new) {
            Ok(server) => SERVERS.insert(server),
            Err(e) => {
                log::error!("kv_server_create: {e}");
                std::ptr::null_mut()
            }
        }
    })
}

/// Starts serving: listens and returns at once (0), or -1 when the address
/// cannot be bound or the handle is bad. Requests are answered on library
/// threads until `kv_server_stop`.
#[no_mangle]
pub extern "C" fn kv_server_start(server: *mut kv_server) -> c_int {
    guard("kv_server_start", -1, || {
        let Some(s) = SERVERS.get(server) else {
            return -1;
        };
        match s.start() {
            Ok(()) => 0,
            Err(e) => {
                log::error!("kv_server_start: {e}");
                -1
            }
        }
    })
}

/// The port a started server listens on (useful with port 0), or -1.
#[no_mangle]
pub extern "C" fn kv_server_port(server: *const kv_server) -> c_int {
    guard("kv_server_port", -1, || {
        SERVERS
            .get(server)
            .and_then(|s| s.local_addr())
            .map_or(-1, |a| c_int::from(a.port()))
    })
}

/// Writes one line of statistics (NUL-terminated, truncated to fit) into
/// `buf`; returns the length of the whole line, or -1 for a bad handle.
///
/// # Safety
/// A non-NULL `buf` must be valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kv_server_stats(
    server: *const kv_server,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    guard("kv_server_stats", -1, || {
        let Some(s) = SERVERS.get(server) else {
            return -1;
        };
        let line = s.stats().to_string();
        if let Some(out) = super::boundary::out_buf(buf, len) {
            let n = line.len().min(out.len() - 1);
            out[..n].copy_from_slice(&line.as_bytes()[..n]);
            out[n] = 0;
        }
        c_int::try_from(line.len()).unwrap_or(c_int::MAX)
    })
}

/// Stops serving: disconnects every client. The handle stays valid (start
/// it again or destroy it). Unknown handles are ignored.
#[no_mangle]
pub extern "C" fn kv_server_stop(server: *mut kv_server) {
    guard("kv_server_stop", (), || {
        if let Some(s) = SERVERS.get(server) {
            s.stop();
        }
    })
}

/// Stops the server and frees it and all stored values; the handle is
/// invalid afterwards (a second destroy is ignored).
#[no_mangle]
pub extern "C" fn kv_server_destroy(server: *mut kv_server) {
    guard("kv_server_destroy", (), || {
        if let Some(s) = SERVERS.remove(server) {
            s.stop();
        }
    })
}

/// Creates an unconnected client for `mode` (`CONN_MODE_CM` or
/// `CONN_MODE_SOCKET`); NULL for an unknown mode. Free with
/// `kv_client_destroy`.
#[no_mangle]
pub extern "C" fn kv_client_create(mode: conn_mode_t) -> *mut kv_client {
    guard(
        "kv_client_create",
        std::ptr::null_mut(),
        || match mode_from_c(mode) {
            Ok(mode) => CLIENTS.insert(ClientSlot {
                mode,
                client: RwLock::new(None),
            }),
            Err(e) => {
                log::error!("kv_client_create: {e}");
                std::ptr::null_mut()
            }
        },
    )
}

fn resolve(host: *const c_char, port: c_int) -> Result<SocketAddr, KvError> {
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

fn connect(
    client: *mut kv_client,
    host: *const c_char,
    port: c_int,
    device: Option<String>,
    mode: ConnMode,
) -> c_int {
    let Some(slot) = CLIENTS.get(client) else {
        return -1;
    };
    if slot.mode != mode {
        log::error!("this client was created for {:?} mode", slot.mode);
        return -1;
    }
    let opts = ClientOptions {
        mode,
        device,
        ..ClientOptions::default()
    };
    match resolve(host, port).and_then(|addr| Client::connect_with(addr, &opts)) {
        Ok(c) => {
            *slot.client.write().expect("client lock") = Some(c);
            0
        }
        Err(e) => {
            log::error!("kv_client_connect: {e}");
            -1
        }
    }
}

/// Connects a `CONN_MODE_CM` client to `server_ip:port` (a name or an
/// address); 0, or -1 when the server is unreachable (within a few seconds).
/// A connected client reconnects (the old connection is closed).
#[no_mangle]
pub extern "C" fn kv_client_connect(
    client: *mut kv_client,
    server_ip: *const c_char,
    port: c_int,
) -> c_int {
    guard("kv_client_connect", -1, || {
        connect(client, server_ip, port, None, ConnMode::Cm)
    })
}

/// Connects a `CONN_MODE_SOCKET` client: QP information is exchanged over
/// TCP at `server_ip:port`; `ib_dev` names the device (NULL: the first).
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
    guard("kv_client_connect_socket", -1, || {
        let device =
            (!ib_dev.is_null()).then(|| CStr::from_ptr(ib_dev).to_string_lossy().into_owned());
        connect(client, server_ip, port, device, ConnMode::Socket)
    })
}

/// Disconnects (the handle stays valid for another connect). Calls other
/// threads have in flight on this client return `KV_ERR_DISCONNECTED`.
#[no_mangle]
pub extern "C" fn kv_client_disconnect(client: *mut kv_client) {
    guard("kv_client_disconnect", (), || {
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
    guard("kv_client_destroy", (), || {
        if let Some(slot) = CLIENTS.remove(client) {
            slot.disconnect();
        }
    })
}

/// Runs `f` with the connected client behind `handle`.
fn with_client(handle: *mut kv_client, f: impl FnOnce(&Client) -> c_int) -> c_int {
    let Some(slot) = CLIENTS.get(handle) else {
        return KV_ERR_INVALID_ARGUMENT;
    };
    let guard = slot.client.read().expect("client lock");
    match guard.as_ref() {
        Some(c) => f(c),
        None => KV_ERR_DISCONNECTED,
    }
}

/// Copies the value of `key` into `value_buf`. `*value_len` is the
/// buffer's capacity on entry and the value's length on return. A value
/// longer than the buffer is not copied: `KV_ERR_BUFFER_TOO_SMALL`, with
/// `*value_len` set to the length needed.
///
/// # Safety
/// `key` valid for `key_len` bytes, `value_buf` for `*value_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kv_client_get(
    client: *mut kv_client,
    key: *const c_char,
    key_len: usize,
    value_buf: *mut c_void,
    value_len: *mut usize,
) -> c_int {
    get_into(
        "kv_client_get",
        client,
        (key, key_len),
        (value_buf, value_len, std::ptr::null_mut()),
        Client::get_into,
    )
}

/// As `kv_client_get`, also reporting the value's version in `*version`
/// (when not NULL), for CAS loops.
///
/// # Safety
/// As `kv_client_get`; a non-NULL `version` must be writable.
#[no_mangle]
pub unsafe extern "C" fn kv_client_get_version(
    client: *mut kv_client,
    key: *const c_char,
    key_len: usize,
    value_buf: *mut c_void,
    value_len: *mut usize,
    version: *mut u64,
) -> c_int {
    get_into(
        "kv_client_get_version",
        client,
        (key, key_len),
        (value_buf, value_len, version),
        Client::get_into,
    )
}

/// As `kv_client_get_version`, without the server's CPU: the client READs
/// the server's hash index and then the value, and takes only a value that
/// verifies as current (a torn or outdated read is retried; what the index
/// cannot answer is asked of the server). Best for values that are read
/// far more often than written.
///
/// # Safety
/// As `kv_client_get_version`.
#[no_mangle]
pub unsafe extern "C" fn kv_client_get_onesided(
    client: *mut kv_client,
    key: *const c_char,
    key_len: usize,
    value_buf: *mut c_void,
    value_len: *mut usize,
    version: *mut u64,
) -> c_int {
    get_into(
        "kv_client_get_onesided",
        client,
        (key, key_len),
        (value_buf, value_len, version),
        Client::get_one_sided_into,
    )
}

/// The body of the single-key GETs, export `name`: checks the arguments,
/// lets `get` copy the value into the caller's buffer, and reports length
/// and version.
unsafe fn get_into(
    name: &'static str,
    client: *mut kv_client,
    (key, key_len): (*const c_char, usize),
    (value_buf, value_len, version): (*mut c_void, *mut usize, *mut u64),
    get: impl FnOnce(&Client, &[u8], &mut [u8]) -> Result<(usize, u64), KvError>,
) -> c_int {
    guard(name, KV_ERR_INTERNAL, || {
        with_client(client, |c| {
            if value_len.is_null() || (value_buf.is_null() && *value_len > 0) {
                return KV_ERR_INVALID_ARGUMENT;
            }
            let k = match self::key(key, key_len) {
                Ok(k) => k,
                Err(e) => return e.code(),
            };
            let buf: &mut [u8] = if value_buf.is_null() {
                &mut []
            } else {
                std::slice::from_raw_parts_mut(value_buf.cast(), *value_len)
            };
            match get(c, k, buf) {
                Ok((n, v)) => {
                    *value_len = n;
                    if let Some(out) = version.as_mut() {
                        *out = v;
                    }
                    KV_OK
                }
                Err(KvError::BufferTooSmall { needed }) => {
                    *value_len = needed as usize;
                    KV_ERR_BUFFER_TOO_SMALL
                }
                Err(e) => code::<()>(Err(e)),
            }
        })
    })
}

/// Stores `value` under `key` (both copied): new keys get version 1, each
/// PUT adds 1.
///
/// # Safety
/// `key` valid for `key_len` bytes, `value` for `value_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kv_client_put(
    client: *mut kv_client,
    key: *const c_char,
    key_len: usize,
    value: *const c_void,
    value_len: usize,
) -> c_int {
    guard("kv_client_put", KV_ERR_INTERNAL, || {
        with_client(client, |c| {
            code(self::key(key, key_len).and_then(|k| c.put(k, bytes(value, value_len)?)))
        })
    })
}

/// Deletes `key`; `KV_ERR_NOT_FOUND` when absent.
///
/// # Safety
/// `key` valid for `key_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn kv_client_delete(
    client: *mut kv_client,
    key: *const c_char,
    key_len: usize,
) -> c_int {
    guard("kv_client_delete", KV_ERR_INTERNAL, || {
        with_client(client, |c| {
            code(self::key(key, key_len).and_then(|k| c.delete(k)))
        })
    })
}

/// Stores `new_value` only if the key's version is `expected_version` (0:
/// only if the key is absent); `*new_version` (when not NULL) gets the new
/// version, or on `KV_ERR_CAS_FAILED` the current one (0: absent).
///
/// # Safety
/// `key` valid for `key_len` bytes, `new_value` for `new_value_len`.
#[no_mangle]
pub unsafe extern "C" fn kv_client_cas(
    client: *mut kv_client,
    key: *const c_char,
    key_len: usize,
    expected_version: u64,
    new_value: *const c_void,
    new_value_len: usize,
    new_version: *mut u64,
) -> c_int {
    guard("kv_client_cas", KV_ERR_INTERNAL, || {
        with_client(client, |c| {
            let r = self::key(key, key_len)
                .and_then(|k| c.cas(k, expected_version, bytes(new_value, new_value_len)?));
            let reported = match &r {
                Ok(v) => Some(*v),
                Err(KvError::CasFailed { current }) => Some(*current),
                Err(_) => None,
            };
            if let (Some(v), Some(out)) = (reported, new_version.as_mut()) {
                *out = v;
            }
            code(r)
        })
    })
}

/// GETs `count` keys with several requests in flight. For each i,
/// `value_lens[i]` is the capacity of `values[i]` on entry and the value's
/// length after a success (the needed length when too small). Returns how
/// many succeeded (-1 for bad arguments).
///
/// # Safety
/// Each array holds `count` entries, valid as in `kv_client_get`.
#[no_mangle]
pub unsafe extern "C" fn kv_client_batch_get(
    client: *mut kv_client,
    keys: *const *const c_char,
    key_lens: *const usize,
    values: *mut *mut c_void,
    value_lens: *mut usize,
    count: c_int,
) -> c_int {
    guard("kv_client_batch_get", -1, || {
        batch_get(
            client,
            (keys, key_lens),
            (values, value_lens),
            count,
            |c, keys, each| c.batch_get_with(keys, each),
        )
    })
}

/// As `kv_client_batch_get`, each key as `kv_client_get_onesided` GETs it:
/// the index buckets and then the values are READ with many in flight,
/// without the server's CPU.
///
/// # Safety
/// As `kv_client_batch_get`.
#[no_mangle]
pub unsafe extern "C" fn kv_client_batch_get_onesided(
    client: *mut kv_client,
    keys: *const *const c_char,
    key_lens: *const usize,
    values: *mut *mut c_void,
    value_lens: *mut usize,
    count: c_int,
) -> c_int {
    guard("kv_client_batch_get_onesided", -1, || {
        batch_get(
            client,
            (keys, key_lens),
            (values, value_lens),
            count,
            |c, keys, each| c.batch_get_one_sided_with(keys, each),
        )
    })
}

/// The body of the batched GETs: checks the arrays, runs `get` on the
/// keys, and copies each value that fits straight into its buffer.
unsafe fn batch_get(
    client: *mut kv_client,
    (keys, key_lens): (*const *const c_char, *const usize),
    (values, value_lens): (*mut *mut c_void, *mut usize),
    count: c_int,
    get: impl FnOnce(&Client, &[&[u8]], &mut dyn FnMut(usize, Result<(&[u8], u64), KvError>)),
) -> c_int {
    with_client(client, |c| {
        let n = match batch_len(
            count,
            &[
                keys.is_null(),
                key_lens.is_null(),
                values.is_null(),
                value_lens.is_null(),
            ],
        ) {
            Ok(n) => n,
            Err(early) => return early,
        };
        let keys = std::slice::from_raw_parts(keys, n);
        let key_lens = std::slice::from_raw_parts(key_lens, n);
        let values = std::slice::from_raw_parts(values, n);
        let value_lens = std::slice::from_raw_parts_mut(value_lens, n);
        let ks: Result<Vec<&[u8]>, KvError> = keys
            .iter()
            .zip(key_lens)
            .map(|(&k, &l)| key(k, l))
            .collect();
        let Ok(ks) = ks else { return -1 };
        let mut ok = 0;
        get(c, &ks, &mut |i, r| {
            let Ok((v, _)) = r else { return };
            if v.len() > value_lens[i] || (values[i].is_null() && !v.is_empty()) {
                value_lens[i] = v.len();
                return;
            }
            if !v.is_empty() {
                // SAFETY: the caller's buffer holds `value_lens[i]` bytes.
                let out =
                    unsafe { std::slice::from_raw_parts_mut(values[i].cast::<u8>(), v.len()) };
                crate::copy::copy(out, v);
            }
            value_lens[i] = v.len();
            ok += 1;
        });
        ok
    })
}

/// PUTs `count` pairs with several requests in flight; returns how many
/// succeeded (-1 for bad arguments).
///
/// # Safety
/// Each array holds `count` entries, valid as in `kv_client_put`.
#[no_mangle]
pub unsafe extern "C" fn kv_client_batch_put(
    client: *mut kv_client,
    keys: *const *const c_char,
    key_lens: *const usize,
    values: *const *const c_void,
    value_lens: *const usize,
    count: c_int,
) -> c_int {
    guard("kv_client_batch_put", -1, || {
        with_client(client, |c| {
            let n = match batch_len(
                count,
                &[
                    keys.is_null(),
                    key_lens.is_null(),
                    values.is_null(),
                    value_lens.is_null(),
                ],
            ) {
                Ok(n) => n,
                Err(early) => return early,
            };
            let parse = || -> Result<Vec<Pair>, KvError> {
                (0..n)
                    .map(|i| {
                        Ok((
                            key(*keys.add(i), *key_lens.add(i))?,
                            bytes(*values.add(i), *value_lens.add(i))?,
                        ))
                    })
                    .collect()
            };
            let Ok(pairs) = parse() else { return -1 };
            c.batch_put(&pairs).iter().filter(|r| r.is_ok()).count() as c_int
        })
    })
}

/// The entry count of a batch call, or what the call returns at once: 0
/// for an empty batch, -1 for a negative count or a NULL array.
fn batch_len(count: c_int, nulls: &[bool]) -> Result<usize, c_int> {
    match count {
        0 => Err(0),
        n if n < 0 || nulls.iter().any(|&null| null) => Err(-1),
        n => Ok(n as usize),
    }
}

/// A static English description of a `KV_*` code. Do not free it.
#[no_mangle]
pub extern "C" fn kv_strerror(code: c_int) -> *const c_char {
    let s: &'static CStr = match code {
        KV_OK => c"success",
        KV_ERR_NOT_FOUND => c"no such key",
        KV_ERR_EXISTS => c"the key exists",
        KV_ERR_CAS_FAILED => c"the version did not match",
        KV_ERR_KEY_TOO_LONG => c"the key is too long",
        KV_ERR_VALUE_TOO_LONG => c"the value is too long",
        KV_ERR_NO_MEMORY => c"the server has no memory",
        KV_ERR_INTERNAL => c"internal error",
        KV_ERR_INVALID_ARGUMENT => c"invalid argument",
        KV_ERR_DISCONNECTED => c"not connected",
        KV_ERR_TIMEOUT => c"timed out",
        KV_ERR_BUFFER_TOO_SMALL => c"the buffer is too small for the value",
        _ => c"unknown key-value result code",
    };
    s.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_match_the_engine() {
        assert_eq!(KvError::CasFailed { current: 1 }.code(), KV_ERR_CAS_FAILED);
        assert_eq!(
            KvError::BufferTooSmall { needed: 1 }.code(),
            KV_ERR_BUFFER_TOO_SMALL
        );
        assert_eq!(KvError::Timeout(Default::default()).code(), KV_ERR_TIMEOUT);
    }

    #[test]
    fn bad_handles_and_arguments_are_refused() {
        let bogus = 0x1234 as *mut kv_client;
        assert_eq!(kv_client_connect(bogus, c"127.0.0.1".as_ptr(), 1), -1);
        let mut len = 4usize;
        let mut buf = [0u8; 4];
        let r =
            unsafe { kv_client_get(bogus, c"k".as_ptr(), 1, buf.as_mut_ptr().cast(), &mut len) };
        assert_eq!(r, KV_ERR_INVALID_ARGUMENT);
        let c = kv_client_create(CONN_MODE_CM);
        assert!(!c.is_null());
        let r = unsafe { kv_client_put(c, std::ptr::null(), 1, std::ptr::null(), 0) };
        assert_eq!(r, KV_ERR_DISCONNECTED, "not connected comes first");
        assert_eq!(kv_client_connect(c, std::ptr::null(), 1), -1);
        kv_client_destroy(c);
        kv_client_destroy(c);
        assert!(kv_client_create(7).is_null());
        let cfg = kv_config {
            bind_ip: [b'1' as c_char; 64],
            port: 0,
            memory_size: 4 << 20,
            use_huge_pages: false,
            hash_table_size: 16,
            num_workers: 1,
            conn_mode: CONN_MODE_CM,
            ib_dev: [0; 64],
        };
        assert!(
            unsafe { kv_server_create(&cfg) }.is_null(),
            "unterminated bind_ip"
        );
        let cfg = kv_config {
            bind_ip: [0; 64],
            ..cfg
        };
        let s = unsafe { kv_server_create(&cfg) };
        assert!(!s.is_null());
        assert_eq!(kv_server_port(s), -1, "not started");
        kv_server_destroy(s);
        assert_eq!(kv_server_start(s), -1, "destroyed");
    }
}
