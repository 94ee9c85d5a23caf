#!/usr/bin/env bash
# Runs a command where RDMA works: directly when this host has an RDMA device,
# otherwise inside a throw-away VM (virtme-ng, Debian's kernel) with one
# Soft-RoCE device, rxe0 on dummy0 at 198.18.0.1/24. Exits with the command's
# exit code. See ../shared/notes/soft-roce-vm.md for why it is done this way.
#
#   scripts/rdma-run.sh <command> [args...]
#
# Environment:
#   SNOWRDMA_FORCE_VM=1      use the VM even when the host has a device
#   SNOWRDMA_VM_MEMORY=8G    VM memory (default 8G: the 1 GiB value tests need room)
#   SNOWRDMA_VM_CPUS=2       VM CPUs (default 2)
#   SNOWRDMA_*, RUST_LOG, RUST_BACKTRACE are passed into the VM.
set -euo pipefail

if [ $# -eq 0 ]; then
    echo "usage: $0 <command> [args...]" >&2
    exit 2
fi

if [ -z "${SNOWRDMA_FORCE_VM:-}" ] && [ -n "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; then
    exec "$@"
fi

top=$(cd "$(dirname "$0")/.." && pwd)
kernel=$(ls /boot/vmlinuz-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
if [ -z "$kernel" ] || ! command -v vng >/dev/null; then
    echo "rdma-run: no RDMA device here and no VM kernel/virtme-ng; run scripts/install-deps.sh" >&2
    exit 3
fi

# Software emulation unless the CPU really offers virtualisation: /dev/kvm can
# exist without nested virtualisation, and QEMU then hangs at boot.
kvm_flag=--disable-kvm
if grep -qwE 'vmx|svm' /proc/cpuinfo && [ -w /dev/kvm ]; then
    kvm_flag=
fi

rwdir="$top/target/rdma-vm"
mkdir -p "$rwdir"
script="$rwdir/run-$$.sh"
trap 'rm -f "$script"' EXIT
{
    echo 'set -e'
    echo 'modprobe rdma_rxe'
    echo 'ip link set lo up'
    echo 'ip link add dummy0 type dummy'
    echo 'ip link set dummy0 mtu 9000 up'
    echo 'ip addr add 198.18.0.1/24 dev dummy0'
    echo 'rdma link add rxe0 type rxe netdev dummy0'
    # Huge pages for the tests that use them; failure to reserve is not fatal.
    echo 'echo 64 > /proc/sys/vm/nr_hugepages || true'
    echo 'ulimit -l unlimited'
    # perf's tracepoints (the bench's system-call count) live in tracefs.
    echo 'mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing 2>/dev/null || true'
    env | grep -E '^(SNOWRDMA_|RUST_LOG|RUST_BACKTRACE)' | grep -v '^SNOWRDMA_VM_' \
        | while IFS='=' read -r k v; do printf 'export %s=%q\n' "$k" "$v"; done || true
    printf 'cd %q\n' "$PWD"
    echo 'set +e'
    printf '%q ' "$@"
    echo
    echo 'rc=$?'
    echo 'sync'
    echo 'exit $rc'
} >"$script"

# Both streams through a pipe: QEMU reopens its standard output and error
# with truncation, so a caller that redirected ours to a file
# (`make test > log`) would lose everything written before the VM started.
set +e
timeout --kill-after=30 "${SNOWRDMA_VM_TIMEOUT:-3600}" \
    vng --run "$kernel" $kvm_flag --append "${SNOWRDMA_VM_APPEND-clocksource=tsc tsc=reliable}" --memory "${SNOWRDMA_VM_MEMORY:-8G}" --cpus "${SNOWRDMA_VM_CPUS:-2}" \
    --rwdir "$top/target" --exec "bash $script" </dev/null 2>&1 | cat
rc=${PIPESTATUS[0]}
set -e
exit $rc
