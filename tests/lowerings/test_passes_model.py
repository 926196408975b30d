"""The fusion pass on the patched toy model over the 656-byte fp8 latent cache: a decode step compiled
(Inductor) with the MLA passes fuses the layer's norm + rope + quantizing write (``fuse_kv_write_fp8``)
and gives eager's logits and cache rows. (The same step compiled without the passes costs another
~15 s of C++ compile on CPU; the small graphs of ``test_passes.py`` compare fused against unfused.)"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.app import toy
from mla_compile.lowerings import mla_passes
from mla_compile.models.metadata import SeqChunk, plan_step
from mla_compile.models.model import patch
from tests.lowerings.test_fused_kv_write import assert_fp8_rows_close

pytest.importorskip("transformers")
BS, NB = 4, 16


@pytest.mark.slow
def test_fp8_cache_decode_step_compiled_with_passes_matches_eager(fresh_dynamo):
    model = patch(toy.toy_hf_model("v2-lite", seed=31, num_hidden_layers=1))
    (cache,) = model.allocate_cache(NB, BS, dtype="fp8", fill=float("nan"))
    prompts, blocks = toy.random_prompts(32, [9, 5]), [[0, 1, 2, 3], [4, 5, 6]]
    with torch.no_grad():  # eager prefill: the context the decode step attends over
        pre = plan_step([], [SeqChunk(b, p) for b, p in zip(blocks, prompts)], BS)
        model(pre.input_ids, pre.positions, pre.meta)
    step = plan_step([SeqChunk(b, [7], len(p)) for b, p in zip(blocks, prompts)], [], BS)
    before = cache.clone()
    with torch.no_grad():
        want = model(step.input_ids, step.positions, step.meta)[:step.num_rows]
    eager_cache = cache.clone()
    cache.copy_(before)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True), mla_passes(True):
        got = compiled(step.input_ids, step.positions, step.meta)[:step.num_rows]
    assert dict(counters["mla_passes"]) == {"fuse_kv_write_fp8": 1, "fuse_absorb_q": 1, "fuse_absorb_out": 1}
    slots = step.meta.slot_mapping.long()
    assert slots.tolist() == [9, 4 * BS + 5]
    rows = lambda c: c.view(-1, c.shape[-1])  # noqa: E731
    assert rows(before)[slots].eq(0xFF).all() and not rows(eager_cache)[slots].eq(0xFF).all()
    untouched = torch.ones(NB * BS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(rows(cache)[untouched], rows(before)[untouched])  # nothing else written
    # layer 0's kv_a_proj is the same extern matmul compiled and eager, and the fused op runs eager's
    # norm and rope math; rows may still differ by float32 rounding of the norm (one e4m3 step at most)
    assert_fp8_rows_close(cache, eager_cache, model.config.kv_lora_rank)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
