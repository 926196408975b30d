"""FP4 experts (DeepSeek-V4's packed e2m1 + ue8m0): :class:`FP4Experts` against a float64 model of the MoE expert
math (dense and grouped, with and without V4's SwiGLU clamp); :func:`load_fp4_experts` on a tiny DeepSeek-named
checkpoint (``w1``/``w3``/``w2``, ``.scale``) with its errors; and ``from_pretrained`` of a V3-shaped checkpoint
whose routed experts are FP4, kept packed, against HF loading the float64 dequantization (logits 1e-4, greedy
tokens identical), compiled whole."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from mla_compile import from_pretrained
from mla_compile.models.checkpoint import CheckpointError
from mla_compile.models.fp4_checkpoint import expert_dtype, load_fp4_experts, parse_expert_key
from mla_compile.models.fp4_linear import FP4Experts
from mla_compile.models.fp8_linear import FP8BlockLinear
from mla_compile.serving.generate import greedy_generate, hf_greedy_reference
from tests.checkpoints import dequantize_fp4_64, quantize_fp4, write_checkpoint, write_dequantized

E, H, I = 6, 96, 64
PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [9, 10], [100, 200, 300, 400, 500]]


def _random_experts(seed=0, **kwargs) -> tuple[FP4Experts, dict[str, torch.Tensor]]:
    """An FP4Experts with random quantized weights, and the float64 weights they stand for."""
    torch.manual_seed(seed)
    module = FP4Experts(E, H, I, torch.nn.SiLU(), **kwargs)
    real = {}
    for name, (rows, cols) in module.shapes(H, I).items():
        packed, scale = quantize_fp4(torch.randn(E, rows, cols) * 0.2)
        getattr(module, name).data.copy_(packed.view(torch.uint8))
        getattr(module, name + "_scale_inv").data.copy_(scale)
        real[name] = dequantize_fp4_64(packed, scale)
    return module, real


def _moe64(x, weights, ids, real, limit=None):
    """The routed-experts sum in float64: ``sum_k w_k * down_e(silu(gate_e x) * up_e x)`` (clamped for V4)."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            g, u = real["gate_proj"][e] @ x[t].double(), real["up_proj"][e] @ x[t].double()
            if limit is not None:
                g, u = g.clamp(max=limit), u.clamp(-limit, limit)
            out[t] += float(weights[t, k]) * (real["down_proj"][e] @ (F.silu(g) * u))
    return out


@pytest.mark.parametrize("limit", [None, 0.3])
@pytest.mark.parametrize("grouped", [False, True])
def test_fp4_experts_match_float64(grouped, limit):
    module, real = _random_experts(swiglu_limit=limit)
    x = torch.randn(9, H)
    ids = torch.stack([torch.randperm(E)[:3] for _ in range(9)])
    weights = torch.rand(9, 3)
    y = module(x, weights, ids, grouped=grouped)
    want = _moe64(x, weights, ids, real, limit)
    assert y.shape == (9, H) and y.dtype == torch.float32
    assert float((y.double() - want).norm() / want.norm()) < 1e-5
    if limit is not None:  # the clamp bites: without it the result differs
        assert float((_moe64(x, weights, ids, real) - want).norm() / want.norm()) > 1e-3


def test_fp4_experts_take_bf16_activations_and_routing_weights():
    """V4's router gives its weights in x's dtype (bf16 in a bf16 model): the experts take them as they come."""
    module, real = _random_experts(swiglu_limit=0.3)
    x = torch.randn(4, H).bfloat16()
    ids = torch.stack([torch.randperm(E)[:3] for _ in range(4)])
    weights = torch.rand(4, 3).bfloat16()
    y = module(x, weights, ids)
    want = _moe64(x.float(), weights.float(), ids, real, 0.3)
    assert y.dtype == torch.float32 and float((y.double() - want).norm() / want.norm()) < 1e-2


