"""Host time of ``MetadataBuilder.build`` for decode-only steps, with and without per-sequence keys, from a
``DecodeRows`` batch, and of a whole ``Engine`` step up to the launch.

    python benchmarks/bench_builder_host.py [--batches 1,8,64,256] [--blocks 65] [--calls 200] [--device cpu]

Each of B sequences holds 64 full blocks of 64 tokens plus part of a 65th (65 blocks), and every step
appends one token to each (a block every 64 steps, staggered over the sequences, so a step appends a
block to about B/64 of them). "full": chunks without keys (the table re-packed every step). "keyed":
the same chunks with ``key=`` (the builder's persistent host tables, updated only where a sequence
grew). "keyed+churn": keyed, and every step one sequence leaves and a new one joins in its place.
"rows": the same trace as a :class:`~mla_compile.serving.decode_rows.DecodeRows` batch, timed with what an
engine does to it per step (a block written for each row that reached a new block, every row advanced).
"engine": a whole ``Engine.step`` of B decoding requests (each holding 65 blocks) up to the moment the step
is launched (the runner's captured call, stubbed), with the per-request SeqChunk path ("chunks") and with the
engine's DecodeRows batch ("rows"), without and with ``overlap``. "after launch": the rest of the same steps, from
the launch to ``Engine.step``'s return (with overlap: reading the previous step's tokens, appending them, stop and
length checks, retiring requests; the work the GPU's timeline sees between two launches when the host is not ahead).
Prints the median and mean over ``--calls`` calls after ``--warmup`` calls, each call timed alone
with ``time.perf_counter`` (making the step's chunks, as an engine does between steps, is not timed).
On a shared machine the median is the figure to read: the mean carries the preemptions.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


import numpy as np
import torch

from mla_compile.graphs.cuda_graph import DecodeGraphRunner
from mla_compile.models.metadata import SeqChunk
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.decode_rows import DecodeRows, RowState
from mla_compile.serving.engine import Engine
from mla_compile.serving.sampling import SamplingParams


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


class RowsTrace(Trace):
    """:class:`Trace` kept as a DecodeRows batch, updated as an engine updates it: :meth:`update` gives a block to
    each row whose position reached a new block and :meth:`advance` moves every row one token on."""

    def __init__(self, batch: int, blocks: int, block_size: int, steps: int) -> None:
        super().__init__(batch, blocks, block_size, steps, True, False)
        self.rows = DecodeRows(max(batch, 2), blocks, block_size)
        params = SamplingParams(seed=0)
        self.rows.arrange(self.keys, lambda i: RowState(self.own[i], (self.lens[i] * 31 + i) % 32000, self.lens[i],
                                                         0, params))
        self.arange = np.arange(batch, dtype=np.int64)

    def update(self) -> DecodeRows:
        rows = self.rows
        for i in rows.short().tolist():
            own = self.own[i]
            own.append(self.pool[i][len(own)])
            rows.set_blocks(i, own)
        return rows

    def advance(self) -> None:
        self.s += 1
        n = len(self.rows)
        self.rows.advance(((self.rows.positions[:n] + 1) * 31 + self.arange) % 32000)


def time_rows(builder: MetadataBuilder, batch: int, blocks: int, calls: int, warmup: int) -> list[float]:
    """Host seconds of ``calls`` steps of a :class:`RowsTrace` (update, ``build``, advance) after ``warmup``."""
    trace = RowsTrace(batch, blocks, builder.block_size, warmup + calls)
    times = []
    for i in range(warmup + calls):
        t0 = time.perf_counter()
        builder.build(trace.update())
        trace.advance()
        times.append(time.perf_counter() - t0)
    return times[warmup:]


class LaunchTimedRunner(DecodeGraphRunner):
    """A ``DecodeGraphRunner`` (capture off) whose sampled decode step is a stub that notes when it was called
    (where a CUDA-graph replay is launched) and returns fixed logits and tokens."""

    def __init__(self, builder: MetadataBuilder, vocab: int) -> None:
        super().__init__(self._model, builder, enabled=False, sampling=True)
        self.vocab, self.launched, self._out = vocab, 0.0, None

    def _model(self, input_ids, positions, meta):
        return torch.zeros(meta.logits_indices.shape[0], self.vocab)

    def _call_sampled(self, step, size):
        self.launched = time.perf_counter()
        if self._out is None or self._out[0].shape[0] < size:
            self._out = torch.zeros(size, self.vocab), torch.zeros(size, dtype=torch.int64)
        return self._out[0][:size], self._out[1][:size]


def time_engine(batch: int, blocks: int, block_size: int, calls: int, warmup: int, overlap: bool,
                rows: bool) -> tuple[list[float], list[float]]:
    """Host seconds from the start of ``Engine.step`` to the launch of its decode step, and from the launch to the
    return of ``Engine.step``, over ``calls`` steps of ``batch`` decoding requests (each holding ``blocks`` blocks
    from admission) after ``warmup`` steps."""
    prompt, vocab = 8, 32000
    builder = MetadataBuilder(max_batch=max(batch, 2), max_blocks_per_seq=blocks, max_tokens=max(batch, 2) * prompt + 1,
                              block_size=block_size, device="cpu")
    runner = LaunchTimedRunner(builder, vocab)
    engine = Engine(runner, num_blocks=batch * blocks + 1, vocab_size=vocab, max_positions=blocks * block_size,
                    overlap=overlap)
    if not rows:
        engine._rows = None
    for i in range(batch):
        engine.add_request([(i * 7 + j) % vocab for j in range(prompt)],
                           SamplingParams(max_new_tokens=blocks * block_size - prompt, seed=i))
    while any(r.prefilling for r in engine.running) or engine.waiting or len(engine.running) < batch:
        engine.step()
    before, after = [], []
    for _ in range(warmup + calls):
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        before.append(runner.launched - t0)
        after.append(t1 - runner.launched)
    return before[warmup:], after[warmup:]


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
        b = MetadataBuilder(max_batch=max(batch, 2), max_blocks_per_seq=a.blocks, max_tokens=max(batch, 2),
                            block_size=a.block_size, device=a.device)
        t = time_rows(b, batch, a.blocks, a.calls, a.warmup)
        cells.append(f"rows {statistics.median(t) * 1e6:6.1f} us (mean {statistics.mean(t) * 1e6:6.1f})")
        print(f"B={batch:4d}: " + "   ".join(cells))
    if a.device != "cpu":
        return
    print(f"Engine.step host time up to the launch, {a.blocks} blocks of {a.block_size} per request, median (mean) "
          f"of {a.calls} steps after {a.warmup}")
    lines = []
    for batch in map(int, a.batches.split(",")):
        cells, later = [], []
        for overlap in (False, True):
            for rows in (False, True):
                t, t_after = time_engine(batch, a.blocks, a.block_size, a.calls, a.warmup, overlap, rows)
                name = ("overlap " if overlap else "") + ("rows" if rows else "chunks")
                cells.append(f"{name} {statistics.median(t) * 1e6:6.1f} us (mean {statistics.mean(t) * 1e6:6.1f})")
                later.append(f"{name} {statistics.median(t_after) * 1e6:6.1f} us "
                             f"(mean {statistics.mean(t_after) * 1e6:6.1f})")
        print(f"B={batch:4d}: " + "   ".join(cells))
        lines.append(f"B={batch:4d}: " + "   ".join(later))
    print("Engine.step host time after the launch (to its return), same steps")
    print("\n".join(lines))

if __name__ == "__main__":
    main()
