#!/usr/bin/env bash
# The runtime's host tests under ThreadSanitizer, where the toolchain allows
# it (a nightly toolchain, for -Zsanitizer); skipped with a note otherwise.
# The standard library is not instrumented (that needs rust-src and
# -Zbuild-std), so races inside it go unseen; see scripts/tsan.supp.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "tsan: no nightly toolchain here; skipped"
    exit 0
fi
export RUSTFLAGS="-Zsanitizer=thread -Cunsafe-allow-abi-mismatch=sanitizer"
export TSAN_OPTIONS="suppressions=$PWD/scripts/tsan.supp halt_on_error=1"
exec cargo +nightly test --lib --target x86_64-unknown-linux-gnu \
    --target-dir target/tsan -- runtime::
