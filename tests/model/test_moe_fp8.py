"""``MLAMoE`` over fp8 experts (``FP8Experts``, fp8 shared experts as ``FP8BlockLinear``): "fused" runs
``mla::moe_experts_fp8`` (the reference on CPU) with the shared experts folded in and matches the experts'
own dense path; a compiled forward has no graph break; "auto"'s choice and the refusals (fp4, act_quant, an
explicit fp8_block_linear backend) read from the module. CUDA: the Triton kernels at V3-like dims against the
reference op, eager and compiled, T = 1 / 4 / 8 (and the grouped part above FUSED_MAX_TOKENS_FP8)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mla_compile.models.fp8_linear import FP8BlockLinear, FP8Experts
from mla_compile.models.moe import MLAMoE
from mla_compile.ops.moe_experts import FUSED_MAX_TOKENS_FP8

pytest.importorskip("transformers")


def _fill_fp8(module: torch.nn.Module, gen: torch.Generator, fan_in: int) -> None:
    """Random e4m3 codes and block scales (values ~ fan_in**-0.5) into every fp8 parameter pair of ``module``
    (made on ``gen``'s device, a leading slice at a time)."""
    for name, p in list(module.named_parameters(recurse=False)):
        if p.dtype == torch.float8_e4m3fn:
            for part in p.data.view(-1, p.shape[-1]).split(8192):
                part.copy_((torch.randn(part.shape, generator=gen, device=gen.device) * 64).clamp(-448, 448))
            scale = module.get_parameter(f"{name}_scale_inv" if name != "weight" else "weight_scale_inv")
            scale.data.copy_((torch.rand(scale.shape, generator=gen, device=gen.device) + 0.5) * fan_in ** -0.5 / 64)


def fp8_moe(device="cpu", seed=0, swiglu_limit=None, **overrides) -> torch.nn.Module:
    """An HF ``DeepseekV3MoE`` (toy V3 config with ``overrides``) whose routed experts are ``FP8Experts`` and whose
    shared experts' linears are ``FP8BlockLinear``, as the loader builds them from an fp8 checkpoint."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from mla_compile.app import toy

    cfg = toy.toy_hf_config("v3", **overrides)
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        moe = DeepseekV3MoE(cfg)
    moe.gate.to_empty(device=device)
    moe.gate.weight.data.copy_(torch.randn(E, H, generator=gen, device=device) * H ** -0.5)
    moe.gate.e_score_correction_bias.copy_(torch.rand(E, generator=gen, device=device) * 0.1)
    moe.experts = FP8Experts(E, H, I, moe.experts.act_fn, swiglu_limit=swiglu_limit, device=device)
    _fill_fp8(moe.experts, gen, fan_in=H)
    se = moe.shared_experts
    for name in ("gate_proj", "up_proj", "down_proj"):
        old = getattr(se, name)
        setattr(se, name, FP8BlockLinear(old.in_features, old.out_features, device=device))
        _fill_fp8(getattr(se, name), gen, fan_in=old.in_features)
    return moe


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("swiglu_limit", [None, 0.05])
def test_fused_fp8_moe_matches_the_experts_own_path(swiglu_limit):
    """impl="fused" (mla::moe_experts_fp8's reference on CPU, shared experts folded in) against impl="dense"
    (FP8Experts through mla::fp8_block_linear, the shared MLP beside it): the same math by other code."""
    moe = fp8_moe(seed=1, swiglu_limit=swiglu_limit)
    x = torch.randn(5, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(2))
    fused, dense = MLAMoE(moe, impl="fused"), MLAMoE(moe, impl="dense")
    assert fused.fusable and fused.fused_refusal is None
    # V3's shared MLP has no clamp: with a limit on the routed experts it runs beside the op
    assert fused.fold_shared == (swiglu_limit is None)
    with torch.no_grad():
        got, want = fused(x), dense(x)
    assert rel(got, want) < 1e-5
    if swiglu_limit is not None:  # the clamp binds: the experts' own path honours it too
        with torch.no_grad():
            assert rel(MLAMoE(fp8_moe(seed=1), impl="dense")(x), want) > 1e-3


def test_compiled_fused_fp8_moe_has_no_graph_break():
    moe = MLAMoE(fp8_moe(seed=3), impl="fused")
    gen = torch.Generator().manual_seed(4)
    compiled = torch.compile(moe, fullgraph=True)
    with torch.no_grad():
        for T in (3, 5):
            x = torch.randn(T, moe.gate.weight.shape[1], generator=gen)
            assert rel(compiled(x), moe(x)) < 1e-6


def test_auto_takes_the_fused_fp8_op_where_its_kernels_serve(monkeypatch):
    """"auto" on an (assumed) H200 whose fp8 experts kernels are GPU-tested runs the fused op (the split inside
    it takes grouped GEMMs above FUSED_MAX_TOKENS_FP8); on CPU, or while the kernels are untested, it does not."""
    from mla_compile.ops import select
    from mla_compile.ops.registry import _TABLE

    moe = MLAMoE(fp8_moe(seed=5))
    assert not moe.auto_fused("cpu", "bfloat16", 2048)
    monkeypatch.setattr(select, "device_capability", lambda device=None: (9, 0))
    table = _TABLE["moe_experts_fp8"]
    for name in ("triton", "grouped"):
        monkeypatch.setitem(table, name, dataclasses.replace(table[name], available=lambda: True, gpu_tested=True))
    assert moe.auto_fused("cuda", "bfloat16", 2048)
    monkeypatch.setitem(table, "triton", dataclasses.replace(table["triton"], gpu_tested=False))
    assert not moe.auto_fused("cuda", "bfloat16", 2048)


@pytest.mark.parametrize("change,reason", [
    (lambda m: setattr(m.experts, "act_quant", True), "act_quant"),
    (lambda m: setattr(m.experts, "backend", "reference"), "backend 'reference'"),
    (lambda m: setattr(m.experts, "is_fp4_block", True), "fp4"),
    (lambda m: setattr(m.experts, "act_fn", torch.nn.GELU()), "SiLU"),
])
def test_fp8_experts_the_fused_op_cannot_run_are_refused_with_the_reason(change, reason):
    block = fp8_moe(seed=6)
    change(block)
    with pytest.raises(ValueError, match=reason):
        MLAMoE(block, impl="fused")
    moe = MLAMoE(block)
    assert not moe.fusable and reason in moe.fused_refusal and not moe.auto_fused("cuda", "bfloat16", 2048)


def test_shared_experts_that_do_not_fold_run_beside_the_fp8_op():
    block = fp8_moe(seed=7)
    block.shared_experts.up_proj.act_quant = True  # not weight-only: cannot run inside mla::moe_experts_fp8
    fused, dense = MLAMoE(block, impl="fused"), MLAMoE(block, impl="dense")
    assert fused.fusable and not fused.fold_shared
    x = torch.randn(4, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert rel(fused(x), dense(x)) < 1e-5


V3_DIMS = dict(hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=16, num_experts_per_tok=8,
               n_group=4, topk_group=2)


def _reference(moe: MLAMoE, x: torch.Tensor) -> torch.Tensor:
    """The same routing, then ``mla::moe_experts_fp8``'s reference backend with the shared experts folded in."""
    from mla_compile.ops.moe_experts_fp8 import moe_experts_fp8
    from mla_compile.ops.moe_route import moe_route
    from mla_compile.models.moe import route_args

    bias, top_k, num_group, topk_group, scoring, renorm, scaling = route_args(moe.gate)
    w, ids = moe_route(torch.nn.functional.linear(x.float(), moe.gate.weight.float()), top_k, bias=bias,
                       num_group=num_group, topk_group=topk_group, scoring=scoring, renormalize=renorm,
                       scaling=scaling, backend="reference")
    ex, se = moe.experts, moe.shared_experts
    return moe_experts_fp8(x, w, ids, ex.gate_proj, ex.gate_proj_scale_inv, ex.up_proj, ex.up_proj_scale_inv,
                           ex.down_proj, ex.down_proj_scale_inv, shared_gate=se.gate_proj.weight,
                           shared_gate_scale=se.gate_proj.weight_scale_inv, shared_up=se.up_proj.weight,
                           shared_up_scale=se.up_proj.weight_scale_inv, shared_down=se.down_proj.weight,
                           shared_down_scale=se.down_proj.weight_scale_inv, backend="reference")


@pytest.mark.cuda
def test_cuda_fused_fp8_moe_at_v3_dims(monkeypatch):
    """The Triton fp8 kernels (impl="fused", and "auto" with them marked GPU-tested: the split op, compiled)
    against the reference op at V3's per-expert dims (H 7168, I 2048; 16 experts, top-8, one shared)."""
    from mla_compile.ops import select
    from mla_compile.ops.registry import _TABLE

    moe = fp8_moe("cuda", seed=9, **V3_DIMS)
    fused, auto = MLAMoE(moe, impl="fused"), MLAMoE(moe)
    assert fused.fold_shared
    table = _TABLE["moe_experts_fp8"]
    for name in ("triton", "grouped"):
        monkeypatch.setitem(table, name, dataclasses.replace(table[name], gpu_tested=True))
    monkeypatch.setattr(select, "device_capability", lambda device=None: (9, 0))
    assert auto.auto_fused("cuda", "bfloat16", 2048)
    compiled = torch.compile(auto, fullgraph=True)
    gen = torch.Generator(device="cuda").manual_seed(10)
    with torch.no_grad():
        for T in (1, 4, FUSED_MAX_TOKENS_FP8, 2 * FUSED_MAX_TOKENS_FP8):
            x = torch.randn(T, V3_DIMS["hidden_size"], generator=gen, device="cuda").bfloat16()
            want = _reference(auto, x)
            if T <= FUSED_MAX_TOKENS_FP8:
                got = fused(x)
                assert got.dtype == torch.bfloat16 and not got.isnan().any()
                assert rel(got, want) < 1e-2, (T, rel(got, want))
            assert rel(auto(x), want) < 1e-2, (T, "auto")
            assert rel(compiled(x), want) < 1e-2, (T, "compiled")


def test_fp8_checkpoint_with_fused_moe_equals_dense(tmp_path):
    """A V3 fp8 checkpoint (tests/checkpoints.py) loaded with moe_impl="fused": every MoE layer runs
    mla::moe_experts_fp8 with its fp8 shared experts folded in; greedy tokens and logits as moe_impl="dense"."""
    from mla_compile import from_pretrained
    from mla_compile.serving.generate import greedy_generate
    from tests.checkpoints import write_checkpoint

    write_checkpoint(tmp_path, "v3", "fp8", seed=5)
    prompts = [[3, 4, 5, 6, 7], [9, 10]]
    runs = {}
    for impl in ("dense", "fused"):
        model = from_pretrained(tmp_path, dtype=torch.float32, moe_impl=impl)
        moes = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MLAMoE)]
        assert moes and all(m.fp8_experts and m.fold_shared for m in moes) and all(m.impl == impl for m in moes)
        model.allocate_cache(16, 4)
        runs[impl] = greedy_generate(model, prompts, 3, block_size=4, num_blocks=16, keep_logits=True)
    assert runs["fused"].tokens == runs["dense"].tokens
    for a, b in zip(runs["fused"].step_logits, runs["dense"].step_logits):
        assert rel(a, b) < 1e-5
