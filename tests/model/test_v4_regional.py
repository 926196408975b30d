"""DeepSeek-V4 with ``patch(..., regional_compile=True)``: each layer runs as two nested compile regions with its cache
writes between them, so ``torch.compile`` traces one region pair per layer kind and calls it for every such layer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM", allow_module_level=True)

from mla_compile.app.v4_toy import V4_LAYER_KINDS as KINDS, depth_overrides, toy_v4_model  # noqa: E402
from mla_compile.models.model import patch  # noqa: E402
from mla_compile.models.v4_model import V4Sequences  # noqa: E402

from test_v4_model import hf_greedy, prompts  # noqa: E402

NAN = float("nan")


def _model_pair(layers: int, seed: int):
    """An HF V4 toy of ``layers`` layers (the three attention kinds in turn, the first layer hash-routed) patched
    twice on copies of the same weights: unregional and regional."""
    hf = toy_v4_model(seed, **depth_overrides(layers))
    return hf, patch(copy.deepcopy(hf)), patch(hf, regional_compile=True)


@torch.no_grad()
def _run(model, step_fn, ps: list[list[int]], steps: int) -> tuple[list[torch.Tensor], V4Sequences]:
    """A batched prefill of ``ps`` then ``steps`` greedy decode steps through ``step_fn`` over fresh NaN-filled caches
    of ``model``: the per-sequence logits of every step (stacked) and the sequences (their caches)."""
    seqs = V4Sequences(model, len(ps) + 1, 64, 4, fill=NAN, pool_len=96)
    out = seqs.step(step_fn, list(range(len(ps))), ps)
    logits = [[out[i]] for i in range(len(ps))]
    for _ in range(steps):
        out = seqs.step(step_fn, list(range(len(ps))), [[int(lg[-1].argmax())] for lg in logits])
        for i in range(len(ps)):
            logits[i].append(out[i])
    return [torch.stack(lg) for lg in logits], seqs


def _caches(model) -> list[torch.Tensor]:
    """Every cache and compressor-state tensor of every layer, in a fixed order."""
    out = []
    for a in model.attn:
        out += [t for t in (a.kv_cache, a.comp_cache, a.index_cache) if t is not None]
        out += [t for pair in a.state.values() for t in pair]
    return out


def test_regional_eager_equals_unregional_and_hf():
    """Eagerly (the regions are plain calls) the split layer (project, write, attend + MoE) gives HF's greedy tokens,
    the unregional model's logits and every cache and compressor-state row bit for bit (the NaN fill included)."""
    hf, plain, regional = _model_pair(4, seed=11)
    ps = prompts(11, [13, 6, 21])
    want, plain_seqs = _run(plain, plain, ps, 4)
    got, _ = _run(regional, regional, ps, 4)
    for p, mine in zip(ps, got):
        _, ref_logits, ref_tokens = hf_greedy(hf, p, 4)
        assert [int(x.argmax()) for x in mine] == ref_tokens
        torch.testing.assert_close(mine, torch.stack(ref_logits), rtol=1e-4, atol=1e-4)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_caches(regional), _caches(plain), strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _subgraph_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The subgraph names of the ``invoke_subgraph`` calls in ``gm``, in order."""
    return [str(n.args[1]) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]


@pytest.mark.usefixtures("fresh_dynamo")
def test_regional_compile_reuses_one_region_pair_per_layer_kind_and_equals_eager():
    """Compiled (fullgraph, aot_eager: Dynamo, the ops' fakes, functionalized cache writes) the regional model equals
    the unregional eager one (logits, caches) with no graph break and one graph for prefill and decode; every layer's
    cache writes stay outside the regions, and the graph calls at most one region pair per layer kind (attention
    type, hash or top-k routing) however deep the model: 7 layers, 4 kinds."""
    layers = 7
    _, plain, regional = _model_pair(layers, seed=12)
    ps = prompts(12, [9, 17, 4])
    want, _ = _run(plain, plain, ps, 3)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(regional, fullgraph=True, backend=backend)
    got, _ = _run(regional, compiled, ps, 3)
    plain_caches = _caches(plain)  # the eager run's (the regional model's were refilled by its own run)
    _run(plain, plain, ps, 3)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(_caches(regional), plain_caches, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert dict(counters["graph_break"]) == {}
    assert len(graphs) == 1  # prefill and decode steps share one graph (T and B dynamic)
    gm = graphs[0]
    calls = _subgraph_calls(gm)
    assert len(calls) >= 2 * layers - 1, calls  # (Dynamo may inline a region called once)
    kinds = {(KINDS[i % 3], i == 0) for i in range(layers)}  # (attention type, hash routing)
    assert len(set(calls)) <= 2 * len(kinds), calls
    writes = [n for n in gm.graph.nodes if n.op == "call_function"
              and ("v4_compress_write" in str(n.target) or "write_index_cache" in str(n.target))]
    compressed = sum(KINDS[i % 3] != KINDS[2] for i in range(layers))
    csa = sum(KINDS[i % 3] == KINDS[0] for i in range(layers))
    assert len(writes) == layers + compressed + csa, [str(n.target) for n in writes]


def test_v4_metadata_flat_round_trip():
    """:meth:`V4Metadata.flat` / ``from_flat`` keep the structure and the tensor objects (what the second region
    takes as plain arguments); ``map_tensors`` copies every tensor, the entry tables' included."""
    from mla_compile.models.v4_model import V4Metadata

    _, _, model = _model_pair(3, seed=13)
    seqs = V4Sequences(model, 3, 32, 4)
    _, _, meta = seqs.metadata([0, 2], [[1, 2, 3], [4]])
    assert len(meta.entry_tables) == 2
    back = V4Metadata.from_flat(*meta.flat())
    assert [id(t) for t in back.tensors()] == [id(t) for t in meta.tensors()]
    assert sorted(back.entry_tables) == sorted(meta.entry_tables)
    copied = meta.map_tensors(torch.clone)
    for a, b in zip(copied.tensors(), meta.tensors(), strict=True):
        assert a is not b and a.data_ptr() != b.data_ptr() and torch.equal(a, b)


def test_bench_regional_compile_v4_kind_compiles_and_matches_eager():
    """``benchmarks/bench_regional_compile.py --kind v4``'s child: a 4-layer V4 toy, regional, compiled (aot_eager
    here: the benchmark times Inductor), greedy tokens equal to the eager model's."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_regional_compile.py"
    proc = subprocess.run([sys.executable, str(bench), "--device", "cpu", "--backend", "aot_eager", "--one", "v4,4,1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (r["kind"], r["layers"], r["regional"], r["tokens_equal"]) == ("v4", 4, True, True), r
