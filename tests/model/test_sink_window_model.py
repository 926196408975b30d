"""Sink + sliding-window attention (``patch(..., sparse="sink_window")``) on the V2/V3 toys: one layer against a
float64 masked reference written from the rule (query i sees key j iff j <= i and (j < sink or j > i - window)),
over prefill, chunked prefill with cached context, mixed and decode steps; the whole model against the dense
path when the window covers everything; and the argument errors."""

import copy

import pytest
import torch

from mla_compile.app import toy
from mla_compile.models.metadata import SeqChunk, plan_step
from mla_compile.models.model import patch
from mla_compile.models.rope import rope_cos_sin

pytest.importorskip("transformers")

F64 = torch.float64


def _rope(x, cos, sin, interleave):
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else x.chunk(2, dim=-1)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def sink_window_mask(L: int, sink: int, window: int) -> torch.Tensor:
    """``[L, L]`` bool: query i sees key j iff j <= i and (j < sink or j > i - window)."""
    i = torch.arange(L)[:, None]
    j = torch.arange(L)[None, :]
    return (j <= i) & ((j < sink) | (j > i - window))


def reference_layer(attn, model, x, mask):
    """float64 non-absorbed MLA attention of one whole sequence ``x [L, hidden]`` (positions 0..L-1) under
    ``mask [L, L]``, straight from the projections (no cache, no absorption)."""
    c = attn.config
    L = x.shape[0]
    freqs = torch.arange(L, dtype=F64)[:, None] * model.inv_freq.double()[None, :]
    cos, sin = freqs.cos() * model.attention_scaling, freqs.sin() * model.attention_scaling
    if attn.q_proj is not None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(L, c.num_heads, c.qk_head_dim)
    q = torch.cat([q[..., :c.qk_nope_head_dim], _rope(q[..., c.qk_nope_head_dim:], cos, sin, c.rope_interleave)], -1)
    lat, k_pe = attn.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
    k_pe = _rope(k_pe, cos, sin, c.rope_interleave)
    k_nope, v = attn.kv_b_proj(attn.kv_a_layernorm(lat)).view(L, c.num_heads, -1).split(
        [c.qk_nope_head_dim, c.v_head_dim], -1)
    k = torch.cat([k_nope, k_pe[:, None].expand(L, c.num_heads, c.qk_rope_head_dim)], -1)
    logits = torch.einsum("thd,shd->hts", q, k) * c.softmax_scale
    probs = logits.masked_fill(~mask[None], float("-inf")).softmax(-1)
    return attn.o_proj(torch.einsum("hts,shd->thd", probs, v).reshape(L, -1))


# (decode (seq, pos) pairs, prefill (seq, start, end) triples) per step: prefill, chunked prefill over cached
# context mixed with decodes, decodes, a lone decode
PLAN = [([], [(0, 0, 10), (1, 0, 18), (2, 0, 6)]),
        ([(0, 10), (1, 18)], [(2, 6, 15)]),
        ([(0, 11), (1, 19), (2, 15)], []),
        ([(0, 12)], [])]
LENS = [13, 20, 16]


def _run_layer(model, attn, xs, bs, perm):
    blocks = [perm[0:4], perm[4:9], perm[9:13]]
    H = attn.config.hidden_size
    dt = xs[0].dtype
    got = [torch.full((n, H), float("nan"), dtype=dt) for n in LENS]
    for dec, pre in PLAN:
        step = plan_step([SeqChunk(blocks[s], [0], p) for s, p in dec],
                         [SeqChunk(blocks[s], [0] * (e - a), a) for s, a, e in pre], bs)
        rows = [(s, p) for s, p in dec] + [(s, p) for s, a, e in pre for p in range(a, e)]
        x = torch.zeros(step.positions.shape[0], H, dtype=dt)
        for t, (s, p) in enumerate(rows):
            x[t] = xs[s][p]
        cos, sin = rope_cos_sin(model.inv_freq, step.positions, model.attention_scaling)
        with torch.no_grad():
            out = attn(x, cos, sin, step.meta, step.positions)
        for t, (s, p) in enumerate(rows):
            got[s][p] = out[t]
    return got


