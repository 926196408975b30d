"""``ParallelConfig`` validation, the memory planner's parameter count against HF models built on the meta
device and against DeepSeek's published totals, per-rank splits, DCP's cache split and ``mla-compile plan``."""

from __future__ import annotations

import pytest
import torch

from mla_compile.app.cli import main
from mla_compile.models.config import MLAConfig, preset
from mla_compile.serving.memory_plan import GIB, kv_bytes_per_token, parameter_count, plan_memory
from mla_compile.parallel import ParallelConfig

V3 = preset("deepseek-v3")


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=0), "ParallelConfig.tp must be a positive int, got 0"),
    (dict(tp=8, ep=3), "ep=3 does not divide tp=8"),
    (dict(tp=8, dp_attention=3), "dp_attention=3 does not divide tp=8"),
    (dict(tp=8, dcp=16), "dcp=16 does not divide the attention TP degree tp/dp_attention=8/1=8"),
    (dict(tp=8, dp_attention=8, dcp=2), "dcp=2 does not divide the attention TP degree tp/dp_attention=8/8=1"),
])
def test_bad_degrees_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize("parallel, message", [
    (ParallelConfig(tp=3), "tp=3 does not divide num_attention_heads=128"),
    (ParallelConfig(tp=6, dp_attention=2), "tp/dp_attention=3 does not divide num_attention_heads=128"),
    (ParallelConfig(tp=6, dp_attention=6, ep=3), "ep=3 does not divide n_routed_experts=256"),
])
def test_validate_for_names_the_numbers(parallel, message):
    with pytest.raises(ValueError, match=message):
        parallel.validate_for(V3)


def test_world_size_is_tp_and_the_other_degrees_partition_it():
    p = ParallelConfig(tp=8, dp_attention=8, ep=8)  # SGLang: --tp 8 --enable-dp-attention --dp 8 --ep 8
    assert (p.world_size, p.attn_tp, p.moe_tp) == (8, 1, 1)
    p.validate_for(V3)


@pytest.mark.parametrize("kind", ["v3", "v2-lite", "v3.2"])
def test_parameter_count_equals_the_hf_model_built_on_meta(kind):
    import transformers

    from mla_compile.app.toy import has_sparse_kinds, toy_hf_config

    if kind == "v3.2" and not has_sparse_kinds():
        pytest.skip("transformers without DeepseekV32ForCausalLM")
    names = {"v3": "DeepseekV3ForCausalLM", "v2-lite": "DeepseekV2ForCausalLM", "v3.2": "DeepseekV32ForCausalLM"}
    hf_config = toy_hf_config(kind, num_hidden_layers=3)
    with torch.device("meta"):
        model = getattr(transformers, names[kind])(hf_config)
    # V3's e_score_correction_bias is a buffer in HF but a tensor of the checkpoint: the planner counts it
    bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert parameter_count(MLAConfig.from_hf(hf_config)) == sum(p.numel() for p in model.parameters()) + bias


@pytest.mark.parametrize("name, total, activated", [
    ("deepseek-v3", 671e9, 37e9), ("deepseek-v2", 236e9, 21e9), ("deepseek-v2-lite", 15.7e9, 2.4e9)])
def test_presets_match_the_published_sizes(name, total, activated):
    # Counted from the preset dims (MTP excluded): V3 671.03B / 37.55B activated, V2 235.74B / 21.38B,
    # V2-Lite 15.71B / 2.66B. Totals agree within 0.2%. Activated counts run 1.5-11% over the papers': the
    # papers round (37B, 21B), and ours includes the embedding, which does no matmul for a token
    # (V2-Lite's 2.66B less its 0.21B embedding is 2.45B, near the published 2.4B).
    config = preset(name)
    assert parameter_count(config) == pytest.approx(total, rel=2e-3)
    assert activated <= parameter_count(config, activated=True) <= 1.12 * activated