def test_fp4_experts_hold_packed_bytes():
    module = FP4Experts(E, H, I, torch.nn.SiLU())
    assert module.gate_proj.dtype == torch.uint8 and module.gate_proj.shape == (E, I, H // 2)
    assert module.down_proj_scale_inv.shape == (E, H, I // 32)
    nbytes = sum(p.numel() for p in module.parameters())
    assert nbytes == 3 * E * H * I // 2 + 3 * E * H * I // 32  # 0.53 bytes per weight
    with pytest.raises(ValueError, match="hidden size 100 must be a multiple of 32"):
        FP4Experts(E, 100, I, torch.nn.SiLU())


def test_parse_expert_key_both_spellings():
    p = parse_expert_key("layers.3.ffn.experts.17.w3.scale")
    assert (p.module, p.index, p.proj, p.kind) == ("layers.3.ffn.experts", 17, "up_proj", "scale")
    p = parse_expert_key("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv")
    assert (p.module, p.index, p.proj, p.kind) == ("model.layers.1.mlp.experts", 0, "down_proj", "scale")
    assert parse_expert_key("layers.3.ffn.shared_experts.w1.weight") is None


def test_expert_dtype_from_config():
    from types import SimpleNamespace as NS

    assert expert_dtype(NS(quantization_config={"quant_method": "fp8", "expert_dtype": "fp4"})) == "fp4"
    assert expert_dtype(NS(quantization_config={"quant_method": "fp8"}, expert_dtype="fp4")) == "fp4"  # V4 top level
    assert expert_dtype(NS(quantization_config=None)) is None
    with pytest.raises(CheckpointError, match="expert_dtype is 'int4'"):
        expert_dtype(NS(quantization_config={"expert_dtype": "int4"}))


def _write_deepseek_experts(root, layers=(0, 1), seed=0, drop=None, change=None):
    """A DeepSeek-named (V4 raw) checkpoint holding only routed experts: ``layers.{i}.ffn.experts.{j}.w{1,3,2}
    .{weight,scale}``, int8 codes and float8_e8m0fnu scales, one shard per layer plus the index."""
    torch.manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)
    names = {"w1": (I, H), "w3": (I, H), "w2": (H, I)}
    weight_map, stored = {}, {}
    for layer in layers:
        tensors = {}
        for j in range(E):
            for w, (rows, cols) in names.items():
                packed, scale = quantize_fp4(torch.randn(rows, cols))
                key = f"layers.{layer}.ffn.experts.{j}.{w}"
                tensors[key + ".weight"], tensors[key + ".scale"] = packed, scale.view(torch.float8_e8m0fnu)
        if change:
            tensors.update(change)
        tensors.pop(drop, None)
        file = f"model-{layer:05d}.safetensors"
        save_file(tensors, str(root / file))
        weight_map.update({k: file for k in tensors})
        stored.update(tensors)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return stored


def test_load_fp4_experts_deepseek_names(tmp_path):
    stored = _write_deepseek_experts(tmp_path)
    modules = {f"layers.{i}.ffn.experts": FP4Experts(E, H, I, torch.nn.SiLU(), device="meta") for i in (0, 1)}
    assert load_fp4_experts(tmp_path, modules) == 2 * E * 3 * 2
    for layer in (0, 1):
        m = modules[f"layers.{layer}.ffn.experts"]
        assert not m.gate_proj.is_meta and m.gate_proj.dtype == torch.uint8
        for j in (0, E - 1):
            for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                key = f"layers.{layer}.ffn.experts.{j}.{w}"
                assert torch.equal(getattr(m, proj)[j], stored[key + ".weight"].view(torch.uint8))
                assert torch.equal(getattr(m, proj + "_scale_inv")[j], stored[key + ".scale"].view(torch.uint8))
    # the loaded module computes with the stored weights
    m = modules["layers.1.ffn.experts"]
    real = {proj: torch.stack([dequantize_fp4_64(stored[f"layers.1.ffn.experts.{j}.{w}.weight"],
                                                 stored[f"layers.1.ffn.experts.{j}.{w}.scale"]) for j in range(E)])
            for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))}
    x, ids, weights = torch.randn(4, H) * 0.1, torch.tensor([[0, 5], [1, 2], [3, 3], [4, 0]]), torch.rand(4, 2)
    want = _moe64(x, weights, ids, real)
    assert float((m(x, weights, ids).double() - want).norm() / want.norm()) < 1e-5


