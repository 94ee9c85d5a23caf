//! The string key-value C API of `kv_store.h` (the legacy `kv_open` /
//! `kv_set` / `kv_get` library), served by the same engine as `kv_client_*`:
//! a `kv_open` handle is a [`crate::kv::Client`], and `run_server` runs a
//! [`crate::kv::Server`]. Keys and values are NUL-terminated strings; the
//! legacy return convention holds (0 success, 1 failure).
//!
//! A key and value under 4 KiB together travel inside the messages (the
//! legacy "eager" protocol); larger ones by RDMA WRITE and READ
//! ("rendezvous").

use std::ffi::{c_char, c_int, c_void, CStr};
use std::net::SocketAddr;

use once_cell::sync::Lazy;

use super::boundary::{guard, guard_or};
use super::table::HandleTable;
use crate::kv::{legacy_port, Client, KvError, Server, ServerConfig};

static HANDLES: Lazy<HandleTable<Client>> = Lazy::new(HandleTable::new);

/// A C string argument.
///
/// # Safety
/// A non-NULL `p` must be a NUL-terminated string.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a [u8], KvError> {
    if p.is_null() {
        return Err(KvError::InvalidArgument(format!("NULL {what}")));
    }
    Ok(CStr::from_ptr(p).to_bytes())
}

/// Runs an export's body behind the panic boundary with the legacy return
/// convention: 0, or 1 with the reason logged.
#[track_caller]
fn legacy_call(what: &'static str, body: impl FnOnce() -> Result<(), KvError>) -> c_int {
    guard_or(1, || match body() {
        Ok(()) => 0,
        Err(e) => {
            log::error!("{what}: {e}");
            1
        }
    })
}

/// Connects to the server `servername` ("host" or "host:port"; the port
/// defaults to 4792, or `SNOWRDMA_KV_PORT`) and stores a handle in
/// `*kv_handle`. Returns 0, or 1 when the server cannot be reached (within
/// a few seconds) or an argument is NULL. Close with `kv_close`.
///
/// # Safety
/// `servername` a C string; `kv_handle` writable.
#[no_mangle]
pub unsafe extern "C" fn kv_open(servername: *mut c_char, kv_handle: *mut *mut c_void) -> c_int {
    legacy_call("kv_open", || {
        if kv_handle.is_null() {
            return Err(KvError::InvalidArgument("NULL kv_handle".into()));
        }
        let name = std::str::from_utf8(text(servername, "servername")?)
            .map_err(|_| KvError::InvalidArgument("servername is not UTF-8".into()))?;
        let client = Client::open(name)?;
        *kv_handle = HANDLES.insert_opaque(client);
        Ok(())
    })
}

/// Stores the string `value` under the string `key` (both copied). 0 or 1.
///
/// # Safety
/// `key` and `value` C strings.
#[no_mangle]
pub unsafe extern "C" fn kv_set(
    kv_handle: *mut c_void,
    key: *const c_char,
    value: *const c_char,
) -> c_int {
    legacy_call("kv_set", || {
        let client = HANDLES.get(kv_handle).ok_or_else(bad_handle)?;
        client
            .put(text(key, "key")?, text(value, "value")?)
            .map(drop)
    })
}

/// Fetches the value of `key` into `*value`: a string the library
/// malloc'd, which the caller frees with `kv_release`. A missing key gives
/// an empty string (and 0). Returns 0, or 1 (and `*value` untouched).
///
/// # Safety
/// `key` a C string; `value` writable.
#[no_mangle]
pub unsafe extern "C" fn kv_get(
    kv_handle: *mut c_void,
    key: *const c_char,
    value: *mut *mut c_char,
) -> c_int {
    legacy_call("kv_get", || {
        if value.is_null() {
            return Err(KvError::InvalidArgument("NULL value pointer".into()));
        }
        let client = HANDLES.get(kv_handle).ok_or_else(bad_handle)?;
        // The value goes straight from the library's buffer into the
        // malloc'd string (a 1 GiB value is not copied twice).
        let copy = |bytes: &[u8]| {
            // SAFETY: a fresh allocation of len + 1 bytes, filled here.
            let out = libc::malloc(bytes.len() + 1).cast::<u8>();
            if !out.is_null() {
                crate::copy::copy(std::slice::from_raw_parts_mut(out, bytes.len()), bytes);
                *out.add(bytes.len()) = 0;
            }
            out
        };
        let out = match client.get_with(text(key, "key")?, copy) {
            Ok((out, _)) => out,
            Err(KvError::NotFound) => copy(&[]),
            Err(e) => return Err(e),
        };
        if out.is_null() {
            return Err(KvError::NoMemory);
        }
        *value = out.cast();
        Ok(())
    })
}

/// Frees a string `kv_get` returned (NULL is ignored).
///
/// # Safety
/// `value` came from `kv_get` and is freed once.
#[no_mangle]
pub unsafe extern "C" fn kv_release(value: *mut c_char) {
    guard(|| libc::free(value.cast()))
}

/// Disconnects and frees the handle. 0, or 1 for a handle that is not open
/// (NULL, or closed already). Calls other threads have in flight on the
/// handle return 1 at once.
#[no_mangle]
pub extern "C" fn kv_close(kv_handle: *mut c_void) -> c_int {
    legacy_call("kv_close", || {
        // Closed now, not when the last call in flight lets go of it: those
        // calls end at once with an error instead of waiting for a reply.
        HANDLES
            .remove(kv_handle)
            .map(|c| c.close())
            .ok_or_else(bad_handle)
    })
}

/// Serves key-value clients of both APIs on port 4792 (`SNOWRDMA_KV_PORT`)
/// of every address, any number at once, until the process ends. Returns 1
/// only when it cannot start.
#[no_mangle]
pub extern "C" fn run_server() -> c_int {
    guard_or(1, || {
        let cfg = ServerConfig {
            addr: SocketAddr::from(([0, 0, 0, 0], legacy_port())),
            // The legacy server kept large values in their own buffers too;
            // a smaller pool leaves memory for them.
            memory_size: 256 << 20,
            ..ServerConfig::default()
        };
        // Held until the process ends: the loop below never returns.
        let _server = match Server::new(cfg).and_then(|s| s.start().map(|()| s)) {
            Ok(s) => s,
            Err(e) => {
                log::error!("run_server: {e}");
                eprintln!("run_server: {e}");
                return 1;
            }
        };
        println!("run_server: serving on port {}", legacy_port());
        loop {
            std::thread::park();
        }
    })
}

fn bad_handle() -> KvError {
    KvError::InvalidArgument("not an open kv handle".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_handles_and_null_arguments_fail_with_1() {
        let mut out: *mut c_char = std::ptr::null_mut();
        let bogus = 0x10 as *mut c_void;
        unsafe {
            assert_eq!(kv_open(std::ptr::null_mut(), std::ptr::null_mut()), 1);
            assert_eq!(kv_set(bogus, c"k".as_ptr(), c"v".as_ptr()), 1);
            assert_eq!(kv_get(bogus, c"k".as_ptr(), &mut out), 1);
            assert_eq!(kv_get(bogus, c"k".as_ptr(), std::ptr::null_mut()), 1);
            kv_release(std::ptr::null_mut());
        }
        assert!(out.is_null());
        assert_eq!(kv_close(std::ptr::null_mut()), 1);
        assert_eq!(kv_close(bogus), 1);
    }
}
