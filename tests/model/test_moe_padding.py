"""The patched model hands its MoE layers the step's real tokens (``token_mask``: slot >= 0), so the fused experts
ops skip the padding tokens' expert work: the mask each step kind gets (a decode batch padded to a capture size by
the builder, a prefill, a mixed step padded to a token count), the real rows' logits of a padded decode batch equal
to the unpadded step's, and the compiled step (fullgraph, whole and regional) with 0 graph breaks, the mask in its
graph and no recompile between two batch sizes. GPU twin: tests/ops/triton/test_triton_moe.py (the MoE block
compiled with a mask) and :func:`test_padded_decode_logits_on_gpu` here."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from mla_compile.app import toy
from mla_compile.models import moe as moe_module
from mla_compile.models.metadata import SeqChunk, mark_dynamic, plan_step
from mla_compile.models.model import patch
from mla_compile.serving.builder import MetadataBuilder

pytest.importorskip("transformers")

BS, NUM_BLOCKS, MAX_BLOCKS = 4, 64, 8
LENS = (9, 5, 14, 3)  # cached tokens of each sequence before its decode token


def _model(kind="v2-lite", device="cpu", dtype=torch.float32, regional=False):
    """A 3-layer toy (one dense MLP layer, two MoE layers) patched with the fused MoE ops."""
    hf = toy.toy_hf_model(kind, seed=7, num_hidden_layers=3, first_k_dense_replace=1, dtype=dtype).to(device)
    return patch(hf, moe_impl="fused", regional_compile=regional)


def _blocks(i):
    return list(range(i * MAX_BLOCKS, (i + 1) * MAX_BLOCKS))


def _prefilled(model, device="cpu", n=len(LENS)):
    """Allocate the cache and prefill ``n`` sequences of :data:`LENS` tokens; returns their decode chunks."""
    model.allocate_cache(NUM_BLOCKS, BS, fill=float("nan"), device=device)
    prompts = toy.random_prompts(3, LENS[:n])
    step = plan_step([], [SeqChunk(_blocks(i), p) for i, p in enumerate(prompts)], BS, max_blocks=MAX_BLOCKS)
    step = step.to(device)
    with torch.no_grad():
        model(step.input_ids, step.positions, step.meta)
    return [SeqChunk(_blocks(i), [17 + i], LENS[i], key=i) for i in range(n)]


def _run(fn, step):
    with torch.no_grad():
        return fn(step.input_ids, step.positions, step.meta)[:step.num_rows]


class _Masks:
    """Records the ``token_mask`` of every ``mla::moe_experts`` call the MoE layers make."""

    def __init__(self, monkeypatch):
        self.seen = []
        real = moe_module.moe_experts

        def spy(*args, token_mask=None, **kwargs):
            self.seen.append(token_mask)
            return real(*args, token_mask=token_mask, **kwargs)

        monkeypatch.setattr(moe_module, "moe_experts", spy)


@pytest.mark.parametrize("kind", toy.KINDS)
def test_padded_decode_gives_the_unpadded_logits_and_masks_the_padding(kind, monkeypatch):
    model = _model(kind)
    chunks = _prefilled(model)
    builder = MetadataBuilder(max_batch=8, max_blocks_per_seq=MAX_BLOCKS, max_tokens=64, block_size=BS, device="cpu")
    for n, capture in ((1, 2), (3, 8)):  # B=1 runs the capture size 2; B=3 pads to 8
        want = _run(model, plan_step(chunks[:n], [], BS, max_blocks=MAX_BLOCKS, min_batch=1))
        masks = _Masks(monkeypatch)
        padded = builder.build(chunks[:n], decode_batch=capture)
        got = _run(model, padded)
        assert padded.meta.slot_mapping.shape[0] == capture
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert len(masks.seen) == 2  # the two MoE layers (the dense layer's MLP takes none)
        for mask in masks.seen:
            assert mask.tolist() == [True] * n + [False] * (capture - n)
        monkeypatch.undo()


def test_prefill_and_mixed_steps_mask_exactly_the_padding(monkeypatch):
    model = _model()
    chunks = _prefilled(model, n=2)
    masks = _Masks(monkeypatch)
    prefill = [SeqChunk(_blocks(5), [3, 4, 5, 6, 7], 0)]
    steps = [plan_step([], prefill, BS, max_blocks=MAX_BLOCKS, tokens=8),  # 5 prompt tokens, 3 padding at the end
             plan_step(chunks, prefill, BS, max_blocks=MAX_BLOCKS, decode_batch=4, tokens=12)]
    wants = [[True] * 5 + [False] * 3, [True] * 2 + [False] * 2 + [True] * 5 + [False] * 3]
    for step, want in zip(steps, wants):
        masks.seen.clear()
        model.allocate_cache(NUM_BLOCKS, BS)
        _run(model, step)
        assert [m.tolist() for m in masks.seen] == [want] * 2


def test_moe_block_without_a_mask_is_unchanged():
    """An HF-style call (no metadata) passes no mask: every row computed; an all-True mask changes nothing."""
    model = _model()
    block = model.model.layers[1].mlp
    x = torch.randn(3, block.gate.weight.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(block(x), block(x, token_mask=torch.ones(3, dtype=torch.bool)), atol=0, rtol=0)
        masked = block(x, token_mask=torch.tensor([True, False, True]))
    assert torch.equal(masked[1], torch.zeros_like(masked[1]))


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("regional", [False, True])
def test_compiled_step_passes_the_mask_without_breaks_or_recompiles(regional):
    eager = _model()
    model = _model(regional=regional)
    model.load_state_dict(eager.state_dict())
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):  # Dynamo's graph, run through AOT (regions need it), no Inductor: fast
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    builder = MetadataBuilder(max_batch=8, max_blocks_per_seq=MAX_BLOCKS, max_tokens=64, block_size=BS, device="cpu")
    chunks = _prefilled(eager)
    _prefilled(model)

    def step(n, capture):
        s = builder.build(chunks[:n], decode_batch=capture)
        mark_dynamic(s.input_ids, s.positions, s.meta)
        return s

    got, want = _run(compiled, step(1, 2)), _run(eager, step(1, 2))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert dict(counters["graph_break"]) == {}
    n_graphs = counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("fail_on_recompile"):
        for n, capture in ((3, 4), (4, 8)):
            got, want = _run(compiled, step(n, capture)), _run(eager, step(n, capture))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == n_graphs
    assert dict(counters["graph_break"]) == {}
    calls = [n for gm in graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
             for n in sub.graph.nodes if n.op == "call_function" and "moe_experts" in str(n.target)]
    assert calls, "no mla::moe_experts call in the compiled graphs"
    for n in calls:  # the mask reaches the op (its last argument, or token_mask=)
        mask = n.kwargs.get("token_mask", n.args[-1] if len(n.args) > 9 else None)
        assert isinstance(mask, torch.fx.Node), n.format_node()


def _padded_steps_match(model, ref):
    """Both models prefilled on CUDA; a B=1 decode padded to 2 and B=3 padded to 8 by the builder give, through
    ``model`` eagerly and compiled, ``ref``'s logits of the unpadded steps for the real rows (bf16 tolerance)."""
    chunks = _prefilled(model, device="cuda")
    _prefilled(ref, device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    builder = MetadataBuilder(max_batch=8, max_blocks_per_seq=MAX_BLOCKS, max_tokens=64, block_size=BS,
                              device="cuda")
    for n, capture in ((1, 2), (3, 8)):
        want = _run(ref, plan_step(chunks[:n], [], BS, max_blocks=MAX_BLOCKS, min_batch=1).to("cuda"))
        padded = builder.build(chunks[:n], decode_batch=capture)
        torch.testing.assert_close(_run(model, padded).float(), want.float(), atol=5e-2, rtol=5e-2)
        mark_dynamic(padded.input_ids, padded.positions, padded.meta)
        torch.testing.assert_close(_run(compiled, padded).float(), want.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("regional", [False, True])
@pytest.mark.parametrize("kind", toy.KINDS + (toy.SPARSE_KINDS if toy.has_sparse_kinds() else ()))
def test_padded_decode_logits_on_gpu(kind, regional):
    """The GPU twin: bf16 on CUDA, "fused" MoE (the Triton kernels skip the padding): a B=1 decode padded to 2 and
    B=3 padded to 8 by the builder give the unpadded step's logits for the real rows, eager and compiled; with
    ``regional`` the padded model runs as compile regions (the fused norm + RoPE + cache write between them, the
    MLP residual added in the next region) against the unregional model."""
    model = _model(kind, device="cuda", dtype=torch.bfloat16, regional=regional)
    ref = copy.deepcopy(model)
    ref.regional_compile = False
    _padded_steps_match(model, ref)


@pytest.mark.cuda
@pytest.mark.usefixtures("fresh_dynamo")  # each case compiles new models: earlier cases' recompiles must not count
@pytest.mark.parametrize("spec", ["skinny_norm_linear=triton", "moe_norm_gate_route=triton", "decode_absorb_out=gluon",
                                  "decode_absorb_out=triton", "write_latent_cache_absorb_q=triton",
                                  "skinny_norm_linear=triton,moe_norm_gate_route=triton,decode_absorb_out=gluon,"
                                  "write_latent_cache_absorb_q=triton"])
@pytest.mark.parametrize("kind", toy.KINDS)
def test_regional_step_with_the_opt_in_fusions_on_gpu(kind, spec):
    """``backend="skinny_norm_linear=triton"``: each layer's first region takes ``mla::skinny_norm_linear`` (the MLP
    residual add, the input norm and the first projections: one launch at two rows, the add + norm launch and
    ``F.linear`` at eight); ``"moe_norm_gate_route=triton"``: each MoE layer's attention residual add, its
    post-attention norm and its router are ``mla::moe_norm_gate_route`` (one launch at two rows);
    ``"decode_absorb_out=<split kernel>"``: the decode, its split merge and W_UV are ``mla::decode_absorb_out`` (the
    merge and W_UV one launch at two rows); ``"write_latent_cache_absorb_q=triton"``: a decode step's cache write and
    absorbed queries (with q_pe's RoPE) are one launch between the regions; a B=1 decode padded to 2 and B=3 padded
    to 8 give the logits of the model without them, eager and compiled."""
    hf = toy.toy_hf_model(kind, seed=7, num_hidden_layers=3, first_k_dense_replace=1, dtype=torch.bfloat16).cuda()
    ref = patch(copy.deepcopy(hf), moe_impl="fused", regional_compile=True)
    model = patch(hf, moe_impl="fused", regional_compile=True, backend=spec)
    layer = model.model.layers[1]
    attn = layer.self_attn
    first = attn.q_proj if attn.q_proj is not None else attn.q_a_proj
    h = torch.empty(2, hf.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    decode_only = SimpleNamespace(prefill=None, decode=object())  # what write_absorb_serves reads of a step
    for name, serves, unasked in (
            ("skinny_norm_linear", attn._norm_linear_serves(h, layer.input_layernorm, first),
             ref.model.layers[1].self_attn._norm_linear_serves(h, layer.input_layernorm, first)),
            ("moe_norm_gate_route", layer.mlp.norm_route_serves(h, layer.post_attention_layernorm),
             ref.model.layers[1].mlp.norm_route_serves(h, layer.post_attention_layernorm)),
            ("decode_absorb_out", attn._decode_absorb_backend(h, attn._w_uk_uv()[1], None) is not None,
             ref.model.layers[1].self_attn._decode_absorb_backend(h, attn._w_uk_uv()[1], None) is not None),
            ("write_latent_cache_absorb_q", attn.write_absorb_serves(h, decode_only),
             ref.model.layers[1].self_attn.write_absorb_serves(h, decode_only))):
        by_auto = name in ("moe_norm_gate_route", "write_latent_cache_absorb_q")  # GPU-tested: "auto" takes them
        assert serves == (name in spec or by_auto) and unasked == by_auto
    _padded_steps_match(model, ref)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("fused,kind", [("moe_norm_gate_route", "v2-lite"), ("decode_absorb_out", "v2-lite"),
                                        ("write_latent_cache_absorb_q", "v2-lite"), ("skinny_norm_linear", "v2-lite"),
                                        ("skinny_norm_linear", "v3"), ("all", "v3")])
def test_regional_step_with_an_opt_in_fusion(fused, kind, monkeypatch):
    """Each MoE layer's attention residual add, post-attention norm and router as ``mla::moe_norm_gate_route``, each
    layer's decode, split merge and W_UV as ``mla::decode_absorb_out``, each layer's cache write and absorbed
    queries (q_pe rotated there, left raw by the first region) as ``mla::write_latent_cache_absorb_q`` between the
    regions, or each layer's MLP residual add, input norm and first projections (and a q-LoRA layer's q_a norm and
    q_b_proj) as ``mla::skinny_norm_linear`` (forced on CPU, through the op's reference): the regional model eager
    and compiled (fullgraph, no Inductor) give the unfused model's logits of a padded decode at two batch sizes, with
    the op in the compiled graph ("all": the four at once, each op in the graph)."""
    from torch._dynamo.backends.debugging import aot_eager

    from mla_compile.models.attention import MLAAttention

    eager = _model(kind)
    model = _model(kind, regional=True)
    model.load_state_dict(eager.state_dict())
    builder = MetadataBuilder(max_batch=8, max_blocks_per_seq=MAX_BLOCKS, max_tokens=64, block_size=BS, device="cpu")
    chunks = _prefilled(eager)
    _prefilled(model)
    sizes = ((1, 2), (3, 8))
    wants = [_run(eager, builder.build(chunks[:n], decode_batch=capture)).clone() for n, capture in sizes]
    # the unfused model's logits are known: from here on the ops are taken
    if fused in ("moe_norm_gate_route", "all"):
        real = moe_module.moe_norm_gate_route
        monkeypatch.setattr(moe_module, "moe_norm_gate_route",
                            lambda *a, **kw: real(*a, **{**kw, "backend": "reference"}))
        monkeypatch.setattr(moe_module.MLAMoE, "norm_route_serves", lambda self, h, norm: True)
    if fused in ("decode_absorb_out", "all"):
        monkeypatch.setattr(MLAAttention, "_decode_absorb_backend", lambda self, q, w_uv, plan: "reference")
    from mla_compile import ops

    if fused in ("skinny_norm_linear", "all"):
        real_norm_linear = ops.skinny_norm_linear
        monkeypatch.setattr(MLAAttention, "_norm_linear_serves", lambda self, h, norm, first: True)
        monkeypatch.setattr(ops, "skinny_norm_linear",
                            lambda *a, **kw: real_norm_linear(*a, **{**kw, "backend": "reference"}))
    if fused in ("write_latent_cache_absorb_q", "all"):  # the decode steps only (the prefills above wrote the cache)

        real_serves, real_op = MLAAttention.write_absorb_serves, ops.write_latent_cache_absorb_q
        monkeypatch.setattr(MLAAttention, "write_absorb_serves",
                            lambda self, x, meta: meta.prefill is None or real_serves(self, x, meta))
        monkeypatch.setattr(ops, "write_latent_cache_absorb_q",
                            lambda *a, **kw: real_op(*a, **{**kw, "backend": "reference"}))
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for (n, capture), want in zip(sizes, wants):
        step = builder.build(chunks[:n], decode_batch=capture)
        torch.testing.assert_close(_run(model, step), want, atol=1e-5, rtol=1e-5)
        mark_dynamic(step.input_ids, step.positions, step.meta)
        torch.testing.assert_close(_run(compiled, step), want, atol=1e-5, rtol=1e-5)
    assert dict(counters["graph_break"]) == {}
    targets = [str(n.target) for gm in graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
               for n in sub.graph.nodes if n.op == "call_function"]
    names = (("moe_norm_gate_route", "decode_absorb_out", "write_latent_cache_absorb_q", "skinny_norm_linear")
             if fused == "all" else (fused,))
    for name in names:
        assert any(name in t for t in targets), f"no mla::{name} call in the compiled graph"
    if "skinny_norm_linear" in names and kind == "v3":  # the q-LoRA layers' q_b fold: two calls a layer's region
        assert sum("skinny_norm_linear" in t for t in targets) >= 2
