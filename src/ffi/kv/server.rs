//! The `kv_server_*` exports.

use std::ffi::{c_char, c_int};

use crate::ffi::boundary::{guard, guard_or};
use crate::kv::{Server, ServerConfig};

use super::handles::{config_from_c, setup_code, SERVERS};
use super::types::{kv_config, kv_server, KV_ERR_INTERNAL, KV_ERR_INVALID_ARGUMENT};

/// Creates a server from `config` (copied; NULL means all defaults): maps
/// its memory pool and index. Returns NULL on bad settings or no memory (the
/// log, enabled with `SNOWRDMA_LOG`, says why). Free with
/// `kv_server_destroy`.
///
/// # Safety
/// A non-NULL `config` must point to a `kv_config_t`.
#[no_mangle]
pub unsafe extern "C" fn kv_server_create(config: *const kv_config) -> *mut kv_server {
    guard(|| {
        let cfg = if config.is_null() {
            Ok(ServerConfig::default())
        } else {
            config_from_c(config)
        };
        match cfg.and_then(Server::new) {
            Ok(server) => SERVERS.insert_opaque(server),
            Err(e) => {
                log::error!("kv_server_create: {e}");
                std::ptr::null_mut()
            }
        }
    })
}

/// Starts serving: listens and returns at once. `KV_OK`,
/// `KV_ERR_INVALID_ARGUMENT` for a bad or destroyed handle, or the code of
/// what failed (`KV_ERR_INTERNAL` when the address cannot be bound, for
/// one); never `KV_ERR_NOT_FOUND`. Requests are answered on library threads
/// until `kv_server_stop`.
#[no_mangle]
pub extern "C" fn kv_server_start(server: *mut kv_server) -> c_int {
    guard_or(KV_ERR_INTERNAL, || {
        let Some(s) = SERVERS.get(server) else {
            return KV_ERR_INVALID_ARGUMENT;
        };
        setup_code("kv_server_start", s.start())
    })
}

/// The port a started server listens on (useful with port 0), or -1.
#[no_mangle]
pub extern "C" fn kv_server_port(server: *const kv_server) -> c_int {
    guard_or(-1, || {
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
    guard_or(-1, || {
        let Some(s) = SERVERS.get(server) else {
            return -1;
        };
        let line = s.stats().to_string();
        if let Some(out) = crate::ffi::boundary::out_buf(buf, len) {
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
    guard(|| {
        if let Some(s) = SERVERS.get(server) {
            s.stop();
        }
    })
}

/// Stops the server and frees it and all stored values; the handle is
/// invalid afterwards (a second destroy is ignored).
#[no_mangle]
pub extern "C" fn kv_server_destroy(server: *mut kv_server) {
    guard(|| {
        if let Some(s) = SERVERS.remove(server) {
            s.stop();
        }
    })
}
