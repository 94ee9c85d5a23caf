#!/usr/bin/env bash
# Runs every benchmark case and its reference, interleaved (A B A B ...), on
# the RDMA device (scripts/rdma-run.sh puts this in the Soft-RoCE VM),
# appending "case side value" lines to the results file. The cases and how
# each side is measured come from `snowrdma-bench cases` (the one list, in
# src/bin/snowrdma-bench/cases.rs); this script only runs what needs a
# process of its own: the perftest programs, the servers, the kv_open menu.
#
#   scripts/bench.sh <results file>      SNOWRDMA_BENCH_REPS (default 5),
#                                         SNOWRDMA_BENCH_CASES (a regex of case
#                                         names: only those; default all)
set -u
results=$1
reps=${SNOWRDMA_BENCH_REPS:-5}
bench=target/release/snowrdma-bench
apps=target/c-examples/kv-app
read -r dev ip < <($bench addr) || { echo "bench: no RDMA device" >&2; exit 1; }
mapfile -t cases < <($bench cases)
[ ${#cases[@]} -gt 0 ] || { echo "bench: $bench printed no cases" >&2; exit 1; }
mkdir -p "$(dirname "$results")"
: >"$results"
port=18600

# perftest <column of the figure> <tool> <args...>: runs the tool's server and
# client on the device, prints the figure from the client's result line.
perftest() {
    local col=$1 tool=$2
    shift 2
    timeout 120 "$tool" -d "$dev" -R -F -p "$port" "$@" >/dev/null 2>&1 &
    local server=$!
    sleep 0.5
    local out
    out=$(timeout 120 "$tool" -d "$dev" -R -F -p "$port" "$@" "$ip" 2>&1)
    wait "$server" 2>/dev/null
    # The result line starts with the message size and the iteration count.
    echo "$out" | awk -v c="$col" '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && NF >= c { v = $c } END { if (v != "") print v }'
}

# ours <case> <side>: the side measured in snowrdma-bench.
ours() {
    timeout 300 $bench run "$1" "$2" --port "$port"
}

# against_server <case> <side> <server command with IP, PORT, BENCH>: starts
# the server in its own process, then the side against it.
against_server() {
    local case=$1 side=$2
    shift 2
    local args=("${@//PORT/$port}")
    args=("${args[@]//IP/$ip}")
    args=("${args[@]//BENCH/$bench}")
    timeout 300 "${args[@]}" >/dev/null 2>&1 &
    local server=$!
    sleep 0.5
    ours "$case" "$side"
    kill "$server" 2>/dev/null
    wait "$server" 2>/dev/null
}

# The kv_open API's throughput: the legacy client's menu option 3 (SET+GET
# pairs, 1 B to 16 MiB) against the application, once; figures in MB/s, as
# perftest prints them.
menu=
run_menu() {
    echo "--- kv_open throughput (menu option 3)"
    SNOWRDMA_KV_PORT=18599 $apps/application >/dev/null 2>&1 &
    local app_server=$!
    sleep 3
    menu=$(echo 3 | timeout 1800 $apps/client "$ip:18599" 2>&1)
    kill $app_server 2>/dev/null
    echo "$menu" | grep -E '^(Eager|Rendezvous):'
}

record() {
    local case=$1 side=$2 value=$3
    if [ -z "$value" ]; then
        echo "bench: $case ($side) produced no figure" >&2
        return
    fi
    echo "$case $side $value" | tee -a "$results"
}

# measure <each|once>: every side of the cases with that schedule, in order.
measure() {
    local line schedule case side kind args value
    for line in "${cases[@]}"; do
        read -r schedule case side kind args <<<"$line"
        [ "$schedule" = "$1" ] || continue
        [[ "$case" =~ ${SNOWRDMA_BENCH_CASES:-.} ]] || continue
        port=$((port + 1))
        # The words of args are split on purpose: a command and its arguments.
        # shellcheck disable=SC2086
        case $kind in
            perftest) value=$(perftest $args) ;;
            here) value=$(ours "$case" "$side") ;;
            server) value=$(against_server "$case" "$side" $args) ;;
            kv-app-menu)
                [ -n "$menu" ] || run_menu
                value=$(echo "$menu" | awk -v s="$args" '$2 == s { printf "%.3f", $3 * 1000 }')
                ;;
            *) echo "bench: $case: unknown measurement '$kind'" >&2; value= ;;
        esac
        record "$case" "$side" "$value"
    done
}

for rep in $(seq 1 "$reps"); do
    echo "--- repetition $rep of $reps"
    measure each
done
measure once
