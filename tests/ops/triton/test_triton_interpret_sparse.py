"""The fp8-cache write, fp8 decode and sparse decode Triton kernels under Triton's CPU interpreter,
against the reference ops (float64 math) on NaN/0xFF-poisoned caches with shuffled block tables.

Run with ``TRITON_INTERPRET=1 pytest tests/ops/triton/test_triton_interpret_sparse.py``; skipped otherwise.
Small dims (kv_lora_rank 128, rope 16): the interpreter runs every program in Python. The interpreter
truncates float32 -> bfloat16 casts (the GPU rounds), so bf16 tolerances here are looser than on CUDA.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import mla_compile  # noqa: F401  (registers the reference ops)
from _sparse_test_util import fp8_paged, float_paged, fp8_width, topk_indices, window_indices

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs TRITON_INTERPRET=1 and an importable triton")

DC, DR, H = 128, 16, 16
SCALE = (DC + DR) ** -0.5


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check(out, lse, ref, ref_lse, dtype, fp8):
    """Fully written, the reference's -inf pattern with exact zeros there, errors within budget."""
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == ref.shape and lse.shape == ref_lse.shape
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten (NaN) output"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty), "-inf LSE pattern differs"
    assert (out[empty] == 0).all(), "a query that sees nothing must give out = 0"
    bf16 = dtype == torch.bfloat16
    assert _rel(out, ref) < (2e-2 if bf16 else 1e-5), _rel(out, ref)
    atol = (2e-2 if fp8 == "rounded" else 2e-3) if bf16 else 1e-4  # sparse fp8 rounds dequantized keys to bf16
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty].double(), atol=atol, rtol=1e-3)


@pytest.mark.parametrize("bs,dtype", [(16, torch.bfloat16), (64, torch.float32)])
def test_fp8_write_bytes_equal_reference(bs, dtype):
    from mla_compile.ops.triton import fp8_cache_write as tw

    gen = torch.Generator().manual_seed(bs)
    nb, T, dc = 4, 50, 256
    cache = torch.full((nb, bs, fp8_width(dc, DR)), 0xFF, dtype=torch.uint8)
    # magnitudes over 11 decades (subnormal e4m3 quotients), an all-zero row, a tiny group
    latent = (torch.randn(T, dc, generator=gen) * torch.logspace(-8, 3, T)[:, None]).to(dtype)
    latent[4], latent[5, :128] = 0, 1e-30
    k_pe = torch.randn(T, DR, generator=gen).to(dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:T].to(torch.int32)
    slots[3] = slots[11] = -1
    slots[9] = nb * bs + 2  # out of range: never written
    expected = cache.clone()
    torch.ops.mla.write_latent_cache_fp8_ref(latent, k_pe, torch.where(slots >= nb * bs, -1, slots), expected)
    tw._launch(latent, k_pe, slots, cache)
    assert torch.equal(cache, expected), f"{int((cache != expected).sum())} bytes differ from the reference"


