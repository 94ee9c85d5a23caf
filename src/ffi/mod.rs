//! The C ABI. Thin by design: it checks pointers, turns errors into codes and
//! keeps panics from unwinding into C (every export runs inside
//! `boundary::guard`); the work happens in the Rust layers below.
//!
//! The header `include/snowrdma.h` is generated from this module by cbindgen.

mod boundary;
pub mod broker;
pub mod broker_mem;
#[cfg(test)]
mod facts;
pub mod kv;
pub mod kv_strings;
pub mod rdma;
mod table;

use std::ffi::{c_char, c_int, CStr};

use crate::verbs;
use boundary::{guard, out_buf};

/// Result codes of the snowrdma C API. Numbers are never reused.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum snowrdma_result {
    /// Success.
    SNOWRDMA_OK = 0,
    /// An argument was NULL, empty or out of range.
    SNOWRDMA_ERR_INVALID_ARGUMENT = 1,
    /// There is no RDMA device, or none with the given name.
    SNOWRDMA_ERR_NO_DEVICE = 2,
    /// A verbs or RDMA CM call failed (the log says which, with its errno).
    SNOWRDMA_ERR_VERBS = 3,
    /// A work request completed with an error status.
    SNOWRDMA_ERR_COMPLETION = 4,
    /// A wait ran out of time.
    SNOWRDMA_ERR_TIMEOUT = 5,
    /// The output buffer is too small; nothing was truncated.
    SNOWRDMA_ERR_BUFFER_TOO_SMALL = 6,
    /// A bug in snowrdma (a caught panic); please report it.
    SNOWRDMA_ERR_INTERNAL = 7,
}

use snowrdma_result::*;

impl From<&verbs::Error> for snowrdma_result {
    fn from(e: &verbs::Error) -> Self {
        match e {
            verbs::Error::Verb { .. } | verbs::Error::CmEvent { .. } => SNOWRDMA_ERR_VERBS,
            verbs::Error::Completion { .. } | verbs::Error::Verification(_) => {
                SNOWRDMA_ERR_COMPLETION
            }
            verbs::Error::Timeout { .. } => SNOWRDMA_ERR_TIMEOUT,
            verbs::Error::NoDevice | verbs::Error::NoSuchDevice(_) => SNOWRDMA_ERR_NO_DEVICE,
            verbs::Error::InvalidArgument(_) => SNOWRDMA_ERR_INVALID_ARGUMENT,
        }
    }
}

/// The library version, e.g. "0.1.0". A static string: do not free it.
/// Callable from any thread.
#[no_mangle]
pub extern "C" fn snowrdma_version() -> *const c_char {
    const VERSION: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(s) => s,
            Err(_) => panic!("version contains a NUL"),
        };
    VERSION.as_ptr()
}

/// A static English description of a result code (unknown codes included).
/// Do not free it. Callable from any thread.
#[no_mangle]
pub extern "C" fn snowrdma_strerror(code: c_int) -> *const c_char {
    let s: &'static CStr = match code {
        0 => c"success",
        1 => c"invalid argument",
        2 => c"no such RDMA device",
        3 => c"an RDMA verbs call failed",
        4 => c"a work request completed with an error",
        5 => c"timed out",
        6 => c"buffer too small",
        7 => c"internal error in snowrdma",
        _ => c"unknown snowrdma result code",
    };
    s.as_ptr()
}

/// Stores the number of RDMA devices on this host in `*count` (0 when the
/// kernel has no RDMA support). Returns `SNOWRDMA_OK`, or
/// `SNOWRDMA_ERR_INVALID_ARGUMENT` when `count` is NULL. Any thread.
///
/// # Safety
/// `count` must be NULL or point to writable memory for one `size_t`.
#[no_mangle]
pub unsafe extern "C" fn snowrdma_device_count(count: *mut usize) -> snowrdma_result {
    guard(|| {
        if count.is_null() {
            return SNOWRDMA_ERR_INVALID_ARGUMENT;
        }
        match verbs::devices() {
            Ok(list) => {
                // SAFETY: checked non-NULL; the caller promises it is writable.
                unsafe { *count = list.len() };
                SNOWRDMA_OK
            }
            Err(e) => {
                log::warn!("snowrdma_device_count: {e}");
                (&e).into()
            }
        }
    })
}

/// Copies the NUL-terminated name of device `index` (from 0) into `buf` of
/// `len` bytes, which the caller owns. Returns `SNOWRDMA_OK`,
/// `SNOWRDMA_ERR_INVALID_ARGUMENT` for a NULL or empty buffer,
/// `SNOWRDMA_ERR_NO_DEVICE` when `index` is out of range, or
/// `SNOWRDMA_ERR_BUFFER_TOO_SMALL` (and `buf` untouched) when the name and
/// its NUL do not fit. Any thread.
///
/// # Safety
/// `buf` must be NULL or valid for `len` bytes of writes.
#[no_mangle]
pub unsafe extern "C" fn snowrdma_device_name(
    index: usize,
    buf: *mut c_char,
    len: usize,
) -> snowrdma_result {
    guard(|| {
        // SAFETY: the caller promises buf is valid for len bytes.
        let Some(out) = (unsafe { out_buf(buf, len) }) else {
            return SNOWRDMA_ERR_INVALID_ARGUMENT;
        };
        let list = match verbs::devices() {
            Ok(list) => list,
            Err(e) => return (&e).into(),
        };
        let Some(dev) = list.get(index) else {
            return SNOWRDMA_ERR_NO_DEVICE;
        };
        let name = dev.name.as_bytes();
        if name.len() + 1 > out.len() {
            return SNOWRDMA_ERR_BUFFER_TOO_SMALL;
        }
        out[..name.len()].copy_from_slice(name);
        out[name.len()] = 0;
        SNOWRDMA_OK
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_its_own_message() {
        let msgs: Vec<_> = (0..=7)
            .map(|c| {
                unsafe { CStr::from_ptr(snowrdma_strerror(c)) }
                    .to_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        let mut unique = msgs.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), msgs.len());
        let unknown = unsafe { CStr::from_ptr(snowrdma_strerror(99)) };
        assert_eq!(unknown.to_str().unwrap(), "unknown snowrdma result code");
    }

    #[test]
    fn null_and_empty_arguments_are_refused() {
        unsafe {
            assert_eq!(
                snowrdma_device_count(std::ptr::null_mut()),
                SNOWRDMA_ERR_INVALID_ARGUMENT
            );
            assert_eq!(
                snowrdma_device_name(0, std::ptr::null_mut(), 16),
                SNOWRDMA_ERR_INVALID_ARGUMENT
            );
            let mut b = [0 as c_char; 4];
            assert_eq!(
                snowrdma_device_name(0, b.as_mut_ptr(), 0),
                SNOWRDMA_ERR_INVALID_ARGUMENT
            );
        }
    }

    #[test]
    fn a_panic_becomes_an_error_code() {
        let r = guard(|| -> snowrdma_result { panic!("boom") });
        assert_eq!(r, SNOWRDMA_ERR_INTERNAL);
    }

    #[test]
    fn version_matches_the_crate() {
        let v = unsafe { CStr::from_ptr(snowrdma_version()) };
        assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
    }
}
