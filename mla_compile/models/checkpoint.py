"""Reading a local HF-format DeepSeek checkpoint directory: config, fp8 quantization, the shard index.

Everything here is host-side bookkeeping; :mod:`mla_compile.models.loader` builds the model and streams the
tensors. Errors are :class:`CheckpointError` (a ValueError) naming the file and, where there is one, the tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mla_compile.models.config import is_mla_model

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SCALE_SUFFIX = "_scale_inv"  # ``<linear>.weight_scale_inv`` next to ``<linear>.weight``
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\."
                    r"(?P<name>weight|weight_scale_inv)$")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file and tensor."""


@dataclass(frozen=True)
class FP8Format:
    """DeepSeek's fp8 weight format from ``quantization_config``: e4m3 weights, one float32 multiplier
    (``weight_scale_inv``) per ``block`` of weights."""

    block: tuple[int, int] = (128, 128)


@dataclass
class ShardIndex:
    """Which shard file holds each tensor (``weight_map`` of ``model.safetensors.index.json``)."""

    root: Path
    weight_map: dict[str, str]
    source: str = INDEX_FILE
    files: dict[str, list[str]] = field(init=False)

    def __post_init__(self) -> None:
        self.files = {}
        for key, file in self.weight_map.items():
            self.files.setdefault(file, []).append(key)

    def file_of(self, key: str) -> str:
        """The shard expected to hold ``key`` (or a phrase saying the index has no entry for it)."""
        return self.weight_map.get(key, f"no shard: not in {self.source}")


def layer_index(key: str) -> int | None:
    """The decoder layer number of a tensor name ``model.layers.{i}....`` (None for other tensors)."""
    m = _LAYER.match(key)
    return int(m.group(1)) if m else None


def read_config(root: Path) -> Any:
    """The HF config of the checkpoint at ``root``; raises CheckpointError unless it is an MLA model."""
    path = root / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; a checkpoint directory needs config.json "
                              "(plus model.safetensors.index.json and its shards, or model.safetensors)")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{path}: transformers cannot read it ({e})") from e
    if not is_mla_model(config):
        raise CheckpointError(f"{path}: model_type {getattr(config, 'model_type', None)!r} is not an MLA model "
                              "(DeepSeek V2/V2-Lite/V3/R1/V3.2 configs have kv_lora_rank and qk_rope_head_dim)")
    return config


def read_fp8_format(config: Any, root: Path) -> FP8Format | None:
    """``quantization_config`` of the config: None (plain weights) or the fp8 block format; others raise."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    where = f"{root / CONFIG_FILE}: quantization_config"
    method = qc.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"{where}.quant_method is {method!r}; only DeepSeek's 'fp8' block format is "
                              "supported (or no quantization_config for bf16 weights)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{where}.fmt is {fmt!r}; the fp8 weights must be 'e4m3' (float8_e4m3fn)")
    block = tuple(qc.get("weight_block_size") or ())
    if block != (128, 128):
        raise CheckpointError(f"{where}.weight_block_size is {list(block)}; expected [128, 128] (DeepSeek's blocks)")
    return FP8Format(block)


def read_index(root: Path) -> ShardIndex:
    """The shard index of ``root`` (or the one-file ``model.safetensors``); every listed shard must exist."""
    index_path = root / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index with a 'weight_map' ({e})") from e
        index = ShardIndex(root, dict(weight_map))
    elif (root / SINGLE_FILE).is_file():
        from safetensors import safe_open

        with safe_open(str(root / SINGLE_FILE), framework="pt") as f:
            index = ShardIndex(root, {key: SINGLE_FILE for key in f.keys()}, source=SINGLE_FILE)
    else:
        raise CheckpointError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
    for file, keys in index.files.items():
        if not (root / file).is_file():
            raise CheckpointError(f"{root / file}: missing shard, listed in {INDEX_FILE} for {len(keys)} tensors "
                                  f"(e.g. {keys[0]}); download it again or fix the index")
    return index


def config_dtype(config) -> torch.dtype:
    """The checkpoint's weight dtype from its config (``dtype`` or the older ``torch_dtype``; a name or a dtype);
    bfloat16 when it names no floating dtype."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.bfloat16
