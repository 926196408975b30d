"""DeepSeek-V4 through :func:`mla_compile.patch` against HF eager (float32, CPU).

The toy has one CSA layer (rate 4, index_topk 3: sparse after 16 tokens), one HCA layer (rate 8), one
sliding layer (window 6), a hash-routed MoE layer and two top-k ``sqrtsoftplus`` MoE layers, mHC with
2 streams. HF runs each sequence alone (batch 1, its own dynamic cache); ours runs them batched through
paged caches filled with NaN, so a read of anything unwritten shows up.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("transformers has no DeepseekV4ForCausalLM", allow_module_level=True)

from mla_compile.models.model import patch  # noqa: E402
from mla_compile.models.v4_model import V4ForCausalLM, V4Metadata, V4Sequences  # noqa: E402
from mla_compile.app.v4_toy import toy_v4_model  # noqa: E402

NAN = float("nan")
TOL = dict(rtol=1e-4, atol=1e-4)


def prompts(seed, lens, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


@torch.no_grad()
def hf_greedy(hf, prompt, steps):
    """HF eager: prompt logits [L, V], then ``steps`` greedy decode steps: (prompt_logits, step_logits, tokens)."""
    # transformers 5.17 names the cache past_key_values; newer ones renamed it cache (the old name warns)
    kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out = hf(torch.tensor([prompt]), use_cache=True)
    cache, logits = getattr(out, kw), [out.logits[0, -1]]
    for _ in range(steps):
        o = hf(logits[-1].argmax().view(1, 1), use_cache=True, **{kw: cache})
        cache = getattr(o, kw)
        logits.append(o.logits[0, -1])
    return out.logits[0], logits, [int(x.argmax()) for x in logits]


@torch.no_grad()
def ours_greedy(model, run, ps, steps, chunk=None, max_len=64, block_size=4, max_seqs=None, pool_len=None):
    """Ours: prefill every prompt (in one batched step, or sequence by sequence in ``chunk``-token chunks),
    then ``steps`` batched greedy decode steps. Returns per sequence the step logits."""
    run = model if run is None else run
    seqs = V4Sequences(model, max_seqs or len(ps), max_len, block_size, fill=NAN, pool_len=pool_len)
    if chunk is None:
        out = seqs.step(run, list(range(len(ps))), ps)
        logits = [[out[i]] for i in range(len(ps))]
    else:
        logits = []
        for i, p in enumerate(ps):
            for start in range(0, len(p), chunk):
                out = seqs.step(run, [i], [p[start:start + chunk]])
            logits.append([out[0]])
    for _ in range(steps):
        out = seqs.step(run, list(range(len(ps))), [[int(lg[-1].argmax())] for lg in logits])
        for i in range(len(ps)):
            logits[i].append(out[i])
    return logits


def test_patch_dispatches_v4():
    hf = toy_v4_model(0)
    assert isinstance(patch(hf), V4ForCausalLM)


def test_backend_spec_reaches_each_v4_op():
    """A per-op spec names each V4 op's backend on its own (and the mHC's through ``mla::hc_pre``); a name the
    CPU cannot run is refused by name at the first step, before anything is written."""
    hf = toy_v4_model(0)
    model = patch(hf, backend="v4_attention=reference,hc_pre=triton")
    assert {a.backend for a in model.attn} == {"reference"}
    assert {a.compress_backend for a in model.attn} == {patch(toy_v4_model(0)).attn[0].compress_backend}
    assert {hc.mla_backend for l in model.model.layers for hc in (l.attn_hc, l.ffn_hc)} == {"triton"}
    seqs = V4Sequences(model, 1, 16, 4, fill=NAN)
    ids, pos, meta = seqs.metadata([0], prompts(0, [5]))
    with pytest.raises(ValueError, match=r"mla\.hc_pre: backend 'triton' runs on \['cuda'\], not on cpu"):
        model(ids, pos, meta)
    assert all(torch.isnan(a.kv_cache).all() for a in model.attn)  # refused before the first cache write


YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}


@pytest.mark.parametrize("rope", ["default", "yarn"])  # yarn: the compressed layers' rope, as V4-Flash
@torch.no_grad()
def test_prefill_logits_every_position_match_hf(rope):
    hf = toy_v4_model(1, **({"rope_parameters": YARN} if rope == "yarn" else {}))
    if rope == "yarn":
        assert hf.config.rope_parameters["compress"]["rope_type"] == "yarn"
    ps = prompts(1, [21, 3, 34])
    ref = [hf(torch.tensor([p])).logits[0] for p in ps]
    model = patch(hf)
    seqs = V4Sequences(model, 3, 40, 4, fill=NAN)
    ids, pos, meta = seqs.metadata([0, 1, 2], ps)
    meta.logits_indices = None
    got = model(ids, pos, meta)
    torch.testing.assert_close(got, torch.cat(ref), **TOL)


def test_greedy_decode_16_steps_match_hf():
    hf = toy_v4_model(2)
    ps = prompts(2, [13, 30, 5])
    ref = [hf_greedy(hf, p, 16) for p in ps]
    got = ours_greedy(patch(hf), None, ps, 16)
    for (_, ref_logits, ref_tokens), mine in zip(ref, got):
        assert [int(x.argmax()) for x in mine] == ref_tokens
        torch.testing.assert_close(torch.stack(mine), torch.stack(ref_logits), **TOL)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_across_window_boundaries_matches_hf(chunk):
    """Chunks of 1, 3 and 7 tokens cross CSA (4), HCA (8) and window (6) boundaries at every phase;
    46 tokens of context at the end (several windows of each kind)."""
    hf = toy_v4_model(3)
    ps = prompts(3, [30, 19])
    model = patch(hf)
    with torch.no_grad():
        ref = [hf(torch.tensor([p])).logits[0] for p in ps]
        seqs = V4Sequences(model, 2, 64, 4, fill=NAN)
        for i, p in enumerate(ps):
            for start in range(0, len(p), chunk):
                ids, pos, meta = seqs.metadata([i], [p[start:start + chunk]])
                meta.logits_indices = None
                torch.testing.assert_close(model(ids, pos, meta), ref[i][start:start + chunk], **TOL)
    got = ours_greedy(patch(toy_v4_model(3)), None, ps, 16, chunk=chunk)
    for p, mine in zip(ps, got):
        _, ref_logits, ref_tokens = hf_greedy(hf, p, 16)
        assert [int(x.argmax()) for x in mine] == ref_tokens
        torch.testing.assert_close(torch.stack(mine), torch.stack(ref_logits), **TOL)


@torch.no_grad()
def test_sparse_selection_and_sinks_matter():
    """The comparisons above can fail: with every compressed entry attended (index_topk large) or the
    sinks zeroed the logits move far beyond the tolerance."""
    ps = prompts(4, [40])
    base = patch(toy_v4_model(4))
    seqs = V4Sequences(base, 1, 48, 4, fill=NAN)
    ref = seqs.step(base, [0], ps)
    dense = patch(toy_v4_model(4, index_topk=64))
    seqs = V4Sequences(dense, 1, 48, 4, fill=NAN)
    assert (seqs.step(dense, [0], ps) - ref).abs().max() > 1e-3
    hf = toy_v4_model(4)
    for layer in hf.model.layers:
        layer.self_attn.sinks.zero_()
    nosink = patch(hf)
    seqs = V4Sequences(nosink, 1, 48, 4, fill=NAN)
    assert (seqs.step(nosink, [0], ps) - ref).abs().max() > 1e-3


@torch.no_grad()
def test_padding_rows_change_nothing():
    """Padding tokens (``query_seq = -1``, slot -1; what a CUDA-graph batch is padded with) write nothing
    and leave the real tokens' logits unchanged."""
    hf = toy_v4_model(5)
    ps = prompts(5, [9, 14])
    model = patch(hf)
    seqs = V4Sequences(model, 2, 32, 4, fill=NAN)
    ids, pos, meta = seqs.metadata([0, 1], ps)
    pad = 3
    ids = torch.cat([ids, ids.new_zeros(pad)])
    pos = torch.cat([pos, pos.new_zeros(pad)])
    meta = V4Metadata(torch.cat([meta.query_seq, meta.query_seq.new_full((pad,), -1)]), meta.seq_lens,
                      meta.block_table, torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), -1)]),
                      meta.state_slot, meta.entry_tables, meta.logits_indices)
    got = model(ids, pos, meta)
    ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in ps])
    torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.usefixtures("fresh_dynamo")
