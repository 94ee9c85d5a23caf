# Counts the system calls in an `strace -f -y` trace between the bench's
# window marks (snowrdma-bench's cost::Window), leaving out the Soft-RoCE
# provider's doorbell (a write to the uverbs device): prints the calls per
# operation, then the doorbells per operation.
/snowrdma-cost-window\/open/ { inside = 1; calls = 0; bells = 0; next }
/snowrdma-cost-window\/close\// {
    if (inside) {
        match($0, /close\/[0-9]+/)
        ops = substr($0, RSTART + 6, RLENGTH - 6)
        inside = 0
    }
    next
}
# Not calls: signals, exits, and the other half of a call a thread switch split.
/^[0-9]+ +(---|\+\+\+)/ || /<\.\.\. [a-z_0-9]+ resumed>/ { next }
inside && /^[0-9]+ +[a-z_0-9]+\(/ {
    if ($0 ~ /write\([0-9]+<\/dev\/infiniband\/uverbs/) bells++
    else {
        calls++
        name = $2
        sub(/\(.*/, "", name)
        by[name]++
    }
}
END {
    if (ops > 0) {
        printf "%.3f %.3f", calls / ops, bells / ops
        for (n in by) printf " %s=%.3f", n, by[n] / ops
        printf "\n"
    }
}