@pytest.mark.parametrize("dtype,s_q,bs,lens,splits", [
    (torch.bfloat16, 1, 16, [0, 37, 80], 1),
    (torch.float32, 1, 64, [130, 0, 5], 3),
    (torch.bfloat16, 2, 16, [1, 9, 0, 33], 2),  # sequence 0's first query sees nothing
])
def test_fp8_decode(dtype, s_q, bs, lens, splits):
    from mla_compile.ops.triton.fp8_decode import launch_fp8

    gen = torch.Generator().manual_seed(len(lens) * 10 + bs + s_q)
    cache, table, seq_lens, _ = fp8_paged(lens, bs, DC, DR, "cpu", gen)
    q = torch.randn(len(lens), s_q, H, DC + DR, generator=gen).to(dtype)
    out, lse = launch_fp8(q, cache, table, seq_lens, SCALE, DC, config={"SPLITS": splits})
    ref, ref_lse = torch.ops.mla.decode_fp8_ref(q.double(), cache, table, seq_lens, SCALE, DC)
    _check(out, lse, ref, ref_lse, dtype, fp8=True)  # exact keys: the bf16 tolerance


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_decode_value_range(dtype):
    """Group scales over twelve (bf16 q and output) or seven decades (float16 output: values below its max),
    values up to ~1e8 (far past float16's range) and down to ~1e-5, and query heads from 1e-3 to 1e2: the
    kernel's float16 tiles keep range through its power-of-two factors."""
    from mla_compile.ops.triton.fp8_decode import launch_fp8

    gen = torch.Generator().manual_seed(31)
    lens = [150, 41, 7]
    cache, table, seq_lens, _ = fp8_paged(lens, 16, DC, DR, "cpu", gen)
    scales = cache[..., DC:DC + DC // 32].view(torch.float32)  # [blocks, bs, groups], NaN where unused
    low, decades = (-4, 12) if dtype == torch.bfloat16 else (-5, 7)
    factor = 10 ** (torch.rand(scales.shape, generator=gen) * decades + low)
    scales.mul_(factor)
    q = torch.randn(len(lens), 1, H, DC + DR, generator=gen) * torch.logspace(-3, 2, H)[:, None]
    q = q.to(dtype)
    out, lse = launch_fp8(q, cache, table, seq_lens, SCALE, DC, config={"SPLITS": 2})
    ref, ref_lse = torch.ops.mla.decode_fp8_ref(q.double(), cache, table, seq_lens, SCALE, DC)
    assert out.dtype == dtype and not out.isinf().any()
    _check(out.bfloat16(), lse, ref, ref_lse, torch.bfloat16, fp8=True)  # the bf16 budget for both


@pytest.mark.parametrize("fp8,bs,splits", [(False, 16, 1), (True, 64, 3)])
def test_sparse_decode_sink_window(fp8, bs, splits):
    from mla_compile.ops.triton import sparse_decode as ts

    gen = torch.Generator().manual_seed(bs + fp8)
    lens = [0, 3, 70, 150]  # empty, sink and window overlapping, both apart
    if fp8:
        cache, table, seq_lens, _ = fp8_paged(lens, bs, DC, DR, "cpu", gen)
    else:
        cache, table, seq_lens = float_paged(lens, bs, DC + DR, torch.bfloat16, "cpu", gen)
    idx = window_indices(table, seq_lens, bs, sink=4, window=40, max_kv=48)
    q = torch.randn(len(lens), 1, H, DC + DR, generator=gen).bfloat16()
    out, lse = ts._launch(q, cache, idx, SCALE, DC, config={"SPLITS": splits, "BLOCK_N": 16})
    ref, ref_lse = torch.ops.mla.sparse_decode_ref(q.double(), cache if fp8 else cache.double(), idx, SCALE, DC)
    _check(out, lse, ref, ref_lse, torch.bfloat16, "rounded" if fp8 else False)


@pytest.mark.parametrize("fp8,dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_sparse_decode_topk(fp8, dtype):
    from mla_compile.ops.triton import sparse_decode as ts

    gen = torch.Generator().manual_seed(7 + fp8)
    lens, s_q, bs, topk = [1, 90, 40], 2, 16, 48  # sequence 0's first query sees nothing
    if fp8:
        cache, table, seq_lens, _ = fp8_paged(lens, bs, DC, DR, "cpu", gen)
    else:
        cache, table, seq_lens = float_paged(lens, bs, DC + DR, dtype, "cpu", gen)
    idx = topk_indices(table, seq_lens, bs, s_q, topk, gen)
    assert (idx[0, 0] == -1).all() and (idx >= 0).any(dim=-1)[1:].all()
    q = torch.randn(len(lens), s_q, H, DC + DR, generator=gen).to(dtype)
    out, lse = ts._launch(q, cache, idx.long(), SCALE, DC, config={"SPLITS": 2, "BLOCK_N": 16})
    ref, ref_lse = torch.ops.mla.sparse_decode_ref(q.double(), cache if fp8 else cache.double(), idx, SCALE, DC)
    _check(out, lse, ref, ref_lse, dtype, "rounded" if fp8 else False)


def test_sparse_splits_past_the_cap_change_nothing():
    """As the dense kernel: programs past ``SPLIT_CAP`` exit and the result is the capped launch's."""
    from mla_compile.ops.triton import sparse_decode as ts

    gen = torch.Generator().manual_seed(5)
    lens = [0, 3, 70, 150]
    cache, table, seq_lens = float_paged(lens, 16, DC + DR, torch.bfloat16, "cpu", gen)
    idx = window_indices(table, seq_lens, 16, sink=4, window=40, max_kv=48)
    q = torch.randn(len(lens), 1, H, DC + DR, generator=gen).bfloat16()
    wide = ts._launch(q, cache, idx, SCALE, DC, config={"SPLITS": 6, "SPLIT_CAP": 2, "BLOCK_N": 16})
    tight = ts._launch(q, cache, idx, SCALE, DC, config={"SPLITS": 2, "BLOCK_N": 16})
    assert all(torch.equal(a, b) for a, b in zip(wide, tight))
