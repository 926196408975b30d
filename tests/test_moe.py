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


@pytest.mark.parametrize("kind", toy.KINDS)
def test_fused_moe_matches_hf_block_and_keeps_the_state_dict(kind):
    """impl="fused" (the mla::moe_route / mla::moe_experts ops, their references on CPU) against HF's block;
    the shared experts fold into the experts op, and no state-dict key or tensor changes."""
    hf = toy.toy_hf_model(kind, seed=3)
    block = hf.model.layers[1].mlp
    ref = copy.deepcopy(block)
    if kind == "v3":
        with torch.no_grad():
            block.gate.e_score_correction_bias.copy_(torch.randn(block.gate.e_score_correction_bias.shape) * 0.3)
            ref.gate.e_score_correction_bias.copy_(block.gate.e_score_correction_bias)
    moe = MLAMoE(block, impl="fused")
    assert moe.fold_shared
    assert moe.state_dict().keys() == block.state_dict().keys()
    assert all(moe.state_dict()[k].data_ptr() == v.data_ptr() for k, v in block.state_dict().items())
    x = torch.randn(37, hf.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), ref(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", toy.KINDS)
def test_compiled_fused_moe_equals_dense(kind, dtype):
    hf = toy.toy_hf_model(kind, seed=6, dtype=dtype)
    block = hf.model.layers[1].mlp
    fused = torch.compile(MLAMoE(block, impl="fused"), fullgraph=True)
    x = torch.randn(5, hf.config.hidden_size).to(dtype)
    with torch.no_grad():
        want = MLAMoE(block, impl="dense")(x)
        got = fused(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_fused_rejects_experts_it_cannot_run():
    hf = toy.toy_hf_model("v2-lite", seed=0)
    block = hf.model.layers[1].mlp
    block.experts.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="SiLU"):
        MLAMoE(block, impl="fused")
    assert not MLAMoE(block).fusable  # "auto" keeps the other paths


def test_shared_experts_that_do_not_fold_run_beside_the_op():
    hf = toy.toy_hf_model("v3", seed=2)
    block = hf.model.layers[1].mlp
    ref = copy.deepcopy(block)
    block.shared_experts.act_fn = torch.nn.Tanh()  # not SiLU: cannot join the experts op
    ref.shared_experts.act_fn = torch.nn.Tanh()
    moe = MLAMoE(block, impl="fused")
    assert not moe.fold_shared
    x = torch.randn(6, hf.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), ref(x), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", toy.KINDS)
def test_greedy_tokens_with_fused_moe_equal_dense(kind):
    from mla_compile.models.model import patch
    from mla_compile.serving.generate import greedy_generate

    prompts = toy.random_prompts(torch.Generator().manual_seed(1), [5, 8])
    runs = {}
    for impl in ("dense", "fused"):
        model = patch(toy.toy_hf_model(kind, seed=7, num_hidden_layers=2), moe_impl=impl)
        model.allocate_cache(16, 4, fill=float("nan"))
        runs[impl] = greedy_generate(model, prompts, 4, block_size=4, num_blocks=16, keep_logits=True,
                                     dynamic=False)
    assert runs["fused"].tokens == runs["dense"].tokens
    for a, b in zip(runs["fused"].step_logits, runs["dense"].step_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _router_case(device, dtype, T=5, E=64, H=2048, seed=11):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(E, H, generator=gen) / H ** 0.5).to(device=device, dtype=dtype)
    want = x.double() @ w.double().t()  # the half-precision values' exact products, summed in float64
    return x, w, want


def test_router_logits_off_cuda_is_hfs_float32_linear():
    from mla_compile.models.moe import router_logits

    x, w, want = _router_case("cpu", torch.bfloat16)
    got = router_logits(x, w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.nn.functional.linear(x.float(), w.float()), atol=0, rtol=0)
    assert float((got.double() - want).norm() / want.norm()) < 1e-6


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("compiled", [False, True])
def test_router_logits_on_cuda_match_float64(dtype, compiled):
    """The half-precision GEMM with float32 output (or, for float32 inputs, the float32 linear) against float64,
    eagerly and under Inductor; poisoned inputs' rows would show."""
    from mla_compile.models.moe import router_logits

    x, w, want = _router_case("cuda", dtype)
    fn = torch.compile(router_logits, fullgraph=True, dynamic=True) if compiled else router_logits
    got = fn(x, w)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got.double() - want).norm() / want.norm()) < 1e-5
    x2 = x.clone()
    x2[1] = float("nan")
    bad = fn(x2, w)
    assert bad[1].isnan().all() and not bad[[0, 2, 3, 4]].isnan().any()
