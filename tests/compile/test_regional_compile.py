"""``patch(..., regional_compile=True)``: each dense-attention layer runs as two nested compile regions (the
cache write between them), so the compiled graph calls the same subgraphs for every layer of one shape."""

from __future__ import annotations

import copy
import operator

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


@pytest.mark.parametrize("kind,cache", [
    ("v2-lite", None), ("v3", None), ("v2-lite", "fp8"),
    pytest.param("v3.2", None, marks=pytest.mark.skipif(not toy.has_sparse_kinds(), reason="no DeepseekV32ForCausalLM"))])
def test_regional_compile_equals_eager_and_reuses_one_region_pair_per_layer_shape(kind, cache):
    """Also: between the regions each layer writes its cache rows from the raw latent in one
    ``mla::write_latent_cache_fused`` call (norm + RoPE + write; quantizing into the fp8 cache), and the tokens,
    logits and cache equal the unregional eager model's, whose norm, RoPE and write are separate ops. A V3.2
    (sparse) layer also writes its indexer's keys between its regions and selects its top-k in the second one."""
    torch._dynamo.reset()
    counters.clear()
    layers = 5
    hf = toy.toy_hf_model(kind, seed=4, num_hidden_layers=layers, first_k_dense_replace=1)
    eager_model = patch(copy.deepcopy(hf))
    model = patch(hf, regional_compile=True)
    assert model.regional_compile and not eager_model.regional_compile
    prompts = toy.random_prompts(3, [9, 21, 4])
    eager_caches = eager_model.allocate_cache(64, 4, dtype=cache, fill=float("nan"))
    want = greedy_generate(eager_model, prompts, 4, block_size=4, num_blocks=64, keep_logits=True)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    got_caches = model.allocate_cache(64, 4, dtype=cache, fill=float("nan"))
    got = greedy_generate(compiled, prompts, 4, block_size=4, num_blocks=64, keep_logits=True)
    assert got.tokens == want.tokens
    for a, b in zip(got.step_logits, want.step_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_caches, eager_caches, strict=True):  # every layer's rows, bit for bit, the NaN fill included
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert dict(counters["graph_break"]) == {}
    for gm in graphs:  # prefill and decode graphs: the MoE layers' two regions are traced once, called per layer
        writes = [n for n in gm.graph.nodes if n.op == "call_function" and "write_latent_cache" in str(n.target)]
        assert len(writes) == layers and all("write_latent_cache_fused" in str(n.target) for n in writes), writes
        index_writes = [n for n in gm.graph.nodes if n.op == "call_function" and "write_index_cache" in str(n.target)]
        assert len(index_writes) == (layers if kind == "v3.2" else 0), index_writes  # V3.2: between the regions too
        calls = _subgraph_calls(gm)
        assert len(calls) >= 2 * (layers - 1), calls  # (Dynamo may inline the one dense layer's second region)
        # torch 2.11 keeps the first MoE layer's first region (after the dense layer) as one more subgraph; from
        # the second MoE layer on, every torch calls the same two
        extra = 1 if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13) else 0
        assert len(set(calls)) <= 4 + extra and len(set(calls[-2 * (layers - 1 - extra):])) == 2, calls
    torch._dynamo.reset()


def test_metadata_flat_round_trip_and_one_choice_cache_per_model():
    """What lets Dynamo (torch >= 2.13) trace the second region once and reuse it for every layer: the region
    takes the metadata as plain arguments (:meth:`MLAMetadata.flat`, rebuilt by ``from_flat``), and every layer
    shares the model's backend-choice token (a per-layer token is a constant that differs between layers)."""
    from mla_compile.models.metadata import MLAMetadata, SeqChunk
    from mla_compile.serving.builder import MetadataBuilder

    builder = MetadataBuilder(max_batch=4, max_blocks_per_seq=8, max_tokens=32, block_size=4, device="cpu",
                              context_chunk_tokens=8)
    decode = [SeqChunk([1, 2, 3], [7], 9, key=0)]
    prefill = [SeqChunk([4, 5, 6, 8], list(range(6)), 5)]  # 5 cached tokens of context, then 6 new ones
    steps = [builder.build(decode), builder.build((), prefill), builder.build(decode, prefill)]
    assert steps[1].meta.prefill.context is not None  # the case with context slices is covered
    for meta in (s.meta for s in steps):
        back = MLAMetadata.from_flat(*meta.flat())
        assert back == meta  # the same structure, plain values and tensor objects (compared by identity)
        assert [id(t) for t in back.tensors()] == [id(t) for t in meta.tensors()]
        assert (back.decode is None, back.prefill is None) == (meta.decode is None, meta.prefill is None)
    model = patch(toy.toy_hf_model("v2-lite", seed=1, num_hidden_layers=3))
    assert len({a._choice_token for a in model.attentions}) == 1
    assert len({id(a._backend_choices) for a in model.attentions}) == 1


