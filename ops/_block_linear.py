"""What the block-quantized linear ops (``mla::fp8_block_linear``, ``mla::fp4_block_linear``) share: the checks of
the activation and the sorted groups, the grouped form's row selection and the output shape."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from mla_compile.ops._checks import FLOAT_DTYPES, check_same_device, check_tensor


def pick_groups(y: Tensor, offs: Tensor, dtype: torch.dtype) -> Tensor:
    """``[R, N]`` from ``y [E, R, N]`` (every group's result on every row): row ``r`` keeps its own group's
    (group ``g`` holds rows ``offs[g-1] <= r < offs[g]``), rows past ``offs[-1]`` are 0; no host sync."""
    rows = torch.arange(y.shape[1], device=y.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True)  # E for rows past offs[-1]
    picked = y.gather(0, group.clamp_max(y.shape[0] - 1)[None, :, None].expand(1, -1, y.shape[-1]))[0]
    return torch.where((group < y.shape[0])[:, None], picked, 0).to(dtype)


def empty_output(x: Tensor, weight: Tensor, offs: Tensor | None) -> Tensor:
    """The output every implementation returns, empty: ``[M, N]``, ``[E, M, N]`` (3-D weight, no ``offs``) or
    (with ``offs``) ``[R, N]``, of x's dtype."""
    N = weight.shape[-2]
    if weight.dim() == 3 and offs is None:
        return x.new_empty(weight.shape[0], x.shape[-2], N)
    return x.new_empty(x.shape[0], N)


def check_x_and_offs(op: str, x: Tensor, weight: Tensor, K: int, groups: Sequence[int], offs: Tensor | None, *,
                     scale_name: str, scale: Tensor, weight_form: str, x_note: str = "") -> None:
    """The checks both block linears make after their weight and scale checks: ``x`` is ``[M, K]`` (or
    ``[E, M, K]`` for a 3-D weight), on the weight's and scale's device, and ``offs`` (sorted groups) is an
    int32 ``[E]`` that needs a 3-D weight (``weight_form`` names its shape in the error) and a 2-D ``x``."""
    x_ndim = (2,) if weight.dim() == 2 else (2, 3)
    x_shape = (None, K) if x.dim() == 2 else (groups[0] if groups else None, None, K)
    check_tensor(op, "x", x, ndim=x_ndim, dtypes=FLOAT_DTYPES, shape=x_shape,
                 expected=f"[M, {K}]" + (f" or [{groups[0]}, M, {K}]" if groups else "") + x_note)
    check_same_device(op, x=x, weight=weight, **{scale_name: scale})
    if offs is not None:
        if weight.dim() != 3 or x.dim() != 2:
            raise ValueError(f"{op}: offs (sorted groups) needs a 3-D weight {weight_form} and x [R, K]; got weight "
                             f"{list(weight.shape)}, x {list(x.shape)}")
        check_tensor(op, "offs", offs, ndim=1, dtypes=(torch.int32,), shape=(groups[0],),
                     expected=f"[{groups[0]}] int32 cumulative row ends")
        check_same_device(op, x=x, offs=offs)
