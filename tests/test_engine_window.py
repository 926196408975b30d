"""The engine over a sink + window model (``patch(..., sparse="sink_window")``): blocks released as the window
moves keep a long generation in a cache too small for it dense, with the tokens and logits of a run that
releases nothing; the prefix cache shares only blocks that still hold their tokens."""

import pytest
import torch

from mla_compile.app import toy
from mla_compile.graphs.cuda_graph import DecodeGraphRunner
from mla_compile.models.model import patch
from mla_compile.serving.admission import RequestRejected
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.engine import Engine

from tests.engine_load import TINY_V3

pytest.importorskip("transformers")

BS = 4


@pytest.fixture(scope="module")
def model():
    hf = toy.toy_hf_model("v3", seed=8, dtype=torch.float64, **TINY_V3)  # float64: tokens never flip on rounding
    return patch(hf, sparse="sink_window", sink=4, window=8)


def _engine(step_fn, num_blocks, max_tokens=16, block_size=BS, **kw):
    builder = MetadataBuilder(max_batch=2, max_blocks_per_seq=40, max_tokens=max_tokens, block_size=block_size,
                              device="cpu")
    return Engine(DecodeGraphRunner(step_fn, builder), num_blocks=num_blocks, **kw)


def _plain(model, num_blocks, block_size=BS):
    """An engine over the same model that does not know it is windowed: a dense block manager, nothing released."""
    model.allocate_cache(num_blocks, block_size, fill=float("nan"))
    return _engine(lambda *a: model(*a), num_blocks, block_size=block_size, vocab_size=97, max_positions=64)


@pytest.mark.parametrize("overlap", [False, True])
def test_long_generation_runs_in_a_bounded_cache(overlap):
    """45 tokens (over 10 windows of 4) in 5 usable blocks of 2 (10 tokens): no step holds more than the sink
    block, the window's blocks and one more; the run's tokens and logits equal those of a run that releases
    nothing (bitwise: the same rows are read in the same order, only from other blocks)."""
    model = patch(toy.toy_hf_model("v3", seed=8, dtype=torch.float64, **TINY_V3), sparse="sink_window", sink=2,
                  window=4)
    prompt = toy.random_prompts(3, [5], vocab_size=97)[0]
    new, bs = 40, 2
    model.allocate_cache(6, bs, fill=float("nan"))
    engine = _engine(model, 6, block_size=bs, overlap=overlap)
    assert engine.blocks.sink_window == (2, 4) and engine.blocks.peak_blocks(5, 45) == 4
    with pytest.raises(RequestRejected, match="hold up to 12 cache tokens"):  # a 6-block prompt: more than 5
        engine.add_request(list(range(11)), 1)
    rid = engine.add_request(prompt, new)
    held, released = [], 0
    while engine.running or engine.waiting or engine._inflight is not None:
        engine.step(keep_logits=True)
        held.append(sum(b.ref > 0 for b in engine.blocks.blocks) - 1)  # less the pinned null block
        if engine.running:
            released = max(released, engine.running[0].alloc.released)
    req = engine.requests[rid]
    assert len(req.output) == new and max(held) <= 4 and released >= 18
    assert engine.blocks.num_free == 5  # all back
    ours = torch.cat(engine.step_logits)

    with pytest.raises(RequestRejected, match="exceed the paged cache"):  # dense: 45 tokens > 12
        _engine(lambda *a: model(*a), 6, block_size=bs, vocab_size=97).add_request(prompt, new)
    plain = _plain(model, 40, bs)
    plain.add_request(prompt, new)
    while plain.running or plain.waiting:
        plain.step(keep_logits=True)
    assert plain.requests[0].output == req.output
    torch.testing.assert_close(ours, torch.cat(plain.step_logits), atol=0, rtol=0)


def test_prefix_cache_shares_only_blocks_that_hold_their_tokens(model):
    """A long prompt's early blocks are released (registered ones stay findable while nobody overwrites them);
    requests with the same prefix, admitted while it runs and after it finished, get the tokens they get alone."""
    gen = torch.Generator().manual_seed(4)
    base = toy.random_prompts(gen, [30], vocab_size=97)[0]
    prompts = [base, base + [5, 6, 7], base[:20] + [9], base + [1]]
    new = [12, 6, 5, 4]
    model.allocate_cache(24, BS, fill=float("nan"))
    engine = _engine(model, 24)
    engine.add_request(prompts[0], new[0])
    for _ in range(4):  # the prompt's two chunks, then decodes: its middle blocks are released by now
        engine.step()
    assert engine.running[0].alloc.released > 0
    for p, n in zip(prompts[1:3], new[1:3]):
        engine.add_request(p, n)
    engine.run()
    engine.add_request(prompts[3], new[3])  # after the others finished: released blocks may have been reused
    done = engine.run()
    assert engine.cached_prompt_tokens >= 28 + 20
    for r in done:
        alone = _plain(model, 64)
        alone.add_request(r.prompt, r.max_new_tokens)
        assert alone.run()[0].output == r.output, r.id
