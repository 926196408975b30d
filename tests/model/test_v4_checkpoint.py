"""``from_pretrained`` of DeepSeek-V4 checkpoint directories (mla_compile/models/v4_loader.py).

A toy V4 (every attention and MoE kind, mHC) is written with transformers' ``save_pretrained`` in several
shards, or rewritten into DeepSeek's own tensor names (the hub release's spelling) or transformers' module
names. Float checkpoints: logits at every position within 1e-4 relative of the HF model (float32) and
greedy tokens identical through V4Sequences. Quantized ones (fp8 128 x 128 blocks with ue8m0 scales named
``.scale``, as V4-Flash ships them; fp8 or fp4 experts): against HF float64 running the dequantized weights
(dequantized here from the format's definition). Broken checkpoints: CheckpointError naming file and tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM", allow_module_level=True)

from mla_compile import from_pretrained  # noqa: E402
from mla_compile.app.v4_toy import toy_v4_model  # noqa: E402
from mla_compile.models.checkpoint import CheckpointError  # noqa: E402
from mla_compile.models.fp4_linear import FP4Experts  # noqa: E402
from mla_compile.models.fp8_linear import FP8BlockLinear, FP8Experts, FP8GroupedLinear  # noqa: E402
from mla_compile.models.v4_loader import v4_model_name  # noqa: E402
from mla_compile.models.v4_model import V4ForCausalLM, V4Sequences  # noqa: E402
from tests.checkpoints import (INDEX, dequantize_fp4_64, edit_json, quantize_fp4, rewrite_shard,  # noqa: E402
                               weight_map)
from tests.model.test_v4_model import hf_greedy, ours_greedy, prompts  # noqa: E402

NAN = float("nan")
E8M0 = getattr(torch, "float8_e8m0fnu", None)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _tensors(root):
    """Every tensor of the checkpoint at ``root`` (tiny: fine to hold in a test)."""
    out = {}
    for file in sorted(p for p in os.listdir(root) if p.endswith(".safetensors")):
        with safe_open(str(root / file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _write(root, tensors, config_from, shards=4, config_change=None):
    """``tensors`` as a sharded checkpoint at ``root`` (round-robin over ``shards`` files), config.json copied
    from ``config_from`` and edited by ``config_change``."""
    root.mkdir(parents=True)
    config = json.loads((config_from / "config.json").read_text())
    if config_change:
        config_change(config)
    (root / "config.json").write_text(json.dumps(config))
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    parts, weight_map = [{} for _ in names], {}
    for i, (k, t) in enumerate(sorted(tensors.items())):
        parts[i % shards][k] = t.contiguous()
        weight_map[k] = names[i % shards]
    for name, part in zip(names, parts):
        save_file(part, str(root / name), metadata={"format": "pt"})
    (root / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _deepseek_names(tensors):
    """transformers' ``save_pretrained`` output renamed into DeepSeek's release spelling (no ``model.`` prefix,
    ``embed``, ``hc_head_fn``) plus one MTP tensor, which the loader must skip."""
    out = {}
    for k, t in tensors.items():
        k = k.removeprefix("model.").replace("embed_tokens.", "embed.").replace("hc_head.hc_", "hc_head_")
        out[k] = t
    out["mtp.0.attn.wq_a.weight"] = torch.full((3, 3), NAN)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The toy saved by transformers in several shards; returns (hf model, directory)."""
    hf = toy_v4_model(21)
    root = tmp_path_factory.mktemp("v4-saved")
    hf.save_pretrained(str(root), max_shard_size="20KB")
    assert len(list(root.glob("*.safetensors"))) >= 4
    return hf, root


