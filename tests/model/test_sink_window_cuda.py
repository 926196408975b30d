"""GPU: sink + window attention (``patch(..., sparse="sink_window")``) compiled with Inductor and its decode steps
replayed as CUDA graphs by the engine, which releases blocks as the windows move."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.app import toy
from mla_compile.graphs.cuda_graph import DecodeGraphRunner
from mla_compile.models.model import patch
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.engine import Engine

from tests.engine_load import run_workload

pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("fresh_dynamo"), pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(model, num_blocks, **runner_kw):
    builder = MetadataBuilder(max_batch=16, max_blocks_per_seq=16, max_tokens=512, block_size=16, device="cuda")
    return Engine(DecodeGraphRunner(model, builder, **runner_kw), num_blocks=num_blocks)


def test_sink_window_decode_graph_replay_equals_direct_steps_in_a_bounded_cache():
    """16 running requests of up to 190 tokens (12 blocks each dense) in 95 usable blocks: the windowed engine
    holds at most 4 blocks per request; captured replays equal direct steps, no syncs, no recompiles."""
    hf = toy.toy_hf_model("v3", seed=6, device="cuda", dtype=torch.bfloat16, num_hidden_layers=2)
    model = patch(hf, sparse="sink_window", sink=4, window=32)
    compiled = torch.compile(model, fullgraph=True)
    load = dict(seed=2, n_requests=40, gap=6, max_new=150, max_prompt=40)
    model.allocate_cache(96, 16)
    want, steps = run_workload(_engine(compiled, 96, enabled=False), **load)
    model.allocate_cache(96, 16)
    engine = _engine(compiled, 96, strict_sync=True)  # fill + replay under sync_debug_mode "error"
    assert engine.blocks.peak_blocks(39, 39 + 149) == 4
    engine.runner.capture()
    graphs = counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("fail_on_recompile"):
        got, got_steps = run_workload(engine, **load)
    assert got_steps == steps and got == want
    assert engine.runner.replays > steps // 2
    assert counters["stats"]["unique_graphs"] == graphs
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert engine.blocks.num_free == 95


def test_compiled_sink_window_model_on_cuda_matches_eager_cpu_float64():
    """The compiled CUDA model (fp32) against the same model eager on the CPU in float64 (whose layers the CPU
    tests check against the float64 masked reference), prefill and decode steps with window < context."""
    from mla_compile.models.metadata import SeqChunk, plan_step

    hf = toy.toy_hf_model("v3", seed=2, num_hidden_layers=2)
    ref = patch(copy.deepcopy(hf).double(), sparse="sink_window", sink=3, window=20)
    model = patch(hf.cuda(), sparse="sink_window", sink=3, window=20)
    compiled = torch.compile(model, fullgraph=True)
    prompts = toy.random_prompts(1, [70, 33])
    blocks = [list(range(0, 8)), list(range(8, 16))]
    ref.allocate_cache(16, 16, fill=float("nan"))
    model.allocate_cache(16, 16, fill=float("nan"))
    lens = [len(p) for p in prompts]
    step = plan_step([], [SeqChunk(b, p) for b, p in zip(blocks, prompts)], 16)
    with torch.no_grad():
        for i in range(6):
            want = ref(step.input_ids, step.positions, step.meta)[:step.num_rows]
            s = step.to("cuda")
            got = compiled(s.input_ids, s.positions, s.meta)[:step.num_rows]
            torch.testing.assert_close(got.double().cpu(), want, atol=2e-3, rtol=2e-3)
            nxt = want.argmax(-1).tolist()
            step = plan_step([SeqChunk(b, [t], n) for b, t, n in zip(blocks, nxt, lens)], [], 16)
            lens = [n + 1 for n in lens]
    assert dict(counters["graph_break"]) == {}
