"""CUDA: the Triton varlen prefill kernel against a float64 per-sequence reference."""

from __future__ import annotations

import math

import pytest
import torch

import mla_compile  # noqa: F401
import _triton_test_util as util
from _triton_test_util import assert_attention_close, cu_from_lens, poison_allocator, prefill_ref64
from mla_compile.ops import prefill

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCALE = 1 / math.sqrt(192)


def _run(H, lens_q, lens_k, causal, dtype, pad=5, dqk=192, dv=128, config=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu_q, cu_k = cu_from_lens(lens_q), cu_from_lens(lens_k)
    T, S = sum(lens_q) + pad, sum(lens_k) + 3
    q = torch.randn(T, H, dqk, generator=gen).to(util.DEVICE, dtype)
    k = torch.randn(S, H, dqk, generator=gen).to(util.DEVICE, dtype)
    v = torch.randn(S, H, dv, generator=gen).to(util.DEVICE, dtype)
    poison_allocator()
    if config is None and util.DEVICE == "cuda":
        out, lse = prefill(q, k, v, cu_q, cu_k, SCALE, causal=causal, backend="triton")
    else:
        from mla_compile.ops.triton.prefill import _launch
        out, lse = _launch(q, k, v, cu_q, cu_k, SCALE, causal, config=config)
    ref, ref_lse = prefill_ref64(q, k, v, cu_q, cu_k, SCALE, causal)
    assert out.shape == (T, H, dv) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (T, H) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert_attention_close(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_mixed_lengths(causal):
    # empty sequences, single tokens, prefix-cache hits (more keys than queries), a long sequence
    lens_q = [1, 0, 300, 128, 1000, 0, 2500, 77]
    lens_k = [1, 0, 300, 1000, 1000, 9, 4096, 1077]
    _run(16, lens_q, lens_k, causal, torch.bfloat16, seed=int(causal))


def test_prefill_deepseek_heads():
    _run(128, [1024, 513], [1024, 2000], True, torch.bfloat16, seed=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_dtypes(dtype):
    _run(4, [100, 37], [150, 37], True, dtype, seed=4)


def test_prefill_many_sequences():
    gen = torch.Generator().manual_seed(5)
    lens_q = torch.randint(0, 60, (300,), generator=gen).tolist()  # more sequences than one search chunk
    lens_k = [n + int(torch.randint(0, 40, (1,), generator=gen)) for n in lens_q]
    _run(2, lens_q, lens_k, True, torch.bfloat16, seed=5)


@pytest.mark.parametrize("block_m,block_n,warps,stages", [(64, 64, 4, 3), (128, 32, 8, 3), (128, 128, 8, 2)])
def test_prefill_configs(block_m, block_n, warps, stages):
    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    _run(8, [200, 333, 0, 64], [200, 400, 5, 64], True, torch.bfloat16, config=cfg, seed=6)


def test_prefill_generic_dims():
    _run(3, [50, 20], [60, 20], True, torch.bfloat16, dqk=128, dv=128, seed=7)  # no second qk tile
    _run(3, [50, 20], [60, 20], False, torch.bfloat16, dqk=80, dv=40, seed=8)   # 64 + 16, masked v


def test_prefill_only_padding():
    _run(4, [0, 0], [0, 3], True, torch.bfloat16, pad=9, seed=9)
