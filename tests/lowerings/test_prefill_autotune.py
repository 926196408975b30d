"""``mla::prefill_autotune`` and its Inductor lowering on CPU: without candidates it compiles to a plain
fallback call; with test candidates (``autotune_on_cpu``) Inductor times them, the faster one is emitted
(and only it), the choice is recorded, and outputs equal a float64 reference. The test candidates charge
their cost to an injected benchmarker (``tests/lowerings/conftest.py``): nothing here measures time.
``backend="autotune"``
reaches prefill from ``ops.prefill`` and from :class:`MLAAttention`. The CUDA test runs on a GPU only."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import mla_compile
import mla_compile.lowerings  # noqa: F401  (installs the lowerings)
from mla_compile.lowerings import prefill as lowering
from mla_compile.lowerings.decode import Candidate
from mla_compile.lowerings.prefill import autotune_on_cpu
from mla_compile.ops import _compile_log
from mla_compile.ops.prefill import fake as prefill_fake
from tests.lowerings._timings import charge
from tests.ops.ref64 import generator, prefill_ref64, randn

LENS_Q, LENS_K, PAD = (5, 0, 3), (7, 2, 3), 2
H, QK, V = 2, 24, 16
SCALE = QK ** -0.5


@torch.library.custom_op("mla_lower_test::costed_prefill", mutates_args=())
def costed_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, scale: float, causal: bool,
                   cost_us: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, charging ``cost_us`` to the injected benchmarker: a candidate with the same numbers
    that the timing calls slower or faster."""
    charge(cost_us)
    out, lse = torch.ops.mla.prefill_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
    return out.clone(), lse.clone()


costed_prefill.register_fake(prefill_fake)


