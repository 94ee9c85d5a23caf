#!/usr/bin/env python3
"""Splits a ping-pong's round trip into the kernel's part and user space's.

Reads the kernel's function tracer output (`/sys/kernel/tracing/trace`)
with two functions traced: `ib_uverbs_post_send` (a doorbell's entry into
the kernel) and `rxe_cq_post` (Soft-RoCE writing a completion). On
Soft-RoCE a doorbell carries the request through the peer's responder
inside the poster's system call, so the first completion written in that
call is the peer's receive. Per message:

  b    doorbell entry -> the peer's receive completion (kernel: requester,
       loopback, responder)
  r    that completion -> the peer's next doorbell entry (the peer's user
       space: finding the completion, its own path, entering the kernel)
  rtt  one thread's doorbell to its next doorbell

The emulated CPU runs at a fast or a slow level for tens of milliseconds at
a time, and which level a run meets is chance (some runs never meet the
fast one), so each message is put in the level of its rtt: fast below
1.35x the lowest 5th percentile among the runs of its program (NAME without
a trailing _N). The figures are medians within a level, per run and pooled
per program: comparable between programs whichever levels their runs met.
The tracer adds the same three events per message to every program.

    doorbell-split.py NAME=TRACE [NAME=TRACE ...]
"""

import re
import statistics
import sys

LINE = re.compile(r"\s*.+?-(\d+)\s+\[\d+\].*?\s([\d.]+):\s+(\w+)")
FAST_BELOW = 1.35


def events(path):
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                yield float(m.group(2)) * 1e6, int(m.group(1)), m.group(3)


def parse(path):
    """The doorbells, as (time, thread, rtt or None, b or None), and the
    first completion of each, as (time, index of the doorbell)."""
    posts = []
    cqes = []
    last = {}
    waiting = {}  # thread -> index of its doorbell still owed a completion
    for t, tid, fn in events(path):
        if fn == "ib_uverbs_post_send":
            rtt = t - last[tid] if tid in last else None
            last[tid] = t
            waiting[tid] = len(posts)
            posts.append([t, tid, rtt, None])
        elif fn == "rxe_cq_post" and tid in waiting:
            i = waiting.pop(tid)
            posts[i][3] = t - posts[i][0]
            cqes.append((t, i))
    return posts, cqes


def fifth(posts):
    rtts = sorted(p[2] for p in posts if p[2] is not None)
    return rtts[len(rtts) // 20] if rtts else None


def split(posts, cqes, limit):
    """Per level ('fast', 'slow'): lists of rtt, b and r in microseconds."""
    out = {lvl: {"rtt": [], "b": [], "r": []} for lvl in ("fast", "slow")}
    level = {}
    for i, (_, _, rtt, b) in enumerate(posts):
        if rtt is None:
            continue
        level[i] = "fast" if rtt < limit else "slow"
        out[level[i]]["rtt"].append(rtt)
        if b is not None:
            out[level[i]]["b"].append(b)
    # r: from a completion to the next doorbell of another thread.
    j = 0
    for t, i in cqes:
        poster = posts[i][1]
        j = max(j, i + 1)
        while j < len(posts) and (posts[j][0] < t or posts[j][1] == poster):
            j += 1
        if j < len(posts) and i in level:
            out[level[i]]["r"].append(posts[j][0] - t)
    return out


def med(values):
    return f"{statistics.median(values):6.1f}" if values else "     -"


def row(name, lvl, v, total):
    share = len(v["rtt"]) / total if total else 0
    print(f"{name:20} {lvl:5} {share:5.2f} {med(v['rtt'])} {med(v['b'])} {med(v['r'])}")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    runs = {}  # program -> [(run name, doorbells, completions)]
    for arg in sys.argv[1:]:
        name, _, path = arg.rpartition("=")
        name = name or path
        program = re.sub(r"_\d+$", "", name)
        runs.setdefault(program, []).append((name, *parse(path)))
    print(f"{'run':20} {'level':5} {'share':>5} {'rtt':>6} {'b':>6} {'r':>6}   (us, medians)")
    for program, its in runs.items():
        fifths = [f for f in (fifth(posts) for _, posts, _ in its) if f is not None]
        if not fifths:
            print(f"{program:20} no doorbells traced")
            continue
        limit = min(fifths) * FAST_BELOW
        pooled = {lvl: {"rtt": [], "b": [], "r": []} for lvl in ("fast", "slow")}
        for name, posts, cqes in its:
            out = split(posts, cqes, limit)
            total = sum(len(v["rtt"]) for v in out.values())
            for lvl, v in out.items():
                row(name, lvl, v, total)
                for k in v:
                    pooled[lvl][k] += v[k]
        total = sum(len(v["rtt"]) for v in pooled.values())
        for lvl, v in pooled.items():
            row(f"{program} (all)", lvl, v, total)


if __name__ == "__main__":
    main()
