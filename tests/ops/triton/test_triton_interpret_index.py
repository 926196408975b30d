"""The index-key cache write and lightning-indexer Triton kernels under Triton's CPU interpreter, against
the reference ops and float64 scores, on poisoned caches with shuffled block tables.

Run with ``TRITON_INTERPRET=1 pytest tests/ops/triton/test_triton_interpret_index.py``; skipped otherwise.
Small shapes: the interpreter runs every program in Python. It truncates float32 -> bfloat16 casts (the
GPU rounds), so the float-cache write is checked on casts the interpreter rounds (to float16) or exact ones.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import mla_compile  # noqa: F401  (registers the reference ops)
from _index_test_util import assert_valid_topk, index_paged, index_queries, lightning_scores64

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs TRITON_INTERPRET=1 and an importable triton")

H, BS = 4, 16


def _slots(n_slots, T, gen):
    slots = torch.randperm(n_slots, generator=gen)[:T].to(torch.int32)
    slots[2] = slots[7] = -1
    slots[5] = n_slots + 3  # out of range: never written
    return slots


def _tie_row(d):
    """A float32 key whose quotients ``x / s`` are exact e4m3 midpoints (ties to even) with amax = 11, where
    multiplying by a rounded ``1 / s`` instead of dividing lands on either side of the tie."""
    mids = torch.tensor([(1 + (2 * i + 1) / 16) * 2.0 ** e for e in range(-6, 9) for i in range(8)])
    mids = mids[mids < 448]
    amax = torch.tensor([11.0])
    s = amax / torch.full_like(amax, 448.0)
    x = mids * s
    keep = (x / s == mids) & (x * (1.0 / s) != x / s)
    row = torch.cat([amax, x[keep]])[:d]
    assert len(row) >= min(d, 20), len(row)
    return torch.cat([row, torch.zeros(d - len(row))])


@pytest.mark.parametrize("d,dtype", [(128, torch.float32), (30, torch.bfloat16)])  # 30: scale bytes unaligned
def test_fp8_index_write_bytes_equal_reference(d, dtype):
    from mla_compile.ops.triton import index_cache_write as tw

    gen = torch.Generator().manual_seed(d)
    nb, T = 4, 40
    cache = torch.full((nb, BS, d + 4), 0xFF, dtype=torch.uint8)
    # magnitudes over 11 decades (subnormal e4m3 quotients), an all-zero key, a tiny one
    k_idx = (torch.randn(T, d, generator=gen) * torch.logspace(-8, 3, T)[:, None]).to(dtype)
    k_idx[4], k_idx[6] = 0, 1e-30
    if dtype == torch.float32:
        k_idx[8] = _tie_row(d)  # catches a reciprocal multiply in place of the division
    slots = _slots(nb * BS, T, gen)
    expected = cache.clone()
    torch.ops.mla.write_index_cache_ref(k_idx, torch.where(slots >= nb * BS, -1, slots), expected)
    tw._launch(k_idx, slots, cache)
    assert torch.equal(cache, expected), f"{int((cache != expected).sum())} bytes differ from the reference"
    assert (cache.view(-1, d + 4) == 0xFF).all(dim=1).sum() == nb * BS - (T - 3), "a padding/out-of-range row written"


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_float_index_write_matches_reference(src, dst):
    from mla_compile.ops.triton import index_cache_write as tw

    gen = torch.Generator().manual_seed(3)
    nb, T, d = 3, 30, 24
    cache = torch.full((nb, BS, d), float("nan"), dtype=dst)
    k_idx = torch.randn(T, d, generator=gen).to(src)
    slots = _slots(nb * BS, T, gen)
    expected = cache.clone()
    torch.ops.mla.write_index_cache_ref(k_idx, torch.where(slots >= nb * BS, -1, slots), expected)
    tw._launch(k_idx, slots, cache)
    assert torch.equal(cache.view(torch.int16), expected.view(torch.int16))


CASES = [  # (cache kind, query dtype, lens, queries per sequence, topk, block_n)
    pytest.param("fp8", torch.bfloat16, [70, 0, 33], [5, 1, 3], 24, 16, id="fp8-bf16q"),
    pytest.param(torch.bfloat16, torch.bfloat16, [40, 17], [4, 2], 48, 32, id="bf16-topk-past-L"),
    pytest.param(torch.float32, torch.float32, [50, 9], [3, 9], 12, 16, id="f32-ieee"),
    pytest.param("fp8", torch.float32, [28], [4], 8, 16, id="fp8-f32q"),
    # long enough for several tiles per program, with the per-row gather (block_n 32 > BS)
    pytest.param(torch.bfloat16, torch.bfloat16, [1100, 300], [2, 2], 64, 32, id="bf16-tiles-gather"),
]


@pytest.mark.parametrize("kind,qdtype,lens,per_seq,topk,block_n", CASES)
def test_lightning_index_exact_inputs_match_reference(kind, qdtype, lens, per_seq, topk, block_n):
    """Exact integer inputs (real ties): the indices equal the float64 reference op's element for element."""
    from mla_compile.ops.triton import lightning_index as tli

    gen = torch.Generator().manual_seed(sum(lens) + topk)
    cache, table, seq_lens, keys = index_paged(lens, BS, 32, kind, "cpu", gen, ints=True)
    q, w, qseq, qpos = index_queries(lens, per_seq, H, 32, qdtype, "cpu", gen, ints=True)
    scores = torch.full((q.shape[0], table.shape[1] * BS), float("nan"))
    tli.lightning_scores(q, w, cache, table, seq_lens, qseq, qpos, block_n=block_n, out=scores)
    want = lightning_scores64(q, w, keys, table, seq_lens, qseq, qpos)
    assert torch.equal(scores.double(), want), "integer scores must be exact"
    got = tli._launch(q, w, cache, table, seq_lens, qseq, qpos, topk, block_n=block_n)
    ref = torch.ops.mla.lightning_index_ref(q.double(), w.double(), cache, table, seq_lens, qseq, qpos, topk)
    assert torch.equal(got, ref)
    assert (ref[-2:] == -1).all() and (ref >= 0).any()