def test_v4_fullgraph_no_breaks_no_recompiles():
    """``torch.compile(fullgraph=True)`` (aot_eager: Dynamo, the ops' fakes and functionalized cache
    writes): equal to eager, 0 graph breaks, and other batch sizes / context lengths reuse the graphs."""
    hf = toy_v4_model(6)
    model = patch(hf)
    ps = prompts(6, [11, 5, 17])
    run = dict(max_seqs=4, pool_len=96)  # the caches keep their sizes from run to run
    eager = ours_greedy(model, model, ps, 3, **run)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got = ours_greedy(model, compiled, ps, 3, **run)
    for a, b in zip(got, eager):
        torch.testing.assert_close(torch.stack(a), torch.stack(b), atol=1e-5, rtol=1e-5)
    assert dict(counters["graph_break"]) == {}
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1  # prefill and decode steps share one graph (T and B are both dynamic)
    with torch.compiler.set_stance("fail_on_recompile"):
        for lens, max_len in (([2, 23], 64), ([4, 9, 6, 30], 64), ([5, 41], 96)):  # 96: wider block tables
            ours_greedy(model, compiled, prompts(7, lens), 3, max_len=max_len, **run)
    assert counters["stats"]["unique_graphs"] == graphs


@torch.no_grad()
def test_token_rows_that_left_the_window_are_never_read():
    """After every step the token rows older than the window (what a block manager may free) are set to
    NaN in every layer; chunked prefill and decode still match HF."""
    hf = toy_v4_model(8)
    ps = prompts(8, [26, 17])
    model = patch(hf)
    W = model.config.sliding_window
    seqs = V4Sequences(model, 2, 48, 4, fill=NAN)

    def poison():
        for s, L in enumerate(seqs.lens):
            for p in range(max(L - W + 1, 0)):
                slot = int(seqs.tables[s, p // 4]) * 4 + p % 4
                for attn in model.attn:
                    attn.kv_cache.view(-1, attn.head_dim)[slot] = NAN

    last = [None, None]
    for i, p in enumerate(ps):
        for start in range(0, len(p), 5):
            last[i] = seqs.step(model, [i], [p[start:start + 5]])[0]
            poison()
    got = [[last[0]], [last[1]]]
    for _ in range(8):
        out = seqs.step(model, [0, 1], [[int(g[-1].argmax())] for g in got])
        poison()
        for i in range(2):
            got[i].append(out[i])
    for p, mine in zip(ps, got):
        _, ref_logits, ref_tokens = hf_greedy(hf, p, 8)
        assert [int(x.argmax()) for x in mine] == ref_tokens
        torch.testing.assert_close(torch.stack(mine), torch.stack(ref_logits), **TOL)


@torch.no_grad()
def test_grouped_experts_match_hf():
    """``moe_impl="grouped"`` (torch._grouped_mm over tokens sorted by expert, the CUDA bf16 default)."""
    hf = toy_v4_model(10)
    ps = prompts(10, [12, 20])
    try:
        torch._grouped_mm(torch.ones(2, 16), torch.ones(1, 16, 16), offs=torch.tensor([2], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError) as e:  # torch builds without CPU _grouped_mm
        pytest.skip(f"torch._grouped_mm on CPU: {e}")
    model = patch(hf, moe_impl="grouped")
    assert all(m.impl == "grouped" for m in model.moe)
    seqs = V4Sequences(model, 2, 24, 4, fill=NAN)
    ids, pos, meta = seqs.metadata([0, 1], ps)
    meta.logits_indices = None
    ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in ps])
    torch.testing.assert_close(model(ids, pos, meta), ref, **TOL)


@torch.no_grad()
def test_fused_router_routes_as_hf(monkeypatch):
    """``V4MoE.gate_route`` (``mla::moe_gate_route`` with the config's ``sqrtsoftplus`` scoring; here forced as on
    a GPU where that scoring is verified, the op's "auto" running its reference on the CPU): the top-k layers take
    it, the hash layer does not, and its float32 weights and int32 ids are the torch route's; the model's logits
    then match HF."""
    from mla_compile.models import v4_model

    hf = toy_v4_model(11)
    model = patch(hf)
    x = torch.randn(5, hf.config.hidden_size)
    ids_in = torch.randint(0, 96, (5,))
    want = [m.route(x, ids_in) for m in model.moe]
    assert all(m.scoring == "sqrtsoftplus" for m in model.moe) and not any(m.gate_route(x) for m in model.moe)
    monkeypatch.setattr(v4_model, "FUSED_ROUTER_SCORINGS", ("sigmoid", "sqrtsoftplus"))
    monkeypatch.setattr(v4_model, "half_kernel", lambda op, *a: "triton" if op == v4_model.GATE_ROUTE_OP else None)
    assert [m.gate_route(x) for m in model.moe] == [not m.is_hash for m in model.moe]
    assert any(m.is_hash for m in model.moe)
    for m, (w_want, ids_want) in zip(model.moe, want):
        w, ids = m.route(x, ids_in)
        if m.is_hash:
            continue
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
        order, order_want = ids.long().sort(-1), ids_want.sort(-1)
        assert torch.equal(order.values, order_want.values)
        torch.testing.assert_close(w.gather(1, order.indices), w_want.float().gather(1, order_want.indices))
    ps = prompts(11, [9, 14])
    seqs = V4Sequences(model, 2, 24, 4, fill=NAN)
    tok, pos, meta = seqs.metadata([0, 1], ps)
    meta.logits_indices = None
    ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in ps])
    torch.testing.assert_close(model(tok, pos, meta), ref, **TOL)


