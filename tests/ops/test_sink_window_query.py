"""``mla::sink_window_query_indices`` (the sink + window rule per query token) against a Python loop over
random paged batches, its agreement with the per-sequence ``sink_window_indices`` at the last position, opcheck,
``torch.compile`` and the malformed-input errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mla_compile import ops
from mla_compile.ops import sink_window_indices, sink_window_query_indices
from .ref64 import IMPLS, Paged, paged

I32 = torch.int32


def _loop(layout: Paged, query_seq: list[int], query_pos: list[int], sink: int, window: int) -> list[list[int]]:
    """Per query token: the slots of positions ``[0, sink) U [p + 1 - window, p]`` of its prefix ``[0, p]``."""
    out = []
    for b, p in zip(query_seq, query_pos):
        chosen = []
        if b >= 0:
            positions = sorted(set(range(min(sink, p + 1))) | set(range(max(p + 1 - window, 0), p + 1)))
            chosen = [layout.where(b, q)[0] * layout.block_size + layout.where(b, q)[1] for q in positions]
        out.append(chosen + [-1] * (sink + window - len(chosen)))
    return out


def _call(impl, layout, qs, qp, sink, window, idx_dtype=I32):
    table = layout.block_table(idx_dtype)
    qs_t, qp_t = torch.tensor(qs, dtype=idx_dtype), torch.tensor(qp, dtype=idx_dtype)
    if impl == "raw":
        return torch.ops.mla.sink_window_query_indices_ref(table, qs_t, qp_t, layout.block_size, sink, window,
                                                           sink + window)
    return sink_window_query_indices(table, qs_t, qp_t, block_size=layout.block_size, sink=sink, window=window)


@given(impl=st.sampled_from(IMPLS), layout=paged(min_seqs=1, max_seqs=4), sink=st.integers(0, 20),
       window=st.integers(0, 70), data=st.data(), idx_i64=st.booleans())
def test_matches_loop(impl, layout, sink, window, data, idx_i64):
    """Random queries of random paged sequences (each at a position its sequence holds), and padding tokens."""
    live = [b for b, n in enumerate(layout.seq_lens) if n > 0]
    n_q = data.draw(st.integers(0, 6))
    qs, qp = [], []
    for _ in range(n_q):
        if live and data.draw(st.booleans()):
            b = data.draw(st.sampled_from(live))
            qs.append(b), qp.append(data.draw(st.integers(0, layout.seq_lens[b] - 1)))
        else:
            qs.append(-1), qp.append(data.draw(st.integers(0, 3)))  # padding: any position, reads nothing
    got = _call(impl, layout, qs, qp, sink, window, torch.int64 if idx_i64 else I32)
    assert got.dtype == I32 and got.shape == (n_q, sink + window)
    assert got.tolist() == _loop(layout, qs, qp, sink, window)


def test_last_position_equals_the_per_sequence_op():
    layout = Paged(4, 12, (9, 13, 1), ((4, 1, 0), (5, 2, 7, 11), (3,)), 4, -1)
    for sink, window in [(2, 3), (0, 5), (4, 20), (3, 1)]:
        per_seq, _ = sink_window_indices(layout.block_table(), layout.seq_lens_tensor(), block_size=4, sink=sink,
                                         window=window, max_kv=sink + window)
        per_query = _call("public", layout, [0, 1, 2], [8, 12, 0], sink, window)
        assert per_query.tolist() == per_seq.tolist()


def test_opcheck_and_compile(fresh_dynamo):
    layout = Paged(4, 12, (9, 13), ((4, 1, 0), (5, 2, 7, 11)), 4, -1)
    table = layout.block_table()
    qs, qp = torch.tensor([1, 0, -1, 1], dtype=I32), torch.tensor([12, 3, 0, 5], dtype=I32)
    torch.library.opcheck(torch.ops.mla.sink_window_query_indices_ref.default, (table, qs, qp, 4, 2, 3, 6))
    fn = torch.compile(lambda t, s, p: ops.sink_window_query_indices(t, s, p, block_size=4, sink=2, window=3),
                       fullgraph=True, dynamic=True)
    torch.testing.assert_close(fn(table, qs, qp), _call("public", layout, qs.tolist(), qp.tolist(), 2, 3))


SWQ = "mla.sink_window_query_indices: "
LAYOUT = Paged(4, 6, (9, 2), ((4, 1, 0), (5,)), 3, -1)
BAD = [
    pytest.param(dict(max_kv=4), ValueError, SWQ + "max_kv must be >= sink \\+ window = 5", id="max-kv"),
    pytest.param(dict(sink=-1), ValueError, SWQ + "sink and window must be >= 0", id="negative-sink"),
    pytest.param(dict(block_size=0), ValueError, SWQ + "block_size must be positive", id="block-size"),
    pytest.param(dict(query_pos=torch.tensor([1, 2, 3], dtype=I32)), ValueError, SWQ + "query_pos must have shape",
                 id="pos-length"),
    pytest.param(dict(query_seq=torch.tensor([2, 0], dtype=I32)), ValueError, SWQ + "query_seq values must lie",
                 id="seq-past-batch"),
    pytest.param(dict(query_pos=torch.tensor([12, 0], dtype=I32)), ValueError, SWQ + "query_pos values must lie",
                 id="pos-past-table"),
    pytest.param(dict(query_pos=torch.tensor([1.0, 0.0])), TypeError, SWQ + "query_pos must have dtype",
                 id="float-pos"),
    pytest.param(dict(query_pos=torch.tensor([8, 0], dtype=I32), query_seq=torch.tensor([1, 0], dtype=I32)),
                 ValueError, SWQ + "block_table values must lie", id="unused-block-read"),
]


@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("change,exc,match", BAD)
def test_rejects_malformed(change, exc, match, raw):
    args = dict(block_table=LAYOUT.block_table(), query_seq=torch.tensor([0, 1], dtype=I32),
                query_pos=torch.tensor([8, 1], dtype=I32), block_size=4, sink=2, window=3, max_kv=5)
    args.update(change)
    if raw:
        with pytest.raises(exc, match=match):
            torch.ops.mla.sink_window_query_indices_ref(**args)
    else:
        with pytest.raises(exc, match=match):
            sink_window_query_indices(**args)
