"""MLAConfig: presets, yarn softmax scale, reading HF DeepSeek configs, MLA detection, validation."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from mla_compile import PRESETS, MLAConfig, is_mla_model, is_sparse_mla_model, preset
from mla_compile.models.config import yarn_mscale

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}


def _small_hf(cls, **extra):
    """A tiny DeepSeek config (nothing is allocated: a config object only)."""
    fields = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=3, kv_lora_rank=32, q_lora_rank=24,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, vocab_size=100,
                  max_position_embeddings=4096 * 40)
    fields.update(extra)
    return cls(**fields)


# ------------------------------------------------------------------------------------------- presets

def test_v2_lite_preset():
    c = preset("deepseek-v2-lite")
    assert (c.num_heads, c.q_lora_rank, c.hidden_size, c.num_layers) == (16, None, 2048, 27)
    assert (c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim) == (512, 64, 128, 128)
    assert c.latent_dim == 576 and c.qk_head_dim == 192 and not c.is_sparse
    mscale = 0.1 * 0.707 * math.log(40) + 1
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-12)


def test_v3_yarn_softmax_scale():
    c = preset("deepseek-v3")
    mscale = 0.1 * 1 * math.log(40) + 1
    assert c.mscale == pytest.approx(mscale, rel=1e-12)
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-12)
    assert (c.num_heads, c.q_lora_rank, c.num_layers, c.rope_type) == (128, 1536, 61, "yarn")


def test_v2_and_v32_presets():
    assert preset("deepseek-v2").num_heads == 128 and preset("deepseek-v2").q_lora_rank == 1536
    v32 = preset("DeepSeek-V3.2")  # names are case-insensitive
    assert v32.is_sparse and (v32.index_n_heads, v32.index_head_dim, v32.index_topk) == (64, 128, 2048)
    assert is_sparse_mla_model(v32) and not is_sparse_mla_model(preset("deepseek-v3"))
    assert set(PRESETS) == {"deepseek-v2-lite", "deepseek-v2", "deepseek-v3", "deepseek-v3.2"}


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'llama'"):
        preset("llama")


def test_yarn_mscale_without_stretch_is_one():
    assert yarn_mscale(1.0, 1.0) == 1.0 and yarn_mscale(0.5, 0.707) == 1.0
    assert MLAConfig(hidden_size=64, num_heads=2).softmax_scale == pytest.approx(192 ** -0.5, rel=1e-12)
    no_all_dim = MLAConfig(hidden_size=64, num_heads=2, rope_type="yarn", rope_factor=40.0)
    assert no_all_dim.mscale == 1.0


# ------------------------------------------------------------------------------------------- from_hf

def test_from_hf_v2_no_q_lora_yarn():
    hf = _small_hf(transformers.DeepseekV2Config, q_lora_rank=None, rope_scaling=dict(YARN, mscale_all_dim=0.707))
    c = MLAConfig.from_hf(hf)
    assert (c.hidden_size, c.num_heads, c.num_layers, c.vocab_size) == (64, 4, 3, 100)
    assert (c.kv_lora_rank, c.q_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (32, None, 16, 8, 12)
    assert (c.rope_type, c.rope_factor, c.rope_mscale_all_dim) == ("yarn", 40.0, 0.707)
    assert c.rope_interleave is True  # V2 configs have no rope_interleave field; DeepSeek V2 rotates pairs
    mscale = 0.1 * 0.707 * math.log(40) + 1
    assert c.softmax_scale == pytest.approx(24 ** -0.5 * mscale ** 2, rel=1e-12)
    assert not c.is_sparse


def test_from_hf_v3_reads_rope_parameters():
    hf = _small_hf(transformers.DeepseekV3Config, rope_scaling=dict(YARN))
    assert hf.rope_parameters["rope_type"] == "yarn"  # the transformers 5.x place
    c = MLAConfig.from_hf(hf)
    assert (c.q_lora_rank, c.rope_type, c.rope_factor, c.rope_mscale_all_dim) == (24, "yarn", 40.0, 1.0)
    assert c.rope_theta == hf.rope_parameters["rope_theta"]
    assert c.max_position_embeddings == 4096 * 40
    assert c.softmax_scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert is_mla_model(hf) and not is_sparse_mla_model(hf)


def test_from_hf_v3_default_rope():
    c = MLAConfig.from_hf(_small_hf(transformers.DeepseekV3Config))
    assert (c.rope_type, c.rope_factor, c.mscale) == ("default", 1.0, 1.0)
    assert c.softmax_scale == pytest.approx(24 ** -0.5, rel=1e-12)


def test_from_hf_transformers_4_rope_scaling_object():
    """An object with 4.x ``rope_scaling`` (``type`` key) and no ``rope_parameters``."""
    hf = SimpleNamespace(hidden_size=64, num_attention_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=None, rope_theta=5e4,
                         rope_scaling={"type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0})
    c = MLAConfig.from_hf(hf)
    assert (c.rope_type, c.rope_factor, c.rope_theta, c.num_layers) == ("yarn", 4.0, 5e4, 1)


def test_llama_is_not_mla():
    llama = transformers.LlamaConfig()
    assert not is_mla_model(llama) and not is_sparse_mla_model(llama)
    with pytest.raises(ValueError, match="LlamaConfig is not an MLA model"):
        MLAConfig.from_hf(llama)


def test_sparse_detection():
    fields = dict(kv_lora_rank=512, qk_rope_head_dim=64)
    assert is_sparse_mla_model(SimpleNamespace(**fields, index_topk=2048, index_n_heads=64, index_head_dim=128))
    assert not is_sparse_mla_model(SimpleNamespace(**fields, index_topk=None))
    assert not is_sparse_mla_model(SimpleNamespace(index_topk=2048))  # not MLA at all
    v32 = getattr(transformers, "DeepseekV32Config", None)
    if v32 is not None:  # transformers releases before V3.2 lack it
        hf = _small_hf(v32, index_topk=16, index_n_heads=2, index_head_dim=8)
        assert is_sparse_mla_model(hf)
        c = MLAConfig.from_hf(hf)
        assert c.is_sparse and (c.index_topk, c.index_n_heads, c.index_head_dim) == (16, 2, 8)


# ------------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("field,value", [
    ("num_heads", 0), ("hidden_size", -1), ("kv_lora_rank", 0), ("qk_nope_head_dim", 1.5), ("v_head_dim", None),
    ("num_layers", 0), ("qk_rope_head_dim", 0),
])
def test_rejects_non_positive_dims(field, value):
    with pytest.raises(ValueError, match=f"MLAConfig.{field} must be a positive int"):
        MLAConfig(**{"hidden_size": 64, "num_heads": 2, field: value})


def test_rejects_odd_rope_dim():
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MLAConfig(hidden_size=64, num_heads=2, qk_rope_head_dim=63)


def test_rejects_bad_q_lora_rank():
    with pytest.raises(ValueError, match="q_lora_rank must be None or positive"):
        MLAConfig(hidden_size=64, num_heads=2, q_lora_rank=0)


def test_rejects_partial_indexer():
    with pytest.raises(ValueError, match="index_n_heads/index_head_dim/index_topk"):
        MLAConfig(hidden_size=64, num_heads=2, index_topk=2048)


def test_frozen_and_replace_revalidates():
    c = preset("deepseek-v3")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_heads = 8  # type: ignore[misc]
    assert c.replace(num_heads=16).num_heads == 16 and c.num_heads == 128
    with pytest.raises(ValueError, match="num_heads"):
        c.replace(num_heads=0)
