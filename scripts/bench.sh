#!/usr/bin/env bash
# Runs every benchmark case and its perftest reference, interleaved (A B A B
# ...), on the RDMA device (scripts/rdma-run.sh puts this in the Soft-RoCE
# VM), appending "case side value" lines to the results file.
#
#   scripts/bench.sh <results file>      SNOWRDMA_BENCH_REPS (default 5)
set -u
results=$1
reps=${SNOWRDMA_BENCH_REPS:-5}
bench=target/release/snowrdma-bench
read -r dev ip < <($bench addr) || { echo "bench: no RDMA device" >&2; exit 1; }
mkdir -p "$(dirname "$results")"
: >"$results"
port=18600

# perftest <column of the figure> <tool> <args...>: runs the tool's server and
# client on the device, prints the figure from the client's result line.
perftest() {
    local col=$1 tool=$2
    shift 2
    port=$((port + 1))
    timeout 120 "$tool" -d "$dev" -R -F -p "$port" "$@" >/dev/null 2>&1 &
    local server=$!
    sleep 0.5
    local out
    out=$(timeout 120 "$tool" -d "$dev" -R -F -p "$port" "$@" "$ip" 2>&1)
    wait "$server" 2>/dev/null
    # The result line starts with the message size and the iteration count.
    echo "$out" | awk -v c="$col" '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && NF >= c { v = $c } END { if (v != "") print v }'
}

ours() {
    port=$((port + 1))
    timeout 300 $bench run "$@" --port "$port"
}

# remote_echo <server command with PORT>: starts the server in its own
# process, then our C echo client against it; prints the client's figure.
remote_echo() {
    port=$((port + 1))
    local args=("${@//PORT/$port}")
    timeout 300 "${args[@]}" >/dev/null 2>&1 &
    local server=$!
    sleep 0.5
    timeout 300 $bench run echo-remote-lat -s 64 -n 1000 --port "$port"
    kill "$server" 2>/dev/null
    wait "$server" 2>/dev/null
}

record() {
    local case=$1 side=$2 value=$3
    if [ -z "$value" ]; then
        echo "bench: $case ($side) produced no figure" >&2
        return
    fi
    echo "$case $side $value" | tee -a "$results"
}

for rep in $(seq 1 "$reps"); do
    echo "--- repetition $rep of $reps"
    record write_lat reference "$(perftest 5 ib_write_lat -s 64 -n 1000)"
    record write_lat snowrdma "$(ours verbs-write-lat -s 64 -n 1000)"
    record read_lat reference "$(perftest 5 ib_read_lat -s 64 -n 1000)"
    record read_lat snowrdma "$(ours verbs-read-lat -s 64 -n 1000)"
    record cas_lat reference "$(perftest 5 ib_atomic_lat -n 1000)"
    record cas_lat snowrdma "$(ours verbs-cas-lat -s 8 -n 1000)"
    record sync_read reference "$(perftest 5 ib_read_lat -s 64 -n 1000)"
    record sync_read snowrdma "$(ours sync-read -s 64 -n 1000)"
    record sync_write reference "$(ours verbs-write-signaled -s 64 -n 1000)"
    record sync_write snowrdma "$(ours sync-write -s 64 -n 1000)"
    record imm_lat reference "$(perftest 5 ib_send_lat -s 64 -n 1000)"
    record imm_lat snowrdma "$(ours verbs-imm-lat -s 64 -n 1000)"
    record echo_lat reference "$(perftest 5 ib_send_lat -s 64 -n 1000)"
    record echo_lat snowrdma "$(ours echo-lat -s 64 -n 1000)"
    # The same client, in its own process, against our echo_server (as the
    # legacy sample echoes) and against a legacy-protocol peer.
    record echo_legacy_lat reference "$(remote_echo target/c-examples/echo_server "$ip" PORT legacy)"
    record echo_legacy_lat snowrdma "$(remote_echo $bench legacy-peer --port PORT)"
    record stream_bw reference "$(perftest 4 ib_write_bw -s 65536 -n 1000)"
    record stream_bw snowrdma "$(ours stream-bw -s 65536 -n 1000)"
    record msg_rate reference "$(perftest 5 ib_write_bw -s 64 -n 20000)"
    record msg_rate snowrdma "$(ours msg-rate -s 64 -n 20000)"
    record kv_get_lat reference "$(perftest 5 ib_send_lat -s 64 -n 1000)"
    record kv_get_lat snowrdma "$(ours kv-get-lat -s 64 -n 1000)"
    record kv_get_lat_crowd reference "$(perftest 5 ib_send_lat -s 64 -n 1000)"
    record kv_get_lat_crowd snowrdma "$(ours kv-get-lat-crowd -s 64 -n 1000)"
    record kv_put_lat reference "$(perftest 5 ib_send_lat -s 64 -n 1000)"
    record kv_put_lat snowrdma "$(ours kv-put-lat -s 64 -n 1000)"
    record kv_onesided_lat reference "$(perftest 5 ib_read_lat -s 64 -n 1000)"
    record kv_onesided_lat snowrdma "$(ours kv-one-sided-lat -s 64 -n 1000)"
    record kv_get_bw reference "$(perftest 4 ib_read_bw -s 65536 -n 500)"
    record kv_get_bw snowrdma "$(ours kv-get-bw -s 65536 -n 500)"
    record kv_onesided_get_bw reference "$(perftest 4 ib_read_bw -s 65536 -n 500)"
    record kv_onesided_get_bw snowrdma "$(ours kv-one-sided-get-bw -s 65536 -n 500)"
    record kv_put_bw reference "$(perftest 4 ib_write_bw -s 65536 -n 500)"
    record kv_put_bw snowrdma "$(ours kv-put-bw -s 65536 -n 500)"
    record kv_mix reference "$(perftest 5 ib_send_bw -s 64 -n 20000)"
    record kv_mix snowrdma "$(ours kv-mix -s 64 -n 4000)"
done

# The kv_open API's throughput (the legacy client's menu option 3: SET+GET
# pairs, 1 B to 16 MiB), once, beside ib_write_bw and ib_read_bw at a few of
# its sizes. Figures in MB/s, as perftest prints them.
echo "--- kv_open throughput (menu option 3)"
apps=target/c-examples/kv-app
SNOWRDMA_KV_PORT=18599 $apps/application >/dev/null 2>&1 &
app_server=$!
sleep 3
menu=$(echo 3 | timeout 1800 $apps/client "$ip:18599" 2>&1)
kill $app_server 2>/dev/null
echo "$menu" | grep -E '^(Eager|Rendezvous):'
for size in 1024 65536 16777216; do
    mbs=$(echo "$menu" | awk -v s="$size" '$2 == s { printf "%.3f", $3 * 1000 }')
    record "kv_app_write_$size" reference "$(perftest 4 ib_write_bw -s $size -n 100)"
    record "kv_app_write_$size" snowrdma "$mbs"
    record "kv_app_read_$size" reference "$(perftest 4 ib_read_bw -s $size -n 100)"
    record "kv_app_read_$size" snowrdma "$mbs"
done
