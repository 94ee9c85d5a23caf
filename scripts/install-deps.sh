#!/usr/bin/env bash
# Installs what building and testing snowrdma needs, skipping what is already
# there: rdma-core and its headers, perftest, QEMU, a Debian kernel with
# rdma_rxe, virtme-ng (for the Soft-RoCE VM), and the pinned cbindgen.
set -euo pipefail

packages=(rdma-core ibverbs-providers libibverbs-dev librdmacm-dev ibverbs-utils
          rdmacm-utils perftest libclang-dev pkg-config qemu-system-x86 linux-image-amd64
          busybox-static kmod iproute2 python3-pip)
missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "install-deps: installing ${missing[*]}"
    sudo=; [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! command -v vng >/dev/null; then
    echo "install-deps: installing virtme-ng"
    python3 -m pip install -q virtme-ng || python3 -m pip install -q --break-system-packages virtme-ng
    hash -r
fi

cbindgen_version=0.29.2
if [ "$(cbindgen --version 2>/dev/null)" != "cbindgen $cbindgen_version" ]; then
    echo "install-deps: installing cbindgen $cbindgen_version"
    cargo install -q --locked cbindgen --version "$cbindgen_version"
fi
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt
