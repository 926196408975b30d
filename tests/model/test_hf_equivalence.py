"""The patched model against HF transformers itself: prefill logits and greedy decode steps, for the
dense kinds and (when transformers has it) the sparse DeepSeek-V3.2 toy, whose prompts here are longer
than its index_topk (8), so the indexer really drops context."""

import copy

import pytest
import torch

from mla_compile.app import toy
from mla_compile.serving.generate import greedy_generate, hf_greedy_reference
from mla_compile.models.metadata import SeqChunk, plan_step
from mla_compile.models.model import MLAForCausalLM, patch

pytest.importorskip("transformers")


@pytest.fixture(params=toy.KINDS + (toy.SPARSE_KINDS if toy.has_sparse_kinds() else ()))
def models(request):
    hf = toy.toy_hf_model(request.param, seed=1234)
    ref = copy.deepcopy(hf)
    return ref, patch(hf)


@pytest.mark.parametrize("block_size", [1, 16])
def test_prefill_logits_match_hf(models, block_size):
    ref, model = models
    gen = torch.Generator().manual_seed(7)
    prompts = toy.random_prompts(gen, [5, 19, 1, 12])
    num_blocks = 64 if block_size == 16 else 128
    model.allocate_cache(num_blocks, block_size, fill=float("nan"))
    # shuffled physical blocks per sequence
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, at = [], 0
    for p in prompts:
        need = -(-len(p) // block_size)
        chunks.append(SeqChunk(perm[at:at + need], p))
        at += need
    step = plan_step([], chunks, block_size, logits="all", num_blocks=num_blocks)
    with torch.no_grad():
        ours = model(step.input_ids, step.positions, step.meta)[:step.num_rows]
        want = torch.cat([ref(torch.tensor([p])).logits[0] for p in prompts])
    torch.testing.assert_close(ours, want, atol=2e-5, rtol=1e-4)


def test_greedy_decode_matches_hf(models):
    ref, model = models
    prompts = toy.random_prompts(torch.Generator().manual_seed(3), [7, 2, 13])
    steps = 5
    want_tokens, want_logits = hf_greedy_reference(ref, prompts, steps)
    model.allocate_cache(64, 4, fill=float("nan"))
    res = greedy_generate(model, prompts, steps, block_size=4, num_blocks=64, keep_logits=True, dynamic=False)
    assert res.tokens == want_tokens
    for s in range(steps):
        want = torch.stack([want_logits[i][s] for i in range(len(prompts))])
        torch.testing.assert_close(res.step_logits[s], want, atol=2e-5, rtol=1e-4)


def test_mixed_decode_and_prefill_step(models):
    """One step holding decode tokens of running sequences and a new prompt gives HF's logits."""
    ref, model = models
    gen = torch.Generator().manual_seed(11)
    running = toy.random_prompts(gen, [6, 9])
    new = toy.random_prompts(gen, [4])[0]
    model.allocate_cache(32, 4, fill=float("nan"))
    blocks = [[0, 1, 2], [3, 4, 5], [6, 7]]
    first = plan_step([], [SeqChunk(b, p) for b, p in zip(blocks, running)], 4)
    with torch.no_grad():
        nxt = model(first.input_ids, first.positions, first.meta)[:first.num_rows].argmax(-1).tolist()
        step = plan_step([SeqChunk(b, [t], len(p)) for b, t, p in zip(blocks, nxt, running)],
                         [SeqChunk(blocks[2], new)], 4)
        ours = model(step.input_ids, step.positions, step.meta)[:step.num_rows]
        want = [ref(torch.tensor([p + [t]])).logits[0, -1] for p, t in zip(running, nxt)]
        want.append(ref(torch.tensor([new])).logits[0, -1])
    torch.testing.assert_close(ours, torch.stack(want), atol=2e-5, rtol=1e-4)


def test_patch_keeps_hf_parameter_names():
    hf = toy.toy_hf_model("v3", seed=0)
    names = {k for k, _ in hf.named_parameters()}
    model = patch(hf)
    assert isinstance(model, MLAForCausalLM)
    assert {k for k, _ in model.named_parameters()} == names


def test_patch_rejects_non_mla_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=128)
    with pytest.raises(ValueError, match="MLA"):
        patch(transformers.LlamaForCausalLM(cfg))


def test_forward_without_cache_is_a_clear_error():
    model = patch(toy.toy_hf_model("v2-lite", seed=0, num_hidden_layers=1))
    step = plan_step([], [SeqChunk([0], [1, 2])], 4)
    with pytest.raises(RuntimeError, match="allocate_cache"):
        model(step.input_ids, step.positions, step.meta)
