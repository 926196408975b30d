"""Tiny DeepSeek checkpoints on disk, as the HF hub ships them: config.json, several safetensors shards with
model.safetensors.index.json, tokenizer.json (a BPE trained here) and tokenizer_config.json (chat template).

Formats: "bf16" is the unquantized layout (stored float32 here, so the loaded model can be compared with
HF at 1e-4 in float32: only the dtype of the stored tensors differs from a real bf16 checkpoint); "fp8" is
DeepSeek's: every projection weight e4m3 with a float32 ``weight_scale_inv`` per 128 x 128 block, norms,
embeddings, lm_head, router and indexer head weights unquantized; "fp4" is "fp8" with the routed experts in
DeepSeek-V4's format (``expert_dtype: "fp4"``): int8 packed e2m1 ``weight`` and float8_e8m0fnu
``weight_scale_inv`` per 32 weights of a row. The V3 checkpoints carry one MTP layer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mla_compile.app import toy

FP4_EXPERT = re.compile(r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
FP8_LINEAR = re.compile(r"(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)|"
                        r"mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj)|"
                        r"indexer\.(wq_b|wk))\.weight$")
INDEX = "model.safetensors.index.json"
TEXT = ["the quick brown fox jumps over the lazy dog", "latent attention caches one row per token",
        "deepseek models mix experts and attention", "hello world, this is a tiny tokenizer"]


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> e4m3 codes ``[N, K]`` and ``weight_scale_inv [ceil(N/128), ceil(K/128)]`` (amax / 448)."""
    N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    blocks = torch.nn.functional.pad(w.float(), (0, kb * 128 - K, 0, nb * 128 - N)).view(nb, 128, kb, 128)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(nb * 128, kb * 128)[:N, :K]
    return codes.contiguous(), scale


