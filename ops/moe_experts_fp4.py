"""``mla::moe_experts_fp4``: the routed experts of one MoE layer over DeepSeek-V4's packed-fp4 expert weights.

Contract. ``out[t] = sum_j weights[t, j] * down_e(silu(g) * u)`` with ``e = ids[t, j]``, ``g = gate_e(x[t])``,
``u = up_e(x[t])`` (a repeated id counts once per pick; the fused kernels skip a pick of weight 0, reading nothing
of its expert: expert parallelism gives the other ranks' picks weight 0), the products and sums in float32
(float64 for a float64 ``x``), the activation ``silu(g) * u`` rounded to x's dtype before the down projection (as
:mod:`mla_compile.ops.moe_experts_fp8`). Each weight is given as packed e2m1 codes and ue8m0 scales, standing
for ``W[n, k] = e2m1[n, k] * 2^(scale[n, k // 32] - 127)`` (:mod:`mla_compile.ops.fp4_block_linear`'s format).
Weight-only: the activation is never quantized. ``swiglu_limit`` (DeepSeek-V4; None clamps nothing): ``g`` is
clamped to ``<= limit`` and ``u`` to ``[-limit, limit]`` before ``silu(g) * u``.

Shapes (as :class:`~mla_compile.models.fp4_linear.FP4Experts` holds them): ``x [T, H]``, ``weights [T, k]``
float32, ``ids [T, k]`` int32/int64 in ``[0, E)``; ``gate, up [E, I, H/2]`` and ``down [E, H, I/2]`` bytes
(uint8 / int8 / float4_e2m1fn_x2) with scales ``gate_scale, up_scale [E, I, H/32]`` and ``down_scale [E, H,
I/32]`` (uint8 / float8_e8m0fnu); H and I multiples of 32. Output ``[T, H]`` of x's dtype, or float32 (float64
for float64 x) with ``out_float32``. DeepSeek-V4's shared expert is fp8, not fp4: it is not part of this op.

Backends: "reference" (plain torch, any device: one expert at a time dequantized, on every token), "grouped"
(CUDA: the (token, pick) copies sorted by expert through ``mla::fp4_block_linear``'s sorted groups, each hit
expert read once: the large-T path; its gate / up outputs are rounded to x's dtype before the activation, as
``FP4Experts`` rounded them), "triton" (ours, CUDA: per (token, pick) the routed expert's gate and up rows in one
kernel with the clamp and ``silu(g) * u``, then down with the weighted combine, the codes decoded in registers:
the small-T path), "gluon" (ours, sm_90: the same two kernels with the products on the tensor cores, the codes
decoded into ``mma``'s register operand, and above 16 tokens their sorted-by-expert form; bf16 x). "auto": "gluon"
where it serves up to :data:`GLUON_MAX_TOKENS_FP4` tokens (faster than the other two at every count timed there,
BENCHMARKS.md), else ``triton`` up to :data:`FUSED_MAX_TOKENS_FP4`, and ``grouped`` above, inside one op (one graph
serves every batch size).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import INDEX_DTYPES, check_same_device, check_tensor
from mla_compile.ops.fp4_block_linear import BLOCK, SCALE_DTYPES, WEIGHT_DTYPES, dequantize, fp4_block_linear
from mla_compile.ops.moe_experts import _acc, _activation, _out_dtype, combine_sorted, fused_or_grouped, sort_by_expert
from mla_compile.ops.registry import (FLOATS, HALF, LAYOUT_TAGS, SM90, declare, declare_op, declare_split_op,
                                      run_split_part)
from mla_compile.ops.select import resolve

OP = declare_op("moe_experts_fp4", "mla.moe_experts_fp4")
# "auto" takes the fused kernels up to this many tokens, the grouped fp4 GEMMs above (BENCHMARKS.md)
FUSED_MAX_TOKENS_FP4 = 16
# ... and the Gluon kernels, where they serve, up to this many: the most tokens timed where they beat grouped (they
# lose at twice this). Above 16 tokens they re-read each hit expert's weights every 8 of its rows (the grouped GEMMs:
# every 16-64), so with tens of rows an expert the grouped tiles win again.
GLUON_MAX_TOKENS_FP4 = 256


def _check_weight(name: str, w: Tensor, scale: Tensor, E: int, rows: int, cols: int) -> None:
    """``w [E, rows, cols/2]`` packed codes and its ``*_scale [E, rows, cols/32]`` ue8m0 bytes."""
    codes = " / ".join(str(d).removeprefix("torch.") for d in WEIGHT_DTYPES)
    check_tensor(OP, name, w, dtypes=WEIGHT_DTYPES, shape=(E, rows, cols // 2),
                 expected=f"[{E}, {rows}, {cols // 2}] packed e2m1 bytes ({codes})")
    scales = " / ".join(str(d).removeprefix("torch.") for d in SCALE_DTYPES)
    check_tensor(OP, f"{name}_scale", scale, dtypes=SCALE_DTYPES, shape=(E, rows, cols // BLOCK),
                 expected=f"[{E}, {rows}, {cols // BLOCK}] ue8m0 bytes ({scales}; one per {BLOCK} weights of {name})")


def validate(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
             up_scale: Tensor, down: Tensor, down_scale: Tensor) -> None:
    """Shape/dtype checks (metadata only, no sync)."""
    check_tensor(OP, "x", x, ndim=2, dtypes=FLOATS, expected="[T, H] float")
    T, H = x.shape
    if H % BLOCK:
        raise ValueError(f"{OP}: x's hidden size {H} must be a multiple of {BLOCK} (one ue8m0 scale per {BLOCK} "
                         f"weights), got x {list(x.shape)}")
    check_tensor(OP, "gate", gate, ndim=3, dtypes=WEIGHT_DTYPES, shape=(None, None, H // 2),
                 expected=f"[E, I, {H // 2}] packed e2m1 bytes (H / 2 = {H // 2})")
    E, I, _ = gate.shape
    if I % BLOCK:
        raise ValueError(f"{OP}: the expert width I = gate.shape[1] = {I} must be a multiple of {BLOCK}")
    _check_weight("gate", gate, gate_scale, E, I, H)
    _check_weight("up", up, up_scale, E, I, H)
    _check_weight("down", down, down_scale, E, H, I)
    check_tensor(OP, "ids", ids, ndim=2, dtypes=INDEX_DTYPES, shape=(T, None), expected=f"[{T}, k] int32/int64")
    check_tensor(OP, "weights", weights, dtypes=(torch.float32, torch.float64), shape=(T, ids.shape[1]),
                 expected=f"[{T}, {ids.shape[1]}] float32")
    check_same_device(OP, x=x, weights=weights, ids=ids, gate=gate, gate_scale=gate_scale, up=up, up_scale=up_scale,
                      down=down, down_scale=down_scale)


@torch.library.custom_op("mla::moe_experts_fp4_ref", mutates_args=(), tags=LAYOUT_TAGS)
def moe_experts_fp4_ref(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
                        up_scale: Tensor, down: Tensor, down_scale: Tensor, out_float32: bool,
                        swiglu_limit: float | None) -> Tensor:
    """Reference (plain torch, any device): each expert dequantized in ``acc`` and run on every token, summed
    through a ``[T, E]`` routing matrix (one expert's weights in memory at a time, no data-dependent shapes)."""
    validate(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale)
    acc = _acc(x)
    T, H = x.shape
    combine = torch.zeros(T, gate.shape[0], dtype=acc, device=x.device).scatter_add_(1, ids.long(), weights.to(acc))
    xa = x.to(acc)
    out = torch.zeros(T, H, dtype=acc, device=x.device)
    for e in range(gate.shape[0]):
        a = _activation(xa @ dequantize(gate[e], gate_scale[e], acc).T, xa @ dequantize(up[e], up_scale[e], acc).T,
                        x.dtype, swiglu_limit)
        out += combine[:, e:e + 1] * (a @ dequantize(down[e], down_scale[e], acc).T)
    return out.to(_out_dtype(x, out_float32))


def fake(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, out_float32, swiglu_limit):
    """Fake output shared by every implementation: validate, then ``[T, H]``."""
    validate(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale)
    return x.new_empty(x.shape, dtype=_out_dtype(x, out_float32))


moe_experts_fp4_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.moe_experts_fp4_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="plain torch, each expert dequantized and run on every token (the ground truth)")


