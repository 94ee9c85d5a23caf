#!/usr/bin/env bash
# Builds the device tests and runs the whole device suite in one go: directly
# on this host's RDMA device, or else in one Soft-RoCE VM boot.
set -euo pipefail
cd "$(dirname "$0")/.."
# The safe API's examples run in the device tests too.
cargo build --examples --features tokio
test_bin=$(cargo test --features tokio --test device --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "device" and m.get("executable"):
        print(m["executable"])')
[ -n "$test_bin" ] || { echo "device-tests: could not build the device tests" >&2; exit 1; }
exec scripts/rdma-run.sh scripts/device-suite.sh "$test_bin" target/debug
