"""DecodeGraphRunner: capture-size choice and padded steps (CPU), capture and replay (CUDA), and the
engine's fault rules (bad requests, aborts, a failing step) around replayed steps (CUDA)."""

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.app import toy
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.engine import Engine
from mla_compile.graphs.cuda_graph import DecodeGraphRunner, default_capture_sizes
from mla_compile.models.model import patch

from tests.engine_load import FailingRunner, check_trace, make_trace, run_trace, run_workload

pytest.importorskip("transformers")


def test_default_capture_sizes_like_peers():
    assert default_capture_sizes(40) == [2, 4, 8, 16, 24, 32, 40]
    assert default_capture_sizes(20) == [2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="max_batch"):
        default_capture_sizes(1)


def test_graph_size_picks_smallest_fit_and_falls_back():
    b = MetadataBuilder(max_batch=16, max_blocks_per_seq=4, max_tokens=64, block_size=4, device="cpu")
    r = DecodeGraphRunner(lambda *a: None, b, capture_sizes=[2, 4, 8])
    assert [r.graph_size(n) for n in (1, 2, 3, 5, 8, 9)] == [2, 2, 4, 8, 8, None]
    with pytest.raises(ValueError, match="capture_sizes"):
        DecodeGraphRunner(lambda *a: None, b, capture_sizes=[1, 32])
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphRunner(lambda *a: None, b, enabled=True)


def _engine(model, sizes, device="cpu", num_blocks=96, max_batch=8, block_size=4, max_blocks=24, **runner_kw):
    builder = MetadataBuilder(max_batch=max_batch, max_blocks_per_seq=max_blocks, max_tokens=256,
                              block_size=block_size, device=device)
    return Engine(DecodeGraphRunner(model, builder, capture_sizes=sizes, **runner_kw), num_blocks=num_blocks)


def test_padded_capture_sizes_give_the_same_tokens_as_unpadded_steps():
    model = patch(toy.toy_hf_model("v2-lite", seed=9, num_hidden_layers=1))
    model.allocate_cache(96, 4)
    padded, steps = run_workload(_engine(model, [2, 4, 8]), seed=1)
    model.allocate_cache(96, 4)
    plain, _ = run_workload(_engine(model, [8]), seed=1)
    assert padded == plain and steps > 30


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_eager_over_1000_steps_without_syncs_or_recompiles():
    torch._dynamo.reset()
    counters.clear()
    hf = toy.toy_hf_model("v3", seed=6, device="cuda", dtype=torch.bfloat16, num_hidden_layers=2)
    kw = dict(device="cuda", num_blocks=1024, max_batch=32, block_size=16, max_blocks=32)
    load = dict(seed=2, n_requests=80, gap=30, max_new=300)
    model = patch(hf, backend="triton")
    compiled = torch.compile(model, fullgraph=True)
    # without graphs: the same compiled step and the same padded sizes, run directly
    model.allocate_cache(1024, 16)
    want, steps = run_workload(_engine(compiled, None, enabled=False, **kw), **load)
    model.allocate_cache(1024, 16)
    engine = _engine(compiled, None, strict_sync=True, **kw)  # fill + replay under sync_debug_mode "error"
    engine.runner.capture()
    assert all(a.cuda_graph for a in model.attentions), "the runner flags captured decode for backend selection"
    graphs = counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("fail_on_recompile"):
        got, got_steps = run_workload(engine, **load)
    assert steps >= 1000 and got_steps == steps
    assert got == want
    assert engine.runner.replays > 900
    assert counters["stats"]["unique_graphs"] == graphs
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flashinfer_decode_planned_by_the_builder_replays_like_uncaptured_steps():
    """FlashInfer's host plan made by the builder before each step (block size 16: FlashMLA cannot serve),
    replayed in CUDA graphs: the same tokens as the same planned steps run uncaptured."""
    pytest.importorskip("flashinfer")
    from mla_compile.ops.adapters.flashinfer import FlashInferDecodePlanner

    torch._dynamo.reset()
    counters.clear()
    hf = toy.toy_hf_model("v2-lite", seed=4, device="cuda", dtype=torch.bfloat16, num_hidden_layers=1,
                          num_attention_heads=16, num_key_value_heads=16)
    model = patch(hf, backend="decode=flashinfer,prefill=triton")
    c = model.config
    compiled = torch.compile(model, fullgraph=True)
    load = dict(seed=5, n_requests=16, gap=12, max_new=60)
    results = []
    for enabled in (False, True):
        planner = FlashInferDecodePlanner(num_heads=c.num_heads, block_size=16, scale=c.softmax_scale,
                                          dtype=torch.bfloat16, kv_lora_rank=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim)
        builder = MetadataBuilder(max_batch=8, max_blocks_per_seq=16, max_tokens=256, block_size=16, device="cuda",
                                  decode_planner=planner)
        model.allocate_cache(256, 16)
        engine = Engine(DecodeGraphRunner(compiled, builder, capture_sizes=[2, 4, 8], enabled=enabled), num_blocks=256)
        results.append(run_workload(engine, **load))
        if enabled:
            assert engine.runner.replays > 20 and max(p.times_planned for p in planner.plans.values()) > 10
    assert results[0][0] == results[1][0] and results[0][1] > 60
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_latent_cache_replays_like_uncaptured_steps():
    """The model over the fp8 latent cache (quantizing Triton write + fp8 Triton decode), compiled and
    captured: the same tokens as the same steps run uncaptured, no syncs, no CUDA-graph skips."""
    torch._dynamo.reset()
    counters.clear()
    hf = toy.toy_hf_model("v2-lite", seed=8, device="cuda", dtype=torch.bfloat16, num_hidden_layers=1)
    model = patch(hf)
    compiled = torch.compile(model, fullgraph=True)
    load = dict(seed=6, n_requests=16, gap=12, max_new=60)
    results = []
    for enabled in (False, True):
        model.allocate_cache(256, 16, dtype="fp8", fill=float("nan"))
        engine = _engine(compiled, [2, 4, 8], device="cuda", num_blocks=256, max_batch=8, block_size=16,
                         max_blocks=16, enabled=enabled, strict_sync=enabled)
        results.append(run_workload(engine, **load))
        if enabled:
            assert engine.runner.replays > 20
    assert results[0][0] == results[1][0] and results[0][1] > 60
    assert counters["inductor"]["cudagraph_skips"] == 0


