"""torch.compile(fullgraph=True) of the patched DeepSeek-V3.2 (sparse MLA) toy on CPU: no breaks, no recompiles.

The backend is ``aot_eager``: Dynamo tracing (graph breaks, guards, recompiles), the ops' fake functions
and AOT functionalization of the cache writes are all exercised, without Inductor's C++ builds, which
take ~2 minutes for this graph on a 2-core CI machine. Inductor on the sparse model runs in
``tests/model/test_sparse_cuda.py`` (GPU); Inductor on CPU is covered by the dense whole-model test.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.app import toy
from mla_compile.serving.generate import greedy_generate
from mla_compile.models.model import patch

pytest.importorskip("transformers")
pytestmark = [pytest.mark.usefixtures("fresh_dynamo"),
              pytest.mark.skipif(not toy.has_sparse_kinds(), reason="transformers has no DeepseekV32ForCausalLM")]


def test_sparse_model_fullgraph_no_breaks_no_recompiles():
    # one layer with a dense MLP: the indexer, its cache write, top-k and sparse attention are what is new
    model = patch(toy.toy_hf_model("v3.2", seed=5, num_hidden_layers=1))
    prompts = toy.random_prompts(0, [5, 11, 3])  # 11 > index_topk: tokens are dropped
    model.allocate_cache(64, 4)
    eager = greedy_generate(model, prompts, 3, block_size=4, num_blocks=64, keep_logits=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    model.allocate_cache(64, 4)
    got = greedy_generate(compiled, prompts, 3, block_size=4, num_blocks=64, keep_logits=True)
    assert got.tokens == eager.tokens
    for a, b in zip(got.step_logits, eager.step_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert dict(counters["graph_break"]) == {}
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2  # one prefill graph, one decode graph
    # other batch sizes (2 and 4) and lengths reuse the same two graphs
    with torch.compiler.set_stance("fail_on_recompile"):
        for lens in ([2, 17], [4, 1, 6, 30]):
            model.allocate_cache(64, 4)
            greedy_generate(compiled, toy.random_prompts(len(lens), lens), 3, block_size=4, num_blocks=64)
    assert counters["stats"]["unique_graphs"] == graphs


def test_sparse_model_with_fp8_index_cache_fullgraph():
    """The fp8 index-key cache (quantizing write, dequantizing top-k) compiles whole and matches eager."""
    model = patch(toy.toy_hf_model("v3.2", seed=6, num_hidden_layers=1))
    prompts = toy.random_prompts(1, [5, 14])
    model.allocate_cache(64, 4, fill=float("nan"), index_dtype="fp8")
    eager = greedy_generate(model, prompts, 3, block_size=4, num_blocks=64, keep_logits=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    model.allocate_cache(64, 4, fill=float("nan"), index_dtype="fp8")
    got = greedy_generate(compiled, prompts, 3, block_size=4, num_blocks=64, keep_logits=True)
    assert got.tokens == eager.tokens
    for a, b in zip(got.step_logits, eager.step_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert dict(counters["graph_break"]) == {}
