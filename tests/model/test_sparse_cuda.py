"""GPU: the patched DeepSeek-V3.2 (sparse MLA) toy compiled with Inductor, and replayed as CUDA graphs."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.app import toy
from mla_compile.serving.builder import MetadataBuilder
from mla_compile.serving.engine import Engine
from mla_compile.serving.generate import greedy_generate, hf_greedy_reference
from mla_compile.graphs.cuda_graph import DecodeGraphRunner
from mla_compile.models.model import patch

from tests.engine_load import run_workload

pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("fresh_dynamo"), pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not toy.has_sparse_kinds(), reason="transformers has no DeepseekV32ForCausalLM")]


def test_compiled_sparse_model_on_cuda_matches_hf():
    hf = toy.toy_hf_model("v3.2", seed=2, device="cuda", num_hidden_layers=1)  # fp32
    ref = copy.deepcopy(hf)
    prompts = toy.random_prompts(1, [33, 5, 70, 2])  # index_topk is 8: most of the context is dropped
    want_tokens, want_logits = hf_greedy_reference(ref, prompts, 4, device="cuda")
    model = patch(hf)
    compiled = torch.compile(model, fullgraph=True)
    model.allocate_cache(128, 16, fill=float("nan"))
    got = greedy_generate(compiled, prompts, 4, block_size=16, num_blocks=128, device="cuda", keep_logits=True)
    assert dict(counters["graph_break"]) == {}
    assert got.tokens == want_tokens
    for s in range(4):
        want = torch.stack([want_logits[i][s] for i in range(len(prompts))])
        torch.testing.assert_close(got.step_logits[s], want, atol=1e-3, rtol=1e-3)


def _engine(model, **runner_kw):
    builder = MetadataBuilder(max_batch=16, max_blocks_per_seq=16, max_tokens=512, block_size=16, device="cuda")
    return Engine(DecodeGraphRunner(model, builder, **runner_kw), num_blocks=512)


def test_sparse_decode_graph_replay_equals_direct_steps_without_syncs_or_recompiles():
    hf = toy.toy_hf_model("v3.2", seed=6, device="cuda", dtype=torch.bfloat16, num_hidden_layers=2)
    model = patch(hf)
    compiled = torch.compile(model, fullgraph=True)
    load = dict(seed=2, n_requests=40, gap=10, max_new=120, max_prompt=40)
    model.allocate_cache(512, 16)
    want, steps = run_workload(_engine(compiled, enabled=False), **load)
    model.allocate_cache(512, 16)
    engine = _engine(compiled, strict_sync=True)  # fill + replay under sync_debug_mode "error"
    engine.runner.capture()
    graphs = counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("fail_on_recompile"):
        got, got_steps = run_workload(engine, **load)
    assert got_steps == steps and got == want
    assert engine.runner.replays > steps // 2
    assert counters["stats"]["unique_graphs"] == graphs
    assert counters["inductor"]["cudagraph_skips"] == 0
