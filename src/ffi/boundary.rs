//! The one place where C meets Rust: the panic boundary and pointer checks
//! every export goes through.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs an export's body; a panic becomes `on_panic` (and a log line) instead
/// of unwinding into C, which would be undefined behaviour.
pub(crate) fn guard<T>(name: &'static str, on_panic: T, body: impl FnOnce() -> T) -> T {
    init_logging();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            log::error!("{name}: internal error (panic caught at the C boundary): {msg}");
            on_panic
        }
    }
}

/// A writable C buffer, or `None` for a NULL pointer, a zero length, or a
/// length no object can have.
///
/// # Safety
/// A non-NULL `ptr` must be valid for `len` bytes of writes.
pub(crate) unsafe fn out_buf<'a>(ptr: *mut libc::c_char, len: usize) -> Option<&'a mut [u8]> {
    if ptr.is_null() || len == 0 || !fits_in_memory(len) {
        None
    } else {
        Some(std::slice::from_raw_parts_mut(ptr.cast::<u8>(), len))
    }
}

/// Whether a C length can be that of one object: no slice is made from a
/// length above `isize::MAX` (a careless `(size_t)-1` would be undefined
/// behaviour, and aborts a debug build).
pub(crate) fn fits_in_memory(len: usize) -> bool {
    isize::try_from(len).is_ok()
}

/// C programs get the library's log on stderr when `SNOWRDMA_LOG` (or
/// `RUST_LOG`) is set; it is off otherwise.
fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| crate::init_logging(None));
}