def test_regional_write_with_a_named_cache_write_backend_keeps_the_separate_ops(monkeypatch):
    """A cache-write backend asked for by name: the regional model (eager) norms and rotates the latent itself and
    writes through that backend (``MLAAttention.write_cache``), with the unregional model's rows and logits."""
    from mla_compile.models.attention import MLAAttention

    hf = toy.toy_hf_model("v2-lite", seed=5, num_hidden_layers=3, first_k_dense_replace=1)
    eager_model = patch(copy.deepcopy(hf))
    model = patch(hf, regional_compile=True, backend="cache_write=reference")
    calls = []
    real = MLAAttention.write_cache
    monkeypatch.setattr(MLAAttention, "write_cache", lambda self, *a: calls.append(self) or real(self, *a))
    prompts = toy.random_prompts(3, [7, 12])
    caches = [m.allocate_cache(32, 4, fill=float("nan")) for m in (eager_model, model)]
    want = greedy_generate(eager_model, prompts, 3, block_size=4, num_blocks=32, keep_logits=True)
    n_unregional = len(calls)
    got = greedy_generate(model, prompts, 3, block_size=4, num_blocks=32, keep_logits=True)
    assert got.tokens == want.tokens and len(calls) == 2 * n_unregional > 0  # every layer's write, both models
    for a, b in zip(got.step_logits, want.step_logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(*caches, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.usefixtures("fresh_dynamo")
def test_two_models_of_other_scales_compile_in_one_process():
    """A second regionally compiled model whose softmax and routing scales differ (v2-lite then v3: 1/sqrt(192) and 1.0 against yarn's
    scale and 2.5), compiled after the first without a Dynamo reset, keeps both scales constants of its graphs:
    a float attribute would have become a SymFloat graph input on that recompile ("automatic dynamic"), which
    the ops' ``float`` arguments refuse. Each model's tokens and logits equal its eager twin's."""
    scales = []
    for kind in ("v2-lite", "v3"):
        hf = toy.toy_hf_model(kind, seed=5, num_hidden_layers=3, first_k_dense_replace=1)
        eager_model = patch(copy.deepcopy(hf))
        model = patch(hf, regional_compile=True)
        attn = model.model.layers[1].self_attn
        assert isinstance(attn.softmax_scale, float) and attn.softmax_scale == attn.config.softmax_scale
        scales.append(attn.softmax_scale)
        prompts = toy.random_prompts(2, [7, 3])
        eager_model.allocate_cache(32, 4)
        want = greedy_generate(eager_model, prompts, 3, block_size=4, num_blocks=32, keep_logits=True)
        graphs: list[torch.fx.GraphModule] = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            from torch._dynamo.backends.debugging import aot_eager
            return aot_eager(gm, example_inputs)

        model.allocate_cache(32, 4)
        got = greedy_generate(torch.compile(model, fullgraph=True, backend=backend), prompts, 3, block_size=4,
                              num_blocks=32, keep_logits=True)
        assert got.tokens == want.tokens
        for a, b in zip(got.step_logits, want.step_logits, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        floats = [n for gm in graphs for n in gm.graph.nodes
                  if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.SymFloat)]
        assert graphs and not floats, floats
    assert scales[0] != scales[1]


def _symbolic_args(node: torch.fx.Node) -> list:
    """The arguments of ``node`` (slices' bounds included) that are symbolic sizes."""
    found = []
    torch.fx.node.map_aggregate((node.args, node.kwargs), lambda a: found.append(a) if isinstance(a, torch.fx.Node)
                                and isinstance(a.meta.get("example_value"), torch.SymInt) else None)
    return found


@pytest.mark.usefixtures("fresh_dynamo")
def test_region_bodies_take_no_symbolic_views_and_decode_steps_skip_the_latent_norm():
    """What keeps torch 2.11's Dynamo cheaper (it traces every region call's body again, layer after layer): no view,
    reshape, expand or slice in a region takes a symbolic size (the token count), whose shape arithmetic is a large
    part of a trace; and a decode-only step's second region has no latent norm and RoPE (only a prefill reads them):
    every region of the decode graph has one norm (the input or the post-attention one), the prefill graph's second
    region two."""
    model = patch(toy.toy_hf_model("v2-lite", seed=2, num_hidden_layers=3, first_k_dense_replace=1),
                  regional_compile=True)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    model.allocate_cache(32, 4)
    greedy_generate(torch.compile(model, fullgraph=True, backend=backend), toy.random_prompts(1, [7, 5]), 2,
                    block_size=4, num_blocks=32)
    assert len(graphs) == 2  # prefill, decode
    shaping = {"view", "reshape", "expand", operator.getitem}
    norms = []
    for gm in graphs:
        regions = [getattr(gm, name) for name in dict.fromkeys(_subgraph_calls(gm))]
        for region in regions:
            symbolic = [n.format_node() for n in region.graph.nodes
                        if n.op in ("call_method", "call_function") and n.target in shaping and _symbolic_args(n)]
            assert not symbolic, symbolic
        norms.append(sorted(sum(n.target is torch.rsqrt for n in r.graph.nodes) for r in regions))
    assert norms[0][-1] == 2 and norms[1] == [1] * len(norms[1]), norms
