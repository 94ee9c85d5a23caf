#!/usr/bin/env bash
# Runs every benchmark case and its reference, interleaved (A B A B ...), on
# the RDMA device (scripts/rdma-run.sh puts this in the Soft-RoCE VM),
# appending "case side value" lines to the results file. The cases and how
# each side is measured come from `snowrdma-bench cases` (the one list, in
# src/bin/snowrdma-bench/cases.rs); this script only runs what needs a
# process of its own: the perftest programs, the servers, the kv_open menu.
#
# The cases measured here also write what each operation cost (counted,
# see src/bin/snowrdma-bench/cost.rs) to <results>.costs; after the timed
# runs, the cases with counted targets run again under perf, to count their
# system calls per operation (as configured, and in spinning mode), and under
# strace, to name them.
#
#   scripts/bench.sh <results file>      SNOWRDMA_BENCH_REPS (default 5),
#                                         SNOWRDMA_BENCH_BIN (the bench program,
#                                         default target/release/snowrdma-bench;
#                                         another build for an A/B: kv_server,
#                                         kv_client and the C programs stay
#                                         the tree's builds),
#                                         SNOWRDMA_BENCH_CASES (a regex of case
#                                         names: only those; default all)
set -u
results=$1
costs=${results%.*}.costs
export SNOWRDMA_BENCH_COSTS=$costs
reps=${SNOWRDMA_BENCH_REPS:-5}
bench="${SNOWRDMA_BENCH_BIN:-target/release/snowrdma-bench}"
apps=target/c-examples/kv-app
read -r dev ip < <($bench addr) || { echo "bench: no RDMA device" >&2; exit 1; }
mapfile -t cases < <($bench cases)
[ ${#cases[@]} -gt 0 ] || { echo "bench: $bench printed no cases" >&2; exit 1; }
mkdir -p "$(dirname "$results")"
: >"$results"
: >"$costs"
port=18600

# start_server, stop_server, start_perftest_server.
# shellcheck source=scripts/servers.sh
. "$(dirname "$0")/servers.sh"

# perftest <column of the figure> <scale> <tool> <args...>: runs the tool's
# server and client on the device, prints the figure from the client's result
# line, times scale.
perftest() {
    local col=$1 scale=$2 tool=$3
    shift 3
    start_perftest_server "$tool" "$@"
    local out
    out=$(timeout -k 10 120 "$tool" -d "$dev" -R -F -p "$port" "$@" "$ip" 2>&1)
    wait "$server" 2>/dev/null
    # The result line starts with the message size and the iteration count.
    echo "$out" | awk -v c="$col" -v s="$scale" '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && NF >= c { v = $c } END { if (v != "") print v * s }'
}

# kv_procs <case> <clients> <operations each>: a kv_server process and that
# many kv_client processes (`mix`), all connected and seeded before the clock
# starts; prints million operations per second of them all, and adds the
# server's CPU time per operation to the cost report.
kv_procs() {
    local case=$1 n=$2 ops=$3 dir server i ready cpu0 cpu1 total first last
    dir=$(mktemp -d)
    target/release/kv_server -a "$ip" -p "$port" -m 256 >/dev/null 2>&1 &
    server=$!
    sleep 2
    for i in $(seq 1 "$n"); do
        timeout -k 10 600 target/release/kv_client -a "$ip" -p "$port" "mix $ops 64 $dir/go" \
            >"$dir/out.$i" 2>&1 &
    done
    for _ in $(seq 1 600); do
        ready=$(find "$dir" -name 'go.ready-*' | wc -l)
        [ "$ready" -ge "$n" ] && break
        sleep 0.5
    done
    cpu0=$(awk '{ print $14 + $15 }' "/proc/$server/stat")
    touch "$dir/go"
    wait $(jobs -p | grep -vx "$server")
    cpu1=$(awk '{ print $14 + $15 }' "/proc/$server/stat")
    kill "$server" 2>/dev/null
    wait "$server" 2>/dev/null
    # Each client's last line: <operations> <start ns> <end ns>.
    read -r total first last < <(for i in $(seq 1 "$n"); do tail -n 1 "$dir/out.$i"; done |
        awk 'NF == 3 { t += $1; if (f == "" || $2 < f) f = $2; if ($3 > l) l = $3; k++ }
             END { if (k > 0) printf "%d %s %s\n", t, f, l }')
    rm -rf "$dir"
    [ -n "${total:-}" ] && [ "$total" -eq $((n * ops)) ] || { echo "bench: $case: a client failed" >&2; return; }
    echo "$case both server_cpu_us $(awk -v t="$((cpu1 - cpu0))" -v h="$(getconf CLK_TCK)" -v o="$total" 'BEGIN { printf "%.3f", t * 1e6 / h / o }')" >>"$costs"
    awk -v t="$total" -v f="$first" -v l="$last" 'BEGIN { printf "%.4f\n", t * 1000 / (l - f) }'
}

# ours <case> <side>: the side measured in snowrdma-bench.
ours() {
    timeout -k 10 300 $bench run "$1" "$2" --port "$port"
}

# against_server <case> <side> <server command>: runs the side against the
# server, which runs in its own process.
against_server() {
    local case=$1 side=$2
    shift 2
    start_server "$@"
    ours "$case" "$side"
    stop_server
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
    menu=$(echo 3 | timeout -k 10 1800 $apps/client "$ip:18599" 2>&1)
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

# selected <case>: whether SNOWRDMA_BENCH_CASES picks the case.
selected() { [[ "$1" =~ ${SNOWRDMA_BENCH_CASES:-.} ]]; }

# measure <each|once>: every side of the cases with that schedule, in order.
measure() {
    local line schedule case side kind args value
    for line in "${cases[@]}"; do
        read -r schedule case side kind args <<<"$line"
        [ "$schedule" = "$1" ] || continue
        selected "$case" || continue
        port=$((port + 1))
        # The words of args are split on purpose: a command and its arguments.
        # shellcheck disable=SC2086
        case $kind in
            perftest) value=$(perftest $args) ;;
            here) value=$(ours "$case" "$side") ;;
            server) value=$(against_server "$case" "$side" $args) ;;
            kv-procs) value=$(kv_procs "$case" $args) ;;
            kv-app-menu)
                [ -n "$menu" ] || run_menu
                value=$(echo "$menu" | awk -v s="$args" '$2 == s { printf "%.3f", $3 * 1000 }')
                ;;
            *) echo "bench: $case: unknown measurement '$kind'" >&2; value= ;;
        esac
        record "$case" "$side" "$value"
    done
}

