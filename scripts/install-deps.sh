#!/usr/bin/env bash
# Installs what building and testing snowrdma needs, and only what is
# missing, one line per thing installed: rdma-core and its headers, perftest,
# QEMU, a Debian kernel with rdma_rxe, virtme-ng (for the Soft-RoCE VM),
# strace, valgrind and perf (the bench's counts), the pinned cbindgen,
# clippy and rustfmt. `apt-get update` runs only when a
# package must be installed.
set -euo pipefail

packages=(rdma-core ibverbs-providers libibverbs-dev librdmacm-dev ibverbs-utils
          rdmacm-utils perftest libclang-dev pkg-config qemu-system-x86 linux-image-amd64
          busybox-static kmod iproute2 python3-pip g++ strace valgrind linux-perf)
cbindgen_version=0.29.2
installed=0

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    printf 'install-deps: installing %s (apt)\n' "${missing[@]}"
    sudo=; [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
    installed=$((installed + ${#missing[@]}))
fi

if ! command -v vng >/dev/null; then
    echo "install-deps: installing virtme-ng (pip)"
    python3 -m pip install -q virtme-ng || python3 -m pip install -q --break-system-packages virtme-ng
    hash -r
    installed=$((installed + 1))
fi

if [ "$(cbindgen --version 2>/dev/null)" != "cbindgen $cbindgen_version" ]; then
    echo "install-deps: installing cbindgen $cbindgen_version (cargo)"
    cargo install -q --locked cbindgen --version "$cbindgen_version"
    installed=$((installed + 1))
fi

for c in clippy fmt; do
    if ! cargo "$c" --version >/dev/null 2>&1; then
        component=$c; [ "$c" = fmt ] && component=rustfmt
        echo "install-deps: installing $component (rustup)"
        rustup component add "$component"
        installed=$((installed + 1))
    fi
done

[ $installed -gt 0 ] || echo "install-deps: nothing missing (${#packages[@]} packages, virtme-ng, cbindgen $cbindgen_version, clippy, rustfmt)"
