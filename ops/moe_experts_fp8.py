"""``mla::moe_experts_fp8``: ``mla::moe_experts`` over DeepSeek's fp8 block-quantized experts.

Contract. The contract of :mod:`mla_compile.ops.moe_experts` (routed SiLU experts plus optional shared ones,
float32 products and sums, the activation rounded to x's dtype, ``out_float32``, repeated ids counted per pick)
with each weight given as float8_e4m3fn codes and a float32 scale per 128 x 128 block (the checkpoint's
``weight_scale_inv``), standing for ``W[n, c] = float(codes[n, c]) * scale[n // 128, c // 128]`` as in
:mod:`mla_compile.ops.fp8_block_linear`. Weight-only: the activation is never quantized (x's bf16/fp16/fp32 values
times the dequantized weight, accumulated in float32; float64 for a float64 x).

Shapes (as :class:`~mla_compile.models.fp8_linear.FP8Experts` holds them; gate and up stay separate):
``gate, up [E, I, H]`` with scales ``[E, ceil(I/128), ceil(H/128)]``, ``down [E, H, I]`` with ``[E, ceil(H/128),
ceil(I/128)]``; optional shared experts (as ``FP8BlockLinear`` holds them) ``shared_gate, shared_up [S*I, H]``
with ``[ceil(S*I/128), ceil(H/128)]`` and ``shared_down [H, S*I]`` with ``[ceil(H/128), ceil(S*I/128)]``.
``swiglu_limit`` (DeepSeek-V4; None clamps nothing): the gate product is clamped to ``<= limit`` and the up
product to ``[-limit, limit]`` before ``silu(g) * u``, for the routed and the shared experts alike.
``token_mask [T]`` bool (optional), as in ``mla::moe_experts``: False rows give 0 exactly; the "triton" backend
reads no weights (codes or scales) for them, the others compute them and zero the rows.

Backends: "reference" (plain torch, any device: one expert at a time dequantized, on every token), "grouped"
(CUDA: tokens sorted by expert through ``mla::fp8_block_linear``'s sorted-groups form, each hit expert read
once: the large-T path; its gate/up outputs are rounded to x's dtype before the activation, as
``FP8Experts`` rounds them), "triton" (ours, CUDA: reads only the routed experts' fp8 rows and their scales
per (token, pick), dequantizing in registers: the small-T path; a routed pick of weight 0, as expert parallelism
gives the other ranks' picks, reads nothing of its expert). "auto" on a GPU with both GPU-tested:
``triton`` up to :data:`~mla_compile.ops.moe_experts.FUSED_MAX_TOKENS_FP8` tokens, ``grouped`` above, inside one op
(one graph serves every batch size); while they are not, "auto" runs "reference".
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import INDEX_DTYPES, check_same_device, check_tensor
from mla_compile.ops.fp8_block_linear import BLOCK, dequantize, fp8_block_linear
from mla_compile.ops.moe_experts import (FUSED_MAX_TOKENS_FP8, _acc, _activation, _out_dtype, check_token_mask,
                                         combine_sorted, fused_or_grouped, sort_by_expert, zero_masked)
from mla_compile.ops.registry import FLOATS, HALF, LAYOUT_TAGS, declare, declare_op, declare_split_op, run_split_part
from mla_compile.ops.select import resolve

OP = declare_op("moe_experts_fp8", "mla.moe_experts_fp8")
FP8 = (torch.float8_e4m3fn,)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_weight(name: str, w: Tensor, scale: Tensor, shape: tuple[int, ...], form: str) -> None:
    """``w`` of ``shape`` float8_e4m3fn and its ``*_scale`` of one float32 per 128 x 128 block."""
    check_tensor(OP, name, w, dtypes=FP8, shape=shape, expected=f"{form} = {list(shape)} float8_e4m3fn")
    want = (*shape[:-2], _cdiv(shape[-2], BLOCK), _cdiv(shape[-1], BLOCK))
    check_tensor(OP, f"{name}_scale", scale, dtypes=(torch.float32,), shape=want,
                 expected=f"{list(want)} float32 (one scale per 128 x 128 block of {name})")


def validate(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
             up_scale: Tensor, down: Tensor, down_scale: Tensor, shared_gate: Tensor | None,
             shared_gate_scale: Tensor | None, shared_up: Tensor | None, shared_up_scale: Tensor | None,
             shared_down: Tensor | None, shared_down_scale: Tensor | None,
             token_mask: Tensor | None = None) -> None:
    """Shape/dtype checks (metadata only, no sync)."""
    check_tensor(OP, "x", x, ndim=2, dtypes=FLOATS, expected="[T, H] float")
    T, H = x.shape
    check_tensor(OP, "gate", gate, ndim=3, dtypes=FP8, shape=(None, None, H), expected=f"[E, I, {H}] float8_e4m3fn")
    E, I, _ = gate.shape
    _check_weight("gate", gate, gate_scale, (E, I, H), "[E, I, H]")
    _check_weight("up", up, up_scale, (E, I, H), "[E, I, H] (like gate)")
    _check_weight("down", down, down_scale, (E, H, I), "[E, H, I]")
    check_tensor(OP, "ids", ids, ndim=2, dtypes=INDEX_DTYPES, shape=(T, None), expected=f"[{T}, k] int32/int64")
    check_tensor(OP, "weights", weights, dtypes=(torch.float32, torch.float64), shape=(T, ids.shape[1]),
                 expected=f"[{T}, {ids.shape[1]}] float32")
    shared = {"shared_gate": shared_gate, "shared_gate_scale": shared_gate_scale, "shared_up": shared_up,
              "shared_up_scale": shared_up_scale, "shared_down": shared_down, "shared_down_scale": shared_down_scale}
    given = {n: t is not None for n, t in shared.items()}
    if any(given.values()) and not all(given.values()):
        raise ValueError(f"{OP}: give all of {list(shared)} or none, got {given}")
    if all(given.values()):
        check_tensor(OP, "shared_gate", shared_gate, ndim=2, dtypes=FP8, shape=(None, H),
                     expected=f"[S*{I}, {H}] float8_e4m3fn")
        width = shared_gate.shape[0]
        if width == 0 or width % I:
            raise ValueError(f"{OP}: shared_gate must have shape [S*{I}, {H}] (S >= 1 shared experts of the "
                             f"routed width {I}), got {list(shared_gate.shape)}")
        _check_weight("shared_gate", shared_gate, shared_gate_scale, (width, H), "[S*I, H]")
        _check_weight("shared_up", shared_up, shared_up_scale, (width, H), "[S*I, H] (like shared_gate)")
        _check_weight("shared_down", shared_down, shared_down_scale, (H, width), "[H, S*I]")
    check_same_device(OP, x=x, weights=weights, ids=ids, gate=gate, gate_scale=gate_scale, up=up, up_scale=up_scale,
                      down=down, down_scale=down_scale, **{n: t for n, t in shared.items() if t is not None})
    check_token_mask(OP, x, token_mask)


@torch.library.custom_op("mla::moe_experts_fp8_ref", mutates_args=(), tags=LAYOUT_TAGS)
def moe_experts_fp8_ref(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
                        up_scale: Tensor, down: Tensor, down_scale: Tensor, shared_gate: Tensor | None,
                        shared_gate_scale: Tensor | None, shared_up: Tensor | None,
                        shared_up_scale: Tensor | None, shared_down: Tensor | None,
                        shared_down_scale: Tensor | None, out_float32: bool, swiglu_limit: float | None,
                        token_mask: Tensor | None = None) -> Tensor:
    """Reference (plain torch, any device): each expert dequantized in ``acc`` and run on every token, summed
    through a ``[T, E]`` routing matrix (one expert's weights in memory at a time, no data-dependent shapes); the
    rows that ``token_mask`` masks are zeroed at the end."""
    validate(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, shared_gate, shared_gate_scale,
             shared_up, shared_up_scale, shared_down, shared_down_scale, token_mask)
    acc = _acc(x)
    T, H = x.shape
    E = gate.shape[0]
    combine = torch.zeros(T, E, dtype=acc, device=x.device).scatter_add_(1, ids.long(), weights.to(acc))
    xa = x.to(acc)

    def mlp(g, gs, u, us, d, ds):
        a = _activation(xa @ dequantize(g, gs, acc).T, xa @ dequantize(u, us, acc).T, x.dtype, swiglu_limit)
        return a @ dequantize(d, ds, acc).T

    out = torch.zeros(T, H, dtype=acc, device=x.device)
    for e in range(E):
        out += combine[:, e:e + 1] * mlp(gate[e], gate_scale[e], up[e], up_scale[e], down[e], down_scale[e])
    if shared_gate is not None:
        out += mlp(shared_gate, shared_gate_scale, shared_up, shared_up_scale, shared_down, shared_down_scale)
    return zero_masked(out, token_mask).to(_out_dtype(x, out_float32))


def fake(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, shared_gate, shared_gate_scale,
         shared_up, shared_up_scale, shared_down, shared_down_scale, out_float32, swiglu_limit, token_mask=None):
    """Fake output shared by every implementation: validate, then ``[T, H]``."""
    validate(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, shared_gate, shared_gate_scale,
             shared_up, shared_up_scale, shared_down, shared_down_scale, token_mask)
    return x.new_empty(x.shape, dtype=_out_dtype(x, out_float32))


moe_experts_fp8_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.moe_experts_fp8_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="plain torch, each expert dequantized and run on every token (the ground truth)")


@torch.library.custom_op("mla::moe_experts_fp8_grouped", mutates_args=(), tags=LAYOUT_TAGS)
def moe_experts_fp8_grouped(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
                            up_scale: Tensor, down: Tensor, down_scale: Tensor, shared_gate: Tensor | None,
                            shared_gate_scale: Tensor | None, shared_up: Tensor | None,
                            shared_up_scale: Tensor | None, shared_down: Tensor | None,
                            shared_down_scale: Tensor | None, out_float32: bool,
                            swiglu_limit: float | None, token_mask: Tensor | None = None) -> Tensor:
    """The (token, pick) copies sorted by expert through ``mla::fp8_block_linear``'s sorted-groups form (each hit
    expert read once, as ``FP8Experts(grouped=True)``), the shared experts as three fp8 linears; masked tokens
    are computed too, their rows zeroed at the end."""
    validate(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, shared_gate, shared_gate_scale,
             shared_up, shared_up_scale, shared_down, shared_down_scale, token_mask)
    order, offs = sort_by_expert(ids, gate.shape[0])
    xs = x[order // ids.shape[1]]
    a = _activation(fp8_block_linear(xs, gate, gate_scale, offs=offs), fp8_block_linear(xs, up, up_scale, offs=offs),
                    x.dtype, swiglu_limit)
    out = combine_sorted(fp8_block_linear(a, down, down_scale, offs=offs), order, weights)
    if shared_gate is not None:
        a = _activation(fp8_block_linear(x, shared_gate, shared_gate_scale),
                        fp8_block_linear(x, shared_up, shared_up_scale), x.dtype, swiglu_limit)
        out = out + fp8_block_linear(a, shared_down, shared_down_scale).float()
    return zero_masked(out, token_mask).to(_out_dtype(x, out_float32))


moe_experts_fp8_grouped.register_fake(fake)
declare(OP, "grouped", torch.ops.mla.moe_experts_fp8_grouped, rank=60, dtypes=FLOATS[:3], gpu_tested=True,
        available=torch.cuda.is_available, package="torch",
        note="tokens sorted by expert, mla::fp8_block_linear's sorted groups: each hit expert read once (large T)")


@torch.library.custom_op("mla::moe_experts_fp8_split", mutates_args=(), tags=LAYOUT_TAGS)
def moe_experts_fp8_split(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
                          up_scale: Tensor, down: Tensor, down_scale: Tensor, shared_gate: Tensor | None,
                          shared_gate_scale: Tensor | None, shared_up: Tensor | None,
                          shared_up_scale: Tensor | None, shared_down: Tensor | None,
                          shared_down_scale: Tensor | None, out_float32: bool, swiglu_limit: float | None,
                          token_mask: Tensor | None, tiers: str, plan_id: int) -> Tensor:
    """``mla::moe_experts_fp8`` through the part of ``tiers`` (``"triton:8/grouped"``) whose bound covers T."""
    args = (x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, shared_gate, shared_gate_scale,
            shared_up, shared_up_scale, shared_down, shared_down_scale, out_float32, swiglu_limit, token_mask)
    return run_split_part(OP, tiers, x.shape[0], args, plan_id)


moe_experts_fp8_split.register_fake(lambda *args: fake(*args[:-2]))
declare_split_op(OP, torch.ops.mla.moe_experts_fp8_split, "batch")


def auto_backend(device: str, dtype: str) -> str:
    """"auto" for ``mla::moe_experts_fp8`` on ``device`` with x of ``dtype``: the fused kernels up to
    ``FUSED_MAX_TOKENS_FP8`` tokens, grouped GEMMs above (:func:`~mla_compile.ops.moe_experts.fused_or_grouped`)."""
    return fused_or_grouped(OP, device, dtype, FUSED_MAX_TOKENS_FP8)


def moe_experts_fp8(x: Tensor, weights: Tensor, ids: Tensor, gate: Tensor, gate_scale: Tensor, up: Tensor,
                    up_scale: Tensor, down: Tensor, down_scale: Tensor, *, shared_gate: Tensor | None = None,
                    shared_gate_scale: Tensor | None = None, shared_up: Tensor | None = None,
                    shared_up_scale: Tensor | None = None, shared_down: Tensor | None = None,
                    shared_down_scale: Tensor | None = None, swiglu_limit: float | None = None,
                    out_float32: bool = False, backend: str | None = None,
                    token_mask: Tensor | None = None) -> Tensor:
    """Routed (and shared) fp8 experts of ``x [T, H]`` -> ``[T, H]``; shapes and math in the module docstring.
    ``backend``: None/"auto" (:func:`auto_backend`), "reference", "grouped", "triton" or a split name.
    ``token_mask [T]`` bool: False rows (padding tokens) give 0 and, in the fused kernels, read no weights."""
    if backend in (None, "auto"):
        backend = auto_backend(str(x.device), str(x.dtype).replace("torch.", ""))
    impl = resolve(OP, x.device, backend, dtype=x.dtype)
    limit = None if swiglu_limit is None else float(swiglu_limit)
    return impl.fn(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale, shared_gate, shared_gate_scale,
                   shared_up, shared_up_scale, shared_down, shared_down_scale, bool(out_float32), limit, token_mask)


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(*args) -> Tensor:
    import mla_compile.ops.triton.moe_experts_fp8  # noqa: F401  (registers mla::moe_experts_fp8_triton)
    return torch.ops.mla.moe_experts_fp8_triton(*args)


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=(torch.float32, *HALF),
        package="triton", gpu_tested=True,
        kernels=("moe_experts_fp8_triton", "_moe_fp8_gate_up_kernel", "_moe_fp8_down_kernel"),
        note="ours: reads only the routed experts' fp8 rows and block scales; gate_up+SiLU*up, then down+combine")
