"""``token_mask`` of ``mla::moe_experts`` and ``mla::moe_experts_fp8``: masked rows (padding tokens) give exactly 0 and
the real rows are what an unmasked call gives them (against the float64 per-(token, pick) loops), for the reference
backends and the Triton kernels under the interpreter; the kernels read no expert weights for masked tokens (the
only experts the masked tokens pick hold NaN, their x rows are NaN, the allocator is NaN-poisoned: the output stays
finite); opcheck and the fake with a mask, the split op passing it on, a compiled call, errors naming it.
GPU twins: tests/ops/triton/test_triton_moe.py, tests/ops/triton/test_triton_moe_fp8.py."""

from __future__ import annotations

import pytest
import torch

from mla_compile import ops
from tests.ops import test_moe_experts as bf
from tests.ops import test_moe_experts_fp8 as f8
from tests.ops.triton.conftest import INTERPRET
from tests.poison import poisoned_empty

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and an importable triton")


def random_mask(T: int, seed: int) -> torch.Tensor:
    """``[T]`` bool with both real and masked tokens."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(T, generator=gen) < 0.5
    mask[0], mask[-1] = True, False
    return mask


def poison_masked(args: tuple, mask: torch.Tensor, weight_slots: tuple[int, ...]) -> tuple:
    """``args`` with a NaN expert (a new last one) that only the masked tokens pick, and NaN x rows for them.
    ``weight_slots``: the indices in ``args`` of the routed weight tensors (``[E, ...]``, one more expert each)."""
    args = list(args)
    x, ids = args[0].clone(), args[2].clone()
    E = args[weight_slots[0]].shape[0]
    x[~mask] = float("nan")
    ids[~mask] = E  # the poisoned expert, in range: a read would be a NaN, never a fault
    args[0], args[2] = x, ids
    for i in weight_slots:
        w = args[i]
        nan = torch.full_like(w[:1], float("nan"), dtype=torch.float32).to(w.dtype)
        args[i] = torch.cat([w, nan])
    return tuple(args)


def check(out: torch.Tensor, unmasked: torch.Tensor, want64: torch.Tensor, mask: torch.Tensor, tol: float) -> None:
    """Masked rows exactly 0; real rows bitwise as without the mask and near the float64 loop."""
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))
    assert torch.equal(out[mask], unmasked[mask]), "a mask must not change the real tokens' rows"
    assert bf.rel(out[mask], want64[mask]) < tol


def activations(module, monkeypatch, run) -> torch.Tensor:
    """The activation buffer ``h [T * slots, I]`` that ``run()`` hands ``module``'s gate-up kernel (launched as
    usual, under the interpreter)."""
    seen = []
    name = "_wrap" if hasattr(module, "_wrap") else "wrap_triton"  # what the module launches its kernels through
    real = getattr(module, name)

    def wrap(kernel):
        launch = real(kernel)

        class Recorder:
            def __getitem__(self, grid):
                def go(*args, **kwargs):
                    seen.append((kernel, args))
                    return launch[grid](*args, **kwargs)
                return go
        return Recorder()

    monkeypatch.setattr(module, name, wrap)
    run()
    (h,) = [args[kernel.arg_names.index("h_ptr")] for kernel, args in seen
            if "gate_up" in kernel.fn.__name__]
    return h


def check_activations(h: torch.Tensor, mask: torch.Tensor) -> None:
    """A poisoned (NaN) activation buffer: the gate-up kernel wrote every row of the real tokens, none of the
    masked ones."""
    rows = mask.repeat_interleave(h.shape[0] // mask.shape[0])
    assert h[rows].isfinite().all(), "a real token's activation rows were not written"
    assert h[~rows].isnan().all(), "the gate-up kernel stored activations of a masked token"


# ---- mla::moe_experts

def _call(args, mask, backend, **kw):
    return ops.moe_experts(*args[:5], shared_gate=args[5], shared_up=args[6], shared_down=args[7], backend=backend,
                           token_mask=mask, **kw)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_reference_masked_rows_are_zero_and_real_rows_unchanged(dtype, shared):
    args = bf.make(T=7, S=2 if shared else 0, dtype=dtype, seed=11, repeat=True)
    mask = random_mask(7, seed=1)
    want = bf.experts64(*args, round_to=dtype)
    out = _call(args, mask, "reference", out_float32=True)
    check(out, _call(args, None, "reference", out_float32=True), want, mask, 1e-5)
    # NaN x rows of the masked tokens stay out of every row (the reference computes them, then zeroes them)
    x = args[0].clone()
    x[~mask] = float("nan")
    poisoned = _call((x, *args[1:]), mask, "reference", out_float32=True)
    assert torch.equal(poisoned, out)


@needs_interpreter
@pytest.mark.parametrize("T,H,I,E,k,S,dtype", [  # each shape once, each dtype at least once
    (7, 40, 24, 6, 3, 2, torch.float32), (2, 64, 32, 8, 6, 0, torch.bfloat16), (4, 300, 20, 5, 2, 1, torch.bfloat16)])
@pytest.mark.parametrize("form", ["gemv", "dot", "pipe"])
def test_interpreter_reads_no_weights_for_masked_tokens(T, H, I, E, k, S, dtype, form, monkeypatch):
    """``form``: the GEMV kernels, the tensor-core forms at 16-wide tiles, kernel 1's pipelined GEMV form at 8 x 16
    tiles (float32 x always takes the GEMV kernels)."""
    from mla_compile.ops.triton import moe_experts as kernels
    from mla_compile.ops.triton.moe_experts import _launch

    forms = {"gemv": dict(gate_up_pipe=False, gate_up_dot=False, down_dot=False),
             "dot": dict(gate_up_pipe=False, gate_up_dot=True, down_dot=True, dot_n=16, dot_k=16, down_h=16, down_k=16),
             "pipe": dict(gate_up_pipe=True, pipe_n=8, pipe_k=16, pipe_stages=2, down_dot=False)}[form]
    for key, value in forms.items():
        monkeypatch.setitem(kernels.CONFIG, key, value)

    args = bf.make(T, H, I, E, k, S, dtype=dtype, seed=T + H, repeat=True)
    mask = random_mask(T, seed=T)
    want = bf.experts64(*args, round_to=dtype)
    with poisoned_empty():
        unmasked = _launch(*args, True)
        out = _launch(*args, True, mask)
        check(out, unmasked, want, mask, 1e-6 if dtype == torch.float32 else 8e-3)
        poisoned = _launch(*poison_masked(args, mask, (3, 4)), True, mask)
        assert torch.equal(poisoned, out), "a masked token read an expert's weights or its x"
        check_activations(activations(kernels, monkeypatch, lambda: _launch(*args, True, mask)), mask)
        low = _launch(*poison_masked(args, mask, (3, 4)), False, mask)
        assert low.dtype == dtype and torch.equal(low[~mask], torch.zeros_like(low[~mask]))
        assert torch.equal(low[mask], _launch(*args, False)[mask])


def test_opcheck_fake_split_and_compiled_call_with_a_mask():
    args = bf.make(T=6, seed=2)
    mask = random_mask(6, seed=2)
    torch.library.opcheck(torch.ops.mla.moe_experts_ref, (*args, False, mask))
    from torch._subclasses.fake_tensor import FakeTensorMode
    short = mask[:-1]
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        assert torch.ops.mla.moe_experts_ref(*fake, True, mode.from_tensor(mask)).shape == args[0].shape
        with pytest.raises(ValueError, match="token_mask"):
            torch.ops.mla.moe_experts_ref(*fake, True, mode.from_tensor(short))
    want = _call(args, mask, "reference")
    for tiers in ("triton:2/reference", "reference:2/triton"):  # either part gets the mask (CPU: the reference)
        got = torch.ops.mla.moe_experts_split(*args, False, mask, tiers, -1)
        assert torch.equal(got, want), tiers
    fn = torch.compile(lambda a, m: _call(a, m, None), fullgraph=True)
    assert torch.equal(fn(args, mask), want)


@pytest.mark.parametrize("bad,match", [
    (lambda m: m[:-1], r"token_mask must have shape \[6\]"),
    (lambda m: m.int(), "token_mask must have dtype"),
    (lambda m: m[:, None], r"token_mask must have shape \[6\]"),
    (lambda m: m.to("meta"), "one device"),
])
def test_mask_errors_name_the_argument(bad, match):
    args = bf.make(T=6)
    mask = random_mask(6, seed=0)
    with pytest.raises((ValueError, TypeError), match=match):
        _call(args, bad(mask), "reference")
    a8 = f8.make(T=6)
    with pytest.raises((ValueError, TypeError), match=match):
        f8.call(a8, backend="reference", token_mask=bad(mask))


# ---- mla::moe_experts_fp8

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fp8_reference_masked_rows_are_zero_and_real_rows_unchanged(dtype):
    args = f8.make(T=7, H=136, dtype=dtype, seed=5, repeat=True)
    mask = random_mask(7, seed=3)
    want = f8.experts64(*args, round_to=dtype, limit=0.5)
    out = f8.call(args, out_float32=True, swiglu_limit=0.5, backend="reference", token_mask=mask)
    unmasked = f8.call(args, out_float32=True, swiglu_limit=0.5, backend="reference")
    check(out, unmasked, want, mask, 1e-5)


@needs_interpreter
@pytest.mark.parametrize("T,H,I,E,k,S,limit,dtype", [
    (7, 40, 24, 6, 3, 2, None, torch.bfloat16),
    (2, 200, 136, 8, 6, 0, None, torch.float32),
    (5, 160, 20, 5, 2, 1, 0.05, torch.float32),
])
def test_fp8_interpreter_reads_no_weights_for_masked_tokens(T, H, I, E, k, S, limit, dtype, monkeypatch):
    from mla_compile.ops.triton.moe_experts_fp8 import _launch

    args = f8.make(T, H, I, E, k, S, dtype=dtype, seed=T + H, repeat=True)
    mask = random_mask(T, seed=T)
    want = f8.experts64(*args, round_to=dtype, limit=limit)
    with poisoned_empty():
        out = _launch(*args, True, limit, mask)
        check(out, _launch(*args, True, limit), want, mask, 1e-6 if dtype == torch.float32 else 8e-3)
        # the poisoned expert: NaN codes and NaN scales for gate, up and down
        poisoned = _launch(*poison_masked(args, mask, (3, 4, 5, 6, 7, 8)), True, limit, mask)
        assert torch.equal(poisoned, out), "a masked token read an expert's weights or its x"
        from mla_compile.ops.triton import moe_experts_fp8 as kernels
        check_activations(activations(kernels, monkeypatch, lambda: _launch(*args, True, limit, mask)), mask)


def test_fp8_opcheck_fake_and_split_with_a_mask():
    from tests.ops.test_fp8_block_linear import OPCHECK_UTILS  # test_schema cannot perturb float8 on CPU

    args = f8.make(T=6, H=136)
    mask = random_mask(6, seed=4)
    torch.library.opcheck(torch.ops.mla.moe_experts_fp8_ref, (*args, False, None, mask), test_utils=OPCHECK_UTILS)
    want = f8.call(args, backend="reference", token_mask=mask)
    assert torch.equal(want[~mask], torch.zeros_like(want[~mask]))
    for tiers in ("triton:2/reference", "reference:2/triton"):
        got = torch.ops.mla.moe_experts_fp8_split(*args, False, None, mask, tiers, -1)
        assert torch.equal(got, want), tiers
