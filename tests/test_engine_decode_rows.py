"""The engine's decode batch kept on the host (DecodeRows): every step it hands the runner builds exactly the
metadata the engine's per-request SeqChunks build, and every request gets the same tokens, over seeded traces
with arrivals, shared prefixes, sampling, stop tokens, aborts, a windowed cache and overlap on and off."""

import math

import pytest
import torch

from mla_compile.graphs.cuda_graph import DecodeGraphRunner
from mla_compile.serving.builder import MetadataBuilder, step_fields
from mla_compile.serving.decode_rows import DecodeRows, RowState
from mla_compile.serving.engine import Engine
from mla_compile.serving.sampling import SamplingParams

from tests.engine_load import make_trace, run_trace, with_sampling

BS, VOCAB = 4, 61


class FakeModel:
    """A step function whose logits depend on every input token, position and slot of its logits rows (so a wrong
    input id or slot changes the tokens); ``sink_window`` set makes the engine's block manager windowed."""

    def __init__(self, sink_window=None) -> None:
        if sink_window is not None:
            self.sink_window = sink_window

    def __call__(self, input_ids, positions, meta):
        rows = meta.logits_indices
        key = (input_ids[rows] * 31 + positions[rows] * 17 + meta.slot_mapping[rows] * 5).to(torch.float64)
        return torch.sin(key[:, None] * 0.37 + torch.arange(VOCAB, dtype=torch.float64) * 1.1) * 4


class Recording(MetadataBuilder):
    """A builder that keeps a copy of every step it builds and counts the steps handed over as a DecodeRows batch
    and those of them built straight from its arrays (a fallback to its keyed chunks fills the keyed tables)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.steps, self.from_rows, self.from_arrays = [], 0, 0
        self.engine = None  # set: each step also records its block manager's counts

    def build(self, decode, prefill=(), **kw):
        step = super().build(decode, prefill, **kw)
        self.from_rows += isinstance(decode, DecodeRows)
        self.from_arrays += isinstance(decode, DecodeRows) and not self.host_tables
        blocks = self.engine.blocks
        counts = (blocks.num_free, blocks.reserved, blocks.claimed, len(blocks.free_ids), len(blocks.evictable))
        self.steps.append(({k: v.clone() for k, v in step_fields(step).items()}, step.num_rows, counts))
        return step


def _run(trace_seed, overlap, window, sampling, rows_on):
    builder = Recording(max_batch=6, max_blocks_per_seq=16, max_tokens=24, block_size=BS, device="cpu")
    runner = DecodeGraphRunner(FakeModel(window), builder, sampling=sampling)
    engine = Engine(runner, num_blocks=40, vocab_size=VOCAB, max_positions=64, overlap=overlap)
    assert (engine._rows is not None) and (engine.blocks.sink_window == window)
    builder.engine = engine
    if not rows_on:
        engine._rows = None  # the per-request SeqChunk path
    trace = with_sampling(make_trace(trace_seed, 50, vocab_size=VOCAB, max_total=64, max_new=36, max_prompt=12, gap=5), seed=trace_seed,
                          vocab_size=VOCAB, stops=True)
    seen = run_trace(engine, trace)
    results = {i: (engine.requests[rid].finish_reason, engine.requests[rid].output) for i, rid in seen.ids.items()}
    return results, builder


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("window", [None, (4, 8)])
def test_engine_steps_from_the_decode_rows_equal_the_chunk_steps(overlap, window):
    for seed, sampling in ((11, False), (12, True)):
        got, rows_builder = _run(seed, overlap, window, sampling, True)
        want, chunk_builder = _run(seed, overlap, window, sampling, False)
        assert got == want
        assert sum(len(out) for _, out in got.values()) > 150
        assert rows_builder.from_rows > 60 and chunk_builder.from_rows == 0
        assert rows_builder.from_arrays == rows_builder.from_rows  # every decode-only step, whatever grew
        assert len(rows_builder.steps) == len(chunk_builder.steps)
        for n, ((g, g_rows, g_counts), (w, w_rows, w_counts)) in enumerate(zip(rows_builder.steps,
                                                                               chunk_builder.steps)):
            assert g.keys() == w.keys() and g_rows == w_rows and g_counts == w_counts, n
            for name in g:
                assert torch.equal(g[name], w[name]), (n, name)


def test_decode_rows_keep_their_state_across_arrangements():
    rows = DecodeRows(4, 3, BS)
    params = [SamplingParams(temperature=0.5 * i, top_k=i, top_p=1.0 - 0.1 * i, seed=100 + i) for i in range(5)]
    lists = {k: [10 * k + j for j in range(k % 3 + 1)] for k in range(5)}

    def state(k, pos):
        return lambda i: RowState(lists[k], 1000 + k, pos, 2, params[k])

    rows.arrange([0, 1], lambda i: state(i, 3)(i))
    rows.advance(torch.tensor([7, 8]).numpy())
    new = []
    rows.arrange([2, 1, 0], lambda i: new.append(i) or state(2, 5)(i))  # 2 joins in front, 1 and 0 keep theirs
    assert new == [0] and rows.keys == [2, 1, 0] and len(rows) == 3
    assert rows.tokens[:3].tolist() == [1002, 8, 7] and rows.positions[:3].tolist() == [5, 4, 4]
    assert rows.steps[:3].tolist() == [2, 3, 3] and rows.block_counts[:3].tolist() == [3, 2, 1]
    assert rows.table[:3].tolist() == [[20, 21, 22], [10, 11, 0], [0, 0, 0]]
    cols = rows.sampling()
    assert cols["seeds"].tolist() == [102, 101, 100] and cols["top_k"].tolist() == [2, 1, 0]
    assert all(math.isclose(a, b) for a, b in zip(cols["top_p"].tolist(), [0.8, 0.9, 1.0]))
    rows.set_blocks(2, [5, 6])
    assert rows.table[2].tolist() == [5, 6, 0] and rows.short().tolist() == []
    rows.positions[2] = 8
    assert rows.short().tolist() == [2]
    chunks = rows.chunks()
    assert [(c.key, list(c.blocks), list(c.tokens), c.start) for c in chunks] == \
        [(2, [20, 21, 22], [1002], 5), (1, [10, 11], [8], 4), (0, [5, 6], [7], 8)]
    with pytest.raises(ValueError, match="unique"):
        rows.arrange([1, 1], state(1, 0))
    with pytest.raises(ValueError, match="max_blocks=3"):
        rows.arrange([0, 4], lambda i: RowState([1, 2, 3, 4], 0, 0, 0, params[4]))
    with pytest.raises(ValueError, match="max_rows=4"):
        rows.arrange(list(range(5)), state(0, 0))
    assert rows.keys == [2, 1, 0]  # the failed arrangements changed nothing
