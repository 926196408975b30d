"""``mla_compile.backends``: the declared static priority (timings replaced by none, see
``test_timings.py`` for "auto" from measurements), overrides (MLA_COMPILE_BACKEND and the argument),
error messages, the Blackwell paths on a faked Hopper, "auto" never picking an unsupported backend,
and the choice being static under torch.compile (no re-selection, no recompile). Fixtures: conftest.py."""

from __future__ import annotations

import contextlib
import itertools
import sys
import types

import pytest
import torch

import mla_compile.ops.triton as ops_triton
from mla_compile import backends, ops
from mla_compile.app import toy
from mla_compile.backends import SPECS, cached_backend, describe, new_choice_cache, parse_backend_spec, select_backend
from mla_compile.serving.generate import greedy_generate
from mla_compile.models.model import patch
from mla_compile.ops import timings

BF16 = torch.bfloat16
SM90, SM100 = (9, 0), (10, 0)
DECODE = dict(num_heads=16, head_dims=(512, 64))
PREFILL = dict(num_heads=16, head_dims=(192, 128))


def test_auto_skips_backends_not_yet_tested_on_a_gpu(installed_untested):
    choice = _pick("decode", block_size=64)
    assert choice.name == "triton"
    assert "not yet tested on a GPU" in choice.rejected["flashmla"]
    assert _pick("decode", block_size=64, requested="flashmla").name == "flashmla"  # by name it serves


def _pick(op, cap=SM90, **kw):
    kw = {**(DECODE if op == "decode" else PREFILL if op == "prefill" else dict(num_heads=16, head_dims=(128,))), **kw}
    kw.setdefault("dtype", BF16)
    return select_backend(op, device="cuda", capability=cap, **kw)


@pytest.mark.parametrize("op, kw, want", [
    ("decode", dict(block_size=64), "flashmla-tiered"),  # FlashMLA (Triton for small steps), block size 64 only
    ("decode", dict(block_size=16), "triton"),  # FlashInfer next, but the caller has no plan
    ("decode", dict(block_size=16, planned=True), "flashinfer"),
    ("decode", dict(block_size=64, dtype=torch.float32), "triton"),
    ("decode", dict(block_size=64, query_len=2), "flashmla-tiered"),
    ("decode", dict(block_size=64, dtype=torch.float16), "triton"),  # FlashMLA (and so the tiers) bf16 only
    ("prefill", dict(), "flash-attn"),  # FlashInfer first, but needs a plan
    ("prefill", dict(planned=True), "flashinfer"),
    ("prefill", dict(cuda_graph=True), "flash-attn"),
    ("prefill", dict(dtype=torch.float32), "triton"),
    ("merge", dict(), "triton"),
])
def test_auto_follows_the_static_priority_without_timings(everything_installed, static_order, op, kw, want):
    choice = _pick(op, **kw)
    assert choice.name == want
    assert choice.reason.startswith(f"auto: first GPU-tested backend of the {op} priority")
    assert choice.name not in choice.rejected
    before = backends.PRIORITY[op][:backends.PRIORITY[op].index(want)]
    assert set(before) <= set(choice.rejected), "every backend ahead of the choice says why it was passed over"


def test_priority_order_is_the_documented_one():
    assert backends.PRIORITY["decode"][:5] == ("flashmla-tiered", "flashmla", "flashinfer", "flashinfer-trtllm", "triton")
    assert backends.PRIORITY["decode"][-1] == "reference"
    assert backends.PRIORITY["prefill"] == ("flashinfer", "flashinfer-trtllm", "flash-attn", "triton", "triton-tma",
                                             "gluon", "gluon-ws", "sdpa-cudnn", "autotune", "reference")
    assert backends.PRIORITY["merge"] == ("triton", "flashinfer", "reference")


def test_cpu_always_gets_the_reference_with_reasons(everything_installed):
    for op in ("decode", "prefill", "merge"):
        choice = select_backend(op, device="cpu", dtype=BF16, block_size=64, num_heads=16, head_dims=(512, 64))
        assert choice.name == "reference"
        assert all("runs on cuda, not cpu" in why for n, why in choice.rejected.items() if n != "autotune")
    # "autotune" runs anywhere (on CPU its lowering falls back) but 'auto' never picks it
    assert "'auto' skips it" in select_backend("decode", device="cpu", dtype=BF16).rejected["autotune"]


def test_blackwell_paths_are_unavailable_on_a_faked_sm90(everything_installed):
    rows = {(r["op"], r["backend"]): r for r in describe(device="cuda", capability=SM90)}
    for key in [("decode", "flashinfer-trtllm"), ("decode", "flashinfer-cutlass"), ("prefill", "flashinfer-trtllm")]:
        assert not rows[key]["available"] and "needs sm100-sm103 (this GPU is sm90)" in rows[key]["why"]
    assert rows[("decode", "flashmla")]["available"] and rows[("prefill", "sdpa-cudnn")]["available"]
    with pytest.raises(ValueError, match=r"backend 'flashinfer-trtllm' \(from the argument\) cannot serve .*"
                                         r"needs sm100-sm103 \(this GPU is sm90\)"):
        _pick("decode", block_size=64, need_lse=False, requested="flashinfer-trtllm")


