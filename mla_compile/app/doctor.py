"""``mla-compile doctor``: versions, the GPU, every backend of every op in the registry with whether it can
run here (and why not), the timing tables "auto" ranks by, and what the selector picks for DeepSeek-V2-Lite
and V3 shapes (decode, prefill, merge, fp8 decode, sparse decode) and for DeepSeek-V4's attention per layer
kind (a split by query rows where the timings say so). Imports no peer library."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from mla_compile import backends, envs
from mla_compile.ops import timings
from mla_compile.models.cache import fp8_row_bytes
from mla_compile.models.config import preset

# (label, preset name) of the shapes the report resolves, with the cache block size and dtype it assumes.
SHAPES = (("DeepSeek-V2-Lite", "deepseek-v2-lite"), ("DeepSeek-V3", "deepseek-v3"))
BLOCK_SIZE = 64
DTYPE = torch.bfloat16
PACKAGES = ("triton", "sgl-flash-mla", "flashinfer-python", "flash-attn")
# DeepSeek-V4's attention as V4Attention asks: (label, heads), head dim 512, window 128, CSA top-512; the
# listed slots per layer kind (None: an HCA layer's list grows with the context)
V4_MODELS = (("DeepSeek-V4", 64), ("DeepSeek-V4", 128))  # V4-Flash's heads, V4-Pro's
V4_HEAD_DIM, V4_WINDOW, V4_TOPK = 512, 128, 512
V4_KINDS = (("sliding", V4_WINDOW), ("CSA", V4_WINDOW + V4_TOPK), ("HCA", None))


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gpu() -> str:
    if not torch.cuda.is_available():
        return "none (torch.cuda.is_available() is False)"
    names = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        names.append(f"cuda:{i} {torch.cuda.get_device_name(i)} (sm{major}{minor})")
    return "; ".join(names)


def _asks(cfg) -> tuple:
    """(op, selector arguments) of every attention op MLAAttention selects for a model of ``cfg``."""
    latent = dict(block_size=BLOCK_SIZE, head_dims=(cfg.kv_lora_rank, cfg.qk_rope_head_dim), need_lse=False)
    width = fp8_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    fp8 = dict(latent, cache_dtype=torch.uint8, cache_strides=(BLOCK_SIZE * width, width, 1), row_width=width)
    return (("decode", latent), ("prefill", dict(head_dims=(cfg.qk_head_dim, cfg.v_head_dim), need_lse=True)),
            ("merge", dict(head_dims=(cfg.v_head_dim,))), ("decode_fp8", fp8), ("sparse_decode", fp8))


def _choices(device: torch.device) -> list[str]:
    lines = []
    for label, name in SHAPES:
        cfg = preset(name)
        for op, kw in _asks(cfg):
            cache = " (fp8 cache)" if kw.get("cache_dtype") == torch.uint8 else ""
            head = f"  {label} ({cfg.num_heads} heads) {op + cache:7s}"
            try:
                choice = backends.select_backend(op, device=device, dtype=DTYPE, num_heads=cfg.num_heads, **kw)
            except ValueError as e:
                lines.append(f"{head} -> error: {e}")
                continue
            lines.append(f"{head} -> {choice.name}: {choice.reason.split('; serves')[0]}")
            for other in backends.PRIORITY[op]:
                if other in choice.rejected:
                    lines.append(f"      not {other}: {choice.rejected[other]}")
    return lines


def _v4_choices(device: torch.device) -> list[str]:
    lines = []
    for label, heads in V4_MODELS:
        for kind, slots in V4_KINDS:
            head = f"  {label} ({heads} heads) v4_attention {kind} ({slots or 'all'} slots)"
            try:
                choice = backends.select_backend(
                    "v4_attention", device=device, dtype=DTYPE, num_heads=heads, head_dims=(V4_HEAD_DIM,),
                    block_size=BLOCK_SIZE, cache_strides=(BLOCK_SIZE * V4_HEAD_DIM, V4_HEAD_DIM, 1),
                    row_width=V4_HEAD_DIM, context=slots)
            except ValueError as e:
                lines.append(f"{head} -> error: {e}")
                continue
            lines.append(f"{head} -> {choice.name}: {choice.reason.split('; serves')[0]}")
    return lines


def doctor_report() -> str:
    """The report as text (what ``mla-compile doctor`` prints)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines = [
        "mla-compile doctor",
        f"python {platform.python_version()}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda or 'none (CPU build)'}, cuDNN {cudnn or 'none'}",
        "packages: " + ", ".join(f"{p} {_version(p)}" for p in PACKAGES),
        f"GPU: {_gpu()}",
        f"MLA_COMPILE_BACKEND: {envs.backend()}",
        *(f"timings \"auto\" ranks by: {t.gpu} (sm{t.capability[0]}{t.capability[1]}), {len(t.rows)} shape classes"
          f"{' (seeded from BENCHMARKS.md)' if t.seeded else ''}, torch {t.versions.get('torch', '?')}"
          for t in timings.tables()),
        "",
        "backends (in static order; 'graphs' = CUDA-graph support: full / planned (host plan before each "
        "replay) / none):",
    ]
    first = ("decode", "decode_fp8", "sparse_decode", "prefill", "merge")
    for op in sorted(backends.SPECS, key=lambda op: first.index(op) if op in first else len(first)):
        lines.append(f"{op}:")
        for row in (r for r in backends.describe() if r["op"] == op):
            state = "available" if row["available"] else "unavailable"
            tested = f" [{row['auto_skip']}]" if row["auto_skip"] else ""  # the selector's own reason
            lse = "" if row["lse"] else ", no LSE"
            why = f": {row['why']}" if row["why"] else ""
            lines.append(f"  {row['backend']:19s} {state}{why} (graphs {row['cuda_graph']}{lse}){tested}")
    lines += ["", f"selection for {str(DTYPE).replace('torch.', '')}, block size {BLOCK_SIZE} on {device.type}, as "
              "MLAAttention asks (decode LSE unused; no FlashInfer decode_planner given to the metadata builder; "
              "sparse_decode as a V3.2 layer of these dims would):"]
    lines += _choices(device)
    lines += ["", f"selection for DeepSeek-V4 attention ({str(DTYPE).replace('torch.', '')}, block size "
              f"{BLOCK_SIZE} on {device.type}, heads of {V4_HEAD_DIM}, window {V4_WINDOW}, CSA top-{V4_TOPK}, as "
              "V4Attention asks: a graph that serves every batch):"]
    lines += _v4_choices(device)
    return "\n".join(lines)
