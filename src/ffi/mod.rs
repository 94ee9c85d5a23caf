//! The C ABI. Thin by design: it checks pointers, converts errors to codes
//! and keeps panics from unwinding into C; the work happens in the Rust
//! layers below.
