# Servers in processes of their own for the device scripts (bench.sh,
# trace-doorbells.sh), sourced. The caller sets $port, $ip, $dev and $bench.

# fill <command with IP, PORT, BENCH>: the command with them filled in, in
# the array $filled.
filled=()
fill() {
    filled=("${@//PORT/$port}")
    filled=("${filled[@]//IP/$ip}")
    filled=("${filled[@]//BENCH/$bench}")
}

# start_server <server command with IP, PORT, BENCH>: starts the server in
# its own process and waits until it says it listens (every server here
# prints "listening on"); its pid goes to $server.
server=
start_server() {
    local log
    fill "$@"
    log=$(mktemp)
    timeout -k 10 300 "${filled[@]}" >"$log" 2>&1 &
    server=$!
    for _ in $(seq 1 100); do
        grep -q "listening on" "$log" && break
        sleep 0.2
    done
    rm -f "$log"
}

# The server's `timeout` passes TERM on and follows it with KILL 10 s
# later (-k); one stuck even so (in the kernel) is reported and left
# behind rather than stalling the caller.
stop_server() {
    kill "$server" 2>/dev/null
    for _ in $(seq 1 150); do
        kill -0 "$server" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$server" 2>/dev/null; then
        echo "${0##*/}: the server (pid $server) did not stop; left behind" >&2
        ps -o pid,stat,wchan:30,args --ppid "$server" >&2
    else
        wait "$server" 2>/dev/null
    fi
}

# start_perftest_server <tool> <args>: a perftest program's server on the
# device through RDMA CM, its pid in $server; it says nothing when it
# listens, so it is given half a second. Its client is the same command
# with the server's address last.
start_perftest_server() {
    local tool=$1
    shift
    timeout -k 10 120 "$tool" -d "$dev" -R -F -p "$port" "$@" >/dev/null 2>&1 &
    server=$!
    sleep 0.5
}