# The system calls perf names one by one.
named_syscalls=$(printf 'syscalls:sys_enter_%s,' futex read write ioctl epoll_wait epoll_pwait \
    poll ppoll pread64 sched_yield nanosleep clock_nanosleep openat close mprotect mmap munmap madvise brk | sed 's/,$//')

# The descriptors the bench keeps perf's FIFOs at (src/bin/snowrdma-bench/
# cost.rs): the window's own writes and reads on them (perf applies an
# enable or disable when it reads it, so how many of them fall inside
# varies from run to run) are counted apart, and taken off.
perf_ctl_fd=1000
perf_ack_fd=1001

# under_perf <dir> <bench args...>: runs the bench under perf stat, counting
# system calls from its cost window's open to its close. The lines of the
# write and read events come twice: all of them, then the window's own.
under_perf() {
    local dir=$1
    shift
    rm -f "$dir/ctl" "$dir/ack" "$dir/costs" "$dir/perf"
    mkfifo "$dir/ctl" "$dir/ack"
    SNOWRDMA_BENCH_COSTS="$dir/costs" SNOWRDMA_BENCH_PERF_CTL="$dir/ctl" SNOWRDMA_BENCH_PERF_ACK="$dir/ack" \
        timeout -k 10 600 perf stat -x, -o "$dir/perf" -e "raw_syscalls:sys_enter,$named_syscalls" \
        -e syscalls:sys_enter_write --filter "fd == $perf_ctl_fd" \
        -e syscalls:sys_enter_read --filter "fd == $perf_ack_fd" \
        --control "fifo:$dir/ctl,$dir/ack" --delay=-1 \
        $bench "$@" >/dev/null 2>&1
}