@pytest.mark.parametrize("drop,change,match", [
    ("layers.1.ffn.experts.4.w2.scale", None, r"1 fp4 expert tensors missing .*layers\.1\.ffn\.experts\.4\.down_proj"),
    (None, {"layers.1.ffn.experts.2.w1.weight": torch.zeros(I, H // 4, dtype=torch.int8)},
     r"model-00001.safetensors: tensor layers\.1\.ffn\.experts\.2\.w1\.weight: shape \[64, 24\], expected \[64, 48\]"),
    (None, {"layers.1.ffn.experts.2.w3.weight": torch.zeros(I, H // 2)},
     r"tensor layers\.1\.ffn\.experts\.2\.w3\.weight: dtype torch.float32, expected packed e2m1"),
    (None, {"layers.1.ffn.experts.2.w3.scale": torch.zeros(I, H // 32)},
     r"tensor layers\.1\.ffn\.experts\.2\.w3\.scale: dtype torch.float32, expected ue8m0"),
])
def test_load_fp4_experts_errors_name_the_tensor(tmp_path, drop, change, match):
    _write_deepseek_experts(tmp_path, drop=drop, change=change)
    modules = {f"layers.{i}.ffn.experts": FP4Experts(E, H, I, torch.nn.SiLU(), device="meta") for i in (0, 1)}
    with pytest.raises(CheckpointError, match=match):
        load_fp4_experts(tmp_path, modules)


@pytest.fixture(scope="module")
def v3_fp4(tmp_path_factory):
    root = tmp_path_factory.mktemp("v3-fp4")
    write_checkpoint(root, "v3", "fp4", seed=5)
    return root


def test_from_pretrained_fp4_experts_match_hf(v3_fp4, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = from_pretrained(v3_fp4, dtype=torch.float32)
    moe = model.model.layers[1].mlp
    assert isinstance(moe.experts, FP4Experts) and isinstance(model.model.layers[1].self_attn.o_proj, FP8BlockLinear)
    assert moe.experts.down_proj.dtype == torch.uint8  # kept packed, never dequantized at load
    index = json.loads((v3_fp4 / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    with safe_open(str(v3_fp4 / index[key]), framework="pt") as f:
        assert f.get_tensor(key).dtype == torch.int8
        assert torch.equal(moe.experts.up_proj[3], f.get_tensor(key).view(torch.uint8))
    src = tmp_path / "dequantized"
    write_dequantized(v3_fp4, src)
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float64, attn_implementation="eager",
                                               experts_implementation="eager").eval()
    steps = 4
    want_tokens, want_logits = hf_greedy_reference(ref, PROMPTS, steps)
    model.allocate_cache(32, 4, fill=float("nan"))
    res = greedy_generate(model, PROMPTS, steps, block_size=4, num_blocks=32, keep_logits=True, dynamic=False)
    assert res.tokens == want_tokens
    for s in range(steps):
        want = torch.stack([want_logits[i][s] for i in range(len(PROMPTS))]).double()
        assert float((res.step_logits[s].double() - want).norm() / want.norm()) < 1e-4


def test_from_pretrained_fp4_grouped_equals_dense_and_compiles(v3_fp4):
    from torch._dynamo.utils import counters

    dense = from_pretrained(v3_fp4, dtype=torch.float32, moe_impl="dense")
    grouped = from_pretrained(v3_fp4, dtype=torch.float32, moe_impl="grouped")
    dense.allocate_cache(32, 4)
    grouped.allocate_cache(32, 4)
    a = greedy_generate(dense, PROMPTS, 3, block_size=4, num_blocks=32, keep_logits=True)
    b = greedy_generate(grouped, PROMPTS, 3, block_size=4, num_blocks=32, keep_logits=True)
    assert a.tokens == b.tokens
    torch._dynamo.reset()
    counters.clear()
    dense.allocate_cache(32, 4)
    c = greedy_generate(torch.compile(dense, fullgraph=True), PROMPTS, 2, block_size=4, num_blocks=32,
                        keep_logits=True)
    assert all(ct == at[:len(ct)] for ct, at in zip(c.tokens, a.tokens)) and sum(counters["graph_break"].values()) == 0
    for s in range(2):
        torch.testing.assert_close(c.step_logits[s], a.step_logits[s], atol=1e-4, rtol=1e-4)


def test_fp4_checkpoint_without_expert_dtype_is_refused(tmp_path):
    root = tmp_path / "v3-fp4"
    write_checkpoint(root, "v3", "fp4", seed=1)
    config = json.loads((root / "config.json").read_text())
    del config["quantization_config"]["expert_dtype"]
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"experts\.\d+\.\w+_proj\.weight is torch.int8: packed fp4 expert "
                                              r"weights need quantization_config.expert_dtype 'fp4'"):
        from_pretrained(root, dtype=torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["triton", None])
@pytest.mark.parametrize("grouped", [False, True])
def test_fp4_experts_on_gpu(grouped, backend):
    module, real = _random_experts(swiglu_limit=0.3)
    module = module.cuda()
    module.backend = backend
    x = torch.randn(9, H)
    ids = torch.stack([torch.randperm(E)[:3] for _ in range(9)])
    weights = torch.rand(9, 3)
    y = module(x.cuda().bfloat16(), weights.cuda(), ids.cuda(), grouped=grouped)
    want = _moe64(x.bfloat16().float(), weights, ids, real, 0.3)
    assert float((y.cpu().double() - want).norm() / want.norm()) < 2e-2  # bf16 operands and intermediate
