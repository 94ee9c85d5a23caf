//! The key-value store over RDMA: one engine ([`Server`]) with a slab pool,
//! a hash index clients may read one-sidedly, versions and CAS, and a
//! [`Client`]. Requests and replies are runtime messages; large values move
//! by one-sided RDMA (a PUT writes into the client's request buffer on the
//! server, a GET reads the stored block).
//!
//! Both legacy C APIs (`kv_client_*` / `kv_server_*` and `kv_open` ...) are
//! served by this engine; see `crate::ffi::kv`.

mod client;
pub mod codes;
mod index;
mod limits;
mod pool;
pub mod proto;
mod server;
mod store;

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

pub use client::{BatchOp, Client, ClientOptions, KvMemory};
pub use codes::KV_DEFAULT_PORT;
pub use limits::{Limits, MAX_WORKERS, MAX_WORKER_QUEUE};
pub use pool::QUARANTINE;
pub use server::{Server, ServerConfig, Stats};

/// Longest key accepted.
pub const MAX_KEY_LEN: usize = 1024;
/// Default largest value (inclusive).
pub const DEFAULT_MAX_VALUE: u64 = 1 << 30;
/// The largest `max_value` a server may be configured with, and the largest
/// a client accepts from one (a HELLO advertising more is refused: every
/// byte from the server is its word, not a fact). 256 TiB: more memory than
/// any machine holds (the largest hold tens of TiB) and all that a 48-bit
/// virtual address space (x86-64 and arm64 with 4-level page tables) maps,
/// so no value past it could be stored or fetched; and far enough below
/// 2^63 that a block's length (header and key added) and a buffer for it
/// rounded up to a power of two cannot overflow.
pub const LARGEST_MAX_VALUE: u64 = 1 << 48;
/// The largest request buffer a server may have and a client accepts: a
/// value that fits it goes in one RDMA WRITE, whose length is 32 bits.
pub const LARGEST_REQUEST_BUF: u64 = u32::MAX as u64;
/// Environment variable overriding the largest value a server accepts, in
/// bytes.
pub const MAX_VALUE_ENV: &str = "SNOWRDMA_KV_MAX_VALUE";
/// Environment variable overriding how long a client waits for one reply,
/// in milliseconds (large transfers get more, in proportion to their size).
pub const TIMEOUT_ENV: &str = "SNOWRDMA_KV_TIMEOUT_MS";

/// Requests and replies up to this many bytes (a small GET or PUT) go to
/// the device inside the work request: no fetch through a registration.
/// Within what RDMA devices take (Soft-RoCE: 400, ConnectX: more).
const MESSAGE_INLINE: u32 = 256;

/// The port `kv_server` and `kv_client` use unless told otherwise (the
/// legacy programs' port).
pub const SERVER_PORT: u16 = 12345;

/// Environment variable overriding [`KV_DEFAULT_PORT`] (the port of the
/// legacy string API: `kv_open`, `run_server`, [`Client::open`]).
pub const PORT_ENV: &str = "SNOWRDMA_KV_PORT";

/// [`KV_DEFAULT_PORT`], or `SNOWRDMA_KV_PORT`.
pub fn legacy_port() -> u16 {
    std::env::var(PORT_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(KV_DEFAULT_PORT)
}

/// Resolves "host" or "host:port" (the port defaulting to
/// [`legacy_port`]) to an IPv4 address.
pub fn server_addr(name: &str) -> Result<SocketAddr> {
    let (host, port) = match name.rsplit_once(':') {
        Some((h, p)) => (
            h,
            p.parse()
                .map_err(|_| KvError::InvalidArgument(format!("bad port in {name:?}")))?,
        ),
        None => (name, legacy_port()),
    };
    (host, port)
        .to_socket_addrs()
        .map_err(|e| KvError::InvalidArgument(format!("resolving {host}: {e}")))?
        .find(SocketAddr::is_ipv4)
        .ok_or_else(|| KvError::InvalidArgument(format!("{host} has no IPv4 address")))
}

/// How clients reach the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConnMode {
    /// RDMA CM (the default).
    #[default]
    Cm,
    /// A TCP connection exchanges QP information; QP states are set by hand.
    Socket,
}

