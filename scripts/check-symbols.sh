#!/usr/bin/env bash
# The shared library exports the public API and the globals, nothing else:
# every dynamic symbol it defines is declared in one of the headers, and
# every function and global the headers declare is exported. (The legacy library
# leaked strdup, gettid, get_current_cpu and rdma_* helpers.)
#
#   scripts/check-symbols.sh <libsnowrdma.so> <header>...
set -euo pipefail
lib=$1
shift
header="$*"
exported=$(nm -D --defined-only "$lib" | awk '{print $3}' | sort -u)
names='rdma[A-Z][A-Za-z0-9]*|snowrdma_[a-z_]+|kv_[a-z_]+|run_server'
declared=$(cat "$@" | grep -v '^typedef' | grep -oE "^(extern [A-Za-z_ ]+[ *]|[A-Za-z_][A-Za-z_0-9 ]*[ *]+)($names)(\(|;)" \
    | grep -oE "($names)(\(|;)\$" | tr -d '(;' | sort -u)
extra=$(comm -23 <(echo "$exported") <(echo "$declared"))
missing=$(comm -13 <(echo "$exported") <(echo "$declared"))
status=0
if [ -n "$extra" ]; then
    echo "check-symbols: exported but not in $header:" $extra >&2
    status=1
fi
if [ -n "$missing" ]; then
    echo "check-symbols: declared in $header but not exported:" $missing >&2
    status=1
fi
[ $status -eq 0 ] && echo "check-symbols: $(echo "$exported" | wc -l) exported symbols, all declared in $header"
exit $status
