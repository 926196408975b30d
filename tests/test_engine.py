"""The reference engine: arrivals, admission, block reuse, tokens equal to HF greedy decoding."""

import copy

import pytest
import torch

from mla_compile import toy
from mla_compile.builder import MetadataBuilder
from mla_compile.engine import Engine
from mla_compile.generate import hf_greedy_reference
from mla_compile.graphs.cuda_graph import DecodeGraphRunner
from mla_compile.model import patch

pytest.importorskip("transformers")


def _engine(model, num_blocks=64, max_batch=4, max_tokens=64, **kw):
    builder = MetadataBuilder(max_batch=max_batch, max_blocks_per_seq=16, max_tokens=max_tokens, block_size=4,
                              device="cpu")
    return Engine(DecodeGraphRunner(model, builder), num_blocks=num_blocks, **kw)


@pytest.mark.parametrize("kind", toy.KINDS)
def test_requests_joining_running_ones_match_hf(kind):
    hf = toy.toy_hf_model(kind, seed=8, num_hidden_layers=1, first_k_dense_replace=0)
    ref = copy.deepcopy(hf)
    model = patch(hf)
    model.allocate_cache(64, 4, fill=float("nan"))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (6, 11, 2, 15, 4, 9)]
    new_tokens = [5, 3, 7, 4, 6, 2]
    engine = _engine(model)
    for p, n in zip(prompts[:3], new_tokens[:3]):
        engine.add_request(p, n)
    engine.step()
    engine.step()
    for p, n in zip(prompts[3:], new_tokens[3:]):  # max_batch 4: some wait for running ones to finish
        engine.add_request(p, n)
    done = engine.run()
    want = [hf_greedy_reference(ref, [p], n)[0][0] for p, n in zip(prompts, new_tokens)]
    assert [r.output for r in done] == want
    assert engine.blocks.num_free == 64  # every block came back (free or evictable)


def test_engine_rejects_requests_that_cannot_fit():
    model = patch(toy.toy_hf_model("v2-lite", seed=0, num_hidden_layers=1))
    model.allocate_cache(8, 4)
    engine = _engine(model, num_blocks=8, max_tokens=16)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        engine.add_request([1] * 60, 10)
    with pytest.raises(ValueError, match="non-empty"):
        engine.add_request([], 3)


def test_engine_reports_a_cache_too_small_to_admit():
    model = patch(toy.toy_hf_model("v2-lite", seed=0, num_hidden_layers=1))
    model.allocate_cache(2, 4)
    engine = _engine(model, num_blocks=2)
    engine.add_request([1] * 12, 2)  # needs 3 blocks, only 2 exist
    with pytest.raises(RuntimeError, match="stuck"):
        engine.run()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_shared_prefixes_and_long_prompts_in_chunks_match_hf(prefix_caching):
    """Prompts sharing a system prefix hit the prefix cache; a prompt longer than the step budget is
    prefilled in chunks while others decode. Tokens equal HF's either way."""
    hf = toy.toy_hf_model("v3", seed=12, num_hidden_layers=1, first_k_dense_replace=0)
    ref = copy.deepcopy(hf)
    model = patch(hf)
    model.allocate_cache(64, 4, fill=float("nan"))
    gen = torch.Generator().manual_seed(5)
    system = torch.randint(0, 1024, (13,), generator=gen).tolist()
    prompts = [system + torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (3, 6, 1)]
    prompts.append(torch.randint(0, 1024, (40,), generator=gen).tolist())  # > the 16-token step budget
    engine = _engine(model, max_tokens=16, enable_prefix_caching=prefix_caching)
    engine.add_request(prompts[0], 4)
    engine.step()  # the first request computes (and registers) the shared prefix
    engine.step()
    for p in prompts[1:]:
        engine.add_request(p, 5)
    done = engine.run()
    want = [hf_greedy_reference(ref, [p], n)[0][0] for p, n in zip(prompts, [4, 5, 5, 5])]
    assert [r.output for r in done] == want
    assert (engine.cached_prompt_tokens == 24) if prefix_caching else (engine.cached_prompt_tokens == 0)
