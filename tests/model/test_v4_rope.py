"""V4's interleaved RoPE (:func:`mla_compile.models.v4_model.rope_interleaved` with :func:`rope_rotation`): HF's own
function bit for bit where both compute in float32, a float64 rotation of each pair within rounding, the leading
channels passed unchanged."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM", allow_module_level=True)

from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

from mla_compile.models.v4_model import rope_interleaved, rope_rotation  # noqa: E402

# (x shape, rotated pairs): a 3-D query with a nope part, a 2-D key row, every channel rotated, more than 3 dims
SHAPES = [((3, 8, 64), 8), ((5, 96), 16), ((2, 4, 32), 16), ((4, 2, 3, 48), 8)]


def rotate_float64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each trailing pair ``(a, b)`` of ``x`` turned by ``cos, sin [T, pairs]``, in float64: ``(a cos - b sin,
    b cos + a sin)``; the leading channels as they are."""
    x = x.double()
    out = x.clone()
    r = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.double().view(shape), sin.double().view(shape)
    a, b = x[..., x.shape[-1] - r::2], x[..., x.shape[-1] - r + 1::2]
    out[..., x.shape[-1] - r::2] = a * c - b * s
    out[..., x.shape[-1] - r + 1::2] = b * c + a * s
    return out


def angles_float64(pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The contract's angles: ``position * inv_freq`` rounded to float32 (as the model forms them), in float64."""
    return (pos.float()[:, None] * inv_freq.float()[None, :]).double()


@pytest.mark.parametrize("shape,pairs", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_hf_bitwise_and_float64(shape, pairs, dtype):
    g = torch.Generator().manual_seed(sum(shape) + pairs)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    pos = torch.randint(0, 9000, (shape[0],), generator=g)
    inv_freq = torch.rand(pairs, generator=g)
    rot = rope_rotation(pos, inv_freq)
    assert rot.shape == (2, shape[0], pairs) and rot.dtype == torch.float32
    got = rope_interleaved(x, rot)
    assert got.dtype == dtype and got.shape == x.shape
    if x.dim() == 3:  # [T, heads, D]: HF's apply_rotary_pos_emb with the half-width float32 cos / sin at dim 1
        assert torch.equal(got, hf_v4.apply_rotary_pos_emb(x, rot[0], rot[1], unsqueeze_dim=1))
    nope = x.shape[-1] - 2 * pairs
    assert torch.equal(got[..., :nope], x[..., :nope])  # the leading channels pass unchanged
    ang = angles_float64(pos, inv_freq)
    want = rotate_float64(x, ang.cos(), ang.sin())
    tol = dict(rtol=0, atol=5e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.double(), want, **tol)
    # the other direction of turn is far outside that: a wrong partner or sign fails
    assert (rotate_float64(x, ang.cos(), -ang.sin()) - want)[..., nope:].abs().max() > 0.1


def test_rope_in_float64_keeps_float64():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, 40, generator=g, dtype=torch.float64)
    rot = rope_rotation(torch.tensor([5, 300, 4097]), torch.rand(12, generator=g))
    got = rope_interleaved(x, rot)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, rotate_float64(x, rot[0], rot[1]), rtol=0, atol=1e-12)