@torch.library.custom_op("mla::moe_experts_fp4_grouped", mutates_args=(), tags=LAYOUT_TAGS)
def moe_experts_fp4_grouped(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
                            up_scale: Tensor, down: Tensor, down_scale: Tensor, out_float32: bool,
                            swiglu_limit: float | None) -> Tensor:
    """The (token, pick) copies sorted by expert through ``mla::fp4_block_linear``'s sorted-groups form (each hit
    expert read once)."""
    validate(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale)
    order, offs = sort_by_expert(ids, gate.shape[0])
    xs = x[order // ids.shape[1]]
    a = _activation(fp4_block_linear(xs, gate, gate_scale, offs=offs), fp4_block_linear(xs, up, up_scale, offs=offs),
                    x.dtype, swiglu_limit)
    out = combine_sorted(fp4_block_linear(a, down, down_scale, offs=offs), order, weights)
    return out.to(_out_dtype(x, out_float32))


moe_experts_fp4_grouped.register_fake(fake)
declare(OP, "grouped", torch.ops.mla.moe_experts_fp4_grouped, rank=60, dtypes=FLOATS[:3], gpu_tested=True,
        available=torch.cuda.is_available, package="torch",
        note="tokens sorted by expert, mla::fp4_block_linear's sorted groups: each hit expert read once (large T)")


@torch.library.custom_op("mla::moe_experts_fp4_split", mutates_args=(), tags=LAYOUT_TAGS)
def moe_experts_fp4_split(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
                          up_scale: Tensor, down: Tensor, down_scale: Tensor, out_float32: bool,
                          swiglu_limit: float | None, tiers: str, plan_id: int) -> Tensor:
    """``mla::moe_experts_fp4`` through the part of ``tiers`` (``"triton:64/grouped"``) whose bound covers T."""
    args = (x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, out_float32, swiglu_limit)
    return run_split_part(OP, tiers, x.shape[0], args, plan_id)


moe_experts_fp4_split.register_fake(lambda *args: fake(*args[:-2]))
declare_split_op(OP, torch.ops.mla.moe_experts_fp4_split, "batch")


def auto_backend(device: str, dtype: str) -> str:
    """"auto" for ``mla::moe_experts_fp4`` on ``device`` with x of ``dtype``: the fused kernels ("gluon" where it
    serves, up to ``GLUON_MAX_TOKENS_FP4`` tokens; else "triton", up to ``FUSED_MAX_TOKENS_FP4``), grouped GEMMs above
    (:func:`~mla_compile.ops.moe_experts.fused_or_grouped`)."""
    return fused_or_grouped(OP, device, dtype, FUSED_MAX_TOKENS_FP4, preferred=("gluon", GLUON_MAX_TOKENS_FP4))


def moe_experts_fp4(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
                    up_scale: Tensor, down: Tensor, down_scale: Tensor, *, swiglu_limit: float | None = None,
                    out_float32: bool = False, backend: str | None = None) -> Tensor:
    """Routed fp4 experts of ``x [T, H]`` -> ``[T, H]``; shapes and math in the module docstring.
    ``backend``: None/"auto" (:func:`auto_backend`), "reference", "grouped", "triton", "gluon" or a split name."""
    if backend in (None, "auto"):
        backend = auto_backend(str(x.device), str(x.dtype).replace("torch.", ""))
    impl = resolve(OP, x.device, backend, dtype=x.dtype)
    limit = None if swiglu_limit is None else float(swiglu_limit)
    return impl.fn(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, bool(out_float32), limit)


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(*args) -> Tensor:
    import mla_compile.ops.triton.moe_experts_fp4  # noqa: F401  (registers mla::moe_experts_fp4_triton)
    return torch.ops.mla.moe_experts_fp4_triton(*args)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=(torch.float32, *HALF),
        package="triton", gpu_tested=True,
        kernels=("moe_experts_fp4_triton", "_moe_fp4_gate_up_kernel", "_moe_fp4_down_kernel"),
        note="ours: reads only the routed experts' fp4 rows and scales; gate+up+clamp+SiLU*up, then down+combine")


def _gluon(*args) -> Tensor:
    import mla_compile.ops.triton.moe_experts_fp4_mma  # noqa: F401  (registers mla::moe_experts_fp4_gluon)
    return torch.ops.mla.moe_experts_fp4_gluon(*args)


declare(OP, "gluon", _gluon, rank=45, available=_triton_available, dtypes=(torch.bfloat16,), min_capability=SM90,
        max_capability=SM90, package="triton", gpu_tested=True,
        kernels=("moe_experts_fp4_gluon=gluon (opaque kernel)", "_moe_fp4_mma_gate_up_kernel",
                 "_moe_fp4_mma_down_kernel", "_moe_fp4_mma_sorted_gate_up_kernel", "_moe_fp4_mma_sorted_down_kernel"),
        note="ours (Gluon, sm_90): as 'triton', the codes decoded straight into mma.sync's bf16 A operand and the "
             "products on the tensor cores, the warps splitting K, sorted by expert above 16 tokens; bf16 x, H and I "
             "multiples of 1024 (else 'triton')")
