"""The V4 model with ``v4_attention`` split by query rows (what "auto" picks on an H200 from the timing table):
compiled with ``fullgraph=True``, 0 graph breaks, one graph for prefill and decode steps, each step's attention
run by the part of its token count, equal to the reference backend; and the slots each layer names to the
selector (the timing rows' context key)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM", allow_module_level=True)

from mla_compile.app.v4_toy import toy_v4_model  # noqa: E402
from mla_compile.models import v4_model  # noqa: E402
from mla_compile.models.model import patch  # noqa: E402
from mla_compile.models.v4_model import CSA, HCA, SLIDING, V4Sequences  # noqa: E402
from mla_compile.ops import registry  # noqa: E402
from mla_compile.ops.registry import FLOATS, Backend, declare_split  # noqa: E402


def _prompts(seed, lens, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@torch.no_grad()
def _greedy(model, run, ps, steps):
    """Prefill every prompt in one step, then ``steps`` batched greedy decode steps: the stacked step logits."""
    seqs = V4Sequences(model, 4, 64, 4, fill=float("nan"), pool_len=96)
    out = seqs.step(run, list(range(len(ps))), ps)
    logits = [out]
    for _ in range(steps):
        out = seqs.step(run, list(range(len(ps))), [[int(t)] for t in out.argmax(-1)])
        logits.append(out)
    return torch.stack(logits)


@pytest.fixture
def spy_split(monkeypatch):
    """A split of two spy backends of v4_attention (the reference, recording each call's part and ``T``) in a
    copy of the registry's table; returns (split name, calls)."""
    monkeypatch.setitem(registry._TABLE, "v4_attention", dict(registry._TABLE["v4_attention"]))
    table, calls = registry._TABLE["v4_attention"], []

    def spy(name):
        def run(*args):
            calls.append((name, args[0].shape[0]))
            return torch.ops.mla.v4_attention_ref(*args)
        return Backend(name, "v4_attention", run, rank=99, devices=("any",), dtypes=FLOATS, cache_dtypes=FLOATS,
                       gpu_tested=True)
    table["spy-few"], table["spy-many"] = spy("spy-few"), spy("spy-many")
    return declare_split("v4_attention", ((3, "spy-few"), (None, "spy-many"))).name, calls


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_split_v4_model_compiles_whole_and_runs_each_step_s_part(spy_split):
    name, calls = spy_split
    model = patch(toy_v4_model(6), backend="reference")
    ps = _prompts(6, [5, 9, 4])
    want = _greedy(model, model, ps, 3)
    for attn in model.attn:
        attn.backend = name
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = _greedy(model, compiled, ps, 3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1  # prefill and decode share one graph (T dynamic)
    layers = len(model.attn)
    # the prefill step (18 tokens) runs the part for many rows in every layer, each decode step (3 rows) the other
    assert calls[:layers] == [("spy-many", 18)] * layers
    assert calls[layers:] == [("spy-few", 3)] * (3 * layers)
    calls.clear()
    with torch.compiler.set_stance("fail_on_recompile"):
        _greedy(model, compiled, _prompts(7, [2, 23]), 1)
    assert calls == [("spy-many", 25)] * layers + [("spy-few", 2)] * layers


def test_the_layers_name_their_listed_slots_to_the_selector(monkeypatch):
    """Sliding: the window; CSA: window + top-k (fixed: the rows' context key); HCA: None (its entry list
    follows the context, so it is ranked by the rows at every context)."""
    model = patch(toy_v4_model(6), backend="reference")
    seen = []
    real = v4_model.v4_attention

    def record(q, kv, ws, comp, cs, *rest, slots=None, **kw):
        seen.append((slots, ws.shape[1] + cs.shape[1]))
        return real(q, kv, ws, comp, cs, *rest, slots=slots, **kw)
    monkeypatch.setattr(v4_model, "v4_attention", record)
    _greedy(model, model, _prompts(3, [30, 7]), 0)
    cfg = model.config
    want = {SLIDING: cfg.sliding_window, CSA: cfg.sliding_window + cfg.index_topk, HCA: None}
    assert [s for s, _ in seen] == [want[a.layer_type] for a in model.attn]
    for (slots, listed), attn in zip(seen, model.attn):
        assert slots is None or slots == listed, attn.layer_type  # what the layer names is what it lists
