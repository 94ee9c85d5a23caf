"""Host tests of doorbell-split.py on synthetic traces whose figures are known.

    python3 -m unittest discover -s scripts -p 'test_*.py'
"""

import importlib.util
import io
import os
import tempfile
import unittest
from contextlib import redirect_stdout

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("split", os.path.join(HERE, "doorbell-split.py"))
split = importlib.util.module_from_spec(spec)
spec.loader.exec_module(split)


def line(comm, tid, cpu, t_us, fn):
    return f"{comm:>16}-{tid:<7} [{cpu:03}] ..... {t_us / 1e6:12.6f}: {fn} <-caller\n"


def ping_pong(levels, start=100.0):
    """Two threads answering each other: per level (messages, b, r), each
    message a doorbell, the peer's receive completion b later in the
    poster's context, and the peer's doorbell r after that."""
    out = ["# tracer: function\n", "#\n"]
    t = start
    tids = (11, 22)
    i = 0
    for messages, b, r in levels:
        for _ in range(messages):
            tid = tids[i % 2]
            out.append(line("prog", tid, i % 2, t, "ib_uverbs_post_send"))
            out.append(line("prog", tid, i % 2, t + b, "rxe_cq_post"))
            t += b + r
            i += 1
    return "".join(out)


def stream(levels, start=100.0):
    """One thread posting back to back (gap per message per level), each
    doorbell writing the receiver's completion (as a WRITE WITH IMM's does),
    and a receiver that posts a credit after every 20th message."""
    out = []
    t = start
    n = 0
    for messages, gap in levels:
        for _ in range(messages):
            out.append(line("sender", 5, 0, t, "ib_uverbs_post_send"))
            out.append(line("sender", 5, 0, t + gap / 2, "rxe_cq_post"))
            n += 1
            if n % 20 == 0:
                out.append(line("sink", 6, 1, t + gap * 0.9, "ib_uverbs_post_send"))
            t += gap
    return "".join(out)


class DoorbellSplit(unittest.TestCase):
    def write(self, text):
        f = tempfile.NamedTemporaryFile("w", suffix=".trace", delete=False)
        f.write(text)
        f.close()
        self.addCleanup(os.unlink, f.name)
        return f.name

    def run_split(self, *args):
        out = io.StringIO()
        argv = split.sys.argv
        split.sys.argv = ["doorbell-split.py", *args]
        try:
            with redirect_stdout(out):
                split.main()
        finally:
            split.sys.argv = argv
        return out.getvalue()

    def test_a_ping_pong_splits_into_kernel_and_user_parts_per_level(self):
        path = self.write(ping_pong([(200, 20.0, 5.0), (200, 40.0, 12.0)]))
        posts, cqes = split.parse(path)
        limit = split.fifth(posts) * split.FAST_BELOW
        out = split.split(posts, cqes, limit)
        med = split.statistics.median
        # A thread's doorbell to its next: both halves of a round trip.
        self.assertEqual(med(out["fast"]["gap"]), 50.0)
        self.assertEqual(med(out["fast"]["b"]), 20.0)
        self.assertEqual(med(out["fast"]["r"]), 5.0)
        self.assertEqual(med(out["slow"]["gap"]), 104.0)
        self.assertEqual(med(out["slow"]["b"]), 40.0)
        self.assertEqual(med(out["slow"]["r"]), 12.0)

    def test_ratios_at_the_same_level_and_a_mismatch_marked(self):
        ref = self.write(ping_pong([(200, 20.0, 5.0), (200, 40.0, 10.0)]))
        ours = self.write(ping_pong([(200, 20.0, 10.0), (200, 40.0, 20.0)]))
        text = self.run_split("--pair", "ours/ref", f"ref_1={ref}", f"ours_1={ours}")
        self.assertIn("ours against ref, gap: fast 1.20, slow 1.20", text)
        # A program that never met the fast level: its slow level looks
        # fast, and b tells.
        slow_only = self.write(ping_pong([(400, 40.0, 20.0)]))
        text = self.run_split("--pair", "late/ref", f"ref_1={ref}", f"late_1={slow_only}")
        self.assertIn("fast 2.40 (different levels: b 2.00x)", text)

    def test_a_stream_counts_its_sender_not_the_receivers_credits(self):
        ref = self.write(stream([(1000, 38.0), (1000, 80.0)]))
        ours = self.write(stream([(1000, 47.0), (1000, 100.0)]))
        text = self.run_split("--pair", "ours/ref", f"ref_1={ref}", f"ours_1={ours}")
        self.assertIn("ours against ref, gap: fast 1.24, slow 1.25", text)
        row = next(ln for ln in text.splitlines() if ln.startswith("ours (all)") and "fast" in ln)
        # Half the sender's messages at each level: the receiver's credits
        # are not messages.
        self.assertEqual(row.split()[3], "0.50")
        # The receiver's completion comes in the sender's doorbell (b), but
        # what follows it is the sender's own next doorbell, not an answer.
        self.assertEqual(row.split()[-2:], ["23.5", "-"])


if __name__ == "__main__":
    unittest.main()
