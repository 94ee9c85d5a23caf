//! Gives the shared library its SONAME, `libsnowrdma.so.<major>`, so C
//! programs record the ABI they were linked against (`make` and `make
//! install` add the `libsnowrdma.so.<major>` link beside the file).
//!
//! The exports need no list here: for a cdylib, rustc hands the linker a
//! version script of its own, generated from the `#[no_mangle]` items (the
//! ones cbindgen writes into the headers), with `local: *` for everything
//! else, so no Rust or std symbol leaks. A second script would be a second
//! list of the API (tried: with both, the linker kept rustc's unversioned one);
//! `scripts/check-symbols.sh` checks that the exports are the headers'.
fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libsnowrdma.so.{major}");
    println!("cargo:rerun-if-changed=build.rs");
}
