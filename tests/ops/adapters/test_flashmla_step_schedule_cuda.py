"""GPU (sm_90, FlashMLA installed): the model making FlashMLA's split schedule once a step gives the logits of every
layer scheduling in its own call: bit for bit eagerly; compiled, and compiled and replayed in CUDA graphs
(``mode="reduce-overhead"``), against the same compile scheduling per call; through FlashMLA, a split that runs it
above 2 rows and ``flashmla-tiered``."""

from __future__ import annotations

import copy

import pytest
import torch

from mla_compile.ops.adapters.flashmla import schedule_parts

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                 reason="needs an sm_90 GPU")]


def test_the_schedule_rows_match_flashmla_s_own():
    """``schedule_parts`` (what the op's fake and a compiled graph take) against the schedule FlashMLA makes."""
    flash_mla = pytest.importorskip("flash_mla")
    lens = torch.tensor([5, 700, 4096], dtype=torch.int32, device="cuda")
    for heads, s_q in ((4, 1), (16, 1), (64, 1), (128, 1), (128, 2), (16, 4)):
        tiles, splits = flash_mla.get_mla_decoding_metadata(lens, s_q * heads, 1, h_q=heads, use_legacy=True)
        assert tiles.shape == (schedule_parts(lens.device, heads, s_q), 8) and splits.shape == (4,)


@pytest.mark.parametrize("backend", ["flashmla", "split:triton:2/flashmla", "flashmla-tiered"])
def test_the_model_s_step_schedule_equals_per_call_scheduling(backend):
    pytest.importorskip("flash_mla")
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models.model import patch
    from mla_compile.ops.registry import declare_split
    from mla_compile.serving.generate import greedy_generate

    declare_split("decode", ((2, "triton"), (None, "flashmla")))
    torch._dynamo.reset()
    prompts = toy.random_prompts(7, [3 + 11 * i for i in range(20)])  # 20 rows: above every split's bound
    hf = toy.toy_hf_model("v3", seed=3, device="cuda", dtype=torch.bfloat16, num_hidden_layers=3,
                          num_attention_heads=16, num_key_value_heads=16)
    kw = dict(block_size=64, num_blocks=96, device="cuda", keep_logits=True)
    per_call = patch(copy.deepcopy(hf), backend=f"decode={backend}", regional_compile=True)  # the same kernels
    per_call.step_schedule = False
    per_call.allocate_cache(96, 64, fill=float("nan"))
    want = greedy_generate(per_call, prompts, 3, **kw)
    model = patch(hf, backend=f"decode={backend}", regional_compile=True)
    model.allocate_cache(96, 64, fill=float("nan"))
    got = greedy_generate(model, prompts, 3, **kw)
    assert got.tokens == want.tokens
    for a, b in zip(got.step_logits, want.step_logits, strict=True):
        assert torch.equal(a, b)  # one schedule: the same splits, bit for bit
    for mode in (None, "reduce-overhead"):  # compiled (and replayed in CUDA graphs): on the schedule as per call
        runs = []
        for m in (per_call, model):
            torch._dynamo.reset()
            m.allocate_cache(96, 64, fill=float("nan"))
            runs.append(greedy_generate(torch.compile(m, fullgraph=True, mode=mode), prompts, 3, **kw))
        assert runs[1].tokens == runs[0].tokens, mode
        for a, b in zip(runs[1].step_logits, runs[0].step_logits, strict=True):
            assert (a.float() - b.float()).norm() / b.float().norm() < 1e-3, mode
    torch._dynamo.reset()