def faulty_trace_with_graphs(step_fn, device: str, enabled: bool, n_requests: int = 400,
                             num_blocks: int = 24) -> tuple:
    """The faulty trace of ``tests/test_engine.py`` (5% bad requests, 10% aborts) through a graph runner
    over ``step_fn`` (a patched toy, vocabulary 1024; its cache allocated for ``num_blocks`` blocks of
    16), whose first pure decode step (a replayed graph when ``enabled``) after call 150 raises. Returns
    ``(engine, trace, seen, counts)`` after :func:`check_trace` passed."""
    builder = MetadataBuilder(max_batch=16, max_blocks_per_seq=8, max_tokens=64, block_size=16, device=device)
    runner = DecodeGraphRunner(step_fn, builder, enabled=enabled, strict_sync=enabled)
    engine = Engine(FailingRunner(runner, fail_from=150, parts=("decode",)), num_blocks=num_blocks)
    limits = engine.limits
    trace = make_trace(11, n_requests, vocab_size=limits.vocab_size, max_total=limits.max_seq_tokens,
                       block_size=16)
    if enabled:
        runner.capture()
    seen = run_trace(engine, trace)
    counts = check_trace(engine, trace, seen)
    return engine, trace, seen, counts


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bad_requests_aborts_and_a_failing_replayed_step_with_cuda_graphs_match_uncaptured_steps():
    """With decode steps replayed as CUDA graphs: ids past the vocabulary are rejected before any kernel
    (a device-side assert in the embedding would end the process), aborts mid-decode free their blocks
    between replays, a failing replayed step fails its requests and serving goes on. The same requests
    finish with the same reasons and tokens as the same steps run uncaptured (bf16 tokens depend on the
    batch, so the reference is the same schedule, not each request alone), and every block comes back."""
    torch._dynamo.reset()
    counters.clear()
    hf = toy.toy_hf_model("v3", seed=6, device="cuda", dtype=torch.bfloat16, num_hidden_layers=2)
    model = patch(hf, backend="triton")
    compiled = torch.compile(model, fullgraph=True)
    results = []
    for enabled in (False, True):
        model.allocate_cache(24, 16, fill=float("nan"))
        engine, trace, seen, counts = faulty_trace_with_graphs(compiled, "cuda", enabled)
        outputs = {r.id: (r.finish_reason, r.output) for r in engine.requests.values()}
        results.append((outputs, seen.aborted, [f.request_ids for f in seen.failures], counts))
    assert results[0] == results[1]
    assert engine.runner.replays > 100 and engine.runner.failed_at is not None  # the failing step: a replay
    assert seen.abort_states["decode"] >= 5 and len(seen.failures) == 1 and counts["failed"] >= 2
    assert any("= 1024 is not a token id in [0, 1024)" in str(e) for e in seen.rejected.values())
    assert counters["inductor"]["cudagraph_skips"] == 0
    print(f"\nfaulty trace with CUDA graphs on {torch.cuda.get_device_name()}: {counts}, "
          f"aborts by state {dict(seen.abort_states)}, {engine.runner.replays} replays, tokens identical")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_inside_the_captured_step_gives_the_tokens_of_sampling_after_it():
    """Greedy and seeded top-k / top-p requests: sampled inside the replayed graph (``sampling=True``, its
    parameters filled without a host sync) they get exactly the tokens that the uncaptured steps sampled
    after the step give them."""
    from mla_compile.serving.sampling import SamplingParams

    torch._dynamo.reset()
    hf = toy.toy_hf_model("v3", seed=6, device="cuda", dtype=torch.bfloat16, num_hidden_layers=1)
    model = patch(hf, backend="triton")
    compiled = torch.compile(model, fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    settings = [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8), {}]
    requests = [(torch.randint(0, 1024, (3 + i % 7,), generator=gen).tolist(),
                 SamplingParams(**settings[i % 4], seed=50 + i, max_new_tokens=10 + i % 9)) for i in range(24)]
    results = []
    for enabled in (False, True):
        model.allocate_cache(256, 16, fill=float("nan"))
        engine = _engine(compiled, [2, 4, 8], device="cuda", num_blocks=256, max_batch=8, block_size=16,
                         max_blocks=16, enabled=enabled, strict_sync=enabled, sampling=enabled)
        for p, params in requests:
            engine.add_request(p, params)
        results.append({r.id: r.output for r in engine.run()})
        if enabled:
            assert engine.runner.replays > 20 and engine.runner.sampling_rows is not None
    assert results[0] == results[1]
    assert sum(len(set(out)) > 1 for out in results[1].values()) > 10
