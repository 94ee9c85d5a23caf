//! The types and constants of `kv_store.h`: connection modes, error codes,
//! the server configuration and the opaque handles.

use std::ffi::{c_char, c_int};

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
