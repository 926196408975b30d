"""The patched model over the 656-byte fp8 latent cache (``allocate_cache(dtype="fp8")``) against the
same weights over a float32 cache: dense prefill of fresh prompts reads no cache (identical logits);
decode, prefix-cached prefill and sparse (V3.2) layers read quantized rows (close, and really
different); compiled without breaks."""

import copy

import pytest
import torch

from mla_compile.app import toy
from mla_compile.serving.generate import greedy_generate
from mla_compile.models.metadata import SeqChunk, plan_step
from mla_compile.models.model import patch

pytest.importorskip("transformers")
KINDS = ("v2-lite",) + (toy.SPARSE_KINDS if toy.has_sparse_kinds() else ())


def _pair(kind):
    hf = toy.toy_hf_model(kind, seed=21, num_hidden_layers=2)
    ref = patch(copy.deepcopy(hf))
    ref.allocate_cache(64, 4, fill=float("nan"))
    fp8 = patch(hf)
    caches = fp8.allocate_cache(64, 4, dtype="fp8", fill=float("nan"))
    assert all(c.dtype == torch.uint8 and c.shape == (64, 4, 656) for c in caches)
    return ref, fp8


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_cache_generation_is_close_to_the_float_cache(kind):
    ref, fp8 = _pair(kind)
    prompts = toy.random_prompts(4, [13, 6, 21])  # longer than V3.2's index_topk (8)
    kw = dict(block_size=4, num_blocks=64, keep_logits=True, dynamic=False)
    want = greedy_generate(ref, prompts, 4, **kw)
    got = greedy_generate(fp8, prompts, 4, **kw)
    first = 0
    if kind not in toy.SPARSE_KINDS:  # dense prefill of fresh prompts attends over fresh latents only
        torch.testing.assert_close(got.step_logits[0], want.step_logits[0])
        first = 1  # (sparse layers read every token, prefill included, from the cache)
    compared = 0
    for s in range(first, 4):  # steps reading quantized rows, while both runs still hold the same tokens
        if [t[:s] for t in got.tokens] != [t[:s] for t in want.tokens]:
            break
        err = _rel(got.step_logits[s], want.step_logits[s])
        assert 1e-7 < err < 5e-2, (s, err)
        compared += 1
    assert compared >= 1


def test_prefix_cached_prefill_reads_the_fp8_context():
    ref, fp8 = _pair("v2-lite")
    prompt = toy.random_prompts(9, [17])[0]
    blocks = list(range(5))
    outs = []
    for model in (ref, fp8):
        with torch.no_grad():
            first = plan_step([], [SeqChunk(blocks, prompt[:9])], 4)
            model(first.input_ids, first.positions, first.meta)
            rest = plan_step([], [SeqChunk(blocks, prompt[9:], 9)], 4, logits="all")  # gathers 9 context rows
            outs.append(model(rest.input_ids, rest.positions, rest.meta)[:rest.num_rows])
    err = _rel(outs[1], outs[0])
    assert 1e-7 < err < 5e-2, err


def test_fp8_cache_model_compiles_without_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    _, fp8 = _pair("v2-lite")
    prompts = toy.random_prompts(5, [7, 3])
    eager = greedy_generate(fp8, prompts, 3, block_size=4, num_blocks=64, keep_logits=True)
    fp8.allocate_cache(64, 4, dtype="fp8", fill=float("nan"))
    compiled = torch.compile(fp8, fullgraph=True, backend="aot_eager")
    got = greedy_generate(compiled, prompts, 3, block_size=4, num_blocks=64, keep_logits=True)
    assert got.tokens == eager.tokens and dict(counters["graph_break"]) == {}
    for a, b in zip(got.step_logits, eager.step_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_fp8_cache_fill_and_width_are_checked():
    _, fp8 = _pair("v2-lite")
    with pytest.raises(ValueError, match="fill of an fp8 latent cache"):
        fp8.allocate_cache(8, 4, dtype="fp8", fill=1.0)
    with pytest.raises(ValueError, match="uint8 fp8 rows"):
        fp8.attentions[0].set_cache(torch.zeros(8, 4, 600, dtype=torch.uint8))