def _cu(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def _inputs(seed: int, dtype=torch.float32):
    """Random q/k/v with NaN padding rows past cu_seqlens[-1] (no implementation may read them)."""
    gen = generator(seed)
    tq, tk = sum(LENS_Q), sum(LENS_K)
    q = randn(gen, tq + PAD, H, QK, dtype=dtype)
    k = randn(gen, tk + PAD, H, QK, dtype=dtype)
    v = randn(gen, tk + PAD, H, V, dtype=dtype)
    q[tq:], k[tk:], v[tk:] = float("nan"), float("nan"), float("nan")
    return q, k, v, _cu(LENS_Q), _cu(LENS_K)


def _step(q, k, v, cu_q, cu_k, causal=True):
    out, lse = mla_compile.ops.prefill(q, k, v, cu_q, cu_k, SCALE, causal=causal, backend="autotune")
    return out * 2, lse


def _compile_run(args, causal=True):
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        (out, lse), code = run_and_get_code(torch.compile(_step, fullgraph=True), *args, causal)
    torch._dynamo.reset()
    return out, lse, "\n".join(code)


def _check(out, lse, args, causal=True, factor=2):
    q, k, v, _, _ = args
    ref_out, ref_lse = prefill_ref64(q, k, v, list(LENS_Q), list(LENS_K), SCALE, causal)
    torch.testing.assert_close(out.double(), factor * ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_cpu_without_candidates_is_a_plain_fallback_call():
    args = _inputs(1)
    before = _compile_log.mark()
    out, lse, code = _compile_run(args)
    _check(out, lse, args)
    assert "torch.ops.mla.prefill_autotune.default(" in code
    assert _compile_log.records_since(before) == []  # nothing was timed on CPU


@pytest.mark.parametrize("slow_first,causal", [(True, True), (False, False)])
def test_autotune_emits_the_faster_candidate_only(slow_first, causal):
    tag = int(slow_first)  # fresh choice names per case: no autotune-cache hit from the other case
    fast = Candidate(f"mla_tp_fast{tag}", "fast", torch.ops.mla_lower_test.costed_prefill.default, (0,))
    slow = Candidate(f"mla_tp_slow{tag}", "slow", torch.ops.mla_lower_test.costed_prefill.default, (20000,))
    cands = [slow, fast] if slow_first else [fast, slow]
    seen = []
    args = _inputs(2 + tag)
    before = _compile_log.mark()
    with autotune_on_cpu(lambda **facts: seen.append(facts) or cands):
        out, lse, code = _compile_run(args, causal)
    _check(out, lse, args, causal)
    assert seen and seen[0]["num_heads"] == H and seen[0]["head_dims"] == (QK, V) and seen[0]["causal"] is causal
    (rec,) = _compile_log.records_since(before)
    assert rec.op == "mla::prefill_autotune" and rec.winner == fast.name and rec.winner_backend == "fast", rec
    assert rec.timings_ms == {slow.name: 20.0, fast.name: 0.0}, rec  # the charged costs, in ms
    calls = [ln for ln in code.splitlines() if "torch.ops.mla_lower_test.costed_prefill.default(" in ln]
    assert len(calls) == 1 and calls[0].rstrip().endswith(", 0)"), calls  # the fast one, once
    assert "mla_prefill_autotune" not in code and "extern_kernels.mla_tp_" not in code  # the timing node is gone


def test_failure_inside_autotuning_warns_and_falls_back(monkeypatch):
    def broken(*a, **k):
        raise AttributeError("simulated private API change")

    monkeypatch.setattr(lowering, "_autotuned", broken)
    monkeypatch.setattr(lowering, "_WARNED", set())
    args = _inputs(5)
    with autotune_on_cpu(lambda **facts: [Candidate("mla_tp_x", "x", torch.ops.mla.prefill_ref.default)]):
        with pytest.warns(UserWarning, match="prefill_autotune: autotuning failed .*simulated private API change"):
            out, lse, code = _compile_run(args)
    _check(out, lse, args)
    assert "torch.ops.mla.prefill_autotune.default(" in code


def test_autotune_is_a_prefill_backend_name_never_picked_by_auto():
    from mla_compile.backends import requested_for, select_backend
    from mla_compile.ops.decode_autotune import lowering_installed

    assert lowering_installed("mla::prefill_autotune") and mla_compile.lowerings.PREFILL_LOWERING_INSTALLED
    assert select_backend("prefill", device="cpu", dtype=torch.bfloat16, requested="autotune").name == "autotune"
    auto = select_backend("prefill", device="cpu", dtype=torch.bfloat16)
    assert auto.name == "reference" and "'auto' skips it" in auto.rejected["autotune"]
    assert requested_for("prefill", "autotune") == "autotune" and requested_for("merge", "autotune") == "auto"
    for causal in (True, False):  # eager: the static default (the reference on CPU)
        args = _inputs(6)
        out, lse = mla_compile.ops.prefill(*args, SCALE, causal=causal, backend="autotune")
        _check(out, lse, args, causal, factor=1)


def test_opcheck_prefill_autotune():
    torch.library.opcheck(torch.ops.mla.prefill_autotune.default, (*_inputs(7), SCALE, True),
                          test_utils=("test_schema", "test_faketensor"))


def test_no_candidates_without_cuda_and_no_planned_or_host_reading_peers():
    assert lowering.prefill_candidates(torch.device("cpu"), torch.bfloat16, 16, (192, 128), True) == []
    from mla_compile.ops.registry import backends_for

    peers = {n for n, s in backends_for("prefill").items() if s.autotune}  # the lowering's candidates
    assert "flashinfer" not in peers and "sdpa-cudnn" not in peers


def test_compiled_mla_attention_prefill_goes_through_the_lowering():
    """A compiled prefill step of a model patched with backend="autotune" lowers its prefill through
    the autotune lowering (one test candidate here) and gives the eager logits."""
    pytest.importorskip("transformers")
    from mla_compile.app import toy
    from mla_compile.models.metadata import SeqChunk, plan_step
    from mla_compile.models.model import patch

    model = patch(toy.toy_hf_model("v2-lite", num_hidden_layers=1, seed=4), backend="autotune")
    model.allocate_cache(8, 4, fill=float("nan"))
    step = plan_step([], [SeqChunk([3, 1], [5, 9, 2, 7, 1]), SeqChunk([6], [4, 4, 8])], 4, logits="all")
    with torch.no_grad():
        want = model(step.input_ids, step.positions, step.meta)[:step.num_rows].clone()
    cand = Candidate("mla_tp_model", "test", torch.ops.mla_lower_test.costed_prefill.default, (0,))
    before = _compile_log.mark()
    torch._dynamo.reset()
    with autotune_on_cpu(lambda **facts: [cand]), torch._inductor.config.patch(force_disable_caches=True), \
            torch.no_grad():
        got = torch.compile(model, fullgraph=True)(step.input_ids, step.positions, step.meta)[:step.num_rows]
    torch._dynamo.reset()
    choices = {k[0]: v for k, v in model.attentions[0]._backend_choices.items()}
    assert choices == {"prefill": "autotune"}, choices
    recs = [r for r in _compile_log.records_since(before) if r.op == "mla::prefill_autotune"]
    assert recs and all(r.winner == cand.name for r in recs), recs
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ CUDA

@pytest.mark.cuda
@pytest.mark.parametrize("lens,causal", [((512, 1024, 256, 2048), True), ((2048,) * 4, True), ((300, 700), False)])
def test_cuda_prefill_autotune_picks_a_backend_and_matches_the_reference(lens, causal):
    gen = torch.Generator(device="cuda").manual_seed(sum(lens))
    lens_k = [n + (0 if causal else 100) for n in lens]
    q = torch.randn(sum(lens) + 3, 16, 192, device="cuda", generator=gen).bfloat16()
    k = torch.randn(sum(lens_k) + 5, 16, 192, device="cuda", generator=gen).bfloat16()
    v = torch.randn(sum(lens_k) + 5, 16, 128, device="cuda", generator=gen).bfloat16()
    cu_q, cu_k = _cu(lens).cuda(), _cu(lens_k).cuda()
    before = _compile_log.mark()

    def step(q, k, v, cu_q, cu_k):
        return mla_compile.ops.prefill(q, k, v, cu_q, cu_k, 192 ** -0.5, causal=causal, backend="autotune")

    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        (out, lse), code = run_and_get_code(torch.compile(step, fullgraph=True), q, k, v, cu_q, cu_k)
    recs = _compile_log.records_since(before)
    assert len(recs) == 1, recs
    rec = recs[0]
    print(f"lens={lens} causal={causal}: winner {rec.winner} ({rec.winner_backend}); timings {rec.timings_ms}")
    assert rec.winner_backend in ("triton", "triton-tma", "flash-attn", "flashinfer-trtllm")
    assert len(rec.timings_ms) >= 2 and all(t is not None and t > 0 for t in rec.timings_ms.values()), rec
    ref_out, ref_lse = torch.ops.mla.prefill_ref(q.float(), k.float(), v.float(), cu_q, cu_k, 192 ** -0.5, causal)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=2e-3)
    assert "mla_prefill_autotune" not in "\n".join(code)  # only the winner's op is emitted


def test_tma_configs_join_the_candidates_on_sm90_only_once_gpu_tested(monkeypatch):
    """On an (assumed) sm_90 with Triton: the pointer kernel's configs always; the TMA kernel's configs only while
    its backend "triton-tma" is marked GPU-tested (an untested kernel never wins an autotune it cannot fail)."""
    import dataclasses

    from mla_compile.ops import select
    from mla_compile.ops.registry import _TABLE

    monkeypatch.setattr(lowering, "triton_available", lambda: True)
    monkeypatch.setattr(select, "device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(lowering._autotune, "peer_candidates", lambda op, facts: [])
    table = _TABLE["prefill"]

    def backends(tested):
        monkeypatch.setitem(table, "triton-tma", dataclasses.replace(table["triton-tma"], gpu_tested=tested))
        return [c.backend for c in lowering.prefill_candidates(torch.device("cuda"), torch.bfloat16, 16,
                                                                (192, 128), True)]
    assert backends(False) == ["triton"] * len(lowering.TRITON_CONFIGS)
    assert backends(True) == ["triton"] * len(lowering.TRITON_CONFIGS) + ["triton-tma"] * len(lowering.TMA_CONFIGS)
