#!/usr/bin/env python3
"""Splits a ping-pong's round trip into the kernel's part and user space's,
and times a one-way stream's messages, per speed level of the emulated CPU.

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
  gap  a thread's doorbell to its next: a round trip in a ping-pong, one
       message's time in a one-way stream (one doorbell per message), where
       b and r mean nothing (perftest's WRITEs make no completion at the
       peer)

Only threads with at least a tenth of the busiest one's doorbells count
(a stream's receiver posts a few credits, not messages).

The emulated CPU runs at a fast or a slow level for tens of milliseconds at
a time, and which level a run meets is chance (some runs, even every run
of one program in a boot, never meet the fast one), so each message is put
in the level of its gap: fast below 1.35x the lowest 5th percentile among
the runs of its program (NAME without a trailing _N). The figures are
medians within a level, per run and pooled per program. The tracer adds
the same events per message to every program.

    doorbell-split.py [--pair OURS/REF ...] NAME=TRACE [NAME=TRACE ...]

--pair prints, per level, the ratio of the two programs' pooled gaps: a
ping-pong's round trip against the reference's, a stream's message time
(the inverse of its rate) against the reference's. A program that never
met the fast level has its slowest level taken for fast; for ping-pongs
that shows in b, the kernel's part, which is nearly the same work in
every program, and a ratio whose two b differ by more than 1.35x is marked
as comparing different levels.
"""

import re
import statistics
import sys

LINE = re.compile(r"\s*.+?-(\d+)\s+\[\d+\].*?\s([\d.]+):\s+(\w+)")
# Between the levels (~2x apart): a gap over the lowest 5th percentile, or
# one program's kernel part b over another's at the same level.
FAST_BELOW = 1.35


def events(path):
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                yield float(m.group(2)) * 1e6, int(m.group(1)), m.group(3)


def parse(path):
    """The doorbells, as (time, thread, gap or None, b or None), and the
    first completion of each, as (time, index of the doorbell)."""
    posts = []
    cqes = []
    last = {}
    waiting = {}  # thread -> index of its doorbell still owed a completion
    for t, tid, fn in events(path):
        if fn == "ib_uverbs_post_send":
            gap = t - last[tid] if tid in last else None
            last[tid] = t
            waiting[tid] = len(posts)
            posts.append([t, tid, gap, None])
        elif fn == "rxe_cq_post" and tid in waiting:
            i = waiting.pop(tid)
            posts[i][3] = t - posts[i][0]
            cqes.append((t, i))
    return posts, cqes


def busy(posts):
    """The threads that count: those with a tenth of the busiest one's doorbells."""
    per = {}
    for p in posts:
        per[p[1]] = per.get(p[1], 0) + 1
    top = max(per.values(), default=0)
    return {tid for tid, n in per.items() if n * 10 >= top}


def fifth(posts):
    """The 5th percentile of the busy threads' gaps."""
    counted = busy(posts)
    gaps = sorted(p[2] for p in posts if p[2] is not None and p[1] in counted)
    return gaps[len(gaps) // 20] if gaps else None


def answers(posts, cqes):
    """Per completion, as (its doorbell's index, r): the next doorbell after
    it when that is another thread's (the peer answering), not the
    poster's own."""
    j = 0
    for t, i in cqes:
        j = max(j, i + 1)
        while j < len(posts) and posts[j][0] < t:
            j += 1
        if j < len(posts) and posts[j][1] != posts[i][1]:
            yield i, posts[j][0] - t


def split(posts, cqes, limit):
    """Per level ('fast', 'slow'): lists of gap, b and r in microseconds."""
    out = {lvl: {"gap": [], "b": [], "r": []} for lvl in ("fast", "slow")}
    level = {}
    counted = busy(posts)
    for i, (_, tid, gap, b) in enumerate(posts):
        if gap is None or tid not in counted:
            continue
        level[i] = "fast" if gap < limit else "slow"
        out[level[i]]["gap"].append(gap)
        if b is not None:
            out[level[i]]["b"].append(b)
    for i, r in answers(posts, cqes):
        if i in level:
            out[level[i]]["r"].append(r)
    return out


def med(values):
    return f"{statistics.median(values):6.1f}" if values else "     -"


def row(name, lvl, v, total):
    share = len(v["gap"]) / total if total else 0
    # b and r only where most messages have them (a ping-pong's, not a
    # stream's: its sender's next doorbell is its own).
    b, r = ([] if len(v[k]) * 4 < len(v["gap"]) else v[k] for k in ("b", "r"))
    print(f"{name:20} {lvl:5} {share:5.2f} {med(v['gap'])} {med(b)} {med(r)}")


def main():
    args = sys.argv[1:]
    pairs = []
    while len(args) >= 2 and args[0] == "--pair":
        pairs.append(args[1].split("/", 1))
        args = args[2:]
    if not args:
        sys.exit(__doc__)
    runs = {}  # program -> [(run name, doorbells, completions)]
    for arg in args:
        name, _, path = arg.rpartition("=")
        name = name or path
        program = re.sub(r"_\d+$", "", name)
        runs.setdefault(program, []).append((name, *parse(path)))
    print(f"{'run':20} {'level':5} {'share':>5} {'gap':>6} {'b':>6} {'r':>6}   (us, medians)")
    pooled_all = {}
    for program, its in runs.items():
        fifths = [f for f in (fifth(posts) for _, posts, _ in its) if f is not None]
        if not fifths:
            print(f"{program:20} no doorbells traced")
            continue
        limit = min(fifths) * FAST_BELOW
        pooled = {lvl: {"gap": [], "b": [], "r": []} for lvl in ("fast", "slow")}
        for name, posts, cqes in its:
            out = split(posts, cqes, limit)
            total = sum(len(v["gap"]) for v in out.values())
            for lvl, v in out.items():
                row(name, lvl, v, total)
                for k in v:
                    pooled[lvl][k] += v[k]
        total = sum(len(v["gap"]) for v in pooled.values())
        for lvl, v in pooled.items():
            row(f"{program} (all)", lvl, v, total)
        pooled_all[program] = pooled
    for ours, ref in pairs:
        if ours not in pooled_all or ref not in pooled_all:
            print(f"{ours} against {ref}: not both traced")
            continue
        ratios = []
        for lvl in ("fast", "slow"):
            a, b = pooled_all[ours][lvl], pooled_all[ref][lvl]
            if not a["gap"] or not b["gap"]:
                ratios.append(f"{lvl} -")
                continue
            ratio = f"{lvl} {statistics.median(a['gap']) / statistics.median(b['gap']):.2f}"
            if all(len(x["r"]) * 4 >= len(x["gap"]) for x in (a, b)):
                kernel = statistics.median(a["b"]) / statistics.median(b["b"])
                if not 1 / FAST_BELOW < kernel < FAST_BELOW:
                    ratio += f" (different levels: b {kernel:.2f}x)"
            ratios.append(ratio)
        print(f"{ours} against {ref}, gap: {', '.join(ratios)}")


if __name__ == "__main__":
    main()
