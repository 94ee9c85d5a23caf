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

pub use crate::kv::codes::{
    KV_ERR_BUFFER_TOO_SMALL, KV_ERR_CAS_FAILED, KV_ERR_DISCONNECTED, KV_ERR_EXISTS,
    KV_ERR_INTERNAL, KV_ERR_INVALID_ARGUMENT, KV_ERR_KEY_TOO_LONG, KV_ERR_NOT_FOUND,
    KV_ERR_NO_MEMORY, KV_ERR_TIMEOUT, KV_ERR_VALUE_TOO_LONG, KV_OK,
};

// The bounds below are the key-value layer's (`crate::kv`), written out
// because cbindgen emits only literal constants; `facts.rs` checks that they
// agree.

/// Longest key accepted, in bytes.
pub const KV_MAX_KEY_LEN: usize = 1024;

/// Most worker threads a server takes (`kv_config.num_workers`).
pub const KV_MAX_WORKERS: c_int = 1024;

/// Largest `kv_limits.worker_queue`.
pub const KV_MAX_WORKER_QUEUE: u64 = 65536;

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
    /// Worker threads for large values (0: 4; at most KV_MAX_WORKERS,
    /// beyond which `kv_server_create` returns NULL).
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
