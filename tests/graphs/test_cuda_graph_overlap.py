"""The token feed of ``Engine(overlap=True)``: its gather and contract on CPU; over replayed CUDA graphs, the
sampled tokens gathered into the next step's input ids inside the captured graph and read by the host one
step late give the same tokens as without overlap."""

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.app import toy
from mla_compile.graphs.cuda_graph import DecodeGraphRunner, TokenFeed
from mla_compile.models.model import patch
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.engine import Engine

from tests.engine_load import FailingRunner, check_trace, make_trace, run_trace, with_sampling

pytest.importorskip("transformers")


def test_token_feed_gathers_the_named_rows_of_the_last_tokens_and_keeps_the_host_ids_elsewhere():
    gen = torch.Generator().manual_seed(0)
    feed = TokenFeed(max_batch=4, device="cpu")
    last = torch.randint(0, 1000, (6,), generator=gen)
    kept = feed.store(last)
    assert kept.data_ptr() == feed.tokens.data_ptr() and torch.equal(kept, last)
    feed.fill([5, -1, 0])
    ids = torch.randint(1000, 2000, (7,), generator=gen)  # host ids: a range the fed tokens never take
    host = ids.clone()
    feed.apply(ids, 4)  # a padded decode part of 4 rows, then 3 prefill tokens
    assert ids.tolist() == [int(last[5]), int(host[1]), int(last[0]), *host[3:].tolist()]
    feed.fill([])
    ids = host.clone()
    feed.apply(ids, 4)
    assert torch.equal(ids, host)
    with pytest.raises(ValueError, match=r"TokenFeed.fill: rows \[8\] must be -1 or in \[0, 8\)"):
        feed.fill([8])
    with pytest.raises(ValueError, match="5 decode rows, the feed holds max_batch=4"):
        feed.fill([0] * 5)


def test_the_token_feed_needs_one_token_per_decode_row_and_sample_step_needs_the_feed():
    builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=4, max_tokens=16, block_size=4, device="cpu",
                              query_len=2)
    with pytest.raises(ValueError, match="one token per decode row; the builder has query_len=2"):
        DecodeGraphRunner(lambda *a: None, builder).enable_token_feed()
    builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=4, max_tokens=16, block_size=4, device="cpu")
    runner = DecodeGraphRunner(lambda *a: None, builder)
    with pytest.raises(ValueError, match="sample_step needs the token feed"):
        runner.sample_step([], [], [], [], [])
    feed = runner.enable_token_feed()
    assert runner.enable_token_feed() is feed


def _trace_run(step_fn, overlap: bool, sampling: bool, n_requests: int = 400) -> tuple:
    """A seeded trace (shared prefixes, sampled and greedy requests without stop tokens, 10% aborts, 5% bad
    requests) through a CUDA-graph runner over ``step_fn`` (vocabulary 1024, 24 cache blocks of 16; its graphs
    captured lazily, by the first decode step) whose first replayed decode step after call 150 raises. Returns ``(engine, seen, results)`` after
    :func:`check_trace` passed."""
    builder = MetadataBuilder(max_batch=16, max_blocks_per_seq=8, max_tokens=64, block_size=16, device="cuda")
    runner = DecodeGraphRunner(step_fn, builder, strict_sync=True, sampling=sampling)
    engine = Engine(FailingRunner(runner, fail_from=150, parts=("decode",)), num_blocks=24, overlap=overlap)
    limits = engine.limits
    trace = make_trace(17, n_requests, vocab_size=limits.vocab_size, max_total=limits.max_seq_tokens, block_size=16)
    with_sampling(trace, seed=4, vocab_size=limits.vocab_size)
    # no runner.capture() here: the first decode step captures, with the prefill's tokens in the feed
    seen = run_trace(engine, trace)
    check_trace(engine, trace, seen)
    results = ({i: (engine.requests[rid].finish_reason, engine.requests[rid].output) for i, rid in seen.ids.items()},
               seen.aborted, [sorted(f.request_ids) for f in seen.failures], seen.steps)
    return engine, seen, results


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_with_the_token_feed_in_the_captured_graph_gives_the_tokens_of_no_overlap():
    """The same trace without overlap (sampling inside the replayed graph), with overlap and sampling inside the
    graph (the token feed reads the graph's own tokens), and with overlap and sampling after the replay: the
    same steps, so (bf16 tokens depend on the batch) the same tokens, finish reasons, aborts and failed step."""
    torch._dynamo.reset()
    counters.clear()
    hf = toy.toy_hf_model("v3", seed=6, device="cuda", dtype=torch.bfloat16, num_hidden_layers=2)
    model = patch(hf, backend="triton")
    compiled = torch.compile(model, fullgraph=True)
    runs = []
    for overlap, sampling in ((False, True), (True, True), (True, False)):
        model.allocate_cache(24, 16, fill=float("nan"))
        engine, seen, results = _trace_run(compiled, overlap, sampling)
        runs.append(results)
        runner = engine.runner.runner
        assert runner.replays > 100 and engine.runner.failed_at is not None
        assert (runner.token_feed is not None) == overlap
    assert runs[0] == runs[1] == runs[2]
    outputs = [out for reason, out in runs[0][0].values() if reason == "length"]
    assert len(outputs) > 250 and sum(len(set(out)) > 1 for out in outputs) > 100
    assert len(runs[0][2]) == 1 and seen.abort_states["decode"] >= 5
    assert counters["inductor"]["cudagraph_skips"] == 0
