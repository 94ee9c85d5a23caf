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
grep -qx rxe_cq_post "$tr/available_filter_functions" 2>/dev/null ||
    grep -q '^rxe_cq_post ' "$tr/available_filter_functions" 2>/dev/null ||
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

# against_sink <case> <trace name>: the bench's case against its sink, in
# a process of its own, traced.
against_sink() {
    local log
    port=$((port + 1))
    log=$(mktemp)
    $bench sink --port $port >"$log" 2>&1 &
    srv=$!
    for _ in $(seq 1 100); do
        grep -q "listening on" "$log" && break
        sleep 0.2
    done
    rm -f "$log"
    trace_on
    timeout -k 5 120 $bench run "$1" snowrdma --port $port >/dev/null 2>&1
    trace_off "$2"
    stop $srv
}

# write_bw <size> <messages> <trace name>: `ib_write_bw`, traced.
write_bw() {
    port=$((port + 1))
    timeout -k 5 120 ib_write_bw -d "$dev" -R -F -p $port -s "$1" -n "$2" >/dev/null 2>&1 &
    srv=$!
    sleep 0.5
    trace_on
    timeout -k 5 120 ib_write_bw -d "$dev" -R -F -p $port -s "$1" -n "$2" "$ip" >/dev/null 2>&1
    trace_off "$3"
    wait $srv
}

# stop <pid>: asks a server to end, then makes it.
stop() {
    kill -TERM "$1" 2>/dev/null
    for _ in $(seq 1 20); do kill -0 "$1" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$1" 2>/dev/null
    wait "$1" 2>/dev/null
}

for r in $(seq 1 "$rounds"); do
    port=$((port + 1))
    timeout -k 5 120 ib_send_lat -d "$dev" -p $port -s 64 -n 2000 >/dev/null 2>&1 &
    srv=$!
    sleep 1
    trace_on
    timeout -k 5 120 ib_send_lat -d "$dev" -p $port -s 64 -n 2000 "$ip" >/dev/null 2>&1
    trace_off "send_lat_$r"
    wait $srv

    port=$((port + 1))
    $bench peer imm-pong --port $port --size 64 >/dev/null 2>&1 &
    srv=$!
    sleep 2
    trace_on
    timeout -k 5 120 $bench run imm_lat snowrdma -n 2000 --port $port >/dev/null 2>&1
    trace_off "imm_lat_$r"
    stop $srv

    port=$((port + 1))
    target/c-examples/echo_server "$ip" $port >/dev/null 2>&1 &
    srv=$!
    sleep 2
    trace_on
    timeout -k 5 120 $bench run echo_lat_2p snowrdma -n 2000 --port $port >/dev/null 2>&1
    trace_off "echo_2p_$r"
    stop $srv

    write_bw 64 20000 "write_bw_64_$r"
    against_sink msg_rate_2p "msg_rate_2p_$r"
    write_bw 65536 1000 "write_bw_64k_$r"
    against_sink stream_bw_2p "stream_bw_2p_$r"
done
args=()
for f in "$out"/*.trace; do
    n=$(basename "$f" .trace)
    args+=("$n=$f")
done
python3 scripts/doorbell-split.py --pair echo_2p/send_lat --pair imm_lat/send_lat \
    --pair msg_rate_2p/write_bw_64 --pair stream_bw_2p/write_bw_64k "${args[@]}"
