"""DeepSeek-V4 cache memory: bytes per token and per sequence for each layer type, and what a context costs.

Per layer and sequence (``b`` bytes per value, ``D = head_dim``, ``W = sliding_window``):
- every layer keeps its last W token rows: ``W * D * b`` (bounded: blocks that left the window are freed);
- CSA (rate m, 4 in V4) adds one compressed entry and one indexer key per m tokens,
  ``(D + index_head_dim) * b / m`` per token, and a ring of ``2m`` rows of ``kv, gate`` for its compressor
  (``2 * 2m * 2D * b``) and its indexer (``2 * 2m * 2 index_head_dim * b``);
- HCA (rate m', 128 in V4) adds one entry per m' tokens, ``D * b / m'`` per token, and a ring of m' rows
  (``2 * m' * D * b``);
- sliding layers add nothing that grows with the context.
These are the tensors :meth:`mla_compile.models.v4_model.V4ForCausalLM.allocate_cache` makes (block rounding aside).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True)
class V4Dims:
    """The dims V4's caches depend on."""

    layer_types: tuple[str, ...]
    head_dim: int = 512
    index_head_dim: int = 128
    sliding_window: int = 128
    csa_rate: int = 4
    hca_rate: int = 128

    @classmethod
    def from_hf(cls, config: Any) -> "V4Dims":
        """From an HF ``DeepseekV4Config``."""
        rates = config.compress_rates
        return cls(tuple(config.layer_types), config.head_dim, config.index_head_dim, config.sliding_window,
                   rates[CSA], rates[HCA])


# DeepSeek-V4-Flash (43 layers: 2 sliding, then CSA / HCA alternating from CSA; head 512, window 128,
# indexer keys 128, rates 4 / 128), from its published config's compress_ratios.
V4_FLASH = V4Dims(layer_types=(SLIDING, SLIDING) + tuple(CSA if i % 2 == 0 else HCA for i in range(41)))


@dataclass(frozen=True)
class V4CacheLayout:
    """Cache bytes of a V4 model by layer type (``cache_dtype`` "bf16" or "fp32")."""

    dims: V4Dims
    cache_dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.cache_dtype not in BYTES:
            raise ValueError(f"cache_dtype must be one of {sorted(BYTES)}, got {self.cache_dtype!r}")

    @property
    def _b(self) -> int:
        return BYTES[self.cache_dtype]

    def entry_bytes(self, layer_type: str) -> int:
        """Bytes one compressed entry takes in a layer of ``layer_type`` (CSA: KV entry + indexer key)."""
        d = self.dims
        return {SLIDING: 0, CSA: (d.head_dim + d.index_head_dim) * self._b, HCA: d.head_dim * self._b}[layer_type]

    def rate(self, layer_type: str) -> int:
        """Tokens per compressed entry (0 for sliding layers)."""
        return {SLIDING: 0, CSA: self.dims.csa_rate, HCA: self.dims.hca_rate}[layer_type]

    def bytes_per_token(self, layer_type: str) -> float:
        """Bytes per token of context that grow with the context, one layer of ``layer_type``."""
        r = self.rate(layer_type)
        return self.entry_bytes(layer_type) / r if r else 0.0

    def fixed_bytes(self, layer_type: str) -> int:
        """Bytes per sequence that do not grow: the window's rows and the compressors' ring state."""
        d, b = self.dims, self._b
        window = d.sliding_window * d.head_dim * b
        if layer_type == CSA:
            m = d.csa_rate
            return window + 2 * (2 * m) * (2 * d.head_dim) * b + 2 * (2 * m) * (2 * d.index_head_dim) * b
        if layer_type == HCA:
            return window + 2 * d.hca_rate * d.head_dim * b
        return window

    def sequence_bytes(self, context: int, layer_type: str | None = None) -> int:
        """Bytes one sequence of ``context`` tokens holds, in one layer of ``layer_type`` or (None) the model."""
        if context < 0:
            raise ValueError(f"context must be >= 0, got {context}")
        if layer_type is not None:
            r = self.rate(layer_type)
            return self.fixed_bytes(layer_type) + ((context // r) * self.entry_bytes(layer_type) if r else 0)
        return sum(self.sequence_bytes(context, t) for t in self.dims.layer_types)

    @property
    def model_bytes_per_token(self) -> float:
        """Growing bytes per token of context across all layers."""
        return sum(self.bytes_per_token(t) for t in self.dims.layer_types)

    def table(self, context: int = 1 << 20) -> str:
        """A text table: per layer type, the layers, bytes per token and what ``context`` tokens cost."""
        gib = 1 << 30
        rows = [f"{'layer type':<30} {'layers':>6} {'B/token/layer':>14} {'fixed KiB/layer':>16} "
                f"{'GiB at ' + format(context, ','):>18}"]
        for t in (SLIDING, CSA, HCA):
            n = self.dims.layer_types.count(t)
            if n:
                rows.append(f"{t:<30} {n:>6} {self.bytes_per_token(t):>14.2f} {self.fixed_bytes(t) / 1024:>16.1f} "
                            f"{n * self.sequence_bytes(context, t) / gib:>18.3f}")
        rows.append(f"{'all layers':<30} {len(self.dims.layer_types):>6} {self.model_bytes_per_token:>14.2f} "
                    f"{'':>16} {self.sequence_bytes(context) / gib:>18.3f}")
        return "\n".join(rows)
