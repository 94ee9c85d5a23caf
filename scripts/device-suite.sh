#!/usr/bin/env bash
# The device suite, run where an RDMA device is (scripts/rdma-run.sh puts it
# in the Soft-RoCE VM): the Rust device tests, the probe, the key-value
# demo and the C example.
# Every step runs; the exit code says whether all passed.
#
#   scripts/device-suite.sh <device-test-binary> <lib profile dir>
set -u
# Warnings and errors from the library on stderr, so a failure says why.
export SNOWRDMA_LOG=${SNOWRDMA_LOG:-warn}
test_bin=$1
profile_dir=$2
failed=()
step() {
    echo "=== $*"
    "$@" || failed+=("$*")
}
step "$test_bin" --ignored --test-threads=1
step "$profile_dir/snowrdma-probe"
# The main job (`make run`), short.
step scripts/kv-demo.sh "$profile_dir" 300
step target/c-examples/devices --require-device
if [ ${#failed[@]} -gt 0 ]; then
    printf 'device suite: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "device suite: all passed"