def test_on_a_faked_sm100_the_hopper_kernels_step_aside(everything_installed):
    rows = {(r["op"], r["backend"]): r for r in describe(device="cuda", capability=SM100)}
    assert "needs sm90 (this GPU is sm100)" in rows[("decode", "flashmla")]["why"]
    assert _pick("decode", cap=SM100, block_size=64, num_heads=128, need_lse=False).name == "flashinfer-trtllm"
    assert _pick("decode", cap=SM100, block_size=64, need_lse=True).name == "triton", "trtllm-gen has no LSE"
    assert _pick("prefill", cap=SM100).name == "flashinfer-trtllm"


def test_env_var_and_argument_overrides(everything_installed, static_order, monkeypatch):
    monkeypatch.setenv("MLA_COMPILE_BACKEND", "triton")
    assert _pick("decode", block_size=64).name == "triton"
    choice = _pick("decode", block_size=64, requested="reference")
    assert choice.name == "reference" and choice.reason == "requested by the argument"
    monkeypatch.setenv("MLA_COMPILE_BACKEND", "decode=flashinfer, prefill=flash-attn")
    choice = _pick("decode", block_size=16, planned=True)
    assert choice.name == "flashinfer" and choice.reason == "requested by the MLA_COMPILE_BACKEND"
    assert _pick("prefill").name == "flash-attn"
    assert _pick("merge").name == "triton", "ops the spec does not name stay on auto"
    assert _pick("decode", block_size=64, requested="auto").name == "flashmla-tiered", "an explicit 'auto' beats the env var"


def test_an_explicit_backend_that_cannot_serve_says_why_and_what_would(everything_installed):
    with pytest.raises(ValueError) as err:
        _pick("decode", block_size=16, requested="flashmla")
    msg = str(err.value)
    assert "decode: backend 'flashmla' (from the argument) cannot serve [cuda (sm90), bfloat16, block size 16" in msg
    assert "block size 16 not in [64]" in msg and "Backends that can: ['triton', 'autotune', 'reference']" in msg
    with pytest.raises(ValueError, match=r"needs a host-side plan \(plan_flashinfer_decode\)"):
        _pick("decode", block_size=16, requested="flashinfer")
    with pytest.raises(ValueError, match=r"prefill: unknown backend 'flashmla' .*prefill backends: \['flashinfer'"):
        _pick("prefill", requested="flashmla")


def test_unusable_backend_on_this_machine_names_the_missing_piece(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # blocked: not importable
    with pytest.raises(ValueError, match=r"not installed \(pip install flash-attn\)"):
        _pick("prefill", requested="flash-attn")


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown backend 'nope'"),
    ("decode=nope", "unknown backend 'nope'"),
    ("attention=triton", "unknown op 'attention'"),
])
def test_backend_spec_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_backend_spec(spec)
    assert parse_backend_spec("auto") == {} and parse_backend_spec(" triton ") == {"*": "triton"}


def test_a_single_peer_name_leaves_the_cache_write_on_auto():
    assert backends.requested_for("cache_write", "flashmla") == "auto"
    assert backends.requested_for("cache_write", "triton") == "triton"
    assert backends.requested_for("cache_write", "cache_write=reference,decode=flashmla") == "reference"


def test_auto_never_picks_an_unsupported_backend(everything_installed):
    grid = itertools.product([BF16, torch.float16, torch.float32], [16, 64], [16, 128], [SM90, SM100, (8, 0)],
                             [False, True], [False, True], [False, True])
    for dtype, block, heads, cap, planned, need_lse, graph in grid:
        for op in ("decode", "prefill"):
            extra = dict(block_size=block) if op == "decode" else {}
            choice = _pick(op, cap=cap, dtype=dtype, num_heads=heads, planned=planned, need_lse=need_lse,
                           cuda_graph=graph, **extra)
            spec = SPECS[op][choice.name]
            assert dtype in spec.dtypes and (spec.block_sizes is None or op != "decode" or block in spec.block_sizes)
            assert spec.num_heads is None or heads in spec.num_heads
            assert spec.lse or not need_lse
            assert planned or not spec.needs_plan
            assert not graph or spec.cuda_graph == "full" or (spec.cuda_graph == "planned" and planned)
            lo, hi = spec.min_capability, spec.max_capability
            assert lo is None or (cap >= lo and (hi is None or cap <= hi))


