"""How an MLA model is laid out over GPUs: the parallel degrees and their validation (no collectives here).

Convention (SGLang's, for DeepSeek): ``tp`` is the number of ranks, ``world_size == tp``. The other degrees
partition those same ranks:

- ``dp_attention`` (SGLang ``--enable-dp-attention --dp N``): attention runs in ``dp_attention`` groups of
  ``attn_tp = tp // dp_attention`` ranks; each group serves its own requests with its own latent cache and
  splits the heads ``attn_tp`` ways. ``--tp 8 --dp-attention 8`` is 8 ranks, every one with all heads.
- ``ep``: routed experts are split ``ep`` ways and each expert ``tp // ep`` ways (``ep == 1``: every expert
  tensor-parallel over all ``tp`` ranks; ``ep == tp``: whole experts, ``n_routed_experts / tp`` per rank).
- ``dcp`` (vLLM ``--decode-context-parallel-size``): inside one attention group, the tokens of each sequence
  are split ``dcp`` ways, so each rank holds ``1 / dcp`` of the latent cache the group would duplicate.

Dense MLPs, shared experts and ``lm_head`` are tensor-parallel over all ``tp`` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_compile.models.config import MLAConfig


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel degrees over ``world_size == tp`` ranks; validated on construction (see the module docstring).

    Raises ``ValueError`` when a degree is not a positive int, or ``dp_attention``, ``ep`` or ``dcp`` does not
    divide what it partitions (``tp``, ``tp`` and ``tp // dp_attention``).
    """

    tp: int = 1
    dp_attention: int = 1
    dcp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp_attention", "dcp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive int, got {value!r}")
        for name in ("dp_attention", "ep"):
            value = getattr(self, name)
            if self.tp % value:
                raise ValueError(f"{name}={value} does not divide tp={self.tp}: the {name} groups partition the "
                                 f"tp ranks; pick a divisor of {self.tp}")
        if self.attn_tp % self.dcp:
            raise ValueError(f"dcp={self.dcp} does not divide the attention TP degree tp/dp_attention="
                             f"{self.tp}/{self.dp_attention}={self.attn_tp}: DCP splits the cache over the ranks "
                             "of one attention group; lower dcp or dp_attention")

    @property
    def world_size(self) -> int:
        """Number of ranks (GPUs): ``tp``."""
        return self.tp

    @property
    def attn_tp(self) -> int:
        """Ranks of one attention group, which split the heads: ``tp // dp_attention``."""
        return self.tp // self.dp_attention

    @property
    def moe_tp(self) -> int:
        """Ways each routed expert is split: ``tp // ep``."""
        return self.tp // self.ep

    def validate_for(self, config: MLAConfig) -> None:
        """Check that ``config`` shards evenly: heads over ``attn_tp``, routed experts over ``ep``, the dense and
        expert MLP widths over ``tp`` and ``moe_tp``. Raises ``ValueError`` naming the numbers."""
        checks = [("num_attention_heads", config.num_heads, self.attn_tp, f"tp/dp_attention={self.attn_tp}"),
                  ("n_routed_experts", config.n_routed_experts, self.ep, f"ep={self.ep}"),
                  ("intermediate_size", config.intermediate_size, self.tp, f"tp={self.tp}"),
                  ("moe_intermediate_size", config.moe_intermediate_size, self.moe_tp, f"tp/ep={self.moe_tp}")]
        if self.dp_attention == 1:
            checks[0] = ("num_attention_heads", config.num_heads, self.tp, f"tp={self.tp}")
        for field, value, degree, label in checks:
            if value % degree:
                raise ValueError(f"{label} does not divide {field}={value}; pick a degree that divides {value}")