@pytest.mark.parametrize("kind", ["fp8", torch.bfloat16])
def test_lightning_page_tiles_exact(kind):
    """Block size 64, tiles of 16: four tiles per page (tile offsets inside the page), two tiles per program;
    exact integer scores equal the float64 ones."""
    from mla_compile.ops.triton import lightning_index as tli

    gen = torch.Generator().manual_seed(5)
    lens = [700, 0, 130]
    cache, table, seq_lens, keys = index_paged(lens, 64, 32, kind, "cpu", gen, ints=True)
    q, w, qseq, qpos = index_queries(lens, [3, 1, 2], H, 32, torch.bfloat16, "cpu", gen, ints=True)
    scores = torch.full((q.shape[0], table.shape[1] * 64), float("nan"))
    tli.lightning_scores(q, w, cache, table, seq_lens, qseq, qpos, block_n=16, out=scores)
    assert torch.equal(scores.double(), lightning_scores64(q, w, keys, table, seq_lens, qseq, qpos))


def test_lightning_index_random_inputs_select_float64_top_set():
    """Gaussian fp8 keys and bf16 queries: scores within float32 error of float64, a valid top-k set."""
    from mla_compile.ops.triton import lightning_index as tli

    gen = torch.Generator().manual_seed(11)
    lens, topk = [90, 45], 20
    cache, table, seq_lens, keys = index_paged(lens, BS, 64, "fp8", "cpu", gen)
    q, w, qseq, qpos = index_queries(lens, [4, 3], H, 64, torch.bfloat16, "cpu", gen)
    scores = torch.full((q.shape[0], table.shape[1] * BS), float("nan"))
    tli.lightning_scores(q, w, cache, table, seq_lens, qseq, qpos, block_n=32, out=scores)
    want = lightning_scores64(q, w, keys, table, seq_lens, qseq, qpos)
    assert torch.equal(torch.isinf(scores), torch.isinf(want)) and not scores.isnan().any()
    fin = torch.isfinite(want)
    torch.testing.assert_close(scores.double()[fin], want[fin], atol=1e-5, rtol=1e-5)
    got = tli._launch(q, w, cache, table, seq_lens, qseq, qpos, topk, block_n=32)
    assert assert_valid_topk(got, want, table, seq_lens, qseq, BS, topk, tol=1e-4) >= q.shape[0] - 2


def test_lightning_index_empty_batch_and_tokens():
    from mla_compile.ops.triton import lightning_index as tli

    q, w = torch.randn(3, H, 32), torch.randn(3, H)
    cache = torch.randn(2, BS, 32)
    none = torch.zeros(0, 2, dtype=torch.int32)
    seq = torch.full((3,), -1, dtype=torch.int32)
    got = tli._launch(q, w, cache, none, torch.zeros(0, dtype=torch.int32), seq, seq.clamp(min=0), 5)
    assert torch.equal(got, torch.full((3, 5), -1, dtype=torch.int32))
    table, lens = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    empty = tli._launch(q[:0], w[:0], cache, table, lens, seq[:0], seq[:0], 5)
    assert empty.shape == (0, 5) and empty.dtype == torch.int32


@pytest.mark.parametrize("L,k", [(300, 7), (300, 300), (1000, 64), (37, 1), (64, 100)])
def test_topk_positions_kernel_equals_select_topk(L, k):
    """The in-register top-k gives exactly ``select_topk``'s positions in its order: random scores with runs of equal
    values, -inf (invisible) entries, -0.0 against 0.0, and k past the row (then k = L); rows of zero length fall back."""
    from mla_compile.ops.sparse_index import select_topk
    from mla_compile.ops.triton.lightning_index import topk_positions

    gen = torch.Generator().manual_seed(L * 31 + k)
    scores = torch.randn(5, L, generator=gen)
    scores[0] = torch.randint(-3, 4, (L,), generator=gen).float()  # many ties
    scores[1, ::3] = float("-inf")
    scores[2] = float("-inf")  # a padding token: every position invisible
    scores[3, : L // 2] = 0.0
    scores[3, L // 2:] = -0.0
    want = select_topk(scores, k)
    got = topk_positions(scores, k)
    assert got.dtype == torch.int64 and got.shape == want.shape == (5, min(k, L))
    assert torch.equal(got, want)
    assert topk_positions(scores[:0], k).shape == (0, min(k, L))
