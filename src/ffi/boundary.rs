//! The one place where C meets Rust: the panic boundary and pointer checks
//! every export goes through.

use std::panic::{catch_unwind, AssertUnwindSafe, Location};

use super::snowrdma_result;

/// What an export returns when its body panicked, by return type (as
/// rustls-ffi's `PanicOrDefault`): NULL for pointers, nothing for `()`,
/// `SNOWRDMA_ERR_INTERNAL` for a `snowrdma_result`. Plain integers mean
/// different things in different APIs, so their exports say which value
/// with [`guard_or`].
pub(crate) trait OnPanic {
    fn on_panic() -> Self;
}

impl<T> OnPanic for *mut T {
    fn on_panic() -> Self {
        std::ptr::null_mut()
    }
}

impl<T> OnPanic for *const T {
    fn on_panic() -> Self {
        std::ptr::null()
    }
}

impl OnPanic for () {
    fn on_panic() -> Self {}
}

impl OnPanic for snowrdma_result {
    fn on_panic() -> Self {
        snowrdma_result::SNOWRDMA_ERR_INTERNAL
    }
}

/// Runs an export's body; a panic becomes the return type's failure value
/// ([`OnPanic`]) and a log line naming the export's source line, instead of
/// unwinding into C, which would be undefined behaviour.
#[track_caller]
pub(crate) fn guard<T: OnPanic>(body: impl FnOnce() -> T) -> T {
    guard_or(T::on_panic(), body)
}

/// [`guard`] for exports whose failure value the type cannot tell (an
/// `int` that is `RDMA_ERR` in one API and `KV_ERR_INTERNAL` in another).
#[track_caller]
pub(crate) fn guard_or<T>(on_panic: T, body: impl FnOnce() -> T) -> T {
    let at = Location::caller();
    init_logging();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(v) => v,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            log::error!(
                "the export at {at}: internal error (panic caught at the C boundary): {msg}"
            );
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
