"""mla_compile: DeepSeek Multi-head Latent Attention as a first-class citizen of ``torch.compile``."""

from mla_compile import envs as _envs
from mla_compile import ops
from mla_compile.cache import CacheLayout, allocate_latent_cache, fp8_row_bytes
from mla_compile.config import PRESETS, MLAConfig, is_mla_model, is_sparse_mla_model, preset

ops.set_checked_mode(_envs.checked())

__version__ = "0.1.0"

__all__ = [
    "CacheLayout", "MLAConfig", "PRESETS", "allocate_latent_cache", "fp8_row_bytes", "is_mla_model",
    "is_sparse_mla_model", "ops", "preset",
]