@torch.no_grad()
def test_float_checkpoint_matches_hf(saved):
    """transformers' save_pretrained output: logits at every position and 8 greedy steps as HF's."""
    hf, root = saved
    model = from_pretrained(root, dtype=torch.float32)
    assert isinstance(model, V4ForCausalLM)
    ps = prompts(21, [23, 5, 30])
    ref = [hf(torch.tensor([p])).logits[0] for p in ps]
    seqs = V4Sequences(model, 3, 40, 4, fill=NAN)
    ids, pos, meta = seqs.metadata([0, 1, 2], ps)
    meta.logits_indices = None
    assert _rel(model(ids, pos, meta), torch.cat(ref)) < 1e-4
    got = ours_greedy(model, None, ps[:2], 8)
    for p, mine in zip(ps, got):
        _, ref_logits, ref_tokens = hf_greedy(hf, p, 8)
        assert [int(x.argmax()) for x in mine] == ref_tokens
        assert _rel(torch.stack(mine), torch.stack(ref_logits)) < 1e-4


@pytest.mark.parametrize("spelling", ["deepseek", "modules"])
def test_other_spellings_load_the_same_weights(saved, tmp_path, spelling):
    """DeepSeek's release names (plus an MTP tensor, skipped) and transformers' module names (stacked experts)
    give every parameter and buffer of the HF model exactly."""
    hf, root = saved
    src = tmp_path / spelling
    if spelling == "deepseek":
        _write(src, _deepseek_names(_tensors(root)), root)
        assert "layers.0.attn.compressor.ape" in json.loads((src / INDEX).read_text())["weight_map"]
    else:
        _write(src, {k: v.clone() for k, v in hf.state_dict().items()}, root)
    model = from_pretrained(src, dtype=torch.float32)
    want = dict(hf.named_parameters()) | dict(hf.named_buffers())
    got = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_bf16_keeps_fp32_modules_and_matches(saved):
    """dtype=bfloat16: projections in bf16, transformers' strict fp32 modules (norms, sinks, mHC, position biases)
    in float32; logits near the float32 model's."""
    hf, root = saved
    model = from_pretrained(root, dtype=torch.bfloat16)
    attn = model.model.layers[0].self_attn
    assert attn.q_a_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.experts.down_proj.dtype == torch.bfloat16
    assert attn.sinks.dtype == torch.float32 and attn.compressor.position_bias.dtype == torch.float32
    assert model.model.layers[0].attn_hc.fn.dtype == torch.float32 and model.model.norm.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.gate.tid2eid.dtype == torch.int64
    out = []
    for m in (from_pretrained(root, dtype=torch.float32), model):
        seqs = V4Sequences(m, 2, 32, 4, fill=NAN)
        ids, pos, meta = seqs.metadata([0, 1], prompts(25, [13, 7]))
        meta.logits_indices = None
        with torch.no_grad():
            out.append(m(ids, pos, meta))
    assert out[1].dtype == torch.bfloat16
    assert _rel(out[1], out[0]) < 5e-2  # bf16 rounding of weights and activations (measured: 2e-2)


def test_model_names():
    """DeepSeek's spelling -> transformers' (facts of transformers' conversion mapping); module names pass."""
    cases = {
        "embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
        "hc_head_scale": "model.hc_head.hc_scale", "layers.3.hc_ffn_base": "model.layers.3.ffn_hc.base",
        "layers.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "layers.0.attn.norm.weight": "model.layers.0.self_attn.kv_norm.weight",
        "layers.0.attn.attn_sink": "model.layers.0.self_attn.sinks",
        "layers.0.attn.compressor.norm.weight": "model.layers.0.self_attn.compressor.kv_norm.weight",
        "layers.0.attn.indexer.compressor.wgate.weight": "model.layers.0.self_attn.compressor.indexer.gate_proj.weight",
        "layers.0.attn.indexer.weights_proj.weight":
            "model.layers.0.self_attn.compressor.indexer.scorer.weights_proj.weight",
        "layers.0.attn.indexer.wq_b.scale": "model.layers.0.self_attn.compressor.indexer.q_b_proj.weight_scale_inv",
        "layers.2.attn.wo_a.scale": "model.layers.2.self_attn.o_a_proj.weight_scale_inv",
        "layers.2.ffn.gate.bias": "model.layers.2.mlp.gate.e_score_correction_bias",
        "layers.2.ffn.experts.7.w3.scale": "model.layers.2.mlp.experts.7.up_proj.weight_scale_inv",
        "layers.2.ffn.shared_experts.w2.weight": "model.layers.2.mlp.shared_experts.down_proj.weight",
        "model.layers.1.attn_hc.scale": "model.layers.1.attn_hc.scale",
        "model.layers.1.mlp.experts.gate_up_proj": "model.layers.1.mlp.experts.gate_up_proj",
    }
    for key, name in cases.items():
        assert v4_model_name(key) == name, key
    assert v4_model_name("mtp.0.attn.wq_a.weight") is None


