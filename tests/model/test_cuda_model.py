"""GPU: the patched model with the Triton backend against HF eager and the reference backend."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.app import toy
from mla_compile.serving.generate import greedy_generate, hf_greedy_reference
from mla_compile.models.model import patch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("kind", toy.KINDS)
def test_triton_backend_matches_hf_fp32_logits_bf16_close(kind):
    hf = toy.toy_hf_model(kind, seed=2, device="cuda")
    ref = copy.deepcopy(hf)
    prompts = toy.random_prompts(1, [33, 5, 70, 1])
    want_tokens, want_logits = hf_greedy_reference(ref, prompts, 4, device="cuda")
    model = patch(hf, backend="triton")
    model.allocate_cache(128, 16, fill=float("nan"))
    got = greedy_generate(model, prompts, 4, block_size=16, num_blocks=128, device="cuda", keep_logits=True)
    # fp32 model; tl.dot may use tf32 internally, so compare logits with a tf32-level tolerance
    for s in range(4):
        want = torch.stack([want_logits[i][s] for i in range(len(prompts))])
        torch.testing.assert_close(got.step_logits[s], want, atol=5e-2, rtol=5e-2)
    # bf16: the whole model in bf16 against the reference backend in bf16
    hf16 = toy.toy_hf_model(kind, seed=2, device="cuda", dtype=torch.bfloat16)
    ref16 = patch(copy.deepcopy(hf16), backend="reference")
    tri16 = patch(hf16, backend="triton")
    ref16.allocate_cache(128, 16)
    tri16.allocate_cache(128, 16)
    a = greedy_generate(ref16, prompts, 3, block_size=16, num_blocks=128, device="cuda", keep_logits=True)
    b = greedy_generate(tri16, prompts, 3, block_size=16, num_blocks=128, device="cuda", keep_logits=True)
    rel = (a.step_logits[0] - b.step_logits[0]).norm() / a.step_logits[0].norm()
    assert rel < 2e-2


def test_compiled_model_on_cuda_has_triton_kernels_inline_and_no_breaks():
    torch._dynamo.reset()
    counters.clear()
    hf = toy.toy_hf_model("v3", seed=4, device="cuda", dtype=torch.bfloat16, num_hidden_layers=1,
                          first_k_dense_replace=0)
    model = patch(hf, backend="triton")
    model.allocate_cache(64, 16)
    prompts = toy.random_prompts(2, [9, 40, 3])
    eager = greedy_generate(model, prompts, 3, block_size=16, num_blocks=64, device="cuda", keep_logits=True)
    compiled = torch.compile(model, fullgraph=True)
    model.allocate_cache(64, 16)
    got = greedy_generate(compiled, prompts, 3, block_size=16, num_blocks=64, device="cuda", keep_logits=True)
    assert dict(counters["graph_break"]) == {}
    for x, y in zip(got.step_logits, eager.step_logits):
        rel = (x - y).norm() / y.norm()
        assert rel < 2e-2
    with torch.compiler.set_stance("fail_on_recompile"):
        model.allocate_cache(64, 16)
        greedy_generate(compiled, toy.random_prompts(3, [5, 6, 7, 8, 90]), 3, block_size=16, num_blocks=64, device="cuda")


def test_model_prefill_takes_flashinfer_through_the_builder_s_prefill_planner():
    """The builder's FlashInfer prefill planner reaches MLAAttention's causal prefill (the model's prefill can
    take FlashInfer); its logits match the reference backend's on the same step (bf16)."""
    pytest.importorskip("flashinfer")
    from mla_compile.serving.builder import MetadataBuilder
    from mla_compile.models.metadata import SeqChunk
    from mla_compile.ops.adapters.flashinfer import FlashInferPrefillPlanner

    hf = toy.toy_hf_model("v3", seed=5, device="cuda", dtype=torch.bfloat16)
    ref = patch(copy.deepcopy(hf), backend="reference")
    fi = patch(hf, backend="prefill=flashinfer")
    c = fi.attentions[0].config
    planner = FlashInferPrefillPlanner(num_heads=c.num_heads, head_dim_qk=c.qk_head_dim, head_dim_v=c.v_head_dim,
                                       scale=c.softmax_scale, dtype=torch.bfloat16, device="cuda")
    builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=8, max_tokens=256, block_size=16, device="cuda",
                              prefill_planner=planner)
    for m in (ref, fi):
        m.allocate_cache(32, 16, fill=float("nan"))
    for lens in ([37, 5, 90], [1, 64]):
        prompts = toy.random_prompts(3, lens)
        step = builder.build([], [SeqChunk(list(range(8 * i, 8 * i + 8)), p, 0) for i, p in enumerate(prompts)])
        assert step.meta.prefill.plan is planner
        with torch.no_grad():
            got = fi(step.input_ids, step.positions, step.meta)[:step.num_rows].float()
            want = ref(step.input_ids, step.positions, step.meta)[:step.num_rows].float()
        assert ("flashinfer" in fi.attentions[0]._backend_choices.values())
        assert torch.isfinite(got).all()
        assert (got - want).norm() / want.norm() < 2e-2
