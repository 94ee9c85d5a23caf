#!/usr/bin/env python3
"""Counts the user-space instructions in callgrind output files, leaving
out what does not belong to the operations being measured:

- CQ polling: every call into the RDMA provider's poll function (rxe's
  poll_cq, reached through the inline ibv_poll_cq). The provider library
  has no symbols, so the function is found by its callers in our own
  profile (`--poll-from`, a callgrind file of snowrdma-bench, whose poll
  wrappers have names containing "poll") and then matched by object and
  address in every file counted (perftest calls the same function).
- perftest's CPU-frequency estimate: a loop that calls gettimeofday until
  a fixed time has passed (tens of thousands of calls), so its count
  follows the machine's speed, not the iterations. Any function that
  calls gettimeofday more than 1000 times is left out with its callees.

    callgrind-count.py --poll-from <our file> <file>...

prints: <total> <polling> <clock loop> <counted>, summed over the files.
"""

import argparse
import collections
import functools
import sys

PROVIDER_DIR = "/libibverbs/"
CLOCK_LOOP_CALLS = 1000


@functools.lru_cache(maxsize=None)
def parse(path):
    """Self cost per (object, function), and per call edge its calls and
    inclusive cost; the total, the file's `totals:` line, which the self
    costs must add up to. Not its `summary:` line: in a part dumped by
    --dump-before from a run with several threads, that line counted about
    twice what the part's functions hold (echo_lat: 5.69M against 2.58M,
    while the window's one busy thread, dumped alone with
    --separate-threads, held 2.58M)."""
    self_cost = collections.Counter()
    edges = collections.defaultdict(lambda: [0, 0])
    ob = cob = None
    fn = cfn = None
    calls = None
    totals = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if line.startswith("ob="):
                ob = line[3:]
            elif line.startswith("fn="):
                fn = (ob, line[3:])
                cob = ob
            elif line.startswith("cob="):
                cob = line[4:]
            elif line.startswith("cfn="):
                cfn = (cob, line[4:])
            elif line.startswith("calls="):
                calls = int(line[6:].split()[0])
            elif line.startswith("totals:"):
                totals = int(line.split()[1])
            elif line[:1].isdigit() or line[:1] in "+-*":
                parts = line.split()
                if len(parts) < 2:
                    continue
                cost = int(parts[1])
                if calls is not None:
                    edge = edges[(fn, cfn)]
                    edge[0] += calls
                    edge[1] += cost
                    calls = None
                    cob = ob
                else:
                    self_cost[fn] += cost
    if totals is None or totals != sum(self_cost.values()):
        sys.exit(
            f"callgrind-count: {path}: its functions add up to "
            f"{sum(self_cost.values())}, its totals line says {totals}"
        )
    return totals, self_cost, edges


def provider_poll(path):
    """The provider functions our poll wrappers call."""
    _, _, edges = parse(path)
    found = {
        callee
        for (caller, callee) in edges
        if "poll" in caller[1]
        and PROVIDER_DIR in (callee[0] or "")
        and PROVIDER_DIR not in (caller[0] or "")
    }
    if not found:
        sys.exit(f"callgrind-count: no provider poll function called in {path}")
    return found


def count(path, poll):
    total, self_cost, edges = parse(path)
    polling = sum(
        cost
        for (caller, callee), (_, cost) in edges.items()
        if callee in poll and caller not in poll
    )
    clock_calls = collections.Counter()
    for (caller, callee), (calls, _) in edges.items():
        if "gettimeofday" in callee[1]:
            clock_calls[caller] += calls
    clock_loop = 0
    for fn, calls in clock_calls.items():
        if calls > CLOCK_LOOP_CALLS:
            clock_loop += self_cost[fn] + sum(
                cost for (caller, _), (_, cost) in edges.items() if caller == fn
            )
    return total, polling, clock_loop


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--poll-from", required=True)
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    poll = provider_poll(args.poll_from)
    sums = [0, 0, 0]
    for path in args.files:
        for i, v in enumerate(count(path, poll)):
            sums[i] += v
    total, polling, clock_loop = sums
    print(total, polling, clock_loop, total - polling - clock_loop)


if __name__ == "__main__":
    main()
