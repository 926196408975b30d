"""V4's interleaved RoPE (:func:`mla_compile.models.v4_model.rope_interleaved`): HF's own function bit for bit where both
compute in float32, a float64 rotation of each pair within rounding, the leading channels passed unchanged."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM", allow_module_level=True)

from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

from mla_compile.models.v4_model import rope_interleaved  # noqa: E402

# (x shape, rotated pairs): a 3-D query with a nope part, a 2-D key row, every channel rotated, more than 3 dims
SHAPES = [((3, 8, 64), 8), ((5, 96), 16), ((2, 4, 32), 16), ((4, 2, 3, 48), 8)]


def rotate_float64(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Each trailing pair ``(a, b)`` turned by its angle, in float64: ``(a cos - b sin, b cos + a sin)``."""
    x, freqs = x.double(), freqs.double()
    out = x.clone()
    r = 2 * freqs.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (freqs.shape[-1],)
    c, s = freqs.cos().view(shape), freqs.sin().view(shape)
    a, b = x[..., x.shape[-1] - r::2], x[..., x.shape[-1] - r + 1::2]
    out[..., x.shape[-1] - r::2] = a * c - b * s
    out[..., x.shape[-1] - r + 1::2] = b * c + a * s
    return out


@pytest.mark.parametrize("shape,pairs", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_hf_bitwise_and_float64(shape, pairs, dtype):
    g = torch.Generator().manual_seed(sum(shape) + pairs)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    freqs = torch.rand(shape[0], pairs, generator=g) * 9000  # angles of positions up to ~9k
    got = rope_interleaved(x, freqs)
    assert got.dtype == dtype and got.shape == x.shape
    if x.dim() == 3:  # [T, heads, D]: HF's apply_rotary_pos_emb with the half-width float32 cos / sin at dim 1
        assert torch.equal(got, hf_v4.apply_rotary_pos_emb(x, freqs.cos(), freqs.sin(), unsqueeze_dim=1))
    nope = x.shape[-1] - 2 * pairs
    assert torch.equal(got[..., :nope], x[..., :nope])  # the leading channels pass unchanged
    want = rotate_float64(x, freqs)
    tol = dict(rtol=0, atol=2e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.double(), want, **tol)
    # a wrong partner or sign is far outside that: the test can fail
    assert (rotate_float64(x, -freqs) - want)[..., nope:].abs().max() > 0.1


def test_rope_in_float64_keeps_float64():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 4, 40, generator=g, dtype=torch.float64)
    freqs = torch.rand(3, 12, generator=g, dtype=torch.float64) * 100
    got = rope_interleaved(x, freqs)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, rotate_float64(x, freqs), rtol=0, atol=1e-12)
