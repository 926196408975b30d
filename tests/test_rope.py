"""Rotary embedding: our layout change keeps q.k equal to DeepSeek's complex-pair rotation."""

import pytest
import torch

from mla_compile.models.rope import apply_rope, default_inv_freq, rope_cos_sin


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_preserves_dot_products_of_reference_rotation(interleave):
    gen = torch.Generator().manual_seed(0)
    T, D = 6, 16
    q, k = torch.randn(T, 3, D, generator=gen, dtype=torch.float64), torch.randn(T, D, generator=gen, dtype=torch.float64)
    pos = torch.tensor([0, 1, 5, 9, 100, 3])
    inv = default_inv_freq(D, 10000.0).double()
    ang = pos[:, None].double() * inv[None]

    def reference(x):  # rotate complex pairs (interleaved) or halves (rotate-half)
        pairs = x.view(*x.shape[:-1], D // 2, 2) if interleave else torch.stack(x.chunk(2, -1), -1)
        z = torch.view_as_complex(pairs.contiguous())
        shape = (T,) + (1,) * (x.dim() - 2) + (D // 2,)
        return torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang).view(shape)).flatten(-2)

    cos, sin = rope_cos_sin(inv, pos)
    got = torch.einsum("thd,td->th", apply_rope(q, cos.double(), sin.double(), interleave),
                       apply_rope(k, cos.double(), sin.double(), interleave))
    want = torch.einsum("thd,td->th", reference(q), reference(k))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # angles are float32, as in HF
