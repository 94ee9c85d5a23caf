//! snowrdma: RDMA made as easy as sockets and as fast as raw verbs, for Rust
//! and (through `libsnowrdma.so` / `libsnowrdma.a`) for C.
//!
//! Layers, each depending only on those below it:
//! - [`verbs`]: a safe layer over libibverbs and librdmacm;
//! - [`ffi`]: the C ABI (thin: pointer checks, the panic boundary, error codes).

pub mod ffi;
pub mod runtime;
pub mod verbs;
