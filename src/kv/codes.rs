//! The key-value store's error codes and well-known ports: on the wire (a
//! server reports a code in its replies) and in the C API, whose
//! `kv_store.h` is generated from these constants (`KV_OK`, `KV_ERR_*`,
//! `KV_DEFAULT_PORT`). [`KvError::code`](super::KvError::code) maps errors
//! to them.

/// Success.
pub const KV_OK: i32 = 0;

/// No such key.
pub const KV_ERR_NOT_FOUND: i32 = -1;

/// The key exists.
pub const KV_ERR_EXISTS: i32 = -2;

/// CAS: the version did not match (the current one is reported).
pub const KV_ERR_CAS_FAILED: i32 = -3;

/// The key is longer than 1024 bytes.
pub const KV_ERR_KEY_TOO_LONG: i32 = -4;

/// The value is longer than the server's maximum (default 1 GiB).
pub const KV_ERR_VALUE_TOO_LONG: i32 = -5;

/// The server has no memory for the value.
pub const KV_ERR_NO_MEMORY: i32 = -6;

/// Anything else (a broken reply, a failed RDMA operation).
pub const KV_ERR_INTERNAL: i32 = -7;

/// snowrdma: a NULL, empty or unknown argument or handle.
pub const KV_ERR_INVALID_ARGUMENT: i32 = -8;

/// snowrdma: not connected, or the server went away.
pub const KV_ERR_DISCONNECTED: i32 = -9;

/// snowrdma: the server did not answer in time.
pub const KV_ERR_TIMEOUT: i32 = -10;

/// snowrdma: `value_buf` is too small; `*value_len` says how long the value is.
pub const KV_ERR_BUFFER_TOO_SMALL: i32 = -11;

/// The legacy server's TCP port, where `kv_open` connects and `run_server`
/// listens unless `SNOWRDMA_KV_PORT` says otherwise.
pub const KV_DEFAULT_PORT: u16 = 4792;
