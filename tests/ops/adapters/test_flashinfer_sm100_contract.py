"""FlashInfer's Blackwell-only paths against a fake ``flashinfer``: trtllm-gen decode and ragged prefill,
the CUTLASS decode. Calls (keyword names, block tables padded to a multiple of 128 / block_size, bounds
from shapes, base-2 LSE), results against the float64 reference, the NaN LSE of the decode paths, and
the capability requirement (sm100) checked inside the ops."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from mla_compile.ops.adapters import flashinfer_sm100 as sm100
from mla_compile.ops.adapters._common import require_capability
from ..ref64 import LSE_TOL, OUT_TOL, Paged, decode_ref64, fill_paged_cache, generator, prefill_ref64, randn

BF16, I32 = torch.bfloat16, torch.int32
LAYOUT = Paged(32, 6, (0, 40, 70), ((), (3, 1), (0, 4, 2)), 3, 5)


@pytest.fixture(autouse=True)
def _small_workspace(monkeypatch):
    monkeypatch.setattr(sm100, "WORKSPACE_BYTES", 1 << 10)


def _decode_inputs(heads: int, seed: int = 0):
    gen = generator(seed)
    cache = fill_paged_cache(LAYOUT, 576, BF16, gen)
    q = randn(gen, 3, 1, heads, 576, dtype=BF16)
    return q, cache, LAYOUT.block_table(torch.int64), LAYOUT.seq_lens_tensor(I32)


def test_trtllm_decode_contract(fake_flashinfer):
    q, cache, table, lens = _decode_inputs(heads=2)
    out, lse = sm100.trtllm_decode_core(q, cache, table, lens, 0.1, 512)
    [(_, kw)] = fake_flashinfer.named("trtllm_batch_decode_with_kv_cache_mla")
    assert kw["query"] is q and kw["kv_cache"] is cache and kw["block_tables"].dtype == I32
    assert kw["block_tables"].shape == (3, 4), "3 columns padded to a multiple of 128 / 32 = 4"
    assert kw["max_seq_len"] == 4 * 32 and kw["bmm1_scale"] == 0.1 and kw["bmm2_scale"] == 1.0
    assert (kw["qk_nope_head_dim"], kw["kv_lora_rank"], kw["qk_rope_head_dim"]) == (128, 512, 64)
    assert kw["workspace_buffer"].dtype == torch.uint8 and not kw["workspace_buffer"].any(), "zeroed once"
    ref_out, _ = decode_ref64(q, cache, LAYOUT, 0.1, 512)
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert torch.isneginf(lse[0]).all() and lse[1:].isnan().all(), "no LSE: NaN, -inf for empty queries"


def test_cutlass_decode_contract_and_limits(fake_flashinfer):
    q, cache, table, lens = _decode_inputs(heads=128)
    scale = 192 ** -0.5
    out, lse = sm100.cutlass_decode_core(q, cache, table, lens, scale, 512)
    [(_, ckw)] = fake_flashinfer.named("BatchMLAPagedAttentionWrapper")
    assert ckw["backend"] == "cutlass"
    [(rargs, rkw)] = fake_flashinfer.named("mla.run")
    assert rargs[0].shape == (3, 128, 512) and rkw["page_table"].shape == (3, 4) and rkw["return_lse"] is False
    ref_out, _ = decode_ref64(q, cache, LAYOUT, scale, 512)
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert lse[1:].isnan().all()
    with pytest.raises(ValueError, match=r"fixed softmax scale 1/sqrt\(192\)"):
        sm100.cutlass_decode_core(q, cache, table, lens, 0.1, 512)
    q2, cache2, table2, lens2 = _decode_inputs(heads=16)
    with pytest.raises(ValueError, match=r"needs num_heads \(q.shape\[2\]\) in \[128\]"):
        sm100.cutlass_decode_core(q2, cache2, table2, lens2, scale, 512)


def test_trtllm_ragged_prefill_contract(fake_flashinfer):
    gen = generator(4)
    q, k = randn(gen, 6, 2, 192, dtype=BF16), randn(gen, 9, 2, 192, dtype=BF16)
    v = randn(gen, 9, 2, 128, dtype=BF16)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=I32), torch.tensor([0, 4, 8], dtype=I32)
    out, lse = sm100.trtllm_prefill_core(q, k, v, cu_q, cu_k, 0.1, True)
    [(_, kw)] = fake_flashinfer.named("trtllm_ragged_attention_deepseek")
    assert kw["return_lse"] is True and kw["is_causal"] is True and kw["window_left"] == -1
    assert (kw["max_q_len"], kw["max_kv_len"], kw["batch_size"]) == (6, 9, 2) and kw["seq_lens"].tolist() == [4, 4]
    ref_out, ref_lse = prefill_ref64(q, k, v, [2, 3], [4, 4], 0.1, True)
    assert_close(out.double(), ref_out, **OUT_TOL[BF16])
    assert_close(lse.double(), ref_lse, **LSE_TOL[BF16])
    assert torch.isneginf(lse[5]).all() and (out[5] == 0).all()


def test_capability_requirement_names_the_gpu(monkeypatch):
    from mla_compile.ops import registry

    monkeypatch.setattr(registry, "_CAPABILITIES", {})  # the capability is asked once a device: fake it afresh
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(ValueError, match=r"backend 'flashinfer-trtllm' needs a GPU of sm100 to sm103, this one is sm90"):
        require_capability("mla.decode", "flashinfer-trtllm", torch.device("cuda", 0), sm100.SM100, sm100.SM103)
    require_capability("mla.decode", "flashinfer-trtllm", torch.device("cpu"), sm100.SM100)  # CPU: contract tests