@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
@pytest.mark.parametrize("sink,window", [(2, 5), (0, 3), (3, 1), (4, 7), (1, 64), (30, 2)],
                         ids=["2+5", "0+3", "3+1", "4+7", "window-past-seq", "sink-past-seq"])
def test_layer_equals_float64_masked_reference(kind, sink, window):
    """Every step kind of one layer (decode and prefill, cached context, mixed) equals the float64 masked
    reference; where the rule drops keys, the dense answer differs by orders more than the tolerance."""
    model = patch(toy.toy_hf_model(kind, seed=21, num_hidden_layers=1, dtype=F64), sparse="sink_window",
                  sink=sink, window=window)
    attn = model.attentions[0]
    assert attn.sink_window == (sink, window) == model.sink_window
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, attn.config.hidden_size, generator=gen, dtype=F64) for n in LENS]
    bs = 4
    model.allocate_cache(40, bs, fill=float("nan"))
    got = _run_layer(model, attn, xs, bs, torch.randperm(40, generator=gen).tolist())
    with torch.no_grad():
        for s, n in enumerate(LENS):
            mask = sink_window_mask(n, sink, window)
            want = reference_layer(attn, model, xs[s], mask)
            # rope angles are float32 products (as in HF), hence not float64-tight
            torch.testing.assert_close(got[s], want, atol=1e-8, rtol=1e-6)
            dense = reference_layer(attn, model, xs[s], sink_window_mask(n, n, 0))
            dropped = (~mask & torch.ones(n, n, dtype=torch.bool).tril()).any(1)  # queries that lose a key
            if dropped.any():
                assert (dense[dropped] - want[dropped]).abs().amax() > 1e-4
            torch.testing.assert_close(dense[~dropped], want[~dropped], atol=1e-12, rtol=1e-12)


def test_fp8_cache_layer_equals_masked_reference_loosely():
    """The sparse path reads the fp8 (656-byte) cache too: same rule, fp8 rounding tolerance."""
    model = patch(toy.toy_hf_model("v3", seed=3, num_hidden_layers=1), sparse="sink_window", sink=2, window=5)
    attn = model.attentions[0]
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(n, attn.config.hidden_size, generator=gen) for n in LENS]
    model.allocate_cache(40, 4, dtype="fp8", fill=float("nan"))
    assert attn.fp8_cache
    got = _run_layer(model, attn, xs, 4, torch.randperm(40, generator=gen).tolist())
    ref_attn = copy.deepcopy(attn).double()
    with torch.no_grad():
        for s, n in enumerate(LENS):
            want = reference_layer(ref_attn, model, xs[s].double(), sink_window_mask(n, 2, 5))
            err = (got[s].double() - want).norm() / want.norm()
            assert err < 0.05, err


@pytest.mark.parametrize("kind", ["v2-lite", "v3"])
def test_window_covering_the_sequence_equals_the_dense_model(kind):
    """A window larger than every sequence keeps every key: the whole sink + window model equals the dense
    patched model (prefill, then decode steps with a cached context)."""
    hf = toy.toy_hf_model(kind, seed=7, dtype=F64)
    dense, windowed = patch(copy.deepcopy(hf)), patch(hf, sparse="sink_window", sink=4, window=64)
    gen = torch.Generator().manual_seed(2)
    prompts = toy.random_prompts(gen, [9, 14])
    blocks = [[3, 0, 7, 5, 9, 10, 11], [1, 2, 4, 6, 8, 12, 13]]
    for m in (dense, windowed):
        m.allocate_cache(16, 4, fill=float("nan"))
    outs = {}
    for name, m in (("dense", dense), ("windowed", windowed)):
        got = []
        with torch.no_grad():
            step = plan_step([], [SeqChunk(b, p) for b, p in zip(blocks, prompts)], 4)
            logits = m(step.input_ids, step.positions, step.meta)[:step.num_rows]
            got.append(logits)
            lens = [len(p) for p in prompts]
            for _ in range(3):
                nxt = logits.argmax(-1).tolist()
                step = plan_step([SeqChunk(b, [t], n) for b, t, n in zip(blocks, nxt, lens)], [], 4)
                logits = m(step.input_ids, step.positions, step.meta)[:step.num_rows]
                got.append(logits)
                lens = [n + 1 for n in lens]
        outs[name] = torch.cat(got)
    torch.testing.assert_close(outs["windowed"], outs["dense"], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(sparse="sink_window", sink=4), TypeError, "needs window="),
    (dict(sparse="sink_window", sink=-1, window=8), ValueError, "sink must be >= 0"),
    (dict(sparse="sink_window", sink=2, window=0), ValueError, "window must be at least 1"),
    (dict(sparse="sink_window", sink=2.0, window=8), TypeError, "sink must be an int"),
    (dict(sparse="sink_window", sink=2, window=True), TypeError, "window must be an int"),
    (dict(sparse="sink_window", sink=2, window="8"), TypeError, "window must be an int"),
    (dict(sparse="window", window=8), ValueError, "sparse must be None or one of"),
    (dict(window=8), TypeError, "needs sparse='sink_window'"),
])
def test_bad_arguments_are_clear_errors(kw, exc, match):
    hf = toy.toy_hf_model("v2-lite", seed=0, num_hidden_layers=1)
    with pytest.raises(exc, match=match):
        patch(hf, **kw)
    assert not hasattr(hf.model.layers[0].self_attn, "sink_window")  # nothing was converted


