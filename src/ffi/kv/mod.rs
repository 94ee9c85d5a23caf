//! The key-value C API of `kv_store.h`: `kv_server_*` and `kv_client_*`
//! (binary keys and values, versions, CAS), served by [`crate::kv`].
//!
//! Handles are opaque; every call checks its handle against the table of
//! live ones, so a NULL, destroyed or foreign handle is refused with an
//! error instead of crashing. All calls are blocking and may be made from
//! any thread; one client handle may be shared among threads.

// In the order of the header: cbindgen emits items in the order it meets
// the modules.
mod types;

mod handles;

mod server;

mod limits;

mod client;

mod ops;

#[cfg(test)]
mod tests;

pub use client::*;
pub use limits::*;
pub use ops::*;
pub use server::*;
pub use types::*;