def test_the_choice_is_static_under_compile(monkeypatch):
    calls = []
    real = backends.select_backend
    monkeypatch.setattr(backends, "select_backend", lambda *a, **k: calls.append(k) or real(*a, **k))
    token, cache = new_choice_cache()

    def step(q, kv_cache, block_table, seq_lens):
        name = cached_backend(token, "decode", "auto", device=kv_cache.device, dtype=q.dtype, block_size=kv_cache.shape[1],
                              num_heads=q.shape[2], head_dims=(24, 8), query_len=q.shape[1])
        return ops.decode(q, kv_cache, block_table, seq_lens, 0.2, kv_lora_rank=24, backend=name)[0]

    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(2, 1, 2, 32, generator=gen), torch.randn(4, 16, 32, generator=gen)
    table, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([20, 9], dtype=torch.int32)
    want = step(q, kv, table, lens)
    assert len(calls) == 1 and list(cache.values()) == ["reference"]
    for _ in range(2):  # compile twice from scratch: the cached choice is reused, never re-selected
        torch._dynamo.reset()
        fn = torch.compile(step, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(fn(q, kv, table, lens), want)
        with torch.compiler.set_stance("fail_on_recompile"):  # the cache adds no guards
            fn(q, kv, table, lens + 1)
    assert len(calls) == 1
    torch._dynamo.reset()


def test_mla_attention_selects_once_per_configuration_and_rejects_bad_specs():
    model = patch(toy.toy_hf_model("v2-lite", num_hidden_layers=1))
    attn = model.attentions[0]
    model.allocate_cache(8, 16)
    greedy_generate(model, [[1, 2, 3], [4, 5]], 2, block_size=16, num_blocks=8)
    assert set(attn._backend_choices.values()) == {"reference"}
    assert {k[0] for k in attn._backend_choices} == {"decode", "prefill"}
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        patch(toy.toy_hf_model("v2-lite", num_hidden_layers=1), backend="nope")


@pytest.mark.parametrize("timed", [False, True], ids=["static order", "shipped H200 timings"])
def test_h200_tested_flags_and_timings_pick_the_measured_fastest(monkeypatch, timed):
    """With the real gpu_tested flags and the H200's packages (no flash-attn); without timings (the static
    order) and with the shipped H200 table (bench_backends.py; its decode rows from BENCHMARKS run 231, FlashMLA
    timed on the step schedule the model makes): at 16 heads on pages of 64 our Gluon decode wins, planned or not;
    at 128 heads our 64-row Gluon kernel to batch 2 then FlashMLA, and with a plan FlashInfer to batch 2 then
    FlashMLA; on pages of 16 (no Gluon, no FlashMLA) Triton, and with a plan Triton to batch 2 then FlashInfer;
    prefill without a plan: our warp-specialized Gluon kernel; with FlashInfer's plan: at 16 heads Gluon-ws to 2048
    tokens then FlashInfer (7% faster at 8 x 4096 once its adapter's eager host time fell), at 128 heads FlashInfer
    (static order: Triton, or FlashInfer with a plan)."""
    for name in ("flash_mla", "flashinfer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setattr(ops_triton, "_AVAILABLE", True)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.delenv("MLA_COMPILE_BACKEND", raising=False)
    with contextlib.nullcontext() if timed else timings.using():
        assert _pick("decode", block_size=64).name == ("gluon" if timed else "flashmla-tiered")
        assert _pick("decode", block_size=64, planned=True).name == ("gluon" if timed else "flashmla-tiered")
        assert _pick("decode", block_size=64, planned=True, batch=16).name == (
            "gluon" if timed else "flashmla-tiered")
        assert _pick("decode", block_size=64, num_heads=128).name == (
            "split:gluon:2/flashmla" if timed else "flashmla-tiered")
        assert _pick("decode", block_size=64, num_heads=128, planned=True).name == (
            "split:flashinfer:2/flashmla" if timed else "flashmla-tiered")
        assert _pick("decode", block_size=16).name == "triton"
        assert _pick("decode", block_size=16, planned=True).name == (
            "split:triton:2/flashinfer" if timed else "flashinfer")
        prefill = _pick("prefill")
        assert prefill.name == ("gluon-ws" if timed else "triton") and "not installed" in prefill.rejected["flash-attn"]
        assert _pick("prefill", planned=True).name == ("split:gluon-ws:2048/flashinfer" if timed else "flashinfer")
        assert _pick("prefill", planned=True, num_heads=128).name == "flashinfer"
        assert _pick("prefill", num_heads=128).name == ("gluon-ws" if timed else "triton")
    assert not SPECS["prefill"]["flash-attn"].gpu_tested and not SPECS["decode"]["flashinfer-trtllm"].gpu_tested


def test_flashinfer_merge_only_up_to_head_dim_256(everything_installed):
    assert _pick("merge", head_dims=(128,), requested="flashinfer").name == "flashinfer"
    choice = _pick("merge", head_dims=(512,))
    assert choice.name == "triton" and "exceed 256" in choice.rejected["flashinfer"]
