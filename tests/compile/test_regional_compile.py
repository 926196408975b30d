"""``patch(..., regional_compile=True)``: each dense-attention layer runs as two nested compile regions (the
cache write between them), so the compiled graph calls the same subgraphs for every layer of one shape."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.app import toy
from mla_compile.serving.generate import greedy_generate
from mla_compile.models.model import patch

pytest.importorskip("transformers")


def _subgraph_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The subgraph names of the ``invoke_subgraph`` calls in ``gm``, in order."""
    return [str(n.args[1]) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]


@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
def test_regional_compile_equals_eager_and_reuses_one_region_pair_per_layer_shape(kind):
    torch._dynamo.reset()
    counters.clear()
    layers = 5
    hf = toy.toy_hf_model(kind, seed=4, num_hidden_layers=layers, first_k_dense_replace=1)
    eager_model = patch(copy.deepcopy(hf))
    model = patch(hf, regional_compile=True)
    assert model.regional_compile and not eager_model.regional_compile
    prompts = toy.random_prompts(3, [9, 21, 4])
    eager_model.allocate_cache(64, 4, fill=float("nan"))
    want = greedy_generate(eager_model, prompts, 4, block_size=4, num_blocks=64, keep_logits=True)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    model.allocate_cache(64, 4, fill=float("nan"))
    got = greedy_generate(compiled, prompts, 4, block_size=4, num_blocks=64, keep_logits=True)
    assert got.tokens == want.tokens
    for a, b in zip(got.step_logits, want.step_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert dict(counters["graph_break"]) == {}
    for gm in graphs:  # prefill and decode graphs: the MoE layers' two regions are traced once, called per layer
        calls = _subgraph_calls(gm)
        assert len(calls) >= 2 * (layers - 1), calls  # (Dynamo may inline the one dense layer's second region)
        assert len(set(calls)) <= 4 and len(set(calls[-2 * (layers - 1):])) == 2, calls
    torch._dynamo.reset()


def test_regional_compile_is_refused_where_it_is_not_built():
    from mla_compile.parallel import ParallelConfig

    with pytest.raises(NotImplementedError, match="regional_compile"):
        patch(toy.toy_hf_model("v2-lite", num_hidden_layers=1), regional_compile=True, parallel=ParallelConfig(tp=1))
