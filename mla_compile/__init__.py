"""mla_compile: DeepSeek Multi-head Latent Attention as a first-class citizen of ``torch.compile``.

The package is in floors: :mod:`mla_compile.models` (what a model is, its weights), :mod:`mla_compile.serving`
(planning and driving steps), :mod:`mla_compile.app` (the command line, demo, doctor, toys), with
:mod:`mla_compile.parallel`, and the ops, lowerings and graphs beneath and beside them.

The front door: :func:`from_pretrained` loads a local DeepSeek checkpoint (bf16 or fp8 blocks) as an MLA
model; :func:`patch` turns a Hugging Face DeepSeek model into an MLA model whose attention
runs through the ``mla::`` custom ops; :class:`MetadataBuilder` plans each step into persistent
buffers; :func:`greedy_generate` and :class:`Engine` drive steps; :class:`DecodeGraphRunner` (from
:mod:`mla_compile.graphs`, imported on first access so that core does not import graphs) replays
decode steps as CUDA graphs.
"""

from typing import Any

from mla_compile import _moved
from mla_compile import envs as _envs
from mla_compile import ops
from mla_compile.models.cache import CacheLayout, allocate_latent_cache, fp8_row_bytes
from mla_compile.models.config import PRESETS, MLAConfig, is_mla_model, is_sparse_mla_model, preset
from mla_compile.models.loader import from_pretrained
from mla_compile.models.model import patch
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.engine import Engine
from mla_compile.serving.generate import greedy_generate

_moved.install()  # the pre-floor names (mla_compile.engine, mla_compile.model, ...) keep importing

ops.set_checked_mode(_envs.checked())

__version__ = "0.1.0"

__all__ = [
    "CacheLayout", "DecodeGraphRunner", "Engine", "MLAConfig", "MetadataBuilder", "PRESETS",
    "allocate_latent_cache", "fp8_row_bytes", "from_pretrained", "greedy_generate", "is_mla_model",
    "is_sparse_mla_model",
    "ops", "patch", "preset",
]


def __getattr__(name: str) -> Any:
    """``DecodeGraphRunner`` on first access (graphs sits above core: no eager import)."""
    if name == "DecodeGraphRunner":
        from mla_compile.graphs.cuda_graph import DecodeGraphRunner
        globals()[name] = DecodeGraphRunner  # later accesses skip this function
        return DecodeGraphRunner
    raise AttributeError(f"module 'mla_compile' has no attribute {name!r}")
