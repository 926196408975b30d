"""Tiny random DeepSeek-V4 HF models for tests and demos: every attention kind (sliding, CSA, HCA),
hash and top-k MoE layers, mHC; weights drawn so that every term matters (sinks, position biases,
correction biases and hash tables non-zero, unlike HF's init)."""

from __future__ import annotations

from typing import Any

import torch


def toy_v4_config(**overrides: Any):
    """A small ``DeepseekV4Config``: 3 layers (CSA, HCA, sliding), CSA rate 4, HCA rate 8, window 6."""
    from transformers import DeepseekV4Config

    cfg = dict(vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
               num_attention_heads=4, head_dim=32, q_lora_rank=16, partial_rotary_factor=8 / 32,
               num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
               layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
               mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=2, hc_sinkhorn_iters=5, sliding_window=6,
               o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=16, index_topk=3,
               max_position_embeddings=512, swiglu_limit=2.0)
    cfg.update(overrides)
    return DeepseekV4Config(**cfg)


V4_LAYER_KINDS = ("compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention")


def depth_overrides(layers: int) -> dict[str, Any]:
    """:func:`toy_v4_config` overrides for a toy of ``layers`` layers: the three attention kinds in turn
    (``V4_LAYER_KINDS``), the first layer hash-routed and the others top-k routed."""
    return dict(num_hidden_layers=layers, layer_types=[V4_LAYER_KINDS[i % 3] for i in range(layers)],
                mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1))


def toy_v4_model(seed: int = 0, **overrides: Any):
    """A float32 eval-mode ``DeepseekV4ForCausalLM`` of :func:`toy_v4_config` with random weights."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(toy_v4_config(**overrides)).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() >= 2 and leaf not in ("position_bias", "fn", "hc_fn"):
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # sinks, position biases, mHC fn/base/scale, ...
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                E, k = model.config.n_routed_experts, b.shape[1]
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model
