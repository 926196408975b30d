"""MLA dimensions and model presets, read from HF DeepSeek configs (V2, V2-Lite, V3, V3.2)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's yarn attention-temperature factor (1.0 when the rope is not stretched)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Static dimensions of one MLA attention stack; validated on construction.

    ``softmax_scale`` is derived: ``1/sqrt(qk_nope + qk_rope)``, times ``mscale**2`` under yarn.
    ``index_*`` are set only for DeepSeek-V3.2 (sparse) models.
    The feed-forward fields (``intermediate_size`` .. ``num_nextn_predict_layers``) describe the rest of the
    decoder for parameter counts and memory plans (``mla_compile.serving.memory_plan``); 0 means not given. Layers
    ``< first_k_dense_replace`` have a dense MLP of ``intermediate_size``, later ones ``n_routed_experts`` routed
    experts plus ``n_shared_experts`` shared ones of ``moe_intermediate_size``; ``router_bias`` is V3's
    ``e_score_correction_bias``; ``num_nextn_predict_layers`` counts the MTP layers a checkpoint adds.
    """

    hidden_size: int
    num_heads: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    q_lora_rank: int | None = None
    num_layers: int = 1
    vocab_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_mscale_all_dim: float = 0.0
    max_position_embeddings: int = 4096
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    router_bias: bool = False
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MLAConfig.{name} must be a positive int, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be even for rotary pairs, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"MLAConfig.q_lora_rank must be None or positive, got {self.q_lora_rank}")
        for name in _FFN_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"MLAConfig.{name} must be an int >= 0 (0: not given), got {value!r}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"MLAConfig.num_experts_per_tok must be <= n_routed_experts={self.n_routed_experts}, "
                             f"got {self.num_experts_per_tok}")
        sparse = (self.index_n_heads, self.index_head_dim, self.index_topk)
        if any(v is not None for v in sparse) and not all(v is not None and v > 0 for v in sparse):
            raise ValueError(f"MLAConfig index_n_heads/index_head_dim/index_topk must be all set (V3.2) or all None, got {sparse}")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the non-absorbed path (nope + rope, 192 for DeepSeek)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent cache row: kv_lora_rank + qk_rope_head_dim (576 for DeepSeek)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mscale(self) -> float:
        """Yarn attention temperature (1.0 without yarn)."""
        if self.rope_type == "default" or not self.rope_mscale_all_dim:
            return 1.0
        return yarn_mscale(self.rope_factor, self.rope_mscale_all_dim)

    @property
    def softmax_scale(self) -> float:
        """Scale applied to q.k in both the absorbed and the non-absorbed path."""
        return self.qk_head_dim ** -0.5 * self.mscale * self.mscale

    @property
    def is_sparse(self) -> bool:
        """True for DeepSeek-V3.2-style models with a top-k indexer."""
        return self.index_topk is not None

    def replace(self, **changes: Any) -> "MLAConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf_config: Any) -> "MLAConfig":
        """Read an HF ``DeepseekV2Config``/``DeepseekV3Config``/V3.2 config (or any object with those fields)."""
        if not is_mla_model(hf_config):
            raise ValueError(
                f"config of type {type(hf_config).__name__} is not an MLA model: it needs kv_lora_rank and "
                "qk_rope_head_dim (DeepSeek V2/V3 configs have them)")
        g = lambda name, default=None: getattr(hf_config, name, default)  # noqa: E731
        rope = _rope_parameters(hf_config)
        return cls(
            hidden_size=g("hidden_size"), num_heads=g("num_attention_heads"),
            kv_lora_rank=g("kv_lora_rank"), qk_nope_head_dim=g("qk_nope_head_dim"),
            qk_rope_head_dim=g("qk_rope_head_dim"), v_head_dim=g("v_head_dim"),
            q_lora_rank=g("q_lora_rank"), num_layers=g("num_hidden_layers", 1),
            vocab_size=g("vocab_size", 0), rms_norm_eps=g("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", g("rope_theta", 10000.0))),
            rope_interleave=bool(g("rope_interleave", True)),
            rope_type=str(rope.get("rope_type", rope.get("type", "default"))),
            rope_factor=float(rope.get("factor", 1.0) or 1.0),
            rope_mscale_all_dim=float(rope.get("mscale_all_dim", 0.0) or 0.0),
            max_position_embeddings=g("max_position_embeddings", 4096),
            index_n_heads=g("index_n_heads"), index_head_dim=g("index_head_dim"),
            index_topk=g("index_topk"),
            **{name: g(name) or 0 for name in _FFN_FIELDS},
            router_bias=g("model_type") in ("deepseek_v3", "deepseek_v32") or g("topk_method") == "noaux_tc",
        )