@torch.no_grad()
def test_prefix_cache_hit_on_a_whole_sequence_ending_mid_window():
    """A new request whose prompt extends a served sequence (26 tokens: mid-window for CSA 4, HCA 8 and the
    sliding window 6) reuses its cache (shared blocks, copied partial blocks, copied compressor state) and
    prefills only its new tokens; both sequences then decode on and match HF."""
    hf = toy_v4_model(12)
    a_prompt, extra = prompts(12, [23, 7])
    model = patch(hf)
    seqs = V4Sequences(model, 2, 64, 4, fill=NAN)
    out = seqs.step(model, [0], [a_prompt])
    a_tokens = list(a_prompt)
    for _ in range(3):
        a_tokens.append(int(out[0].argmax()))
        out = seqs.step(model, [0], [a_tokens[-1:]])
    assert seqs.lens[0] == 26
    seqs.fork(0, 1)
    b_prompt = a_tokens + extra
    out = seqs.step(model, [1, 0], [extra, [int(out[0].argmax())]])
    got_b, got_a = [out[0]], [out[1]]
    for _ in range(5):
        out = seqs.step(model, [0, 1], [[int(got_a[-1].argmax())], [int(got_b[-1].argmax())]])
        got_a.append(out[0])
        got_b.append(out[1])
    _, ref_b, tok_b = hf_greedy(hf, b_prompt, 5)
    assert [int(x.argmax()) for x in got_b] == tok_b
    torch.testing.assert_close(torch.stack(got_b), torch.stack(ref_b), **TOL)
    # sequence 0 went on from its own 26 tokens: its step logits are HF's greedy continuation of it
    _, ref_a, tok_a = hf_greedy(hf, a_tokens[:26], 6)
    assert [int(x.argmax()) for x in got_a] == tok_a[1:]
    torch.testing.assert_close(torch.stack(got_a), torch.stack(ref_a[1:]), **TOL)
