"""cuDNN SDPA adapter with a fake attention function standing in for
``torch.ops.aten._scaled_dot_product_cudnn_attention``: one dense call per sequence in ``[1, H, L, E]``,
``compute_log_sumexp=True``, LSE shaped ``[B, H, L, 1]`` (torch 2.13's meta) reshaped, bottom-right
causal through a context part + a square causal part merged by LSE, and results against the float64
reference. The real op's schema is checked against this torch."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mla_compile.ops.adapters.sdpa import sdpa_cudnn_prefill_core
from ..ref64 import LSE_TOL, OUT_TOL, generator, prefill_ref64, randn

BF16, I32 = torch.bfloat16, torch.int32


class FakeCudnnAttention:
    """Float64 dense attention with SDPA's top-left causal mask, in cuDNN's return layout."""

    def __init__(self):
        self.calls = []

    def __call__(self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                 return_debug_mask=False, *, scale=None):
        self.calls.append(dict(shapes=(query.shape, key.shape, value.shape), attn_bias=attn_bias,
                               compute_log_sumexp=compute_log_sumexp, dropout_p=dropout_p, is_causal=is_causal,
                               return_debug_mask=return_debug_mask, scale=scale))
        assert query.dim() == 4 and query.shape[0] == 1
        s = torch.einsum("bhqd,bhkd->bhqk", query.double(), key.double()) * scale
        if is_causal:  # SDPA: top-left aligned
            lq, lk = s.shape[-2:]
            s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        out = torch.softmax(s, -1) @ value.double()
        return (out.to(query.dtype), lse[..., None].float(), None, None, query.shape[2], key.shape[2], None, None, None)


@pytest.mark.parametrize("causal, lens_q, lens_k", [(True, [3, 2, 4], [3, 6, 4]), (False, [3, 2, 2], [0, 5, 1])])
def test_per_sequence_calls_and_result(causal, lens_q, lens_k):
    gen = generator(9)
    T, S = sum(lens_q) + 1, sum(lens_k) + 1
    q, k = randn(gen, T, 2, 192, dtype=BF16), randn(gen, S, 2, 192, dtype=BF16)
    v = randn(gen, S, 2, 128, dtype=BF16)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=I32)  # noqa: E731
    fake = FakeCudnnAttention()
    out, lse = sdpa_cudnn_prefill_core(q, k, v, cu(lens_q), cu(lens_k), 0.1, causal, attn_fn=fake)
    ref_out, ref_lse = prefill_ref64(q, k, v, lens_q, lens_k, 0.1, causal)
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert_close(lse.double(), ref_lse, **LSE_TOL[BF16])
    assert torch.isneginf(lse[-1]).all() and (out[-1] == 0).all()
    for call in fake.calls:
        assert call["compute_log_sumexp"] is True and call["attn_bias"] is None and call["dropout_p"] == 0.0
        assert call["scale"] == 0.1 and call["return_debug_mask"] is False
    if causal:  # sequence 1 has 4 context keys: a non-causal context call and a square causal call
        assert [c["is_causal"] for c in fake.calls] == [True, False, True, True]
        assert fake.calls[1]["shapes"][1][2] == 4 and fake.calls[2]["shapes"][1][2] == 2
    else:  # the sequence without keys is skipped
        assert len(fake.calls) == 2 and not any(c["is_causal"] for c in fake.calls)


def test_the_cudnn_op_schema_is_what_the_adapter_calls():
    schema = str(torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema)
    assert ("(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, bool compute_log_sumexp, float dropout_p=0., "
            "bool is_causal=False, bool return_debug_mask=False, *, float? scale=None)") in schema
    assert schema.split("->")[1].strip().startswith("(Tensor output, Tensor logsumexp")