/// Why a key-value operation failed. [`KvError::code`] gives the legacy
/// `KV_ERR_*` number.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("no such key")]
    NotFound,
    #[error("the key exists")]
    Exists,
    #[error("the version did not match; the current version is {current}")]
    CasFailed { current: u64 },
    #[error("the key is longer than {MAX_KEY_LEN} bytes")]
    KeyTooLong,
    #[error("the value is longer than the server's maximum of {max} bytes")]
    ValueTooLong { max: u64 },
    #[error("the server has no memory for the value")]
    NoMemory,
    #[error("internal error: {0}")]
    Internal(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("not connected to the server: {0}")]
    Disconnected(String),
    #[error("the server did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the value has {needed} bytes, more than the buffer holds")]
    BufferTooSmall { needed: u64 },
}

pub type Result<T, E = KvError> = std::result::Result<T, E>;

impl KvError {
    /// The C code (`KV_ERR_*`).
    pub fn code(&self) -> i32 {
        use codes::*;
        match self {
            KvError::NotFound => KV_ERR_NOT_FOUND,
            KvError::Exists => KV_ERR_EXISTS,
            KvError::CasFailed { .. } => KV_ERR_CAS_FAILED,
            KvError::KeyTooLong => KV_ERR_KEY_TOO_LONG,
            KvError::ValueTooLong { .. } => KV_ERR_VALUE_TOO_LONG,
            KvError::NoMemory => KV_ERR_NO_MEMORY,
            KvError::Internal(_) => KV_ERR_INTERNAL,
            KvError::InvalidArgument(_) => KV_ERR_INVALID_ARGUMENT,
            KvError::Disconnected(_) => KV_ERR_DISCONNECTED,
            KvError::Timeout(_) => KV_ERR_TIMEOUT,
            KvError::BufferTooSmall { .. } => KV_ERR_BUFFER_TOO_SMALL,
        }
    }

    /// Rebuilds an error a server reported by its code; `detail` is the
    /// version (CAS), the length (buffer) or the maximum (value too long).
    pub(crate) fn from_code(code: i32, detail: u64) -> KvError {
        use codes::*;
        match code {
            KV_ERR_NOT_FOUND => KvError::NotFound,
            KV_ERR_EXISTS => KvError::Exists,
            KV_ERR_CAS_FAILED => KvError::CasFailed { current: detail },
            KV_ERR_KEY_TOO_LONG => KvError::KeyTooLong,
            KV_ERR_VALUE_TOO_LONG => KvError::ValueTooLong { max: detail },
            KV_ERR_NO_MEMORY => KvError::NoMemory,
            KV_ERR_INVALID_ARGUMENT => {
                KvError::InvalidArgument("the server refused the request".into())
            }
            other => KvError::Internal(format!("the server answered code {other}")),
        }
    }
}

impl From<crate::runtime::Error> for KvError {
    fn from(e: crate::runtime::Error) -> KvError {
        use crate::runtime::Error as E;
        match e {
            E::Disconnected | E::NotConnected => KvError::Disconnected(e.to_string()),
            E::InvalidArgument(s) => KvError::InvalidArgument(s),
            other => KvError::Internal(other.to_string()),
        }
    }
}

impl From<crate::verbs::Error> for KvError {
    fn from(e: crate::verbs::Error) -> KvError {
        KvError::Internal(e.to_string())
    }
}

/// Checks a key against the limits.
pub(crate) fn check_key(key: &[u8]) -> Result<()> {
    if key.is_empty() {
        return Err(KvError::InvalidArgument("the key is empty".into()));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KvError::KeyTooLong);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_take_an_optional_port() {
        assert_eq!(server_addr("127.0.0.1:99").unwrap().port(), 99);
        assert_eq!(server_addr("127.0.0.1").unwrap().port(), legacy_port());
        assert!(server_addr("127.0.0.1:x").is_err());
    }
}
