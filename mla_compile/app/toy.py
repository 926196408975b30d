"""Small random-initialised HF DeepSeek models with real MLA dims, for the demo, tests and benchmarks.

``"v2-lite"`` is DeepSeek-V2-Lite-shaped (no q_lora, softmax greedy routing, yarn rope);
``"v3"`` is DeepSeek-V3-shaped (q_lora, sigmoid group-limited routing with bias, yarn rope);
``"v3.2"`` is ``"v3"`` plus DeepSeek-V3.2's lightning indexer (sparse attention: 16 index heads of
128 dims, ``index_topk`` 8 so that a few dozen tokens already drop most of the context).
Hidden size, layers, experts and vocab are shrunk; kv_lora_rank 512, rope 64, nope 128, v 128 are kept.
``KINDS`` lists the dense kinds; ``SPARSE_KINDS`` the sparse ones (they need transformers with
``DeepseekV32ForCausalLM``); ``ALL_KINDS`` both.
"""

from __future__ import annotations

from typing import Sequence, Any

import torch

KINDS = ("v2-lite", "v3")
SPARSE_KINDS = ("v3.2",)
ALL_KINDS = KINDS + SPARSE_KINDS


def _v32_classes():
    """``(DeepseekV32Config, DeepseekV32ForCausalLM)``, or a clear error on transformers without them."""
    import transformers

    cfg, model = getattr(transformers, "DeepseekV32Config", None), getattr(transformers, "DeepseekV32ForCausalLM", None)
    if cfg is None or model is None:
        raise NotImplementedError(f"toy kind 'v3.2' needs transformers with DeepseekV32ForCausalLM "
                                  f"(models/deepseek_v32); installed: {transformers.__version__}")
    return cfg, model


def has_sparse_kinds() -> bool:
    """True when the installed transformers can build the ``SPARSE_KINDS`` toys."""
    try:
        _v32_classes()
    except (ImportError, NotImplementedError):
        return False
    return True


def toy_hf_config(kind: str = "v2-lite", **overrides: Any):
    """An HF ``DeepseekV2Config``/``DeepseekV3Config``/``DeepseekV32Config`` of a small model of ``kind``."""
    import transformers

    common = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1,
                  max_position_embeddings=5120, rms_norm_eps=1e-6, n_shared_experts=1,
                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0,
                                       mscale_all_dim=0.707, original_max_position_embeddings=128,
                                       beta_fast=32, beta_slow=1))
    v3 = dict(common, q_lora_rank=128, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
              norm_topk_prob=True, routed_scaling_factor=2.5)
    v3["rope_parameters"] = dict(common["rope_parameters"], mscale_all_dim=1.0)
    if kind == "v2-lite":
        cfg = dict(common, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3, topk_method="greedy",
                   n_group=1, topk_group=1, routed_scaling_factor=1.0)
        cls = transformers.DeepseekV2Config
    elif kind == "v3":
        cfg = dict(v3, rope_interleave=True)
        cls = transformers.DeepseekV3Config
    elif kind == "v3.2":
        # 16 index heads: a key's score is exactly 0 (a tie) only when all 16 relu terms are 0
        cfg = dict(v3, index_n_heads=16, index_head_dim=128, index_topk=8)
        cls = _v32_classes()[0]
    else:
        raise ValueError(f"kind must be one of {ALL_KINDS}, got {kind!r}")
    cfg.update(overrides)
    return cls(**cfg)


def toy_hf_model(kind: str = "v2-lite", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", **overrides: Any):
    """A seeded random-initialised HF ``DeepseekV{2,3,32}ForCausalLM`` (eager attention) of ``kind``."""
    import transformers

    config = toy_hf_config(kind, **overrides)
    config._attn_implementation = "eager"
    cls = {"v2-lite": transformers.DeepseekV2ForCausalLM, "v3": transformers.DeepseekV3ForCausalLM}.get(kind)
    cls = cls or _v32_classes()[1]
    torch.manual_seed(seed)
    model = cls(config).to(dtype=dtype, device=device).eval()
    with torch.no_grad():  # HF zero-inits the V3 routing bias; give it values so the test sees it
        for module in model.modules():
            if getattr(module, "e_score_correction_bias", None) is not None:
                module.e_score_correction_bias.uniform_(-0.05, 0.05)
    return model


def random_prompts(seed: int | torch.Generator, lengths: Sequence[int], vocab_size: int = 1024) -> list[list[int]]:
    """Seeded random token lists of the given ``lengths`` (ids below ``vocab_size``); ``seed`` may be a
    ``torch.Generator`` to continue its stream."""
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
