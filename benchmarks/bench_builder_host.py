"""Host time of ``MetadataBuilder.build`` for decode-only steps, with and without per-sequence keys.

    python benchmarks/bench_builder_host.py [--batches 1,8,64,256] [--blocks 65] [--calls 200] [--device cpu]

Each of B sequences holds 64 full blocks of 64 tokens plus part of a 65th (65 blocks), and every step
appends one token to each (a block every 64 steps, staggered over the sequences, so a step appends a
block to about B/64 of them). "full": chunks without keys (the table re-packed every step). "keyed":
the same chunks with ``key=`` (the builder's persistent host tables, updated only where a sequence
grew). "keyed+churn": keyed, and every step one sequence leaves and a new one joins in its place.
Prints the median and mean over ``--calls`` calls after ``--warmup`` calls, each call timed alone
with ``time.perf_counter`` (making the step's chunks, as an engine does between steps, is not timed).
On a shared machine the median is the figure to read: the mean carries the preemptions.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


from mla_compile.models.metadata import SeqChunk
from mla_compile.serving.builder import MetadataBuilder


class Trace:
    """``batch`` sequences growing by one token per step, each block list one list object appended to in
    place when the sequence needs a block (as an engine holds it); :meth:`step` makes the next step's
    chunks (new ``SeqChunk`` objects each step, as an engine makes them). ``churn``: every step one
    sequence finishes and a new one (a new key and block list, as long) takes its place in the batch."""

    def __init__(self, batch: int, blocks: int, block_size: int, steps: int, keyed: bool, churn: bool) -> None:
        self.rng = random.Random(batch)
        self.blocks = blocks
        self.pool = [self._fresh() for _ in range(batch)]
        # every sequence ends within ``blocks`` blocks; starts staggered so block appends spread over steps
        self.lens = [(blocks - 1) * block_size - steps - 1 + (i * 7) % block_size for i in range(batch)]
        self.own = [t[:-(-(n + 1) // block_size)] for t, n in zip(self.pool, self.lens)]
        self.keys = list(range(batch))
        self.block_size, self.keyed, self.churn, self.s = block_size, keyed, churn, 0

    def _fresh(self) -> list[int]:
        return self.rng.sample(range(1 << 20), self.blocks)

    def step(self) -> list[SeqChunk]:
        if self.churn:
            i = self.s % len(self.own)
            self.pool[i] = self._fresh()
            self.own[i] = self.pool[i][:len(self.own[i])]
            self.keys[i] = len(self.keys) + self.s
        out = []
        for i, (own, n) in enumerate(zip(self.own, self.lens)):
            n += self.s
            while len(own) * self.block_size < n + 1:
                own.append(self.pool[i][len(own)])
            out.append(SeqChunk(own, [(n * 31 + i) % 32000], n, key=self.keys[i] if self.keyed else None))
        self.s += 1
        return out


def time_build(builder: MetadataBuilder, batch: int, blocks: int, calls: int, warmup: int, keyed: bool,
               churn: bool = False) -> list[float]:
    """Host seconds of each of ``calls`` ``build`` calls after ``warmup`` calls."""
    trace = Trace(batch, blocks, builder.block_size, warmup + calls, keyed, churn)
    for _ in range(warmup):
        builder.build(trace.step())
    times = []
    for _ in range(calls):
        chunks = trace.step()
        t0 = time.perf_counter()
        builder.build(chunks)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--blocks", type=int, default=65)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    print(f"MetadataBuilder.build host time, {a.blocks} blocks of {a.block_size} per sequence, median (mean) of "
          f"{a.calls} calls after {a.warmup} (device {a.device})")
    for batch in map(int, a.batches.split(",")):
        cells = []
        for name, keyed, churn in (("full", False, False), ("keyed", True, False), ("keyed+churn", True, True)):
            b = MetadataBuilder(max_batch=max(batch, 2), max_blocks_per_seq=a.blocks,
                                max_tokens=max(batch, 2), block_size=a.block_size, device=a.device)
            t = time_build(b, batch, a.blocks, a.calls, a.warmup, keyed, churn)
            cells.append(f"{name} {statistics.median(t) * 1e6:6.1f} us (mean {statistics.mean(t) * 1e6:6.1f})")
        print(f"B={batch:4d}: " + "   ".join(cells))

if __name__ == "__main__":
    main()