# perf_syscalls <case> <side> <dir> <figure>: one run of the case under
# perf, its system calls per operation (doorbells and the window's marks
# left out) added to the costs as <figure>, and named.
perf_syscalls() {
    local case=$1 who=$2 dir=$3 figure=$4 calls bells ops
    under_perf "$dir" run "$case" snowrdma --port "$port"
    calls=$(awk -F, '
        $3 == "raw_syscalls:sys_enter" { raw = $1 }
        $3 == "syscalls:sys_enter_write" && w++ { marks += $1 }
        $3 == "syscalls:sys_enter_read" && r++ { marks += $1 }
        raw != "" { done = 1 }
        END { if (done && raw ~ /^[0-9]+$/) print (raw > marks ? raw - marks : 0) }' "$dir/perf")
    # Soft-RoCE's doorbell is a write to the uverbs device per post_send.
    bells=$(awk '$3 == "send_doorbells" { s += $4 } END { print s + 0 }' "$dir/costs")
    ops=$(awk '$3 == "window_ops" { print $4 }' "$dir/costs")
    if [[ "$calls" =~ ^[0-9]+$ ]] && [ -n "$ops" ]; then
        echo "$case $who $figure $(awk -v c="$calls" -v o="$ops" -v b="$bells" \
            'BEGIN { v = c / o - b; printf "%.3f", v < 0 ? 0 : v }')" | tee -a "$costs"
        # The calls named, per operation (write: with the doorbells; the
        # window's own marks taken off).
        awk -F, -v o="$ops" '$3 ~ /^syscalls:sys_enter_/ {
                n = $3; sub(/^syscalls:sys_enter_/, "", n)
                if (n in count) { count[n] -= $1 } else { count[n] = $1; order[++k] = n } }
            END { for (i = 1; i <= k; i++) if (count[order[i]] > 0) printf " %s=%.3f", order[i], count[order[i]] / o
                printf "\n" }' "$dir/perf" | sed "s/^/    $case $figure under perf:/"
    else
        echo "bench: $case under perf produced no count ($(head -c 300 "$dir/perf" 2>/dev/null))" >&2
    fi
}

syscalls() {
    local case=$1 dir counted calls names line c side kind args run who=both
    local spin_before=${SNOWRDMA_SPIN_ALWAYS-unset} budget_before=${SNOWRDMA_SPIN_US-unset}
    dir=$(mktemp -d)
    for line in "${cases[@]}"; do
        read -r _ c side kind args <<<"$line"
        [ "$c" = "$case" ] && [ "$side" = snowrdma ] && break
    done
    [ "$kind" = server ] && who=caller
    # As configured (the spin policy stands down on a crowded machine), in
    # spinning mode, which the target is for, then under strace; each on a
    # fresh port, against a fresh server where the case has one (a server
    # serves one client). Spinning mode spins until the work comes, as
    # perftest does: whatever the load (SNOWRDMA_SPIN_ALWAYS) and for up to
    # 1 s (SNOWRDMA_SPIN_US), longer than any wait of a case: 100 ms was
    # outlasted between a batch's PUTs on a slow day (a kv worker that got
    # no job of a batch of 32 x 64 KiB, 67 ms each, slept).
    for run in syscalls syscalls_spin strace; do
        port=$((port + 1))
        # The spinning run's server spins too.
        if [ "$run" = syscalls_spin ]; then
            export SNOWRDMA_SPIN_ALWAYS=1 SNOWRDMA_SPIN_US=1000000
        else
            if [ "$spin_before" = unset ]; then
                unset SNOWRDMA_SPIN_ALWAYS
            else
                export SNOWRDMA_SPIN_ALWAYS=$spin_before
            fi
            if [ "$budget_before" = unset ]; then
                unset SNOWRDMA_SPIN_US
            else
                export SNOWRDMA_SPIN_US=$budget_before
            fi
        fi
        if [ "$kind" = server ]; then
            # shellcheck disable=SC2086
            start_server $args
        fi
        case $run in
            syscalls) perf_syscalls "$case" "$who" "$dir" syscalls ;;
            syscalls_spin) perf_syscalls "$case" "$who" "$dir" syscalls_spin ;;
            strace)
                SNOWRDMA_BENCH_COSTS=/dev/null timeout -k 10 600 strace -f -qq -y -o "$dir/trace" \
                    $bench run "$case" snowrdma --port "$port" >/dev/null 2>&1
                ;;
        esac
        if [ "$kind" = server ]; then
            stop_server
        fi
    done
    counted=$(awk -f scripts/strace-window.awk "$dir/trace")
    rm -rf "$dir"
    if [ -n "$counted" ]; then
        read -r calls _ names <<<"$counted"
        echo "    $case under strace (not spinning): $calls per op: $names"
    fi
}

