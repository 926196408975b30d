"""Rotary embedding: our layout change keeps q.k equal to DeepSeek's complex-pair rotation."""

import pytest
import torch

from mla_compile.models.rope import apply_rope, apply_rope_leading, default_inv_freq, rope_cos_sin, rotate_part


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


# (x shape, rotated pairs): an indexer query ([T, heads, 128], rope 64), a key row, all channels rotated, more dims,
# and a width the rope does not divide (the concatenating form)
LEADING = [((3, 8, 128), 32), ((5, 128), 32), ((2, 4, 64), 32), ((4, 2, 3, 96), 16), ((3, 100), 16)]


@pytest.mark.parametrize("shape,half", LEADING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rope_on_the_leading_channels_matches_float64(shape, half, dtype):
    gen = torch.Generator().manual_seed(sum(shape) + half)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    pos = torch.randint(0, 9000, (shape[0],), generator=gen)
    cos, sin = rope_cos_sin(torch.rand(half, generator=gen), pos)
    got = apply_rope_leading(x, cos, sin)
    assert got.dtype == dtype and got.shape == x.shape
    r = 2 * half
    assert torch.equal(got, torch.cat([apply_rope(x[..., :r], cos, sin, False), x[..., r:]], dim=-1))  # its values
    assert torch.equal(got[..., r:], x[..., r:])  # the other channels pass unchanged
    shape_cs = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.double().view(shape_cs), sin.double().view(shape_cs)
    a, b = x[..., :half].double(), x[..., half:r].double()
    want = torch.cat([a * c - b * s, b * c + a * s, x[..., r:].double()], dim=-1)
    tol = dict(rtol=8e-3, atol=8e-3) if dtype == torch.bfloat16 else dict(rtol=0, atol=5e-6)  # a float32 rotation
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("D,half,interleave,leading", [(9, 2, True, False), (96, 32, False, True),
                                                        (128, 32, False, False), (8, 8, True, True)])
def test_rotate_part_refuses_layouts_it_cannot_turn(D, half, interleave, leading):
    x, cs = torch.randn(2, D), torch.rand(2, half)
    with pytest.raises(ValueError, match=f"x.shape\\[-1\\] = {D} with 2 \\* cos.shape\\[-1\\] = {2 * half}"):
        rotate_part(x, cs, cs, interleave=interleave, leading=leading)
