"""``torch.library.opcheck`` on every raw ``mla::*_ref`` op (schema, fake function, autograd
registration, AOT dispatch with dynamic shapes). Mutating ops get clones: opcheck runs them many times.
"""

from __future__ import annotations

import pytest
import torch

import mla_compile  # noqa: F401  (registers the ops)
from .ref64 import RANK, ROPE, generator, randn

D = RANK + ROPE
I32 = torch.int32


def _write(bs: int, T: int):
    gen = generator(51)
    slots = torch.randperm(3 * bs, generator=gen)[:T].to(I32)
    slots[0] = -1
    return (torch.ops.mla.write_latent_cache_ref.default,
            (randn(gen, T, RANK, dtype=torch.float32), randn(gen, T, ROPE, dtype=torch.float32), slots,
             randn(gen, 3, bs, D, dtype=torch.float32).clone()))


def _decode(bs: int, s_q: int):
    gen = generator(52)
    table = torch.randperm(6, generator=gen).to(I32).reshape(2, 3)
    seq_lens = torch.tensor([2 * bs + 1, 3], dtype=I32)
    return (torch.ops.mla.decode_ref.default,
            (randn(gen, 2, s_q, 2, D, dtype=torch.float32), randn(gen, 6, bs, D, dtype=torch.float32), table,
             seq_lens, D ** -0.5, RANK))


def _decode_by_rows(bs: int, rows: int):
    """The autotune lowering's size split (``mla::decode_by_rows``) over the reference on both sides."""
    _, args = _decode(bs, 1)
    return torch.ops.mla.decode_by_rows.default, (*args, [rows], "mla::decode_ref,mla::decode_ref", [], [0, 0])


def _prefill(causal: bool, pad: int):
    gen = generator(53)
    cu_q, cu_k = torch.tensor([0, 3, 3, 7], dtype=I32), torch.tensor([0, 5, 6, 10], dtype=I32)
    return (torch.ops.mla.prefill_ref.default,
            (randn(gen, 7 + pad, 2, 24, dtype=torch.float32), randn(gen, 10 + pad, 2, 24, dtype=torch.float32),
             randn(gen, 10 + pad, 2, 16, dtype=torch.float32), cu_q, cu_k, 0.2, causal))


def _merge(T: int, dtype: torch.dtype):
    gen = generator(54)
    lse_b = randn(gen, T, 2, dtype=torch.float32)
    lse_b[0] = float("-inf")
    return (torch.ops.mla.merge_attn_states_ref.default,
            (randn(gen, T, 2, 8, dtype=dtype), randn(gen, T, 2, dtype=torch.float32), randn(gen, T, 2, 8, dtype=dtype),
             lse_b))


def _merge_strided(T: int):
    """Transposed, non-dense inputs: the fake's outputs must be contiguous like every implementation's."""
    gen = generator(57)
    out_a, out_b = (randn(gen, 2, T, 12, dtype=torch.float32).transpose(0, 1)[..., 2:10] for _ in range(2))
    lse_a, lse_b = (randn(gen, 2, T, dtype=torch.float32).t() for _ in range(2))
    return torch.ops.mla.merge_attn_states_ref.default, (out_a, lse_a, out_b, lse_b)


def _gather(bs: int, pad: int):
    gen = generator(55)
    table = torch.randperm(6, generator=gen).to(I32).reshape(2, 3)
    cu = torch.tensor([0, 4, 4 + bs], dtype=I32)
    return (torch.ops.mla.gather_latent_cache_ref.default,
            (randn(gen, 6, bs, D, dtype=torch.float32), table, cu, torch.tensor([1, bs - 1], dtype=I32),
             torch.zeros(4 + bs + pad, D)))


CASES = [
    pytest.param(_write, (16, 5), id="write-bs16"),
    pytest.param(_write, (1, 3), id="write-bs1"),
    pytest.param(_decode, (16, 1), id="decode-bs16-sq1"),
    pytest.param(_decode, (4, 3), id="decode-bs4-sq3"),
    pytest.param(_decode_by_rows, (16, 1), id="decode-by-rows-small-side"),
    pytest.param(_decode_by_rows, (16, 8), id="decode-by-rows-large-side"),
    pytest.param(_prefill, (True, 0), id="prefill-causal"),
    pytest.param(_prefill, (False, 2), id="prefill-noncausal-padded"),
    pytest.param(_merge, (4, torch.float32), id="merge-fp32"),
    pytest.param(_merge, (1, torch.bfloat16), id="merge-bf16"),
    pytest.param(_merge_strided, (5,), id="merge-strided"),
    pytest.param(_gather, (16, 0), id="gather-bs16"),
    pytest.param(_gather, (4, 3), id="gather-bs4-padded"),
]


@pytest.mark.parametrize("make,params", CASES)
def test_opcheck(make, params):
    op, args = make(*params)
    torch.library.opcheck(op, args)
