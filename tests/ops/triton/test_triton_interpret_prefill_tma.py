"""The TMA prefill kernel (``ops/triton/prefill_tma.py``) run by Triton's CPU interpreter against float64.

Host-made tensor descriptors run in the interpreter too; shapes are small (every program runs in Python).
Padding rows of q, k and v hold NaN (a tile may run past its sequence: nothing of them may leak).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import mla_compile  # noqa: F401  (registers the reference ops)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="needs TRITON_INTERPRET=1 and an importable triton")

NAN = float("nan")


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _run(H, lq, lk, causal, dqk, dv, config, dtype=torch.bfloat16, seed=0):
    from mla_compile.ops.triton import prefill_tma as pt

    gen = torch.Generator().manual_seed(seed)
    cu_q, cu_k = _cu(lq), _cu(lk)
    T, S = sum(lq) + 6, sum(lk) + 3  # padding rows past the last sequence
    q = torch.randn(T, H, dqk, generator=gen).to(dtype)
    k = torch.randn(S, H, dqk, generator=gen).to(dtype)
    v = torch.randn(S, H, dv, generator=gen).to(dtype)
    q[sum(lq):], k[sum(lk):], v[sum(lk):] = NAN, NAN, NAN
    out, lse = pt.launch(q, k, v, cu_q, cu_k, 0.2, causal, config=config)
    ref, ref_lse = torch.ops.mla.prefill_ref(q.double(), k.double(), v.double(), cu_q, cu_k, 0.2, causal)
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten (NaN) output or leaked padding"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "-inf LSE pattern differs"
    empty = torch.isinf(ref_lse)
    assert (out[empty] == 0).all()
    fin = torch.isfinite(ref)
    rel = float((out.double() - ref)[fin].norm() / ref[fin].norm())
    assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), rel
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads_first", [True, False])
def test_prefill_tma_mixed_lengths(causal, heads_first):
    # an empty sequence (with keys), one token, more keys than queries, a partial last tile, a first sequence
    # shorter than a key tile (its shifted last tile starts before the tensor's first row)
    _run(2, [5, 0, 40, 17], [5, 7, 70, 17], causal, 48, 32,
         dict(BLOCK_M=16, BLOCK_N=16, HEADS_FIRST=heads_first), seed=int(causal) + 2 * int(heads_first))
    _run(2, [3, 20], [9, 20], causal, 48, 32, dict(BLOCK_M=16, BLOCK_N=32), seed=9)


def test_prefill_tma_single_qk_tile():
    # qk 32 has no second tile (DB = 0); float16
    _run(2, [9, 30], [20, 30], True, 32, 16, dict(BLOCK_M=16, BLOCK_N=32), dtype=torch.float16, seed=5)


def test_prefill_tma_strided_views():
    # k and v as column slices of one projection output (head stride != head dim), as MLA's kv_b gives them
    from mla_compile.ops.triton import prefill_tma as pt

    gen = torch.Generator().manual_seed(7)
    lq, lk = [12, 3], [20, 3]
    cu_q, cu_k = _cu(lq), _cu(lk)
    kv = torch.randn(sum(lk), 2, 48 + 32 + 16, generator=gen).bfloat16()
    k, v = kv[..., :48], kv[..., 48:80]
    q = torch.randn(sum(lq), 2, 48, generator=gen).bfloat16()
    out, lse = pt.launch(q, k, v, cu_q, cu_k, 0.3, True, config=dict(BLOCK_M=16, BLOCK_N=16))
    ref, ref_lse = torch.ops.mla.prefill_ref(q.double(), k.double(), v.double(), cu_q, cu_k, 0.3, True)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
    torch.testing.assert_close(lse.double(), ref_lse.double(), atol=2e-3, rtol=1e-3)


def test_prefill_tma_split_dims_and_config_names():
    from mla_compile.ops.triton import prefill_tma as pt

    assert pt.split_dims(192) == (128, 64) and pt.split_dims(128) == (128, 0) and pt.split_dims(48) == (32, 16)
    assert pt.split_dims(80) == (64, 16) and pt.split_dims(96 + 8) is None and pt.split_dims(8) is None
    assert pt.config_name({}) == "tma_m128_n128_w8_s2"
    assert pt.config_name(dict(BLOCK_N=64, HEADS_FIRST=True)) == "tma_m128_n64_w8_s2_hf"
    # CPU tensors are never eligible (the op runs mla::prefill_triton, i.e. the reference, there)
    q = torch.randn(4, 2, 192).bfloat16()
    assert not pt.eligible(q, q, q[..., :128])
