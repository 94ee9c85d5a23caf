#!/usr/bin/env bash
# The runtime's host tests under ThreadSanitizer, where the toolchain allows
# it: a nightly toolchain with rust-src, so the standard library is built
# with TSan too (-Zbuild-std; without it, std's own locks are invisible to
# TSan and every Mutex looks like a race). Skipped with a note otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "tsan: no nightly toolchain here; skipped"
    exit 0
fi
sysroot=$(rustc +nightly --print sysroot)
if [ ! -d "$sysroot/lib/rustlib/src/rust/library" ]; then
    rustup component add rust-src --toolchain nightly >/dev/null 2>&1 || true
fi
if [ ! -d "$sysroot/lib/rustlib/src/rust/library" ]; then
    echo "tsan: the nightly toolchain has no rust-src (needed for -Zbuild-std); skipped"
    exit 0
fi
export RUSTFLAGS="-Zsanitizer=thread"
export RUSTDOCFLAGS="-Zsanitizer=thread"
export TSAN_OPTIONS="halt_on_error=1"
exec cargo +nightly test -Zbuild-std --lib --target x86_64-unknown-linux-gnu \
    --target-dir target/tsan -- runtime::
