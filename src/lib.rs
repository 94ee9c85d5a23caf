//! snowrdma: RDMA made as easy as sockets and as fast as raw verbs, for Rust
//! and (through `libsnowrdma.so` / `libsnowrdma.a`) for C.
//!
//! Layers, each depending only on those below it:
//! - [`verbs`]: a safe layer over libibverbs and librdmacm;
//! - [`runtime`]: the SnowRDMA runtime (connections, CM and completion threads);
//! - [`kv`]: the key-value store engine, server and client;
//! - [`ffi`]: the C ABI (thin: pointer checks, the panic boundary, error codes).

pub mod broker;
mod copy;
pub mod costs;
pub mod ffi;
pub mod kv;
mod logging;
mod mapping;
pub mod runtime;
pub mod safe;
mod tcp;
pub mod verbs;

pub use logging::{init_logging, LOG_ENV};

/// The README's and the guides' Rust examples compile (`cargo test --doc`).
#[cfg(doctest)]
mod guides {
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("../docs/safe-api.md")]
    struct SafeApi;
    #[doc = include_str!("../docs/broker.md")]
    struct Broker;
}
