"""The MoE Triton kernels under Triton's interpreter (CPU): ``mla::moe_route``'s kernel against the float64
per-row routing math, best pick first; the two ``mla::moe_experts`` kernels against the float64 per-(token, pick)
loop (shared experts folded in or not, an expert picked twice, widths off the tiles), NaN-poisoned outputs,
run-to-run equality. References and inputs: tests/ops/test_moe_route.py, tests/ops/test_moe_experts.py."""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_moe_experts import experts64, make, rel
from tests.ops.test_moe_route import CASES, _check, _inputs, route64, route_choice
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("case", CASES + [(64, 6, 1, 1, "softmax", False, False, 1.0),
                                          (256, 8, 8, 4, "sigmoid", True, True, 2.5)])
def test_interpreter_matches_float64_math(case):
    from mla_compile.ops.triton.moe_route import _launch

    E, k, G, TG, scoring, bias, renorm, scaling = case
    logits, b = _inputs(E, bias, T=5, seed=E)
    with poisoned_empty():
        w, ids = _launch(logits, b, k, G, TG, scoring, renorm, scaling)
        _check(w, ids, route64(logits, b, k, G, TG, scoring, renorm, scaling), 2e-6)
        best_first = [[route_choice(logits[t], b, scoring)[e] for e in ids[t].tolist()] for t in range(5)]
        assert all(row == sorted(row, reverse=True) for row in best_first)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
def test_interpreter_sqrtsoftplus_of_very_negative_and_large_logits():
    """V4's scores where softplus is tiny (logits near -25: ``log(1 + e^z)`` in float32 would be 0 for every
    expert, and the renormalized weights 0 / 0) and where it is linear (above 20): weights as float64's."""
    from mla_compile.ops.triton.moe_route import _launch

    logits, _ = _inputs(16, False, T=5, seed=3)
    logits = logits - 25.0
    logits[4] += 45.0  # around 20: both sides of softplus's linear threshold
    w, ids = _launch(logits, None, 3, 1, 1, "sqrtsoftplus", True, 1.0)
    _check(w, ids, route64(logits, None, 3, 1, 1, "sqrtsoftplus", True, 1.0), 2e-6)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("scoring", ["sigmoid", "softmax", "sqrtsoftplus"])
def test_interpreter_nan_logits_still_give_expert_ids_in_range(scoring):
    """A NaN router row routes to garbage, but never to an expert id the experts kernel would read past E with."""
    from mla_compile.ops.triton.moe_route import _launch

    logits, _ = _inputs(12, False, T=3, seed=1)
    logits[1, 4] = float("nan")
    logits[2] = float("nan")
    _, ids = _launch(logits, None, 4, 1, 1, scoring, False, 1.0)
    assert ((ids >= 0) & (ids < 12)).all(), ids


# the experts kernels' forms: the GEMV kernels, the tensor-core (tl.dot) forms at their default tiles and at
# 16-wide tiles (several steps along H and I, every slot's chunks in the down kernel's one loop), and kernel 1's
# pipelined GEMV form at its default tiles and at 8 x 16 tiles (several steps along H, masked tails); the down GEMV at
# 2 x 16 tiles (``gemv_down_*``: several I steps)
VARIANTS = {"gemv": dict(gate_up_pipe=False, gate_up_dot=False, down_dot=False),
            "dot": dict(gate_up_pipe=False, gate_up_dot=True, down_dot=True),
            "dot16": dict(gate_up_pipe=False, gate_up_dot=True, down_dot=True, dot_n=16, dot_k=16, down_h=16, down_k=16,
                          dot_stages=2),
            "pipe": dict(gate_up_pipe=True, down_dot=False),
            "pipe8": dict(gate_up_pipe=True, pipe_n=8, pipe_k=16, pipe_stages=2, down_dot=False),
            "down2": dict(gate_up_pipe=True, down_dot=False, gemv_down_h=2, gemv_down_k=16, gemv_down_warps=2)}


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
@pytest.mark.parametrize("T,H,I,E,k,S,dtype,variant", [
    (*shape, dtype, variant) for shape in [(5, 40, 24, 6, 3, 2), (1, 64, 32, 8, 6, 0), (3, 300, 20, 5, 2, 1)]
    for dtype, variant in [(torch.float32, "gemv"), *((torch.bfloat16, v) for v in VARIANTS)]
    if not (variant == "down2" and shape[1] == 300)])  # the 2-row down GEMV over 300 columns: 150 programs a row
def test_interpreter_matches_float64_loop(T, H, I, E, k, S, dtype, variant, monkeypatch):
    """bf16 x under every form; float32 x always takes the GEMV kernels (tl.dot would round it to tf32), whatever
    the config asks: :func:`test_interpreter_float32_keeps_the_gemv_kernels`."""
    from mla_compile.ops.triton import moe_experts
    from mla_compile.ops.triton.moe_experts import _launch

    for key, value in VARIANTS[variant].items():
        monkeypatch.setitem(moe_experts.CONFIG, key, value)
    args = make(T, H, I, E, k, S, dtype=dtype, seed=T + H, repeat=True)
    want = experts64(*args, round_to=dtype)
    with poisoned_empty():
        out = _launch(*args, True)
        assert out.dtype == torch.float32 and not out.isnan().any()
        # bf16: the activation's rounding (the interpreter's float32 -> bf16 cast truncates: up to 1 ulp, 2**-8)
        assert rel(out, want) < (1e-6 if dtype == torch.float32 else 8e-3)
        again = _launch(*args, True)
        assert torch.equal(out, again), "the combine must add the picks in one fixed order"
        low = _launch(*args, False)
        assert low.dtype == dtype and rel(low, want) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")
def test_interpreter_float32_keeps_the_gemv_kernels(monkeypatch):
    """With the tensor-core forms asked for, float32 x still launches the GEMV kernels (bf16 x the forms)."""
    from mla_compile.ops.triton import moe_experts

    for key, value in VARIANTS["dot16"].items():
        monkeypatch.setitem(moe_experts.CONFIG, key, value)
    names = {}
    real = moe_experts.wrap_triton
    for dtype in (torch.float32, torch.bfloat16):
        args = make(2, 40, 24, 6, 3, 1, dtype=dtype, seed=9)
        seen = []

        def wrap(kernel, seen=seen):
            seen.append(kernel.fn.__name__)
            return real(kernel)

        monkeypatch.setattr(moe_experts, "wrap_triton", wrap)
        out = moe_experts._launch(*args, True)
        assert rel(out, experts64(*args, round_to=dtype)) < (1e-6 if dtype == torch.float32 else 8e-3)
        names[dtype] = seen
    assert names[torch.float32] == ["_moe_gate_up_kernel", "_moe_down_kernel"]
    assert names[torch.bfloat16] == ["_moe_gate_up_dot_kernel", "_moe_down_dot_kernel"]