# Instructions are counted with every end waiting on its completion channel
# (SNOWRDMA_SPIN_US=0, perftest's -e): what a spinning end executes while it
# waits depends on how long it waits, and is not the operation's cost. Both
# counts leave out the provider's CQ poll function and perftest's
# CPU-frequency loop (scripts/callgrind-count.py says why).
cg=(valgrind --tool=callgrind --dump-line=no --compress-strings=no --compress-pos=no)
cgdir=$(mktemp -d)

# instructions <case> <iterations>: our case's user-space instructions per
# operation, every thread, from the window's open to its close; its
# callgrind file stays as $cgdir/ours, which tells perftest's count the
# provider's poll function.
instructions() {
    local case=$1 n=$2 counted
    port=$((port + 1))
    SNOWRDMA_SPIN_US=0 SNOWRDMA_BENCH_COSTS=/dev/null timeout -k 10 1200 "${cg[@]}" \
        --callgrind-out-file="$cgdir/cg" --zero-before=snowrdma_cost_window_open \
        --dump-before=snowrdma_cost_window_close \
        $bench run "$case" snowrdma -n "$n" --port "$port" >/dev/null 2>&1
    if [ ! -s "$cgdir/cg.1" ]; then
        echo "bench: $case under callgrind produced no window" >&2
        return 1
    fi
    mv "$cgdir/cg.1" "$cgdir/ours"
    read -r _ _ _ counted < <(scripts/callgrind-count.py --poll-from "$cgdir/ours" "$cgdir/ours")
    echo "$case both instructions $((counted / n))" | tee -a "$costs"
}

# perftest_instructions <tool> <iterations>: both ends' instructions per
# iteration of a perftest latency program, as the difference of a run of 2n
# and a run of n iterations (which cancels set-up and tear-down).
perftest_instructions() {
    local tool=$1 n=$2 m counted=()
    for m in "$n" $((2 * n)); do
        port=$((port + 1))
        timeout -k 10 1200 "${cg[@]}" --callgrind-out-file="$cgdir/server.$m" \
            "$tool" -d "$dev" -e -p "$port" -s 64 -n "$m" >/dev/null 2>&1 &
        local server=$!
        # Under valgrind the server takes seconds to listen (TCP, for its
        # exchange of QP information).
        for _ in $(seq 1 120); do
            ss -ltn | grep -q ":$port " && break
            sleep 0.5
        done
        timeout -k 10 1200 "${cg[@]}" --callgrind-out-file="$cgdir/client.$m" \
            "$tool" -d "$dev" -e -p "$port" -s 64 -n "$m" "$ip" >/dev/null 2>&1
        wait "$server"
        counted+=("$(scripts/callgrind-count.py --poll-from "$cgdir/ours" \
            "$cgdir/server.$m" "$cgdir/client.$m" | awk '{ print $4 }')")
    done
    echo "$tool both instructions $(( (counted[1] - counted[0]) / n ))" | tee -a "$costs"
}

for rep in $(seq 1 "$reps"); do
    echo "--- repetition $rep of $reps"
    measure each
done
echo "--- system calls per operation (perf; strace names them)"
for case in kv_get_lat kv_put_lat echo_lat msg_rate kv_get_bw kv_put_bw safe_send_lat broker_rate_b32 broker_lat; do
    selected "$case" && syscalls "$case"
done
echo "--- user-space instructions per operation (callgrind, waiting on events)"
# Twice each: how often the in-process GET's caller finds its reply itself
# rather than through the completion thread depends on how valgrind, which
# runs one thread at a time, interleaves them. The echo's count has no
# target (its target is its time) and is reported beside perftest's.
if selected kv_get_lat || selected echo_lat; then
    for _ in 1 2; do
        any=0
        if selected kv_get_lat && instructions kv_get_lat 400; then any=1; fi
        if selected echo_lat && instructions echo_lat 400; then any=1; fi
        [ "$any" = 1 ] && perftest_instructions ib_send_lat 200
    done
fi
rm -rf "$cgdir"
measure once