@pytest.mark.skipif(not toy.has_sparse_kinds(), reason="transformers has no DeepseekV32ForCausalLM")
def test_v32_model_is_refused_before_any_change():
    hf = toy.toy_hf_model("v3.2", seed=0, num_hidden_layers=1)
    with pytest.raises(NotImplementedError, match="V3.2"):
        patch(hf, sparse="sink_window", window=8)
    assert not hasattr(hf.model.layers[0].self_attn, "sink_window")


def test_default_sink_is_four_and_dense_patch_clears_it():
    hf = toy.toy_hf_model("v2-lite", seed=0, num_hidden_layers=2)
    assert patch(hf, sparse="sink_window", window=16).sink_window == (4, 16)
    model = patch(hf)  # patching again without sparse: dense again
    assert model.sink_window is None and model.attentions[0].sink_window is None
    model.set_sink_window(0, 8)  # on a patched (or from_pretrained) model
    assert model.sink_window == (0, 8) and all(a.sink_window == (0, 8) for a in model.attentions)
    with pytest.raises(ValueError, match="window must be at least 1"):
        model.set_sink_window(2, 0)
    assert model.sink_window == (0, 8)
    model.set_sink_window(None)
    assert model.sink_window is None and all(a.sink_window is None for a in model.attentions)


def test_compiles_whole_without_graph_breaks_or_recompiles(fresh_dynamo):
    """``torch.compile(fullgraph=True)`` (aot_eager: Dynamo and the fake kernels, no C++ toolchain) of a mixed
    step, then a decode step of another batch size and length: the eager logits, one dynamic graph per kind."""
    from torch._dynamo.utils import counters

    from mla_compile.models.metadata import mark_dynamic
    from tests.engine_load import TINY_V3

    model = patch(toy.toy_hf_model("v3", seed=4, dtype=F64, **TINY_V3), sparse="sink_window", sink=2, window=5)
    model.allocate_cache(32, 4, fill=float("nan"))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(3)
    p = toy.random_prompts(gen, [11, 7, 14], vocab_size=97)
    blocks = [[3, 0, 7, 5], [1, 2, 4, 6], [8, 9, 10, 11]]
    steps = [plan_step([], [SeqChunk(blocks[0], p[0]), SeqChunk(blocks[1], p[1][:4])], 4),
             plan_step([SeqChunk(blocks[0], [5], 11)], [SeqChunk(blocks[1], p[1][4:], 4), SeqChunk(blocks[2], p[2])],
                       4),
             plan_step([SeqChunk(blocks[0], [6], 12), SeqChunk(blocks[1], [7], 7), SeqChunk(blocks[2], [8], 14)], [],
                       4)]
    with torch.no_grad():
        for step in steps:
            want = model(step.input_ids, step.positions, step.meta)
            mark_dynamic(step.input_ids, step.positions, step.meta)
            torch.testing.assert_close(compiled(step.input_ids, step.positions, step.meta), want, atol=0, rtol=0)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] <= 3  # prefill-only, mixed, decode-only: no per-size recompiles
