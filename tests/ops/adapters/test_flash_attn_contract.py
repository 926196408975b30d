"""flash-attn 2 adapter against a fake ``flash_attn``: the exact call (v padded to the qk dim, int32
cu_seqlens, shape-bound max lengths, return_attn_probs), LSE ``[H, T] -> [T, H]``, FA2's ``+inf`` for
rows without keys and unwritten padding rows -> ``0 / -inf``, and outputs equal to the float64 reference."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mla_compile import ops
from mla_compile.ops.adapters.flash_attn import flash_attn_prefill_core
from ..ref64 import LSE_TOL, OUT_TOL, generator, prefill_ref64, randn

I32 = torch.int32
OUT = {**OUT_TOL, torch.float16: dict(rtol=2e-3, atol=2e-3)}
LSE = {**LSE_TOL, torch.float16: dict(rtol=1e-4, atol=1e-4)}
# (lens_q, lens_k, causal, padding rows): a plain causal batch with a cached-context sequence, and a
# non-causal context chunk where one sequence has no keys at all (FA2 gives those rows +inf).
CASES = [([3, 5, 1], [3, 9, 1], True, 2), ([4, 2, 3], [6, 0, 2], False, 1)]


def _inputs(lens_q, lens_k, pad, dtype, seed=0, dqk=192, dv=128, heads=2):
    gen = generator(seed)
    T, S = sum(lens_q) + pad, sum(lens_k) + pad
    q, k = randn(gen, T, heads, dqk, dtype=dtype), randn(gen, S, heads, dqk, dtype=dtype)
    v = randn(gen, S, heads, dv, dtype=dtype)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32)  # noqa: E731
    return q, k, v, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("lens_q, lens_k, causal, pad", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_call_contract_and_result(fake_flash_attn, lens_q, lens_k, causal, pad, dtype):
    q, k, v, cu_q, cu_k = _inputs(lens_q, lens_k, pad, dtype)
    scale = 192 ** -0.5
    out, lse = flash_attn_prefill_core(q, k, v, cu_q, cu_k, scale, causal)

    [(args, kw)] = fake_flash_attn.named("flash_attn_varlen_func")
    q_in, k_in, v_in = args
    assert q_in is q and k_in is k
    assert v_in.shape == (k.shape[0], 2, 192) and v_in.dtype == dtype
    assert torch.equal(v_in[..., :128], v) and not v_in[..., 128:].any(), "v zero-padded from 128 to 192"
    assert kw["cu_seqlens_q"].dtype == kw["cu_seqlens_k"].dtype == I32
    assert (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (q.shape[0], k.shape[0]), "bounds from shapes: no host sync"
    assert kw["dropout_p"] == 0.0 and kw["softmax_scale"] == scale and kw["causal"] is causal
    assert kw["return_attn_probs"] is True

    ref_out, ref_lse = prefill_ref64(q, k, v, lens_q, lens_k, scale, causal)
    assert out.shape == (q.shape[0], 2, 128) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (q.shape[0], 2) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert_close(out.double(), ref_out, **OUT[dtype])
    assert_close(lse.double(), ref_lse, **LSE[dtype])
    empty = ref_lse == float("-inf")
    assert empty.any(), "the cases include rows that see no key"
    assert torch.isneginf(lse[empty]).all() and (out[empty] == 0).all() and not out.isnan().any()


def test_the_custom_op_matches_the_core_and_passes_opcheck(fake_flash_attn):
    q, k, v, cu_q, cu_k = _inputs([3, 5], [3, 7], 1, torch.bfloat16, seed=1)
    out, lse = torch.ops.mla.prefill_flash_attn(q, k, v, cu_q, cu_k, 0.1, True)
    ref_out, ref_lse = flash_attn_prefill_core(q, k, v, cu_q, cu_k, 0.1, True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    torch.library.opcheck(torch.ops.mla.prefill_flash_attn.default, (q, k, v, cu_q, cu_k, 0.1, True))


def test_the_public_op_compiles_fullgraph_through_the_fake_function(fake_flash_attn, allow_cpu):
    allow_cpu("mla.prefill", "flash-attn")
    q, k, v, cu_q, cu_k = _inputs([2, 4], [2, 6], 0, torch.bfloat16, seed=2)
    fn = torch.compile(lambda *a: ops.prefill(*a, 0.1, backend="flash-attn"), fullgraph=True, backend="aot_eager")
    out, lse = fn(q, k, v, cu_q, cu_k)
    want_out, want_lse = flash_attn_prefill_core(q, k, v, cu_q, cu_k, 0.1, True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_refuses_what_fa2_cannot_take(fake_flash_attn):
    q, k, v, cu_q, cu_k = _inputs([2], [2], 0, torch.float32)
    with pytest.raises(TypeError, match="backend 'flash-attn' needs q in"):
        flash_attn_prefill_core(q, k, v, cu_q, cu_k, 0.1, True)
    q, k, v, cu_q, cu_k = _inputs([2], [2], 0, torch.bfloat16, dqk=128, dv=192)
    with pytest.raises(ValueError, match="v_head_dim <= qk_head_dim"):
        flash_attn_prefill_core(q, k, v, cu_q, cu_k, 0.1, True)
    assert not fake_flash_attn