# DeepSeek-V4-Flash's release, as its config.json and shard headers list it (facts: names, shapes, dtypes)
FLASH_CONFIG = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", hc_eps=1e-6, hc_mult=4, hc_sinkhorn_iters=20,
    head_dim=512, hidden_act="silu", hidden_size=4096, index_head_dim=128, index_n_heads=64, index_topk=512,
    max_position_embeddings=1048576, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
    norm_topk_prob=True, num_attention_heads=64, num_experts_per_tok=6, num_hidden_layers=43, num_hash_layers=3,
    num_key_value_heads=1, num_nextn_predict_layers=1, o_groups=8, o_lora_rank=1024, q_lora_rank=1024,
    qk_rope_head_dim=64, rms_norm_eps=1e-6, rope_theta=10000, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
    sliding_window=128, swiglu_limit=10.0, tie_word_embeddings=False, torch_dtype="bfloat16", vocab_size=129280,
    quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8", scale_fmt="ue8m0",
                             weight_block_size=[128, 128]),
    rope_scaling=dict(beta_fast=32, beta_slow=1, factor=16, original_max_position_embeddings=65536, type="yarn"),
    compress_rope_theta=160000, compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0])


def _flash_layout(layers, experts):
    """``(name, shape)`` of every tensor of V4-Flash's first ``layers`` layers (``experts`` routed experts each)
    and the top-level ones, in the release's spelling; MTP (``mtp.0.*``) left out."""
    H, V, Q, HD, NH, OG, OL, I = 4096, 129280, 1024, 512, 64, 8, 1024, 2048
    out = [("embed.weight", (V, H)), ("head.weight", (V, H)), ("norm.weight", (H,)), ("hc_head_base", (4,)),
           ("hc_head_fn", (4, 4 * H)), ("hc_head_scale", (1,))]

    def fp8(name, n, k):
        return [(f"{name}.weight", (n, k)), (f"{name}.scale", (-(-n // 128), -(-k // 128)))]

    for i in range(layers):
        p, rate = f"layers.{i}", FLASH_CONFIG["compress_ratios"][i]
        out += [(f"{p}.attn.attn_sink", (NH,)), (f"{p}.attn.kv_norm.weight", (HD,)), (f"{p}.attn.q_norm.weight", (Q,)),
                (f"{p}.attn_norm.weight", (H,)), (f"{p}.ffn_norm.weight", (H,)), (f"{p}.ffn.gate.weight", (256, H))]
        out += fp8(f"{p}.attn.wkv", HD, H) + fp8(f"{p}.attn.wo_a", OG * OL, NH * HD // OG)
        out += fp8(f"{p}.attn.wo_b", H, OG * OL) + fp8(f"{p}.attn.wq_a", Q, H) + fp8(f"{p}.attn.wq_b", NH * HD, Q)
        for w, (n, k) in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H))):
            out += fp8(f"{p}.ffn.shared_experts.{w}", n, k)
            out += [(f"{p}.ffn.experts.{j}.{w}.{kind}", (n, k // (2 if kind == "weight" else 32)))
                    for j in range(experts) for kind in ("weight", "scale")]
        out += [(f"{p}.hc_{hc}_{part}", {"base": (24,), "fn": (24, 4 * H), "scale": (3,)}[part])
                for hc in ("attn", "ffn") for part in ("base", "fn", "scale")]
        out.append((f"{p}.ffn.gate.tid2eid", (V, 6)) if i < 3 else (f"{p}.ffn.gate.bias", (256,)))
        if rate:
            c = 2 * HD if rate == 4 else HD
            out += [(f"{p}.attn.compressor.ape", (rate, c)), (f"{p}.attn.compressor.norm.weight", (HD,)),
                    (f"{p}.attn.compressor.wgate.weight", (c, H)), (f"{p}.attn.compressor.wkv.weight", (c, H))]
        if rate == 4:
            out += [(f"{p}.attn.indexer.compressor.ape", (4, 256)),
                    (f"{p}.attn.indexer.compressor.norm.weight", (128,)),
                    (f"{p}.attn.indexer.compressor.wgate.weight", (256, H)),
                    (f"{p}.attn.indexer.compressor.wkv.weight", (256, H)),
                    (f"{p}.attn.indexer.weights_proj.weight", (64, H))] + fp8(f"{p}.attn.indexer.wq_b", 64 * 128, Q)
    return out


def test_v4_flash_release_layout_maps_onto_the_model(tmp_path):
    """Every tensor name of DeepSeek-V4-Flash's release (first 4 layers: sliding, hash MoE, CSA, HCA) lands on a
    parameter of the model built from its config.json (transformers converts the raw config), with the stored
    shape: fp8 linears as FP8BlockLinear / FP8GroupedLinear (o_a_proj: 8 groups of 1024 rows), packed experts as
    FP4Experts (no expert_dtype in that config.json: read from the int8 weights). Meta device, no data."""
    from mla_compile.models.checkpoint import ShardIndex
    from mla_compile.models.v4_loader import _EXPERT, _Entry, _V4Loader

    config = dict(FLASH_CONFIG, num_hidden_layers=4, compress_ratios=FLASH_CONFIG["compress_ratios"][:4])
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert cfg.layer_types == ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                               "heavily_compressed_attention"]
    layout = _flash_layout(4, cfg.n_routed_experts)
    with torch.device("meta"):
        hf = transformers.DeepseekV4ForCausalLM(cfg)
    entries = [_Entry(k, "shard", v4_model_name(k)) for k, _ in layout]
    index = ShardIndex(tmp_path, {k: "shard" for k, _ in layout})
    _V4Loader(hf, cfg, index, entries, torch.device("meta"), torch.bfloat16, fp4=True)
    attn, experts = hf.model.layers[2].self_attn, hf.model.layers[2].mlp.experts
    assert isinstance(attn.o_a_proj, FP8GroupedLinear) and isinstance(attn.q_b_proj, FP8BlockLinear)
    assert isinstance(experts, FP4Experts) and experts.swiglu_limit == 10.0
    assert type(attn.compressor.kv_proj) is torch.nn.Linear  # bf16 in the release: no scale, stays a Linear
    for (key, shape), e in zip(layout, entries):
        m = _EXPERT.match(e.name)
        if m:
            kind = "weight" if m["name"] == "weight" else "scale"
            want = hf.get_submodule(m["module"]).expected_shape(m["proj"], kind)
        else:
            prefix, _, attr = e.name.rpartition(".")
            module = hf.get_submodule(prefix)
            want = module._parameters.get(attr, module._buffers.get(attr)).shape
        assert tuple(want) == shape, (key, e.name, shape, tuple(want))


# ---- quantized checkpoints ----------------------------------------------------------------------------------

FP8_LINEAR = ("attn.wq_a.", "attn.wq_b.", "attn.wkv.", "attn.wo_a.", "attn.wo_b.", "indexer.wq_b.",
              "shared_experts.w", "head.")  # V4-Flash's fp8 linears (+ lm_head here: its dequantized path)


def _quantize_e8m0(w):
    """``w [N, K]`` -> e4m3 codes and ue8m0 block scales ``2^ceil(log2(amax / 448))`` per 128 x 128 block."""
    N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    blocks = torch.nn.functional.pad(w.double(), (0, kb * 128 - K, 0, nb * 128 - N)).view(nb, 128, kb, 128)
    exp = torch.ceil(torch.log2(blocks.abs().amax(dim=(1, 3)).clamp_min(2.0 ** -100) / 448.0))
    codes = (blocks / torch.exp2(exp)[:, None, :, None]).to(torch.float8_e4m3fn)
    return codes.view(nb * 128, kb * 128)[:N, :K].contiguous(), (exp + 127).to(torch.uint8)


def _dequantize64(codes, scale_bytes):
    """The float64 weight of e4m3 codes and ue8m0 block scale bytes (the format's definition)."""
    N, K = codes.shape
    s = torch.exp2(scale_bytes.double() - 127).repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    return codes.double() * s


def _quantized_checkpoint(root, kind, **overrides):
    """A V4 toy as a DeepSeek-named checkpoint with fp8 linears (ue8m0 ``.scale``) and ``kind`` experts ("fp8":
    e4m3 blocks; "fp4": packed e2m1 + ue8m0 per 32); returns the float64 HF reference of the stored weights."""
    hf = toy_v4_model(22, **overrides)
    src = root.parent / f"{root.name}-src"
    hf.save_pretrained(str(src), max_shard_size="20KB")
    tensors, ref = _deepseek_names(_tensors(src)), {}
    out = {}
    for k, t in tensors.items():
        expert = ".ffn.experts." in k
        if k.startswith("mtp."):
            out[k] = t
        elif k.endswith(".weight") and expert and kind == "fp4":
            packed, scale = quantize_fp4(t)
            out[k], out[k[: -len(".weight")] + ".scale"] = packed, scale.view(E8M0)
            ref[k] = dequantize_fp4_64(packed, scale)
        elif k.endswith(".weight") and (expert or any(p in k for p in FP8_LINEAR)):
            codes, scale = _quantize_e8m0(t)
            out[k], out[k[: -len(".weight")] + ".scale"] = codes, scale.view(E8M0)
            ref[k] = _dequantize64(codes, scale)
        else:
            out[k] = t

    def config(c):
        c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
        if kind == "fp4":
            c["expert_dtype"] = "fp4"  # top level, as DeepSeek-V4's config.json has it
    _write(root, out, src, config_change=config)
    # the float64 reference: the HF model with the stored weights dequantized
    state = {}
    for k, w in ref.items():
        name = v4_model_name(k)
        if ".experts." in name and not name.endswith("gate_up_proj"):
            module, j, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
            state.setdefault(module, {})[(j, proj)] = w
        else:
            state[name] = w
    hf = hf.double()
    if hasattr(hf, "set_experts_implementation"):  # torch._grouped_mm takes no float64
        hf.set_experts_implementation("eager")
    else:
        hf.config._experts_implementation = "eager"
    with torch.no_grad():
        for name, w in state.items():
            if isinstance(w, dict):  # experts: stacked [gate; up] and down
                ex = hf.get_submodule(name)
                for (j, proj), wj in w.items():
                    I = ex.down_proj.shape[2]
                    if proj == "down_proj":
                        ex.down_proj[j] = wj
                    else:
                        ex.gate_up_proj[j, (0 if proj == "gate_proj" else I):][:I] = wj
            else:
                hf.get_parameter(name).copy_(w)
    return hf


@pytest.mark.skipif(E8M0 is None, reason="torch without float8_e8m0fnu")
@pytest.mark.parametrize("kind,overrides", [("fp8", {}), ("fp8", {"o_lora_rank": 128}),
                                            ("fp4", {"moe_intermediate_size": 32})],
                         ids=["fp8", "fp8-grouped-o_a", "fp4-experts"])
@torch.no_grad()
def test_quantized_checkpoint_matches_float64_dequantized(tmp_path, kind, overrides):
    root = tmp_path / "q"
    ref = _quantized_checkpoint(root, kind, **overrides)
    model = from_pretrained(root, dtype=torch.float32)
    layer = model.model.layers[1]
    assert isinstance(layer.self_attn.q_b_proj, FP8BlockLinear)
    assert layer.self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    assert isinstance(layer.mlp.shared_experts.up_proj, FP8BlockLinear)
    assert isinstance(layer.self_attn.o_a_proj, FP8GroupedLinear) == ("o_lora_rank" in overrides)
    assert isinstance(layer.mlp.experts, FP4Experts if kind == "fp4" else FP8Experts)
    assert layer.mlp.experts.swiglu_limit == 2.0
    assert model.lm_head.weight.dtype == torch.float32  # dequantized at load: lm_head has no fp8 form here
    assert layer.self_attn.compressor.kv_proj.weight.dtype == torch.float32  # bf16 in V4-Flash: no scale
    ps = prompts(22, [19, 6])
    want = torch.cat([ref(torch.tensor([p])).logits[0] for p in ps])
    seqs = V4Sequences(model, 2, 32, 4, fill=NAN)
    ids, pos, meta = seqs.metadata([0, 1], ps)
    meta.logits_indices = None
    assert _rel(model(ids, pos, meta), want) < 1e-4
    got = ours_greedy(model, None, ps, 4)
    for p, mine in zip(ps, got):
        _, ref_logits, ref_tokens = hf_greedy(ref, p, 4)
        assert [int(x.argmax()) for x in mine] == ref_tokens
        assert _rel(torch.stack(mine), torch.stack(ref_logits)) < 1e-4


@pytest.mark.skipif(E8M0 is None, reason="torch without float8_e8m0fnu")
@pytest.mark.usefixtures("fresh_dynamo")
def test_quantized_compiles_whole(tmp_path):
    """fp8 linears, the grouped fp8 o_a_proj and fp8 experts under ``torch.compile(fullgraph=True)``
    (aot_eager): no graph breaks, equal to eager."""
    from torch._dynamo.utils import counters

    root = tmp_path / "q"
    _quantized_checkpoint(root, "fp8", o_lora_rank=128)
    model = from_pretrained(root, dtype=torch.float32)
    ps = prompts(23, [11, 5])
    eager = ours_greedy(model, model, ps, 2)
    compiled = ours_greedy(model, torch.compile(model, fullgraph=True, backend="aot_eager"), ps, 2)
    assert dict(counters["graph_break"]) == {}
    for a, b in zip(compiled, eager):
        assert _rel(torch.stack(a), torch.stack(b)) < 1e-5


@pytest.mark.skipif(E8M0 is None, reason="torch without float8_e8m0fnu")
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
@torch.no_grad()
def test_quantized_bf16_matches_float32(tmp_path, kind):
    """The quantized checkpoint loaded in bf16 (the router's weights then bf16, as the experts ops get them) runs
    its experts' ops and stays near the float32 load (the ops' numbers are tested against float64 in
    tests/ops/test_moe_experts_fp8.py and test_moe_experts_fp4.py)."""
    root = tmp_path / "q"
    _quantized_checkpoint(root, kind, moe_intermediate_size=32)
    ps = prompts(24, [19, 6])
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        model = from_pretrained(root, dtype=dtype)
        seqs = V4Sequences(model, 2, 32, 4, fill=NAN)
        ids, pos, meta = seqs.metadata([0, 1], ps)
        meta.logits_indices = None
        out.append(model(ids, pos, meta).float())
    assert out[1].isfinite().all()
    # bf16 rounding of activations and of the unquantized weights; a row's error is the median's: one bf16 routing
    # flip in this toy moves a few rows by ~0.3 (measured: fp8 rows median 0.019, two rows 0.28 / 0.32)
    rows = (out[1] - out[0]).norm(dim=-1) / out[0].norm(dim=-1)
    assert float(rows.median()) < 5e-2


@pytest.mark.cuda
@pytest.mark.skipif(E8M0 is None, reason="torch without float8_e8m0fnu")
@pytest.mark.parametrize("kind,overrides", [("fp8", {"o_lora_rank": 128}), ("fp4", {"moe_intermediate_size": 32})],
                         ids=["fp8-grouped-o_a", "fp4-experts"])
@torch.no_grad()
def test_quantized_on_cuda_matches_cpu(tmp_path, kind, overrides):
    """The quantized checkpoint loaded onto the GPU (the fp8 / fp4 ops' CUDA backends) against the CPU load."""
    root = tmp_path / "q"
    _quantized_checkpoint(root, kind, **overrides)
    ps = prompts(24, [19, 6])
    out = []
    for device in ("cpu", "cuda"):
        model = from_pretrained(root, dtype=torch.float32, device=device)
        assert model.lm_head.weight.device.type == device
        seqs = V4Sequences(model, 2, 32, 4, fill=NAN)
        ids, pos, meta = seqs.metadata([0, 1], ps)
        meta.logits_indices = None
        out.append(model(ids.to(device), pos.to(device), meta.to(device)).cpu())
    assert _rel(out[1], out[0]) < 1e-3


# ---- broken checkpoints -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4q") / "q"
    _quantized_checkpoint(root, "fp8")
    return root


@pytest.fixture
def ckpt(pristine, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    return root




@pytest.mark.parametrize("form", ["uint8", "float32"])
def test_block_scale_storage_forms_load_the_same(pristine, tmp_path, form):
    """ue8m0 scales as uint8 bytes (``scale_fmt: ue8m0``) or as float32 ``weight_scale_inv`` (V3's form) give the
    same model as the float8_e8m0fnu ``.scale`` tensors."""
    tensors = {}
    for k, t in _tensors(pristine).items():
        if t.dtype == E8M0 and form == "uint8":
            t = t.view(torch.uint8)
        elif t.dtype == E8M0:
            k, t = k.removesuffix(".scale") + ".weight_scale_inv", t.float()
        tensors[k] = t
    _write(tmp_path / "ckpt", tensors, pristine)
    want = from_pretrained(pristine, dtype=torch.float32)
    got = from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    theirs = dict(got.named_parameters())
    for name, t in want.named_parameters():
        assert theirs[name].dtype == t.dtype, name
        if t.dtype == torch.float8_e4m3fn:  # compared as bytes: torch.equal of fp8 needs a recent torch
            t, theirs[name] = t.view(torch.uint8), theirs[name].view(torch.uint8)
        assert torch.equal(theirs[name], t), name


def test_missing_shard(ckpt):
    file = weight_map(ckpt)["layers.1.attn.wo_b.weight"]
    (ckpt / file).unlink()
    with pytest.raises(CheckpointError, match=f"{file}: missing shard"):
        from_pretrained(ckpt)


def test_wrong_shape(ckpt):
    key = "layers.0.attn.q_norm.weight"
    file = rewrite_shard(ckpt, key, lambda t: t.update({key: torch.ones(7)}))
    with pytest.raises(CheckpointError, match=rf"{file}: tensor {key} \(model.layers.0.self_attn.q_a_norm.weight\) "
                       r"has shape \[7\].*expects \[16\]"):
        from_pretrained(ckpt)


def test_missing_tensor_names_its_shard(ckpt):
    key = "layers.2.ffn.experts.3.w3.weight"
    file = rewrite_shard(ckpt, key, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=f"{file}: tensor {key} is listed in the index but not in this shard"):
        from_pretrained(ckpt)
    edit_json(ckpt / INDEX, lambda d: d["weight_map"].pop(key))
    missing = r"model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight\b"
    with pytest.raises(CheckpointError, match=rf"1 tensors missing.*{missing}"):
        from_pretrained(ckpt)


def test_missing_plain_tensor(ckpt):
    key = "layers.1.attn.compressor.ape"
    rewrite_shard(ckpt, key, lambda t: t.pop(key))
    edit_json(ckpt / INDEX, lambda d: d["weight_map"].pop(key))
    missing = r"model\.layers\.1\.self_attn\.compressor\.position_bias"
    with pytest.raises(CheckpointError, match=rf"1 tensors missing.*{missing}"):
        from_pretrained(ckpt)


def test_fp8_weight_without_scale(ckpt):
    key, scale = "layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale"
    file = weight_map(ckpt)[key]
    rewrite_shard(ckpt, scale, lambda t: t.pop(scale))
    edit_json(ckpt / INDEX, lambda d: d["weight_map"].pop(scale))
    with pytest.raises(CheckpointError, match=f"{file}: tensor {key} is float8_e4m3fn but its block scale"):
        from_pretrained(ckpt)


def test_scaled_weight_that_is_not_fp8(ckpt):
    key = "layers.1.attn.wo_b.weight"
    file = rewrite_shard(ckpt, key, lambda t: t.update({key: t[key].to(torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=f"{file}: tensor {key} is torch.bfloat16, but the model expects "
                       "torch.float8_e4m3fn"):
        from_pretrained(ckpt)


def test_bad_scale_dtype(ckpt):
    key = "layers.1.attn.wq_a.scale"
    file = rewrite_shard(ckpt, key, lambda t: t.update({key: t[key].view(torch.uint8).to(torch.int32)}))
    with pytest.raises(CheckpointError, match=f"{file}: tensor {key} is torch.int32; a block scale"):
        from_pretrained(ckpt)


def test_fp4_dims_not_multiple_of_32(tmp_path):
    root = tmp_path / "q"
    _quantized_checkpoint(root, "fp4", moe_intermediate_size=32)
    edit_json(root / "config.json", lambda c: c.update(moe_intermediate_size=16))
    with pytest.raises(CheckpointError, match=r"config.json: expert_dtype 'fp4' for model.layers.0.mlp.experts: "
                       "FP4Experts: intermediate size 16 must be a multiple of 32"):
        from_pretrained(root)


def test_packed_experts_without_expert_dtype(tmp_path):
    """No expert_dtype in config.json (DeepSeek-V4-Flash's first release): int8 expert weights load as packed
    fp4; an explicit expert_dtype 'fp8' with int8 expert weights is refused, naming the tensor."""
    root = tmp_path / "q"
    _quantized_checkpoint(root, "fp4", moe_intermediate_size=32)
    config = json.loads((root / "config.json").read_text())
    del config["expert_dtype"]
    (root / "config.json").write_text(json.dumps(config))
    model = from_pretrained(root, dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, FP4Experts)
    with safe_open(str(root / weight_map(root)["layers.0.ffn.experts.1.w2.weight"]), framework="pt") as f:
        assert torch.equal(experts.down_proj[1], f.get_tensor("layers.0.ffn.experts.1.w2.weight").view(torch.uint8))
    config["expert_dtype"] = "fp8"
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensor layers\.0\.ffn\.experts\.\d+\.w\d\.weight is packed fp4 bytes, "
                       "but config.json says expert_dtype 'fp8'"):
        from_pretrained(root)


def test_unsupported_options(saved):
    """(``parallel=`` works: tests/test_parallel_v4.py.)"""
    _, root = saved
    with pytest.raises(NotImplementedError, match="kv_cache_dtype"):
        from_pretrained(root, kv_cache_dtype="fp8")


_MEASURE = """
import gc, json, sys, torch
from pathlib import Path
from mla_compile import from_pretrained
root = Path(sys.argv[1])
def status(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024
dtype = getattr(torch, sys.argv[2])
from_pretrained(root, dtype=dtype)  # a first load imports transformers' model code
gc.collect()
open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current RSS
before = status("VmRSS")
model = from_pretrained(root, dtype=dtype)
peak = status("VmHWM")
weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
print(json.dumps(dict(before=before, peak=peak, weights=weights)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_peak_host_memory_is_about_one_shard_plus_weights(tmp_path):
    """Peak RSS growth (VmHWM reset just before the load, fresh process) against 1.5 x the largest shard + the
    loaded weights, as tests/model/test_checkpoint_errors.py measures the V3 loader. Measured here: 34 MB
    against a bound of 48 MB (shards of 17 and 19 MB); a loader reading every shard before placing would hold
    36 MB of float32 tensors besides the 19 MB of bf16 weights."""
    from mla_compile.app.v4_toy import toy_v4_config

    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(toy_v4_config(vocab_size=131072)).float()  # embed + head: 2 x 16 MB
    root = tmp_path / "big"
    hf.save_pretrained(str(root), max_shard_size="20MB")
    del hf
    shards = [p.stat().st_size for p in root.glob("*.safetensors")]
    assert len(shards) >= 2
    # bfloat16: every float32 tensor is converted (copied), the demanding case (float32 ones may stay mapped)
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(root), "bfloat16"], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"))
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["before"]
    assert growth <= 1.5 * max(shards) + m["weights"], (growth, max(shards), m["weights"])
