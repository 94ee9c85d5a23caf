//! Gives the shared library its SONAME, `libsnowrdma.so.<major>`, so C
//! programs record the ABI they were linked against (`make` and `make
//! install` add the `libsnowrdma.so.<major>` link beside the file).
fn main() {
    let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libsnowrdma.so.{major}");
    println!("cargo:rerun-if-changed=build.rs");
}
