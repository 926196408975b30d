"""DeepSeek-V4's FP4 expert tensors in a checkpoint: recognising them and streaming them, still packed, into
:class:`~mla_compile.models.fp4_linear.FP4Experts` modules.

Facts of the format (transformers 5.x: ``utils/quantization_config.py`` ``FineGrainedFP8Config`` with
``expert_dtype`` "fp8" | "fp4" and ``scale_fmt`` "float" | "ue8m0"; ``models/deepseek_v4/configuration_deepseek_v4.py``,
which moves a top-level ``expert_dtype`` into ``quantization_config``; ``conversion_mapping.py`` "deepseek_v4",
DeepSeek's ``w1`` / ``w3`` / ``w2`` as gate / up / down; ``quantizers/quantizer_finegrained_fp8.py``, which
renames DeepSeek-V4-Flash's ``.scale`` to ``.weight_scale_inv``): per expert and projection a ``weight``
``[rows, cols/2]`` int8 (two e2m1 codes per byte) and a ue8m0 scale ``[rows, cols/32]`` (float8_e8m0fnu,
or uint8), named ``<prefix>.experts.<j>.<w1|w2|w3>.{weight,scale}`` in DeepSeek's checkpoints and
``<prefix>.experts.<j>.<gate_proj|up_proj|down_proj>.{weight,weight_scale_inv}`` in HF-named ones.

:func:`load_fp4_experts` is the loader helper for any model (the V4 model included): it maps checkpoint
module prefixes to ``FP4Experts`` modules and streams only their tensors, shard by shard.
:func:`mla_compile.from_pretrained` uses the same pieces for V3-shaped checkpoints whose experts are FP4.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from mla_compile.models.checkpoint import CONFIG_FILE, CheckpointError, ShardIndex, read_index
from mla_compile.models.fp4_linear import PROJECTIONS, FP4Experts

EXPERT_KEY = re.compile(r"^(?P<module>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\."
                        r"(?P<name>weight|weight_scale_inv|scale)$")
DEEPSEEK_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
EXPERT_DTYPES = ("fp8", "fp4")


@dataclass(frozen=True)
class ExpertKey:
    """One expert tensor's name, parsed: the experts module's checkpoint prefix, the expert, the projection
    (HF name) and ``kind`` "weight" or "scale"."""

    module: str
    index: int
    proj: str
    kind: str


def parse_expert_key(key: str) -> ExpertKey | None:
    """``<module>.experts.<j>.<proj>.<name>`` in DeepSeek's or HF's spelling -> :class:`ExpertKey` (else None)."""
    m = EXPERT_KEY.match(key)
    if m is None:
        return None
    proj = DEEPSEEK_NAMES.get(m["proj"], m["proj"])
    return ExpertKey(m["module"], int(m["index"]), proj, "weight" if m["name"] == "weight" else "scale")


def expert_dtype(config: Any, root: Path | str = ".") -> str | None:
    """The checkpoint's expert format: "fp4" or "fp8" from ``quantization_config.expert_dtype`` (or a top-level
    ``expert_dtype``, as DeepSeek-V4's config.json has it); None when neither says. Other values raise."""
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    value = (qc or {}).get("expert_dtype", getattr(config, "expert_dtype", None))
    if value is not None and value not in EXPERT_DTYPES:
        raise CheckpointError(f"{Path(root) / CONFIG_FILE}: expert_dtype is {value!r}; expected one of "
                              f"{list(EXPERT_DTYPES)} (DeepSeek's fp8 blocks, or V4's packed e2m1 + ue8m0)")
    return value


def place_fp4_expert(module: FP4Experts, parsed: ExpertKey, key: str, t: Tensor, file: str, *,
                     device: torch.device | str | None = None) -> None:
    """One checkpoint tensor into ``module`` (packed bytes copied as they are); a CheckpointError naming the
    file and tensor when its dtype or shape does not fit."""
    try:
        module.load_expert(parsed.index, parsed.proj, parsed.kind, t, device=device)
    except ValueError as e:
        raise CheckpointError(f"{file}: tensor {key}: {e}") from None


def missing_fp4_tensors(prefix: str, module: FP4Experts, filled: set[tuple[str, int, str, str]]) -> list[str]:
    """Names (HF spelling) of the expert tensors of ``module`` not in ``filled`` ``(prefix, j, proj, kind)``."""
    names = {"weight": "weight", "scale": "weight_scale_inv"}
    return [f"{prefix}.{j}.{proj}.{names[kind]}" for j in range(module.num_experts) for proj in PROJECTIONS
            for kind in ("weight", "scale") if (prefix, j, proj, kind) not in filled]


def load_fp4_experts(checkpoint: str | Path | ShardIndex, modules: Mapping[str, FP4Experts], *,
                     device: torch.device | str | None = None) -> int:
    """Stream the FP4 expert tensors of ``checkpoint`` (a directory with its safetensors index, or a
    :class:`~mla_compile.models.checkpoint.ShardIndex`) into ``modules``: checkpoint prefix (e.g.
    ``"layers.3.ffn.experts"`` or ``"model.layers.3.mlp.experts"``) -> :class:`FP4Experts`.

    Only the shards holding those tensors are opened, one tensor in host memory at a time; the bytes land on
    ``device`` (default cpu) unchanged. Every expert's weight and scale must be present. Returns the number of
    tensors placed. Raises :class:`~mla_compile.models.checkpoint.CheckpointError` naming the file and tensor for a
    wrong dtype or shape, and listing the missing ones.
    """
    from safetensors import safe_open

    index = checkpoint if isinstance(checkpoint, ShardIndex) else read_index(Path(checkpoint))
    device = torch.device(device or "cpu")
    filled: set[tuple[str, int, str, str]] = set()
    for file in sorted(index.files):
        wanted = [(k, p) for k in index.files[file] if (p := parse_expert_key(k)) and p.module in modules]
        if not wanted:
            continue
        with safe_open(str(index.root / file), framework="pt", device="cpu") as f:
            present = set(f.keys())
            for key, parsed in wanted:
                if key not in present:
                    raise CheckpointError(f"{index.root / file}: tensor {key} is listed in the index but not in "
                                          "this shard")
                place_fp4_expert(modules[parsed.module], parsed, key, f.get_tensor(key), file, device=device)
                filled.add((parsed.module, parsed.index, parsed.proj, parsed.kind))
    missing = [name for prefix, module in modules.items() for name in missing_fp4_tensors(prefix, module, filled)]
    if missing:
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        raise CheckpointError(f"{index.root}: {len(missing)} fp4 expert tensors missing from the checkpoint: "
                              f"{'; '.join(missing[:10])}{more} (DeepSeek spells them w1/w3/w2 .weight/.scale)")
    return len(filled)