def _parts(parallel, config=V3, weights="bf16"):
    return plan_memory(config, parallel, gpu_mem_gib=141, weight_dtype=weights).weight_bytes_by_part


@pytest.mark.parametrize("parallel", [ParallelConfig(tp=8), ParallelConfig(tp=8, ep=8),
                                      ParallelConfig(tp=4, ep=2), ParallelConfig(tp=8, dcp=8)])
def test_tensor_parallel_splits_add_up(parallel):
    full, rank = _parts(ParallelConfig()), _parts(parallel)
    n, c = parallel.world_size, V3
    replicated_attention = 2 * c.num_layers * c.hidden_size * (c.q_lora_rank + c.latent_dim)  # q_a, kv_a (bf16)
    assert n * rank["attention"] == full["attention"] + (n - 1) * replicated_attention
    for part in ("dense_mlp", "shared_experts", "routed_experts", "embedding", "lm_head"):
        assert n * rank[part] == full[part], part
    for part in ("router", "norms"):
        assert rank[part] == full[part], part


def test_dp_attention_replicates_attention_and_embedding():
    full, rank = _parts(ParallelConfig()), _parts(ParallelConfig(tp=8, dp_attention=8, ep=8))
    assert rank["attention"] == full["attention"] and rank["embedding"] == full["embedding"]
    assert 8 * rank["routed_experts"] == full["routed_experts"] and 8 * rank["lm_head"] == full["lm_head"]


def test_fp8_weights_carry_their_block_scales():
    one, fp8 = ParallelConfig(), _parts(ParallelConfig(), weights="fp8")
    c = V3
    experts = (c.num_layers - c.first_k_dense_replace) * c.n_routed_experts
    # gate_up [2*2048, 7168] and down [7168, 2048]: 1 byte a value + a float32 per 128x128 block
    values = 3 * c.moe_intermediate_size * c.hidden_size
    scales = 3 * (c.moe_intermediate_size // 128) * (c.hidden_size // 128)
    assert fp8["routed_experts"] == experts * (values + 4 * scales)
    assert fp8["lm_head"] == _parts(one)["lm_head"]  # lm_head stays bf16


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_kv_per_token_with_dcp_is_the_dcp_th_part(kv):
    row = {"bf16": 2 * 576, "fp8": 656}[kv] * V3.num_layers
    assert kv_bytes_per_token(V3, kv) == row
    tp = plan_memory(V3, ParallelConfig(tp=8), gpu_mem_gib=141, kv_dtype=kv)
    dcp = plan_memory(V3, ParallelConfig(tp=8, dcp=8), gpu_mem_gib=141, kv_dtype=kv)
    assert tp.kv_bytes_per_token == row and dcp.kv_bytes_per_token == row / 8
    assert dcp.tokens_per_group == tp.cache_bytes * 8 // row
    assert dcp.batch_at(32768) == dcp.tokens_per_group // 32768


def test_weights_that_do_not_fit_leave_no_tokens():
    plan = plan_memory(V3, ParallelConfig(), gpu_mem_gib=141)
    assert plan.cache_bytes < 0 and plan.tokens_per_group == 0 and plan.batch_at() == 0
    assert plan.weight_bytes > 600 * GIB


def test_cli_plan_prints_the_per_rank_table(capsys):
    assert main(["plan", "--model", "v3", "--tp", "8", "--dcp", "8", "--gpu-mem", "141"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3 on 8 x 141 GiB" in out and "tp=8 dp_attention=1 ep=1 dcp=8 (8 ranks)" in out
    for row in ("weights routed_experts", "weights total", "kv bytes / token", "8784.0", "batch at 32k context"):
        assert row in out, row


def test_cli_plan_rejects_a_layout_that_does_not_divide(capsys):
    assert main(["plan", "--model", "v2", "--tp", "8", "--ep", "3"]) == 2
    assert "ep=3 does not divide tp=8" in capsys.readouterr().err
