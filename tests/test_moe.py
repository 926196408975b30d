"""The compile-friendly MoE against HF's own MoE blocks (routing and experts)."""

import copy

import pytest
import torch

from mla_compile.app import toy
from mla_compile.models.moe import MLAMoE, experts_dense, experts_grouped

pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", toy.KINDS)
def test_moe_matches_hf_block(kind):
    hf = toy.toy_hf_model(kind, seed=3)
    block = hf.model.layers[1].mlp
    ref = copy.deepcopy(block)
    x = torch.randn(37, hf.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(MLAMoE(block)(x), ref(x), atol=1e-5, rtol=1e-4)


def test_dense_experts_against_loop():
    gen = torch.Generator().manual_seed(0)
    T, H, I, E, k = 9, 16, 8, 5, 2
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64)
    down = torch.randn(E, H, I, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen, dtype=torch.float64)
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            g, u = (gate_up[e] @ x[t]).chunk(2)
            want[t] += w[t, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
    got = experts_dense(x, w, ids, gate_up, down, torch.nn.functional.silu)
    torch.testing.assert_close(got, want)


def test_moe_rejects_unknown_impl():
    hf = toy.toy_hf_model("v2-lite", seed=0)
    with pytest.raises(ValueError, match="impl"):
        MLAMoE(hf.model.layers[1].mlp, impl="magic")


def test_grouped_experts_match_dense_float64_with_fp32_combine():
    """bf16 grouped experts (``torch._grouped_mm``) against float64 dense; the combine sums in fp32."""
    gen = torch.Generator().manual_seed(1)
    T, H, I, E, k = 13, 32, 16, 6, 3
    x = torch.randn(T, H, generator=gen).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * 0.2).bfloat16()
    down = (torch.randn(E, H, I, generator=gen) * 0.2).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen)
    act = torch.nn.functional.silu
    try:
        got = experts_grouped(x, w, ids, gate_up, down, act)
    except (RuntimeError, NotImplementedError) as e:  # torch builds without CPU _grouped_mm
        pytest.skip(f"torch._grouped_mm on CPU: {e}")
    want = experts_dense(x.double(), w.double(), ids, gate_up.double(), down.double(), act)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    assert not torch.equal(got.double(), torch.zeros_like(want))