def dequantize64(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 weight the fp8 blocks stand for (an independent model of the format)."""
    N, K = codes.shape
    full = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    return codes.double() * full


# The e2m1 values of codes 0..7 (OCP Microscaling spec: 1 sign, 2 exponent, 1 mantissa bit); codes 8..15 are
# their negatives. Written out here as the format's definition, independent of the op's decoder.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_BLOCK = 32


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` (K a multiple of 32) -> DeepSeek-V4's fp4: packed ``int8 [..., N, K/2]`` (element 2j in
    byte j's low nibble) and ue8m0 ``uint8 [..., N, K/32]`` scales ``2^ceil(log2(amax / 6))``, codes rounded to
    the nearest e2m1 value."""
    *lead, N, K = w.shape
    blocks = w.double().reshape(*lead, N, K // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(-1).clamp_min(2.0 ** -120)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    q = blocks / torch.exp2(exp)[..., None]
    table = torch.tensor(E2M1, dtype=torch.float64)
    mag = (q.abs()[..., None] - table).abs().argmin(-1)
    codes = (mag + 8 * (q < 0)).reshape(*lead, N, K).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8).contiguous(), (exp + 127).to(torch.uint8)


def dequantize_fp4_64(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 weight ``[..., N, K]`` DeepSeek-V4's fp4 stands for (an independent model of the format)."""
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float64)
    b = packed.view(torch.uint8).long()
    values = torch.stack((table[b % 16], table[b // 16]), dim=-1).flatten(-2)
    s = scale.view(torch.uint8).double()
    mult = torch.where(s == 255, torch.nan, 2.0 ** (s - 127))
    return values * mult.repeat_interleave(FP4_BLOCK, dim=-1)


def write_tokenizer(root: Path) -> None:
    """A BPE tokenizer trained on a few sentences, plus a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<bos>", "<eos>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    tok.save(str(root / "tokenizer.json"))
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
         "unk_token": "<unk>", "chat_template": template}))


def write_checkpoint(root: Path, kind: str, fmt: str, *, seed: int = 0, shards: int = 3, **overrides):
    """Write a tiny ``kind`` ("v2-lite", "v3", "v3.2") checkpoint in ``fmt`` ("bf16", "fp8" or "fp4") to ``root``.

    Returns the HF model whose weights were written (float32). The state is split into at least ``shards``
    files by ``save_pretrained``'s own sharding; fp8 rewrites each shard with the quantized tensors.
    """
    hf = toy.toy_hf_model(kind, seed=seed, **overrides)
    total = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
    hf.save_pretrained(str(root), max_shard_size=total // (shards + 1))
    write_tokenizer(root)
    if kind != "v2-lite":
        _add_mtp_layer(root, hf.config)
    if fmt in ("fp8", "fp4"):
        _quantize_checkpoint(root, fp4_experts=fmt == "fp4")
    return hf


def _edit_config(root: Path, **changes) -> None:
    path = root / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config, indent=2))


def _index(root: Path) -> dict:
    return json.loads((root / INDEX).read_text())


def edit_json(path: Path, change) -> None:
    """Rewrite the JSON file ``path`` (a checkpoint's config or index) with ``change(data)`` applied in place."""
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def weight_map(root: Path) -> dict:
    """The checkpoint's index: tensor name -> shard file name."""
    return _index(root)["weight_map"]


def rewrite_shard(root: Path, key: str, change) -> str:
    """Rewrite the shard holding ``key`` with ``change(tensors)`` applied (a dict, edited in place); returns the
    shard's name (for checkpoint-error tests)."""
    file = weight_map(root)[key]
    with safe_open(str(root / file), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, str(root / file), metadata={"format": "pt"})
    return file


def _add_mtp_layer(root: Path, config) -> None:
    """One MTP layer (index num_hidden_layers) in its own shard, as V3/R1/V3.2 ship it."""
    i, h = config.num_hidden_layers, config.hidden_size
    tensors = {f"model.layers.{i}.eh_proj.weight": torch.randn(h, 2 * h),
               f"model.layers.{i}.enorm.weight": torch.ones(h), f"model.layers.{i}.hnorm.weight": torch.ones(h)}
    save_file(tensors, str(root / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = _index(root)
    index["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
    (root / INDEX).write_text(json.dumps(index, indent=2))
    _edit_config(root, num_nextn_predict_layers=1)


def _quantize_checkpoint(root: Path, fp4_experts: bool = False) -> None:
    index = _index(root)
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(root / file), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        out = {}
        for key, t in tensors.items():
            if fp4_experts and FP4_EXPERT.search(key):
                packed, scale = quantize_fp4(t)
                out[key], out[key + "_scale_inv"] = packed, scale.view(torch.float8_e8m0fnu)
                index["weight_map"][key + "_scale_inv"] = file
            elif FP8_LINEAR.search(key):
                out[key], out[key + "_scale_inv"] = quantize_blocks(t)
                index["weight_map"][key + "_scale_inv"] = file
            else:
                out[key] = t.to(torch.bfloat16) if t.is_floating_point() else t
        save_file(out, str(root / file), metadata={"format": "pt"})
    (root / INDEX).write_text(json.dumps(index, indent=2))
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    _edit_config(root, dtype="bfloat16", quantization_config=qc | ({"expert_dtype": "fp4"} if fp4_experts else {}))


def _dequantize64(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize_fp4_64(t, scale) if t.dtype == torch.int8 else dequantize64(t, scale)


def write_dequantized(src: Path, dst: Path) -> None:
    """``src`` (fp8 / fp4 experts) rewritten in float64 with every quantized weight dequantized, and no
    quantization_config: what ``transformers`` loads as the float64 reference of the checkpoint."""
    dst.mkdir(parents=True, exist_ok=True)
    index = _index(src)
    weight_map = {k: v for k, v in index["weight_map"].items() if not k.endswith("_scale_inv")}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(src / file), framework="pt") as f:
            keys = [k for k in f.keys() if not k.endswith("_scale_inv")]
            out = {k: (_dequantize64(f.get_tensor(k), f.get_tensor(k + "_scale_inv")) if k + "_scale_inv" in f.keys()
                       else f.get_tensor(k).double()) for k in keys}
        save_file(out, str(dst / file), metadata={"format": "pt"})
    (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    config["dtype"] = "float64"
    (dst / "config.json").write_text(json.dumps(config))
