#!/usr/bin/env bash
# Where a ping-pong's round trip goes on Soft-RoCE, kernel or user space:
# perftest's `ib_send_lat`, our raw verbs WRITE WITH IMM ping-pong and the
# runtime's echo (C `echo_server` against the bench's client, two
# processes), and what a streamed message takes: `ib_write_bw` 64 B and
# 64 KiB against the runtime's message rate and stream (the bench's rows
# against its sink). Interleaved for a number of rounds, each under the
# kernel's function tracer on two functions (a doorbell's entry and
# Soft-RoCE's completion writes), then split by scripts/doorbell-split.py
# into b (the kernel's part) and r (the peer's user space), per speed level
# of the emulated CPU, with our programs' ratios to perftest's at each
# level. Needs root (tracefs) and Soft-RoCE; `make trace-doorbells` runs it
# in the VM after building what it runs.
#
#   scripts/trace-doorbells.sh [rounds (default 4)]     traces in target/doorbells/
set -u
rounds=${1:-4}
bench=target/release/snowrdma-bench
tr=/sys/kernel/tracing
out=target/doorbells
read -r dev ip < <($bench addr) || { echo "trace-doorbells: no RDMA device" >&2; exit 1; }
# A module's functions are listed with the module's name after them.
grep -qE '^rxe_cq_post( |$)' "$tr/available_filter_functions" 2>/dev/null ||
    { echo "trace-doorbells: needs tracefs and Soft-RoCE (rxe_cq_post)" >&2; exit 1; }
mkdir -p "$out"
rm -f "$out"/*.trace
echo 131072 >"$tr/buffer_size_kb"
port=20500

trace_on() {
    echo 0 >"$tr/tracing_on"
    echo nop >"$tr/current_tracer"
    echo >"$tr/trace"
    printf 'ib_uverbs_post_send\nrxe_cq_post\n' >"$tr/set_ftrace_filter"
    echo function >"$tr/current_tracer"
    echo 1 >"$tr/tracing_on"
}

# trace_off <name>: stops the tracer (changing the tracer would clear it)
# and keeps what it saw.
trace_off() {
    echo 0 >"$tr/tracing_on"
    cp "$tr/trace" "$out/$1.trace"
    echo nop >"$tr/current_tracer"
}

# start_server, stop_server, start_perftest_server, fill.
# shellcheck source=scripts/servers.sh
. "$(dirname "$0")/servers.sh"

# traced <trace name> <server command> -- <client command>: the server in a
# process of its own, then the client, traced; IP, PORT and BENCH in both
# commands are filled in.
traced() {
    local name=$1 server_cmd=()
    shift
    while [ "$1" != "--" ]; do
        server_cmd+=("$1")
        shift
    done
    shift
    port=$((port + 1))
    start_server "${server_cmd[@]}"
    fill "$@"
    trace_on
    timeout -k 5 120 "${filled[@]}" >/dev/null 2>&1
    trace_off "$name"
    stop_server
}

# perftest_traced <trace name> <tool> <args>: a perftest program's server,
# then its client, traced.
perftest_traced() {
    local name=$1 tool=$2
    shift 2
    port=$((port + 1))
    start_perftest_server "$tool" "$@"
    trace_on
    timeout -k 10 120 "$tool" -d "$dev" -R -F -p "$port" "$@" "$ip" >/dev/null 2>&1
    trace_off "$name"
    wait "$server" 2>/dev/null
}

for r in $(seq 1 "$rounds"); do
    perftest_traced "send_lat_$r" ib_send_lat -s 64 -n 2000
    traced "imm_lat_$r" BENCH peer imm-pong --port PORT --size 64 -- \
        BENCH run imm_lat snowrdma -n 2000 --port PORT
    traced "echo_2p_$r" target/c-examples/echo_server IP PORT -- \
        BENCH run echo_lat_2p snowrdma -n 2000 --port PORT
    perftest_traced "write_bw_64_$r" ib_write_bw -s 64 -n 20000
    traced "msg_rate_2p_$r" BENCH sink --port PORT -- BENCH run msg_rate_2p snowrdma --port PORT
    perftest_traced "write_bw_64k_$r" ib_write_bw -s 65536 -n 1000
    traced "stream_bw_2p_$r" BENCH sink --port PORT -- BENCH run stream_bw_2p snowrdma --port PORT
done
args=()
for f in "$out"/*.trace; do
    n=$(basename "$f" .trace)
    args+=("$n=$f")
done
python3 scripts/doorbell-split.py --pair echo_2p/send_lat --pair imm_lat/send_lat \
    --pair msg_rate_2p/write_bw_64 --pair stream_bw_2p/write_bw_64k "${args[@]}"
