//! The legacy SnowRDMA C ABI (`rdma.h`): the structs to the byte, the
//! globals, and the functions, over [`crate::runtime`].
//!
//! Handles: `RdmaConn *` and `RdmaListener *` point to memory the library
//! owns. Every call looks the pointer up in the connection table first, so a
//! stale or foreign pointer gets `RDMA_ERR` (or `(size_t)-1`, or NULL)
//! instead of being dereferenced.

#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

// In the order of the header: cbindgen emits items in the order it meets
// the modules.
mod types;

mod globals;

mod bridge;

mod handles;

mod setup;

mod data;

#[cfg(test)]
mod tests;

pub use data::*;
pub use globals::*;
pub use setup::*;
pub use types::*;
