"""CUDA: the Triton decode kernel against the float64 reference on fresh random paged caches."""

from __future__ import annotations

import math

import pytest
import torch

import mla_compile  # noqa: F401
from mla_compile.ops import decode
import _triton_test_util as util
from _triton_test_util import assert_attention_close, paged_cache, poison_allocator

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCALE = 1 / math.sqrt(192)


def _lens(B, max_len, gen, zeros=True):
    lens = torch.randint(0, max_len + 1, (B,), generator=gen)
    lens[0] = max_len  # the longest possible sequence always appears
    if zeros and B > 2:
        lens[1] = 0
    return lens.tolist()


def _run(B, H, s_q, lens, bs, dtype, dc=512, dr=64, config=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache, table, seq_lens = paged_cache(lens, bs, dc + dr, dtype, gen=gen, table_cols=None)
    q = torch.randn(B, s_q, H, dc + dr, generator=gen).to(util.DEVICE, dtype)
    poison_allocator()
    if config is None and util.DEVICE == "cuda":
        out, lse = decode(q, cache, table, seq_lens, SCALE, kv_lora_rank=dc, backend="triton")
    else:
        from mla_compile.ops.triton.decode import _launch
        out, lse = _launch(q, cache, table, seq_lens, SCALE, dc, config=config)
    if util.DEVICE == "cuda":
        torch.cuda.synchronize()
    ref, ref_lse = torch.ops.mla.decode_ref(q.double(), cache.double(), table, seq_lens, SCALE, dc)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32 and lse.is_contiguous()
    assert_attention_close(out, lse, ref, ref_lse, dtype)


@pytest.mark.parametrize("B,H,s_q,max_len,bs", [
    (1, 16, 1, 16384, 64),     # one long sequence: many splits
    (2, 128, 1, 4096, 16),     # a zero-length neighbour
    (256, 16, 1, 1024, 64),    # large batch, memory-bound shape
    (128, 128, 1, 2048, 64),   # a full wave: one split, direct write
    (33, 128, 2, 2048, 64),    # MTP: 2 queries per sequence, folded into 256 rows
    (7, 32, 4, 300, 16),       # 4 queries, lengths below s_q - 1 see nothing
    (3, 16, 1, 100, 1),        # block size 1
    (5, 64, 1, 64, 64),        # a single block
])
def test_decode_shapes(B, H, s_q, max_len, bs):
    gen = torch.Generator().manual_seed(B * 1000 + H)
    _run(B, H, s_q, _lens(B, max_len, gen), bs, torch.bfloat16, seed=B + H)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_dtypes(dtype):
    gen = torch.Generator().manual_seed(7)
    _run(6, 16, 1, _lens(6, 700, gen), 64, dtype)


@pytest.mark.parametrize("splits", [1, 2, 7, 64])
def test_decode_forced_splits(splits):
    gen = torch.Generator().manual_seed(splits)
    _run(4, 16, 2, _lens(4, 3000, gen), 16, torch.bfloat16, config={"SPLITS": splits})


@pytest.mark.parametrize("block_h,block_n,warps,stages", [(16, 32, 8, 3), (32, 32, 8, 3), (64, 32, 8, 3)])
def test_decode_configs(block_h, block_n, warps, stages):
    gen = torch.Generator().manual_seed(block_h)
    cfg = dict(BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    _run(9, 64, 1, _lens(9, 1500, gen), 64, torch.bfloat16, config=cfg)


def test_decode_generic_dims():
    gen = torch.Generator().manual_seed(11)
    _run(5, 16, 1, _lens(5, 400, gen), 16, torch.bfloat16, dc=128, dr=32)
    _run(3, 20, 1, _lens(3, 200, gen), 16, torch.bfloat16, dc=96, dr=0)


def test_decode_all_empty():
    _run(4, 16, 1, [0, 0, 0, 0], 64, torch.bfloat16)