_FFN_FIELDS = ("intermediate_size", "moe_intermediate_size", "n_routed_experts", "n_shared_experts",
               "num_experts_per_tok", "first_k_dense_replace", "num_nextn_predict_layers")


def _rope_parameters(hf_config: Any) -> Mapping[str, Any]:
    """The rope dict of a transformers 5.x (``rope_parameters``) or 4.x (``rope_scaling``) config."""
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(hf_config, name, None)
        if isinstance(value, Mapping):
            return value
    return {}


def is_mla_model(config: Any) -> bool:
    """True when an HF config (or MLAConfig) describes Multi-head Latent Attention."""
    if isinstance(config, MLAConfig):
        return True
    return all(getattr(config, f, None) for f in ("kv_lora_rank", "qk_rope_head_dim"))


def is_sparse_mla_model(config: Any) -> bool:
    """True for DeepSeek-V3.2-style sparse MLA (a lightning indexer with ``index_topk``)."""
    if isinstance(config, MLAConfig):
        return config.is_sparse
    return is_mla_model(config) and bool(getattr(config, "index_topk", None))


_YARN = dict(rope_type="yarn", rope_factor=40.0, rope_mscale_all_dim=1.0, rope_interleave=True)
# feed-forward dims of the public HF config.json files
_V2_LITE_FFN = dict(intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2,
                    num_experts_per_tok=6, first_k_dense_replace=1)
_V2_FFN = dict(intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160, n_shared_experts=2,
               num_experts_per_tok=6, first_k_dense_replace=1)
_V3_FFN = dict(intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1,
               num_experts_per_tok=8, first_k_dense_replace=3, router_bias=True, num_nextn_predict_layers=1)

PRESETS: dict[str, MLAConfig] = {
    "deepseek-v2-lite": MLAConfig(hidden_size=2048, num_heads=16, q_lora_rank=None, num_layers=27,
                                  vocab_size=102400, max_position_embeddings=163840,
                                  rope_type="yarn", rope_factor=40.0, rope_mscale_all_dim=0.707, **_V2_LITE_FFN),
    "deepseek-v2": MLAConfig(hidden_size=5120, num_heads=128, q_lora_rank=1536, num_layers=60,
                             vocab_size=102400, max_position_embeddings=163840,
                             rope_type="yarn", rope_factor=40.0, rope_mscale_all_dim=0.707, **_V2_FFN),
    "deepseek-v3": MLAConfig(hidden_size=7168, num_heads=128, q_lora_rank=1536, num_layers=61,
                             vocab_size=129280, max_position_embeddings=163840, **_YARN, **_V3_FFN),
    "deepseek-v3.2": MLAConfig(hidden_size=7168, num_heads=128, q_lora_rank=1536, num_layers=61,
                               vocab_size=129280, max_position_embeddings=163840,
                               index_n_heads=64, index_head_dim=128, index_topk=2048, **_YARN, **_V3_FFN),
}


def preset(name: str) -> MLAConfig:
    """A named preset: one of ``PRESETS`` (deepseek-v2-lite, deepseek-v2, deepseek-v3, deepseek-v3.2)."""
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}") from None


def check_sink_window(sink, window) -> tuple[int, int]:
    """``(sink, window)`` validated: ints (not bools), ``sink >= 0``, ``window >= 1``; raises naming the argument."""
    for name, value, low in (("sink", sink, 0), ("window", window, 1)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int (tokens), got {type(value).__name__} {value!r}")
        if value < low:
            what = "at least 1 (the query itself is in the window)" if name == "window" else ">= 0 (0: no sink)"
            raise ValueError(f"{name} must be {what}, got {value}")
    return sink, window
