"""``mla::fp8_block_linear_pair``: two fp8 block-quantized linears that share one input, in one launch.

Contract. ``x [M, K]`` and two 2-D weights in ``mla::fp8_block_linear``'s format (``weight [N_i, K]``
float8_e4m3fn with ``weight_scale_inv [ceil(N_i/128), ceil(K/128)]`` float32) give ``(x @ W_1.T, x @ W_2.T)``,
``[M, N_1]`` and ``[M, N_2]`` of x's dtype, each exactly as ``mla::fp8_block_linear`` computes it (weight-only or
``act_quant``). DeepSeek-V4's decode step has such pairs: the attention's ``q_a_proj`` and ``kv_proj`` read the same
hidden state, the shared expert's ``gate_proj`` and ``up_proj`` too; at a few tokens each is a launch of a few
microseconds, so one launch for both saves one (BENCHMARKS.md run 285).

Backends: "reference" (two ``mla::fp8_block_linear_ref`` calls, any device) and "triton" (CUDA: our fp8 kernel over
both weights' column tiles, the two outputs views of one ``[M, N_1 + N_2]`` tensor).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mla_compile.ops._checks import check_tensor
from mla_compile.ops.fp8_block_linear import BLOCK
from mla_compile.ops.registry import FLOATS, LAYOUT_TAGS, declare, declare_op
from mla_compile.ops.select import resolve

OP = declare_op("fp8_block_linear_pair", "mla.fp8_block_linear_pair")


def validate(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, weight2: Tensor, weight2_scale_inv: Tensor) -> None:
    """Shape/dtype checks (metadata only, no sync): ``x [M, K]`` and two 2-D weights of K columns with their block
    scales, all on x's device."""
    check_tensor(OP, "x", x, ndim=2, dtypes=FLOATS, expected="[M, K]")
    K = x.shape[1]
    for name, w, scale in (("weight", weight, weight_scale_inv), ("weight2", weight2, weight2_scale_inv)):
        check_tensor(OP, name, w, ndim=2, dtypes=(torch.float8_e4m3fn,), shape=(None, K),
                     expected=f"[N, {K}] float8_e4m3fn")
        blocks = (-(-w.shape[0] // BLOCK), -(-K // BLOCK))
        check_tensor(OP, f"{name}_scale_inv", scale, ndim=2, dtypes=(torch.float32,), shape=blocks,
                     expected=f"{list(blocks)} float32 (one scale per 128 x 128 block of {name})")
        for t, what in ((w, name), (scale, f"{name}_scale_inv")):
            if t.device != x.device:
                raise ValueError(f"{OP}: {what} is on {t.device}, x on {x.device}")


@torch.library.custom_op("mla::fp8_block_linear_pair_ref", mutates_args=(), tags=LAYOUT_TAGS)
def fp8_block_linear_pair_ref(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, weight2: Tensor,
                              weight2_scale_inv: Tensor, act_quant: bool) -> tuple[Tensor, Tensor]:
    """Reference (any device): ``mla::fp8_block_linear_ref`` per weight."""
    validate(x, weight, weight_scale_inv, weight2, weight2_scale_inv)
    ref = torch.ops.mla.fp8_block_linear_ref
    return ref(x, weight, weight_scale_inv, act_quant), ref(x, weight2, weight2_scale_inv, act_quant)


def fake(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, weight2: Tensor, weight2_scale_inv: Tensor,
         act_quant: bool) -> tuple[Tensor, Tensor]:
    """Fake outputs shared by every implementation: validate, then ``[M, N_1]`` and ``[M, N_2]`` of x's dtype."""
    validate(x, weight, weight_scale_inv, weight2, weight2_scale_inv)
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], weight2.shape[0])


fp8_block_linear_pair_ref.register_fake(fake)

declare(OP, "reference", torch.ops.mla.fp8_block_linear_pair_ref, rank=100, devices=("any",), dtypes=FLOATS,
        gpu_tested=True, note="mla::fp8_block_linear_ref per weight")


def fp8_block_linear_pair(x: Tensor, first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor], *,
                          act_quant: bool = False, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """``(x @ W_1.T, x @ W_2.T)`` for ``x [..., K]`` and ``first`` / ``second`` = ``(weight, weight_scale_inv)``
    of two fp8 block-quantized 2-D weights: ``[..., N_1]`` and ``[..., N_2]``; see the module docstring.
    ``backend``: None/"auto", "reference" or "triton"."""
    lead = x.shape[:-1]
    impl = resolve(OP, x.device, backend, dtype=x.dtype)
    y1, y2 = impl.fn(x.reshape(-1, x.shape[-1]), *first, *second, act_quant)
    return y1.reshape(*lead, y1.shape[-1]), y2.reshape(*lead, y2.shape[-1])


# Triton backend: its module (and Triton) is imported on the first call, never at import time.
from mla_compile.ops.triton import available as _triton_available  # noqa: E402


def _triton(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, weight2: Tensor, weight2_scale_inv: Tensor,
            act_quant: bool) -> tuple[Tensor, Tensor]:
    """CUDA 16- or 32-bit ``x``: ``mla::fp8_block_linear_pair_triton``'s ``[M, N_1 + N_2]`` split into two views;
    float64 or off CUDA: the reference."""
    if x.device.type != "cuda" or x.dtype == torch.float64:
        return torch.ops.mla.fp8_block_linear_pair_ref(x, weight, weight_scale_inv, weight2, weight2_scale_inv,
                                                       act_quant)
    import mla_compile.ops.triton.fp8_block_linear  # noqa: F401  (registers mla::fp8_block_linear_pair_triton)
    y = torch.ops.mla.fp8_block_linear_pair_triton(x, weight, weight_scale_inv, weight2, weight2_scale_inv, act_quant)
    return y[:, :weight.shape[0]], y[:, weight.shape[0]:]


declare(OP, "triton", _triton, rank=50, available=_triton_available, dtypes=FLOATS, package="triton",
        gpu_tested=True, kernels=("fp8_block_linear_pair_triton", "_fp8_linear_kernel"),
        note="ours: mla::fp8_block_linear's kernel over both weights' column tiles, one launch")
