#!/usr/bin/env bash
# Generates the C headers from src/ffi with the pinned cbindgen:
#   include/rdma.h      <- src/ffi/mod.rs, src/ffi/rdma/ (cbindgen.toml)
#   include/kv_store.h  <- src/ffi/kv/, kv_strings.rs      (cbindgen-kv.toml)
#   include/snowrdma/broker.h <- src/ffi/broker.rs, broker_mem.rs (cbindgen-broker.toml)
# cbindgen sees the whole crate, so each header's config excludes the items
# the other header declares and the constants of the Rust layers (its
# "@FOREIGN@" entry is replaced by their names).
#
#   scripts/headers.sh <output dir>
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-include}
mkdir -p "$out" target/headers
items() {
    grep -hoE 'pub (unsafe )?extern "C" fn [A-Za-z0-9_]+|^pub (static mut|struct|enum|type|const|static) [A-Za-z0-9_]+' "$@" \
        | awk '{print "\"" $NF "\""}' | sort -u | paste -sd, -
}
# src/kv/codes.rs is kv_store.h's: the error codes and the default port.
internal=$(grep -rhoE --exclude=codes.rs '^ *pub (const|static) [A-Za-z0-9_]+' src/kv src/runtime src/verbs src/broker src/safe \
    | awk '{print "\"" $NF "\""}' | grep -v '"RDMA_CMD_MAGIC"' | sort -u | paste -sd, -)
broker_items=$(items src/ffi/broker.rs src/ffi/broker_mem.rs),\"EventKind\",\"BrokerStats\"
kv_items=$(items src/ffi/kv/*.rs src/ffi/kv_strings.rs src/kv/codes.rs)
# RDMA_CMD_MAGIC lives in the runtime's protocol module.
rdma_items=$(items src/ffi/mod.rs src/ffi/rdma/*.rs),\"RDMA_CMD_MAGIC\"
sed "s/\"@FOREIGN@\"/$kv_items,$broker_items,$internal/" cbindgen.toml >target/headers/rdma.toml
sed "s/\"@FOREIGN@\"/$rdma_items,$broker_items,$internal/" cbindgen-kv.toml >target/headers/kv.toml
sed "s/\"@FOREIGN@\"/$rdma_items,$kv_items,$internal/" cbindgen-broker.toml >target/headers/broker.toml
cbindgen -q --config target/headers/rdma.toml --crate snowrdma --output "$out/rdma.h"
cbindgen -q --config target/headers/kv.toml --crate snowrdma --output "$out/kv_store.h"
mkdir -p "$out/snowrdma"
cbindgen -q --config target/headers/broker.toml --crate snowrdma --output "$out/snowrdma/broker.h"
