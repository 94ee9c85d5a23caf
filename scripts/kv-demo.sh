#!/usr/bin/env bash
# The main job (`make run`): starts kv_server on the RDMA device's address,
# runs a short kv_client benchmark against it and prints the result table,
# then stops the server with SIGINT (which prints its final statistics).
# Run it where a device is: scripts/rdma-run.sh puts it in the Soft-RoCE VM.
#
#   scripts/kv-demo.sh <bin dir> [operations] [value bytes]
set -euo pipefail
bin=$1
ops=${2:-2000}
size=${3:-64}
netdev=$(rdma link show | awk '{for (i = 1; i < NF; i++) if ($i == "netdev") { print $(i + 1); exit }}')
ip=$(ip -o -4 addr show dev "$netdev" | awk '{print $4}' | cut -d/ -f1 | head -n 1)
[ -n "$ip" ] || { echo "kv-demo: the RDMA device ($netdev) has no IPv4 address" >&2; exit 1; }
log=$(mktemp)
"$bin/kv_server" -a "$ip" -p 12345 -m 256 --stats-interval 0 >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 300); do
    grep -q "listening on" "$log" && break
    kill -0 $server 2>/dev/null || { cat "$log" >&2; exit 1; }
    sleep 0.2
done
grep -q "listening on" "$log" || { cat "$log" >&2; echo "kv-demo: kv_server did not listen within 60 s" >&2; exit 1; }
cat "$log"
echo "kv_client -a $ip bench $ops $size"
"$bin/kv_client" -a "$ip" -p 12345 "bench $ops $size" "put hello world" "get hello"
kill -INT $server
wait $server
tail -n 2 "$log"
